"""The language model: transformers' Qwen3, stepped per slot by our `DecoderStack`.

The module tree is transformers' own `Qwen3ForCausalLM`, so its parameter names are the
checkpoint's (`llm.` stripped: `model.embed_tokens`, `model.layers.N.*`, `model.norm`,
`lm_head`) and its layers compute what Qwen3 computes; only the attention's memory and the
batching over sessions are ours (decoder_stack.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from plugins.minicpmo.config import LanguageConfig
from plugins.minicpmo.decoder_stack import AttentionShape, DecoderStack, SlotKV


def qwen3_config(config: LanguageConfig) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=config.tie_word_embeddings,
    )


class LanguageModel(nn.Module):
    """Qwen3 with our per-slot memory: `embed` token ids, `forward` rows of embeddings,
    `logits` of a hidden state."""

    def __init__(self, config: LanguageConfig) -> None:
        super().__init__()
        self.config = config
        self.llm = Qwen3ForCausalLM(qwen3_config(config))
        self.stack = DecoderStack(
            self.llm.model.layers,
            self.llm.model.norm,
            AttentionShape(
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                rope_theta=config.rope_theta,
                qk_norm=True,
            ),
        )

    def new_memory(self, slots: int, capacity: int) -> SlotKV:
        weight = self.llm.model.embed_tokens.weight
        return self.stack.new_memory(slots, capacity, weight.dtype, weight.device)

    def embed(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[len(ids), hidden] token embeddings."""
        weight = self.llm.model.embed_tokens.weight
        ids = torch.as_tensor(ids, dtype=torch.long, device=weight.device)
        return self.llm.model.embed_tokens(ids)

    def forward(
        self, memory: SlotKV, rows: Sequence[tuple[int, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Each row's final-norm hidden states (what the reference reads as
        `hidden_states[-1]`), after feeding the rows to their slots."""
        return self.stack.forward(memory, rows)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of final-norm hidden states ([..., hidden] -> [..., vocab]),
        in float32 (the decisions compare them)."""
        return self.llm.lm_head(hidden).float()


__all__ = ["LanguageModel", "qwen3_config"]
