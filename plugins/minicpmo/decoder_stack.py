"""A decoder-only transformer stepped for many sessions at once, each with its own memory.

MiniCPM-o's language model (Qwen3) and its speech-token model (Llama) are causal decoder
stacks. transformers gives us their layers (the modules and the published parameter
names), but its caches hold one sequence per batch row that all advance together, while
our sessions do not: each slot has heard a different amount, feeds a different number of
positions in a unit (a camera frame adds 66, a speaking unit up to 20 more), and leaves or
joins the batch at any unit. So the stack's attention and memory are ours:

- `SlotKV` holds every slot's keys and values in one preallocated tensor per layer
  ([slots, kv_heads, capacity, head_dim]) with a length per slot. Nothing is reallocated
  as a conversation grows; a slot is reset by setting its length to 0.
- `DecoderStack.forward` takes *rows*: (slot, embeddings of the positions it feeds now),
  any number of positions each. The rows are padded into one batch, each position is
  rotated (RoPE) at its slot's own position, written into its slot's memory, and attends
  causally over that slot's memory only (a mask per row). One call is one batched forward
  of every layer, whatever mix of prefills and single tokens the rows hold.

Positions are the slot's memory length: both models place a new position right after the
last one they hold (the reference's `position_ids = cache_len + arange(L)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class ContextFull(RuntimeError):
    """A slot would hold more positions than its memory has room for."""

    def __init__(self, slot: int, wanted: int, capacity: int) -> None:
        super().__init__(f"slot {slot} needs {wanted} positions; its memory holds {capacity}")
        self.slot = slot
        self.wanted = wanted
        self.capacity = capacity


class SlotKV:
    """Every slot's keys and values, one preallocated tensor per layer, and each slot's
    length (how many positions it holds)."""

    def __init__(
        self,
        *,
        slots: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (layers, slots, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.lengths = [0] * slots

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def length(self, slot: int) -> int:
        return self.lengths[slot]


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What the stack's attention needs to know of its layers' shapes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    #: Qwen3 normalises each head's query and key (RMSNorm) before RoPE; Llama does not
    qk_norm: bool


class DecoderStack:
    """Runs the layers of a transformers decoder-only model (its modules, its weights) over
    rows of several slots, with the slots' memory in a `SlotKV`."""

    def __init__(self, layers: nn.ModuleList, norm: nn.Module, shape: AttentionShape) -> None:
        self.layers = layers
        self.norm = norm
        self.shape = shape
        # on the CPU explicitly: the model may be built on the meta device (weights loaded
        # later, `assign=True`), and these frequencies are not a weight
        half = torch.arange(0, shape.head_dim, 2, dtype=torch.float32, device="cpu")
        half = half / shape.head_dim
        self.inv_freq = 1.0 / (shape.rope_theta**half)

    def new_memory(
        self, slots: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ) -> SlotKV:
        return SlotKV(
            slots=slots,
            layers=len(self.layers),
            kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            capacity=capacity,
            dtype=dtype,
            device=device,
        )

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def drop(self, memory: SlotKV, slot: int, start: int, end: int) -> None:
        """Forget positions [start, end) of `slot`: the later ones move down and their keys
        are rotated back by the distance they moved, so the memory is what feeding the kept
        positions at their new places would have made (RoPE rotations compose), and the
        next position follows the shorter memory."""
        length = memory.lengths[slot]
        if not 0 <= start <= end <= length:
            raise ValueError(f"cannot drop [{start}, {end}) of a slot holding {length}")
        gone, kept = end - start, length - end
        if gone == 0:
            return
        if kept:
            back = torch.full((kept,), -float(gone), device=memory.keys.device)
            freqs = back[:, None] * self.inv_freq.to(memory.keys.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos().to(memory.keys.dtype)
            sin = emb.sin().to(memory.keys.dtype)
            keys = memory.keys[:, slot, :, end:length].clone()
            memory.keys[:, slot, :, start : start + kept] = self._rotate(keys, cos, sin)
            values = memory.values[:, slot, :, end:length].clone()
            memory.values[:, slot, :, start : start + kept] = values
        memory.lengths[slot] = start + kept

    @torch.no_grad()
    def forward(
        self, memory: SlotKV, rows: Sequence[tuple[int, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Feed each row's embeddings ([L, hidden], L >= 1) to its slot, in one batched
        forward; returns each row's final-norm hidden states ([L, hidden]), in row order.
        A slot appears in at most one row."""
        if not rows:
            return []
        slots = [slot for slot, _ in rows]
        if len(set(slots)) != len(slots):
            raise ValueError("a slot appears in two rows of one forward")
        lengths = [embeds.shape[0] for _, embeds in rows]
        starts = [memory.lengths[slot] for slot in slots]
        for slot, start, length in zip(slots, starts, lengths, strict=True):
            if start + length > memory.capacity:
                raise ContextFull(slot, start + length, memory.capacity)
        first = rows[0][1]
        batch, longest = len(rows), max(lengths)
        hidden = first.new_zeros((batch, longest, first.shape[-1]))
        for index, (_, embeds) in enumerate(rows):
            hidden[index, : embeds.shape[0]] = embeds
        device = hidden.device
        start_t = torch.tensor(starts, device=device)
        offsets = torch.arange(longest, device=device)
        positions = start_t[:, None] + offsets[None, :]  # [B, L]
        cos, sin = self._rope(positions, hidden.dtype)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, L, head_dim]
        end = max(s + n for s, n in zip(starts, lengths, strict=True))
        keys_at = torch.arange(end, device=device)
        # causal over the slot's own memory: position j of a row sees its slot's first
        # start + j + 1 positions (padded positions see the same and are thrown away)
        mask = keys_at[None, None, :] <= positions[:, :, None]  # [B, L, T]
        mask = mask[:, None]
        valid = offsets[None, :] < torch.tensor(lengths, device=device)[:, None]
        row_of, col_of = valid.nonzero(as_tuple=True)
        slot_t = torch.tensor(slots, device=device)
        write_slot, write_pos = slot_t[row_of], positions[row_of, col_of]
        shape = self.shape
        groups = shape.num_heads // shape.num_kv_heads
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attn.q_proj(normed).view(batch, longest, shape.num_heads, shape.head_dim)
            k = attn.k_proj(normed).view(batch, longest, shape.num_kv_heads, shape.head_dim)
            v = attn.v_proj(normed).view(batch, longest, shape.num_kv_heads, shape.head_dim)
            if shape.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = self._rotate(q.transpose(1, 2), cos, sin)
            k = self._rotate(k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            layer_keys, layer_values = memory.keys[index], memory.values[index]
            # [n, kv_heads, head_dim] for every real position, into its slot's memory
            layer_keys[write_slot, :, write_pos] = k.transpose(1, 2)[row_of, col_of]
            layer_values[write_slot, :, write_pos] = v.transpose(1, 2)[row_of, col_of]
            seen_k = layer_keys[slot_t, :, :end]
            seen_v = layer_values[slot_t, :, :end]
            if groups > 1:
                seen_k = seen_k.repeat_interleave(groups, dim=1)
                seen_v = seen_v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(
                q, seen_k, seen_v, attn_mask=mask, scale=shape.head_dim**-0.5
            )
            out = out.transpose(1, 2).reshape(batch, longest, shape.num_heads * shape.head_dim)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for slot, length in zip(slots, lengths, strict=True):
            memory.lengths[slot] += length
        hidden = self.norm(hidden)
        return [hidden[index, :length] for index, length in enumerate(lengths)]


__all__ = ["AttentionShape", "ContextFull", "DecoderStack", "SlotKV"]
