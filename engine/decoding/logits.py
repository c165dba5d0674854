"""Whisper's decoding rules as composable logit processors, as openai/whisper's LogitFilters.

Each processor is a small object with one method, `apply(logits, rows)`, that edits the logits of a
whole sampling step [B, V] in place. What a rule needs to know about each row (is it at its first
sampled token, does it want timestamps, what did it emit) is on the host already; a processor writes
it into its own preallocated input buffer (RowInputs: pinned on CUDA, copied in one go, so no tensor
is made from host data and nothing is read back) and applies its rule as masks over the whole batch:
no loop of tensor operations per row. The list runs in order (engine/decoding/rules.py builds it):
suppressed tokens, blank at the first sampled token, timestamp rules, then biases (engine/decoding/keyterms.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from engine.decoding.rules import Vocab
    from engine.scheduling.request import Beam, Request

NEG_INF = float("-inf")
MAX_INITIAL_TIMESTAMP_S = 1.0
SECONDS_PER_TIMESTAMP = 0.02


@dataclass
class StepRows:
    """The rows of one sampling step (row i is reqs[i]), read once per step from host state."""

    reqs: Sequence[
        Request | Beam
    ]  # a beam search's beams are rows as requests are (engine/scheduling/request.py Beam)
    first: list[int]  # rows sampling their first token (openai/whisper's sample_begin)
    # The rules' distribution (log-softmax), frozen by the first processor that asks for it: a bias
    # after it leaves the probability recorded for a token (its confidence) what the model gave it.
    _logprobs: Tensor | None = None
    # Per-row values a processor wants back on the host with the chosen tokens (one copy for all).
    fetch: dict[str, Tensor] = field(default_factory=dict)
    # The tokens, when the last processor chose them itself (saves the argmax over the logits it
    # already made certain); None: the argmax of the final logits.
    tokens: Tensor | None = None

    @classmethod
    def of(cls, reqs: Sequence[Request | Beam]) -> StepRows:
        first = [i for i, r in enumerate(reqs) if len(r.generated) == r.sample_begin and not r.forced]
        return cls(reqs=reqs, first=first)

    def logprobs(self, logits: Tensor) -> Tensor:
        """log-softmax of `logits` as they are the first time this is called in the step."""
        if self._logprobs is None:
            self._logprobs = torch.log_softmax(logits, dim=-1)
        return self._logprobs


class LogitProcessor(Protocol):
    def apply(self, logits: Tensor, rows: StepRows) -> None:
        """Edit `logits` [B, V] (row i is rows.reqs[i]) in place."""


class RowInputs:
    """A processor's per-row inputs: written on the host (numpy views of one buffer, pinned on CUDA)
    and copied to the device in one operation. Grows to the largest batch seen."""

    def __init__(self, fields: Sequence[str], dtype: torch.dtype, device: torch.device) -> None:
        self.index = {name: i for i, name in enumerate(fields)}
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self._grow(16)

    def _grow(self, capacity: int) -> None:
        self.capacity = capacity
        shape = (len(self.index), capacity)
        self.device_buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        on_cuda = self.device.type == "cuda"
        self.host_buffer = (
            torch.zeros(shape, dtype=self.dtype, pin_memory=True) if on_cuda else self.device_buffer
        )
        self.host_np: np.ndarray = self.host_buffer.numpy()

    def host(self, n: int) -> np.ndarray:
        """The host rows [fields, n] to fill for a batch of n (zeroed)."""
        if n > self.capacity:
            self._grow(max(n, 2 * self.capacity))
        view = self.host_np[:, :n]
        view[:] = 0
        return view

    def upload(self, n: int) -> Tensor:
        """The filled rows on the device [fields, n]."""
        if self.host_buffer is not self.device_buffer:  # pinned -> device, queued in stream order
            self.device_buffer[:, :n].copy_(self.host_buffer[:, :n], non_blocking=True)
        return self.device_buffer[:, :n]


class SuppressTokens:
    """Tokens a model never emits (generation_config.suppress_tokens): every row, every step."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask  # bool [V]

    def apply(self, logits: Tensor, rows: StepRows) -> None:
        logits.masked_fill_(self.mask, NEG_INF)


class SuppressBlank:
    """No blank and no end of text as the first sampled token (generation_config.begin_suppress_tokens)."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask  # bool [V]
        self.inputs = RowInputs(("first",), torch.bool, mask.device)

    def apply(self, logits: Tensor, rows: StepRows) -> None:
        if not rows.first:
            return
        if len(rows.first) == logits.shape[0]:  # every row (a window's first step): no per-row mask
            logits.masked_fill_(self.mask, NEG_INF)
            return
        n = logits.shape[0]
        self.inputs.host(n)[0, rows.first] = True
        first = self.inputs.upload(n)[0]
        logits.masked_fill_(first[:, None] & self.mask[None, :], NEG_INF)


class ApplyTimestampRules:
    """openai/whisper's ApplyTimestampRules, over every row that decodes with timestamps at once.

    Per row: timestamps come in pairs (a pair closes a segment and text must follow; text then a
    timestamp needs another timestamp or the end), never go backwards, and a segment's end is strictly
    after its start; the first sampled token is a timestamp of at most MAX_INITIAL_TIMESTAMP_S; and when
    the timestamps together are likelier than any one text token, a timestamp it is."""

    FIELDS = ("stamped", "pair", "open", "empty", "floor")

    def __init__(self, vocab: Vocab, n_vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.column = torch.arange(n_vocab, device=device)[None, :]
        self.last_allowed = vocab.timestamp_begin + round(MAX_INITIAL_TIMESTAMP_S / SECONDS_PER_TIMESTAMP)
        self.inputs = RowInputs(self.FIELDS, torch.long, device)

    def apply(self, logits: Tensor, rows: StepRows) -> None:
        stamped = [i for i, r in enumerate(rows.reqs) if r.options.timestamps and not r.forced]
        if not stamped:
            return
        v, ts, n = self.vocab, self.vocab.timestamp_begin, logits.shape[0]
        host = self.inputs.host(n)
        host[4, :] = ts  # floor: no timestamp banned from below
        for i in stamped:
            r = rows.reqs[i]
            seq = r.generated[r.sample_begin :]  # sampled tokens only: not the language or task
            last_was_ts = len(seq) >= 1 and seq[-1] >= ts
            penultimate_was_ts = len(seq) < 2 or seq[-2] >= ts
            last_stamp = next((t for t in reversed(seq) if t >= ts), None)
            host[:4, i] = (
                1,
                last_was_ts and penultimate_was_ts,
                last_was_ts and not penultimate_was_ts,
                not seq,
            )
            if last_stamp is not None:
                # Timestamps never go backwards; a segment's end is strictly after its start.
                host[4, i] = last_stamp if (last_was_ts and not penultimate_was_ts) else last_stamp + 1
        values = self.inputs.upload(n)
        row, pair, open_segment, empty = (values[k, :, None] > 0 for k in range(4))
        col = self.column
        ban = (col >= ts) & (col < values[4, :, None])
        ban |= pair & (col >= ts)  # a pair closed a segment: text must follow
        ban |= open_segment & (col < v.eot)  # text then a timestamp: another timestamp (or the end)
        ban |= empty & ((col < ts) | (col > self.last_allowed))  # begin with an early timestamp
        ban |= row & (col == v.no_timestamps)
        logits.masked_fill_(ban, NEG_INF)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        # As a device-side condition (no `if` on a tensor: that would wait for the device).
        likelier = torch.logsumexp(logprobs[:, ts:], dim=-1) > logprobs[:, :ts].max(dim=-1).values
        logits[:, :ts].masked_fill_(row & likelier[:, None], NEG_INF)
