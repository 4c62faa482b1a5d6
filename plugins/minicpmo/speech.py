"""The speech-token model: what the language model says, turned into 25 Hz codec tokens.

MiniCPM-o 4.5 speaks through a small Llama (the reference's `MiniCPMTTS`): for each unit
in which the language model speaks, the words it chose (each word's token embedding plus
its hidden state, projected and L2-normalised) and an `audio_bos` position condition the
Llama, which then samples codec tokens one at a time, each fed back, until it has 25 (one
second at 25 Hz) or the end-of-speech code. Its memory runs over a whole turn: every
unit's condition and codes stay in it, and a turn's end clears it.

This module holds the weights (under the checkpoint's `tts.` names) and the batched
sampling loop: all speaking slots of a unit advance together, one position each per step
(the condition in the first), in one forward of the stack. What the reference does, step
for step (`MiniCPMTTS.generate_chunk`): logits divided by the temperature; from the second
step on, a repetition penalty over the codes of this call (the last 16; a code seen n times
has its logit multiplied by penalty^n when negative, divided when positive); the end code
masked while fewer than `min_new` steps were taken; then a draw (the reference only
samples; our `generator=None` takes the argmax, for tests). At most `max_new` (26) steps:
the last step's code is drawn but neither returned nor fed, so a mid-turn unit gives 25
codes and the memory grows by the condition plus the codes returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from plugins.minicpmo.config import SpeechConfig
from plugins.minicpmo.decoder_stack import AttentionShape, DecoderStack, SlotKV

#: the reference's defaults for the duplex loop's speech sampling
TTS_TEMPERATURE = 0.8
TTS_REPETITION_PENALTY = 1.05
TTS_PENALTY_WINDOW = 16
#: steps of a unit's call: 25 codes are kept (one second at 25 Hz), the 26th is dropped
TTS_STEPS_PER_UNIT = 26


class Projector(nn.Module):
    """Linear, ReLU, Linear: how MiniCPM-o maps one model's hidden states into another's
    (the reference's `MultiModalProjector`; parameter names `linear1`, `linear2`)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


class _WeightNormParams(nn.Module):
    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.original0 = nn.Parameter(torch.empty(out_features, 1))  # g, one per row
        self.original1 = nn.Parameter(torch.empty(out_features, in_features))  # v


class _Parametrizations(nn.Module):
    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = _WeightNormParams(out_features, in_features)


class WeightNormHead(nn.Module):
    """A bias-free Linear stored as weight norm (`torch.nn.utils.parametrizations.
    weight_norm`, dim 0), under the same parameter names (`parametrizations.weight.
    original0` = g, `original1` = v): weight = g * v / ||v|| per output row."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.parametrizations = _Parametrizations(out_features, in_features)
        self._weight: torch.Tensor | None = None

    def weight(self) -> torch.Tensor:
        """g * v / ||v||, computed once: the weights never change once loaded (inference
        only), and the norm of a [6562, 768] matrix at every code step is not free."""
        if self._weight is None:
            params = self.parametrizations.weight
            v = params.original1.detach()
            self._weight = params.original0.detach() * v / v.norm(dim=1, keepdim=True)
        return self._weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())


class _Backbone(nn.Module):
    """The Llama's layers and final norm under the checkpoint's names (`model.layers.N`,
    `model.norm`). Its token embedding (`model.embed_tokens`) is never used: positions are
    fed as embeddings (conditions, `emb_code` of codes), so it is not loaded."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


#: checkpoint parameters under `tts.` that the duplex loop never uses (not loaded)
UNUSED_SPEECH_PARAMETERS = ("model.embed_tokens.", "projector_spk.")


@dataclasses.dataclass
class SpeechRequest:
    """One slot's call for a unit: its condition, how many steps it must take before the
    end code may be drawn, and its random generator (None: argmax)."""

    slot: int
    condition: torch.Tensor  # [C, hidden]
    min_new: int
    generator: torch.Generator | None
    max_new: int = TTS_STEPS_PER_UNIT


class SpeechTokenModel(nn.Module):
    def __init__(self, config: SpeechConfig) -> None:
        super().__init__()
        self.config = config
        llama = LlamaConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads,
            num_hidden_layers=config.num_layers,
            max_position_embeddings=config.max_positions,
            rope_theta=config.rope_theta,
            rms_norm_eps=config.rms_norm_eps,
        )
        self.emb_text = nn.Embedding(config.num_text_tokens, config.hidden_size)
        self.model = _Backbone(llama)
        self.projector_semantic = Projector(config.llm_dim, config.hidden_size)
        self.emb_code = nn.ModuleList([nn.Embedding(config.num_audio_tokens, config.hidden_size)])
        self.head_code = nn.ModuleList(
            [WeightNormHead(config.hidden_size, config.num_audio_tokens)]
        )
        self.stack = DecoderStack(
            self.model.layers,
            self.model.norm,
            AttentionShape(
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                rope_theta=config.rope_theta,
                qk_norm=False,
            ),
        )

    def new_memory(self, slots: int, capacity: int) -> SlotKV:
        weight = self.emb_text.weight
        return self.stack.new_memory(slots, capacity, weight.dtype, weight.device)

    @torch.no_grad()
    def condition(self, ids: Sequence[int], hidden: torch.Tensor | None) -> torch.Tensor:
        """A unit's condition ([len(ids) + 1, hidden]): each kept word's embedding plus its
        projected, normalised language-model hidden state (`hidden`: [len(ids), llm_dim]),
        then `audio_bos`. A unit that kept no word conditions on `audio_bos` alone."""
        device = self.emb_text.weight.device
        bos = self.emb_text(torch.tensor([self.config.audio_bos_token_id], device=device))
        if not ids:
            return bos
        assert hidden is not None and hidden.shape[0] == len(ids)
        words = self.emb_text(torch.tensor(list(ids), dtype=torch.long, device=device))
        semantic = F.normalize(self.projector_semantic(hidden.to(words.dtype)), p=2, dim=-1)
        return torch.cat([words + semantic, bos], dim=0)

    @torch.no_grad()
    def generate(
        self,
        memory: SlotKV,
        requests: Sequence[SpeechRequest],
        *,
        temperature: float = TTS_TEMPERATURE,
        repetition_penalty: float = TTS_REPETITION_PENALTY,
    ) -> dict[int, list[int]]:
        """Every request's codes for this unit, all slots stepped together."""
        eos = self.config.eos_code
        drawn: dict[int, list[int]] = {r.slot: [] for r in requests}
        kept: dict[int, list[int]] = {}
        live = list(requests)
        step = 0
        while live:
            rows = [
                (
                    r.slot,
                    r.condition
                    if step == 0
                    else self.emb_code[0](
                        torch.tensor(drawn[r.slot][-1:], device=r.condition.device)
                    ),
                )
                for r in live
            ]
            hidden = self.stack.forward(memory, rows)
            last = torch.stack([h[-1] for h in hidden])
            logits = self.head_code[0](last).float() / torch.tensor(temperature)
            still: list[SpeechRequest] = []
            for index, request in enumerate(live):
                row = logits[index]
                history = drawn[request.slot]
                if step > 0 and repetition_penalty != 1.0:
                    row = _penalise(row, history[-TTS_PENALTY_WINDOW:], repetition_penalty)
                if step < request.min_new:
                    row = row.clone()
                    row[eos] = -torch.inf
                if request.generator is None:
                    code = int(torch.argmax(row))
                else:
                    probs = F.softmax(row, dim=-1)
                    code = int(torch.multinomial(probs, 1, generator=request.generator))
                history.append(code)
                if code == eos:
                    kept[request.slot] = history[:-1]
                elif step + 1 >= request.max_new:
                    # the last step's code is drawn and dropped (never fed)
                    kept[request.slot] = history[:-1]
                else:
                    still.append(request)
            live = still
            step += 1
        return kept


def _penalise(row: torch.Tensor, codes: Sequence[int], penalty: float) -> torch.Tensor:
    """The reference's count-based, sign-aware repetition penalty on one row of logits."""
    if not codes:
        return row
    counts = torch.bincount(torch.tensor(list(codes)), minlength=row.shape[0]).to(row.device)
    alpha = torch.pow(torch.tensor(penalty, dtype=row.dtype), counts.to(row.dtype))
    return torch.where(row < 0, row * alpha, row / alpha)


__all__ = [
    "TTS_STEPS_PER_UNIT",
    "UNUSED_SPEECH_PARAMETERS",
    "Projector",
    "SpeechRequest",
    "SpeechTokenModel",
    "WeightNormHead",
]
