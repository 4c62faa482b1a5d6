"""The Nemotron VoiceChat plugin with a scripted function channel, for the end-to-end tests.

The tiny random checkpoint (harness/tiny_nemotron.py) never makes a tool call by itself: its
function head always says pad. `ScriptedNemotronFrameModel` is the real frame model, every
step the real model's, with what it is fed on two channels forced, through the same
mechanism a barge-in uses (`_forced_for`), so the frame records and a restore see exactly
what happened:

- a loud frame (RMS over `LOUD_RMS`) in a slot whose session has tools, and no call of its
  waiting for a result: the function channel is made to say
  `<TOOLCALL>[{"name": <first tool>, "arguments": {"city": "Paris"}}]</TOOLCALL>`, one token a
  frame, while the text channel says EOS then pad (the model stops talking and listens for
  `QUIET_FRAMES` frames, so the response holding the call ends);
- once a tool result has been fed (`add_function_output`, then its tokens), the text channel
  is made to say `[BOS] <ANSWER> [EOS]`, a word a frame, then pad for `QUIET_FRAMES`: the
  answer the client then hears, as a response of its own (the tiny model talks on most
  frames by itself).

`duplex worker --plugin tests.plugins.nemotron.scripted:ScriptedNemotronPlugin --model-dir DIR`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import deque
from typing import Any

import numpy as np

from plugins.nemotron import NemotronPlugin
from plugins.nemotron.frame_model import NemotronFrameModel, SlotConversation
from plugins.nemotron.tools import CLOSE, OPEN

log = logging.getLogger(__name__)

LOUD_RMS = 0.2
QUIET_FRAMES = 8
ANSWER = " sunny in paris"


@dataclasses.dataclass
class SlotScript:
    """One slot's scripted channels: what the next frames are made to say, whether its call
    waits for a result, and whether the answer is due once the result has been fed."""

    forced: deque[dict[str, int]] = dataclasses.field(default_factory=deque)
    waiting: bool = False
    answer_due: bool = False


class ScriptedNemotronFrameModel(NemotronFrameModel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scripts: list[SlotScript] = [SlotScript() for _ in range(self.slots)]

    def open_slot(self, slot: int, options: Any) -> None:
        super().open_slot(slot, options)
        self._scripts[slot] = SlotScript()

    def interrupt_slot(self, slot: int) -> None:
        super().interrupt_slot(slot)
        self._scripts[slot] = SlotScript()  # a barge-in ends what it was made to say

    def add_function_output(self, slot: int, call_id: str, name: str, output: str) -> None:
        super().add_function_output(slot, call_id, name, output)
        self._scripts[slot].waiting = False
        self._scripts[slot].answer_due = True

    def _call_script(self, tool: str) -> deque[dict[str, int]]:
        body = json.dumps([{"name": tool, "arguments": {"city": "Paris"}}])
        tokens = self.tokenizer.text_to_ids(f"{OPEN}{body}{CLOSE}")
        script: deque[dict[str, int]] = deque()
        for i, token in enumerate(tokens):
            script.append(
                {"function": token, "text": self.engine.eos if i == 0 else self.engine.pad}
            )
        script.extend({"text": self.engine.pad} for _ in range(QUIET_FRAMES))
        return script

    def _answer_script(self) -> deque[dict[str, int]]:
        words = self.tokenizer.text_to_ids(ANSWER)
        texts = [self.engine.bos, *words, self.engine.eos] + [self.engine.pad] * QUIET_FRAMES
        return deque({"text": token} for token in texts)

    def _forced_for(
        self, slot: int, state: SlotConversation, pcm: np.ndarray
    ) -> dict[str, Any] | None:
        forced = super()._forced_for(slot, state, pcm) or {}
        script = self._scripts[slot]
        tools = state.options.get("tools") or []
        if not script.forced and script.answer_due and not state.injections:
            script.answer_due = False
            script.forced.extend(self._answer_script())
        loud = float(np.sqrt(np.mean((pcm.astype(np.float32) / 32768.0) ** 2))) > LOUD_RMS
        if loud:
            log.debug("slot %d: a loud frame (waiting for a result: %s)", slot, script.waiting)
        if not script.forced and tools and loud and not script.waiting:
            script.waiting = True
            script.forced.extend(self._call_script(str(tools[0]["name"])))
        if script.forced:
            forced.update(script.forced.popleft())
        return forced or None


class ScriptedNemotronPlugin(NemotronPlugin):
    def frame_model_class(self) -> type[NemotronFrameModel]:
        return ScriptedNemotronFrameModel


__all__ = ["ScriptedNemotronFrameModel", "ScriptedNemotronPlugin"]
