"""Preallocated KV cache in slots, kept dense: active sequences always occupy rows 0..n-1.

Dense packing lets every decode step read the cache through plain slices (no gather of
cross-attention K/V, which would copy megabytes per step). When a sequence leaves, the
last row moves into its place: one copy per departure instead of one per step.
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
        self.used = 0

    @property
    def nbytes(self) -> int:
        tensors = self.self_k + self.self_v + self.cross_k + self.cross_v
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def free(self) -> int:
        return self.slots - self.used

    def allocate(self, count: int) -> slice:
        """Take `count` rows at the end of the dense block."""
        if count > self.free:
            raise RuntimeError(f"KV cache: asked for {count} slots, {self.free} free")
        rows = slice(self.used, self.used + count)
        self.used += count
        return rows

    def set_cross_len(self, rows: list[int], lengths: list[int], lengths_t: Tensor) -> None:
        """Record how many audio positions rows hold (lengths_t: the same, already on the device)."""
        self.cross_len[torch.tensor(rows, device=self.cross_len.device)] = lengths_t
        for row, length in zip(rows, lengths, strict=True):
            self.cross_len_host[row] = length

    def max_cross_len(self, rows: slice) -> int:
        return max(self.cross_len_host[rows])

    def release(self, row: int) -> int | None:
        """Free `row`; the last used row moves into it. Returns the row that moved, if any."""
        last = self.used - 1
        self.used -= 1
        if row == last:
            return None
        for tensors in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            for t in tensors:
                t[row].copy_(t[last])
        self.cross_len[row] = self.cross_len[last]
        self.cross_len_host[row] = self.cross_len_host[last]
        return last
