"""Word timings from cross-attention, the way openai/whisper's timing.py computes them.

The decoder's alignment heads (a few cross-attention heads whose attention follows the audio; their list
ships with the weights) are read over the final tokens: softmax over the audio frames, each head
normalised over the tokens, a median filter along time (width 7), averaged over heads, and dynamic time
warping finds the monotonic path from tokens to frames. Tokens are grouped into words (split at spaces,
punctuation merged into its neighbour word); a word starts where the path first reaches its first token
and ends where it reaches the next word. Word probability is the mean probability of its tokens.

The model pass that produces the attention runs in the model runner (engine/model/model.py
`alignment_attention`); this module is the arithmetic, on CPU tensors and numpy.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.decoding.rules import DecodingRules
from engine.model.kv_cache import KVCache
from engine.model.model import Whisper
from engine.outputs import WordTiming
from engine.scheduling.request import Request

FRAMES_PER_SECOND = 50  # encoder positions: 20 ms each
SAMPLES_PER_FRAME = 320  # at 16 kHz
MEDIAN_FILTER_WIDTH = 7
MAX_MEDIAN_WORD_S = 0.7
CLOSING_MARKS = ".,!?;:。，！？"
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


def alignment_heads(generation_config: object, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """(layer, head) pairs from the weights (generation_config.json's alignment_heads, which CTranslate2
    folders carry too); without them, every head of the decoder's upper half, as openai/whisper does."""
    heads = getattr(generation_config, "alignment_heads", None)
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    return [(layer, head) for layer in range(n_layers // 2, n_layers) for head in range(n_heads)]


def median_filter(x: Tensor, width: int) -> Tensor:
    """Median over the last dimension, reflect-padded (as openai/whisper's CPU path)."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    padded = F.pad(x.reshape(-1, 1, shape[-1]), (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad].reshape(shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through cost [tokens, frames]: (token indexes, frame indexes)."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    trace = np.zeros((n + 1, m + 1), dtype=np.int8)
    acc[0, 0] = 0.0
    for i in range(1, n + 1):
        row, prev, c = acc[i], acc[i - 1], cost[i - 1]
        for j in range(1, m + 1):
            diag, up, left = prev[j - 1], prev[j], row[j - 1]
            if diag <= up and diag <= left:
                best, step = diag, 0
            elif up <= left:
                best, step = up, 1
            else:
                best, step = left, 2
            row[j] = c[j - 1] + best
            trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    tokens, frames = [], []
    while i > 0 or j > 0:
        tokens.append(i - 1)
        frames.append(j - 1)
        move = trace[i, j]
        if move == 0:
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    path = np.array([tokens, frames])[:, ::-1]
    return path[0], path[1]


@dataclass(frozen=True)
class AlignmentInput:
    """One finished window: its text tokens, the attention rows that predicted them, and its audio."""

    text_tokens: list[int]
    qk: Tensor  # [heads, len(text_tokens) + 1, frames]: rows of the tokens before each text token and EOT
    probabilities: np.ndarray  # [len(text_tokens)]
    n_frames: int  # encoder positions the audio covers (samples / 320)


def split_words(
    tokens: Sequence[int], decode: Callable[[list[int]], str]
) -> tuple[list[str], list[list[int]]]:
    """Group tokens into words: a new word at a leading space or a punctuation mark (openai/whisper's
    split_tokens_on_spaces); a token cut inside a multi-byte character stays with the next."""
    words: list[str] = []
    groups: list[list[int]] = []
    current: list[int] = []
    for token in tokens:
        current.append(token)
        text = decode(current)
        if "\ufffd" in text:
            continue  # an incomplete UTF-8 sequence: wait for the rest
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append(text)
            groups.append(current)
        else:
            words[-1] += text
            groups[-1].extend(current)
        current = []
    return words, groups


@dataclass
class _Raw:
    word: str
    start: float
    end: float
    probability: float


def _merge_punctuation(raw: list[_Raw]) -> list[_Raw]:
    """Opening punctuation joins the next word, closing punctuation the previous one, which keep their
    own times (openai/whisper's merge_punctuations)."""
    i, j = len(raw) - 2, len(raw) - 1
    while i >= 0:
        previous, following = raw[i], raw[j]
        if previous.word.startswith(" ") and previous.word.strip() in PREPEND_PUNCTUATION:
            following.word = previous.word + following.word
            previous.word = ""
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(raw):
        previous, following = raw[i], raw[j]
        if not previous.word.endswith(" ") and following.word in APPEND_PUNCTUATION:
            previous.word = previous.word + following.word
            following.word = ""
        else:
            i = j
        j += 1
    return [r for r in raw if r.word]


def word_timings(
    item: AlignmentInput, decode: Callable[[list[int]], str], offset_s: float = 0.0
) -> list[WordTiming]:
    """Words of one window with start/end from its first sample (+ offset_s) and probabilities."""
    tokens = item.text_tokens
    if not tokens or item.n_frames < 2:
        return []
    n_frames = min(item.n_frames, item.qk.shape[-1])
    weights = item.qk[:, :, :n_frames].float().softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = (weights - mean) / std.clamp_min(1e-9)
    weights = median_filter(weights, MEDIAN_FILTER_WIDTH)
    matrix = weights.mean(dim=0).numpy()
    text_index, time_index = dtw(-matrix.astype(np.float64))
    words, groups = split_words(tokens, decode)
    jumps = np.pad(np.diff(text_index), (1, 0), constant_values=1).astype(bool)
    jump_times = time_index[jumps] / FRAMES_PER_SECOND  # where the path reaches each token (and EOT)
    boundaries = np.cumsum([0] + [len(g) for g in groups])
    raw = []
    for k, word in enumerate(words):
        a, b = boundaries[k], boundaries[k + 1]
        start, end = jump_times[a], jump_times[min(b, len(jump_times) - 1)]
        raw.append(_Raw(word, float(start), float(max(start, end)), float(np.mean(item.probabilities[a:b]))))
    merged = _clamp_long_words(_merge_punctuation(raw))
    return [
        WordTiming(r.word, round(r.start + offset_s, 3), round(r.end + offset_s, 3), r.probability)
        for r in merged
    ]


def _clamp_long_words(raw: list[_Raw]) -> list[_Raw]:
    """The path reaches a word at the start of the pause before it, and leaves a word that closes a
    phrase at the end of the pause after it. Like openai/whisper (first word after a pause, words at
    sentence ends), a word longer than twice the median word (the median capped at 0.7 s) loses the
    excess: at its end when it carries closing punctuation, else at its start."""
    durations = [r.end - r.start for r in raw if r.end > r.start]
    if not durations:
        return raw
    longest = 2 * min(MAX_MEDIAN_WORD_S, float(np.median(durations)))
    for r in raw:
        if r.end - r.start > longest:
            if r.word.rstrip()[-1:] in CLOSING_MARKS:
                r.end = r.start + longest
            else:
                r.start = r.end - longest
    return raw


# --- the runner's part: one batched pass over finished windows -----------------------------------


class WordAligner:
    """Computes word timings for finished windows whose cross-attention K/V is still in the KV cache."""

    def __init__(
        self, model: Whisper, cache: KVCache, rules: DecodingRules, heads: list[tuple[int, int]]
    ) -> None:
        self.model = model
        self.cache = cache
        self.rules = rules
        self.heads = heads

    def _decode(self, tokens: list[int]) -> str:
        return str(self.rules.tokenizer.decode(tokens))

    def align(self, reqs: Sequence[Request]) -> None:
        """ONE extra decoder pass over each request's [prompt + generated] tokens (batched), then the
        alignment per window; appends to req.words (times from the utterance's first sample)."""
        eot = self.rules.vocab.eot
        sequences, text_positions = [], []
        for req in reqs:
            seq = [*req.prompt_tokens, *req.generated]
            if seq[-1] == eot:
                seq = seq[:-1]
            start = len(req.prompt_tokens)
            # A text token at position p was predicted by the query at p - 1; EOT by the last one.
            positions = [start + i for i, t in enumerate(req.generated) if t < eot]
            sequences.append(seq)
            text_positions.append(positions)
        device = self.cache.cross_len.device
        width = max(len(s) for s in sequences)
        tokens = torch.tensor([s + [eot] * (width - len(s)) for s in sequences], device=device)
        rows = torch.tensor([r.row for r in reqs], device=device)
        qk, logits = self.model.alignment_attention(tokens, rows, self.cache, self.heads)
        for b, req in enumerate(reqs):
            positions = text_positions[b]
            if not positions:
                continue
            text_tokens = [req.generated[p - len(req.prompt_tokens)] for p in positions]
            query_rows = torch.tensor([p - 1 for p in positions] + [positions[-1]], device=device)
            probs = logits[b, query_rows[:-1], :eot].float().softmax(dim=-1)
            token_probs = probs[
                torch.arange(len(text_tokens), device=device), torch.tensor(text_tokens, device=device)
            ]
            item = AlignmentInput(
                text_tokens=text_tokens,
                qk=qk[b][:, query_rows].float().cpu(),
                probabilities=token_probs.cpu().numpy(),
                n_frames=len(req.window_audio()) // SAMPLES_PER_FRAME,
            )
            req.words.extend(word_timings(item, self._decode, offset_s=30.0 * req.window))
