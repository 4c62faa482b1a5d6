"""What the assistant says: a small deterministic responder, and the prompt for an LLM.

The built-in responder answers greetings, the time and date, its name, thanks, goodbyes and
"repeat after me ...", and says what it heard otherwise. With `--llm-model` the assistant
sends `llm_prompt(...)` to a vLLM text stage instead.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

NAME = "the duplex serve assistant"

SORRY = "Sorry, I did not catch that."


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def understands(text: str) -> bool:
    """Whether `text` is one of the responder's commands (not "You said ..." or sorry)."""
    answer = reply(text)
    return answer != SORRY and not answer.startswith("You said")


def reply(text: str, now: datetime.datetime | None = None) -> str:
    """The built-in responder's answer to one user utterance."""
    now = now or datetime.datetime.now()
    words = _words(text)
    phrase = " ".join(words)
    if not words:
        return SORRY
    if phrase.startswith("repeat after me"):
        rest = " ".join(words[3:])
        return f"{rest.capitalize()}." if rest else "Repeat what?"
    if "time" in words:
        return f"It is {now.strftime('%H:%M')}."
    if "date" in words or ("day" in words and "what" in words):
        return f"Today is {now.strftime('%A, %B')} {now.day}."
    if "name" in words or phrase.startswith("who are you"):
        return f"I am {NAME}."
    if phrase.startswith("how are you"):
        return "I am fine, thank you. How can I help?"
    if phrase.startswith("can you hear me"):
        return "Yes, I can hear you."
    if words[0] in ("hello", "hi", "hey") or phrase.startswith("good "):
        return "Hello! How can I help you?"
    if words[0] in ("thanks", "thank"):
        return "You are welcome."
    if words[0] in ("goodbye", "bye") or phrase.startswith("see you"):
        return "Goodbye!"
    return f"You said: {phrase}."


def llm_prompt(history: Sequence[Mapping[str, Any]], user_text: str, instructions: str) -> str:
    """A plain-text chat prompt: the instructions, then the conversation, one line a turn.
    Each turn extends the previous prompt, so vLLM's prefix cache reuses the earlier turns."""
    lines = [instructions.strip() or f"You are {NAME}. Answer in one short sentence."]
    for item in history:
        if item.get("type") != "message":
            continue
        said = " ".join(
            str(part.get("transcript") or part.get("text") or "")
            for part in item.get("content") or []
        ).strip()
        if said:
            lines.append(f"{'User' if item.get('role') == 'user' else 'Assistant'}: {said}")
    if not lines[-1].endswith(user_text) or not user_text:
        lines.append(f"User: {user_text}")
    lines.append("Assistant:")
    return "\n".join(lines)


def sentences(text: str) -> tuple[list[str], str]:
    """Complete sentences in `text`, and the unfinished rest (for speaking as text streams)."""
    parts = re.split(r"(?<=[.!?])\s+", text)
    if parts and not re.search(r"[.!?]$", parts[-1]):
        return [p for p in parts[:-1] if p.strip()], parts[-1]
    return [p for p in parts if p.strip()], ""
