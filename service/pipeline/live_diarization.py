"""Live speaker labels on one channel of a stream (issue 30 item 1, live): online clustering of each
utterance's CAM++ embedding (service/pipeline/speaker_models.py) against the call's speakers so far.

The endpointer has already cut the channel into utterances. Each one is embedded off the event loop the
moment it is submitted to the engine (so the embedding runs while the transcript is decoded): one CAM++
embedding of its audio, or, when it is longer than LONG_S, one per window of about WINDOW_S (a turn
change inside a long utterance then moves the words of the windows after it). When the final is ready,
each embedding goes to the speaker whose centroid is nearest by cosine similarity if that is at least
SIMILARITY, else opens a new speaker (at most `max_speakers`; past it, the nearest); the chosen centroid
takes the embedding in, weighted by its seconds of audio. Numbering: 0-based, in order of first
appearance, kept for the whole call and never renumbered.

Delay: a final's speakers are fixed when the final is sent, so they arrive with the final's own delay
(the endpointer's silence plus decoding); the final waits for its embedding at most
--live-diarization-wait-s past its transcript, and past that it goes out without speakers (the embedding
is dropped, the call's speakers are not changed by it).

Overlap: a word goes to the speaker of the window that holds its midpoint, and a window's embedding is
one voice, the one that speaks most of it: overlapped speech goes to whoever holds the turn.

Cost: one CAM++ pass per utterance (per window on long ones): 3-6 CPU s per call minute, 0.05-0.1 s per
second of audio (scripts/bench_diarization.py --live, a loaded 2-CPU VM), in one thread for the whole
process at one torch thread, beside the recorded path's. That one thread bounds the live calls one
frontend can label in time (roughly 10-20 talking at once on that VM); past it finals go out without
speakers rather than late.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from service.pipeline.diarization import _embed
from service.pipeline.endpointing import Utterance
from service.pipeline.speaker_models import SAMPLE_RATE, load_models

# Cosine similarity to a speaker's centroid at or above which an utterance is that speaker's: chosen by
# scripts/bench_diarization.py --live on the calls the recorded path was tuned on (docs/benchmarks.md).
SIMILARITY = 0.45
LONG_S = 3.0  # an utterance (with its pad) longer than this is embedded in windows
WINDOW_S = 1.5  # about: a long utterance is cut into equal windows of at least this
MIN_OPEN_S = 1.0  # an utterance shorter than this joins the nearest speaker rather than open a new one

# One thread for the whole process: live embeddings one at a time, on one core, so the engine and the
# event loop keep the rest (the recorded path's diarize() runs in its own thread at one torch thread too).
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="live-diarization")
_THREADS_SET = threading.Event()


@dataclass(frozen=True)
class Embedded:
    """An utterance's windows: their spans in stream seconds, their unit embeddings and seconds of
    speech."""

    spans: tuple[tuple[float, float], ...]
    vectors: np.ndarray
    seconds: tuple[float, ...]


def windows(u: Utterance, long_s: float = LONG_S, window_s: float = WINDOW_S) -> list[tuple[int, int]]:
    """Sample ranges of `u.audio` to embed: the whole of it, or equal windows of at least `window_s`."""
    n = len(u.audio)
    if n <= long_s * SAMPLE_RATE:
        return [(0, n)]
    count = max(1, int(n / (window_s * SAMPLE_RATE)))
    edges = np.linspace(0, n, count + 1).astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def embed(u: Utterance, long_s: float = LONG_S, window_s: float = WINDOW_S) -> Embedded:
    """Runs in _EXECUTOR (`long_s`, `window_s`: the bench's variants)."""
    if not _THREADS_SET.is_set():
        torch.set_num_threads(1)
        _THREADS_SET.set()
    _, model = load_models()
    ranges = windows(u, long_s, window_s)
    wave = torch.from_numpy(np.ascontiguousarray(u.audio, dtype=np.float32))
    vectors = _embed(model, [wave[a:b] for a, b in ranges])
    start = u.audio_start_s
    spans = tuple((start + a / SAMPLE_RATE, start + b / SAMPLE_RATE) for a, b in ranges)
    # the detected speech in each window, without the endpointer's pad
    speech = tuple(max(0.0, min(b, u.end_s) - max(a, u.start_s)) for a, b in spans)
    return Embedded(spans, vectors, speech)


def warm() -> concurrent.futures.Future[object]:
    """Load the models in the diarization thread before the first utterance needs them."""
    return _EXECUTOR.submit(load_models)


class LiveSpeakers:
    """One channel's speakers over a call."""

    def __init__(self, max_speakers: int, similarity: float = SIMILARITY) -> None:
        self.max_speakers = max(1, max_speakers)
        self.similarity = similarity
        self._sums: list[np.ndarray] = []  # per speaker: the seconds-weighted sum of its embeddings

    @property
    def speakers(self) -> int:
        return len(self._sums)

    def submit(self, u: Utterance) -> concurrent.futures.Future[Embedded]:
        return _EXECUTOR.submit(embed, u)

    def assign(self, e: Embedded) -> Callable[[float, float], int]:
        """Each window's speaker (opening speakers as needed), and the words' rule: the window holding
        the span's midpoint (nearest window outside them all)."""
        labels = [self._place(v, s) for v, s in zip(e.vectors, e.seconds, strict=True)]

        def speaker_of(start_s: float, end_s: float) -> int:
            mid = (start_s + end_s) / 2
            distance = [0.0 if a <= mid <= b else min(abs(a - mid), abs(b - mid)) for a, b in e.spans]
            return labels[int(np.argmin(distance))]

        return speaker_of

    def _place(self, vector: np.ndarray, seconds: float) -> int:
        if self._sums:
            centroids = np.stack([s / np.linalg.norm(s) for s in self._sums])
            scores = centroids @ vector
            best = int(np.argmax(scores))
            full = len(self._sums) >= self.max_speakers
            if scores[best] >= self.similarity or full or seconds < MIN_OPEN_S:
                self._sums[best] = self._sums[best] + vector * seconds
                return best
        self._sums.append(vector * seconds)
        return len(self._sums) - 1
