"""How the language model's next token is chosen in the duplex loop.

The reference's `StreamDecoder.decode`, one slot at a time (its state is the slot's own):

1. A first look at the raw logits (argmax when greedy, else one draw from their softmax,
   no temperature): if it is `<|chunk_eos|>`, the unit's speech ends there.
2. Otherwise `<|chunk_eos|>`, `<|tts_pad|>` and the tokenizer's bad ids are masked out,
   every token of the slot's last 512 decisions has its logit divided by the repetition
   penalty (1.05; negative logits too, so a disliked token becomes *more* likely: the
   reference does this and we keep it), `<|turn_eos|>` gets the length penalty (1.1:
   divided when positive, multiplied when negative), and the token is chosen: argmax, or a
   draw after temperature (0.7), top-k (20) and top-p (0.8).
3. The chosen token (not a first-look `<|chunk_eos|>`, nor a forced one) joins the slot's
   history of decisions.

A slot's draws come from its own `torch.Generator`, so what a session says does not depend
on who shares its batch, and a restored session (its generator re-seeded from the session's
seed and unit index) draws what it would have.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence

import torch
from torch.nn import functional as F

TEXT_REPETITION_WINDOW = 512


@dataclasses.dataclass(frozen=True)
class TextSampling:
    """The duplex loop's decoding settings (the reference's defaults)."""

    greedy: bool = False
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    length_penalty: float = 1.1


class TextHistory:
    """A slot's last decisions, as the repetition penalty reads them."""

    def __init__(self, decisions: Iterable[int] = ()) -> None:
        self.decisions: deque[int] = deque(decisions, maxlen=TEXT_REPETITION_WINDOW)

    def add(self, token: int) -> None:
        self.decisions.append(token)


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the `top_k` best logits, then the smallest set whose probability reaches
    `top_p` (the first token past it kept): the others become -inf."""
    logits = logits.clone()
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        threshold = torch.topk(logits, k).values[-1]
        logits[logits < threshold] = -torch.inf
    if top_p > 0.0:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.cumsum(F.softmax(ordered, dim=-1), dim=-1)
        drop = cumulative > top_p
        drop[1:] = drop[:-1].clone()
        drop[0] = False
        logits[order[drop]] = -torch.inf
    return logits


class TextDecider:
    """Chooses tokens for every slot under one set of special ids."""

    def __init__(
        self,
        *,
        chunk_eos: int,
        turn_eos: int,
        forbidden: Sequence[int],
        sampling: TextSampling,
    ) -> None:
        self.chunk_eos = chunk_eos
        self.turn_eos = turn_eos
        # the reference appends <|chunk_eos|> to the forbidden ids: once the first look
        # did not end the unit, the second may not either
        self.forbidden = sorted({*forbidden, chunk_eos})
        self.sampling = sampling

    def choose(
        self, logits: torch.Tensor, history: TextHistory, generator: torch.Generator | None
    ) -> int:
        """The next token from one slot's logits ([vocab], float32)."""
        sampling = self.sampling
        greedy = sampling.greedy or generator is None
        if greedy:
            first = int(torch.argmax(logits))
        else:
            first = int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator))
        if first == self.chunk_eos:
            return first
        logits = self.penalised(logits, history)
        if greedy:
            token = int(torch.argmax(logits))
        else:
            warped = _top_k_top_p(logits / sampling.temperature, sampling.top_k, sampling.top_p)
            token = int(torch.multinomial(F.softmax(warped, dim=-1), 1, generator=generator))
        history.add(token)
        return token

    def penalised(self, logits: torch.Tensor, history: TextHistory) -> torch.Tensor:
        """The logits the second look chooses from: forbidden ids masked, the repetition
        and length penalties applied (a copy)."""
        sampling = self.sampling
        logits = logits.clone()
        logits[self.forbidden] = -torch.inf
        if sampling.repetition_penalty != 1.0 and history.decisions:
            seen = torch.tensor(sorted(set(history.decisions)), dtype=torch.long)
            seen = seen[seen < logits.shape[0]]
            if sampling.repetition_penalty > 1.0:
                logits[seen] = logits[seen] / sampling.repetition_penalty
            else:
                logits[seen] = logits[seen] * (1.0 / sampling.repetition_penalty)
        if sampling.length_penalty != 1.0:
            value = logits[self.turn_eos]
            logits[self.turn_eos] = (
                value / sampling.length_penalty if value > 0 else value * sampling.length_penalty
            )
        return logits


__all__ = ["TEXT_REPETITION_WINDOW", "TextDecider", "TextHistory", "TextSampling"]
