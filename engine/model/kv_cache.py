"""Preallocated KV cache in rows (slots): storage only.

Which request holds which row is the scheduler's (engine/scheduling/scheduler.py KVRows): it keeps them dense,
active sequences in rows 0..n-1, so that every decode step reads the cache through plain slices (no
gather of cross-attention K/V, which would copy megabytes per step). When a sequence leaves, the
scheduler moves the last row into its place and this cache copies it (`move`): one copy per
departure instead of one per step.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(
        self,
        *,
        slots: int,
        layers: int,
        heads: int,
        head_dim: int,
        max_tokens: int,
        audio_ctx: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.slots = slots
        self.max_tokens = max_tokens

        def alloc(length: int) -> list[Tensor]:
            return [
                torch.zeros(slots, heads, length, head_dim, device=device, dtype=dtype) for _ in range(layers)
            ]

        self.self_k, self.self_v = alloc(max_tokens), alloc(max_tokens)
        self.cross_k, self.cross_v = alloc(audio_ctx), alloc(audio_ctx)
        self.cross_len = torch.zeros(slots, dtype=torch.long, device=device)
        # The same lengths on the host: the decode step sizes its cross-attention from them without
        # reading the device (a read would wait for it).
        self.cross_len_host = [0] * slots

    @property
    def nbytes(self) -> int:
        tensors = self.self_k + self.self_v + self.cross_k + self.cross_v
        return sum(t.numel() * t.element_size() for t in tensors)

    def set_cross_len(self, rows: list[int], lengths: list[int], lengths_t: Tensor) -> None:
        """Record how many audio positions rows hold (lengths_t: the same, already on the device)."""
        self.cross_len[torch.tensor(rows, device=self.cross_len.device)] = lengths_t
        for row, length in zip(rows, lengths, strict=True):
            self.cross_len_host[row] = length

    def max_cross_len(self, rows: slice) -> int:
        return max(self.cross_len_host[rows])

    def reorder(self, rows: list[int], sources: list[int], length: int) -> None:
        """Beam search: row rows[b] takes the self-attention K/V of row sources[b] (positions below
        `length`, all that is written), on the device. Cross-attention K/V are the same audio in every
        beam row and stay."""
        moved = [(dst, src) for dst, src in zip(rows, sources, strict=True) if dst != src]
        if not moved or length == 0:
            return
        device = self.cross_len.device
        dst_t = torch.tensor([d for d, _ in moved], device=device)
        src_t = torch.tensor([s for _, s in moved], device=device)
        for t in (*self.self_k, *self.self_v):
            # the gather on the right copies first: a row that is both a source and a target reads its old K/V
            t[dst_t, :, :length] = t.index_select(0, src_t)[:, :, :length]

    def move(self, src: int, dst: int) -> None:
        """Copy row `src` into row `dst` (the scheduler moved the sequence there)."""
        for tensors in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            for t in tensors:
                t[dst].copy_(t[src])
        self.cross_len[dst] = self.cross_len[src]
        self.cross_len_host[dst] = self.cross_len_host[src]
