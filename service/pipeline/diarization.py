"""Who spoke when on one channel of a whole recording: segmentation, speaker embeddings and clustering
over the call (service/pipeline/speaker_models.py), then a speaker for each word.

1. Segmentation: 10 s windows every WINDOW_STEP_S (more apart on long calls, so that a call of any length
   gives at most MAX_WINDOWS), each -> the activity of up to 3 local speakers per 16.9 ms frame.
2. One CAM++ embedding per (window, local speaker) with at least MIN_EMBED_S of speech of its own (frames
   where it speaks alone): the window's speaker as one voice.
3. Agglomerative clustering (average linkage, cosine distance) of the embeddings, stopped at
   MERGE_THRESHOLD without being told the count, then held within the asked min/max speakers. Local
   speakers with too little speech for an embedding join the cluster of the nearest (window, speaker).
4. Each cluster's activity over the call: the mean, over the windows that cover a frame, of the local
   activity of the speaker mapped to it.

The overlap rule: a word goes to the speaker with the most activity summed over the word's span; where two
talk at once both count, so the one who speaks over more of the word (usually the one who holds the turn)
wins. Speakers are numbered from 0 in order of first speech.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.pipeline.speaker_models import (
    FRAME_STEP_S,
    LOCAL_SPEAKERS,
    SAMPLE_RATE,
    WINDOW_S,
    fbank,
    load_models,
    powerset_to_speakers,
)

WINDOW_STEP_S = 2.5
MAX_WINDOWS = 600  # bounds the clustering's cost (its distance matrix grows as the square)
MIN_EMBED_S = 0.6  # less speech than this gives an embedding too noisy to cluster
# Cosine distance. CAM++ puts different speakers' 1-3 s turns on 8 kHz G.711 at 0.5-0.75 and one speaker's
# turns far apart in a call at up to ~0.6 (scripts/bench_diarization.py's calls): no threshold parts both
# well; two voices heard in one window are parted by CANNOT_LINK instead, and the threshold is set for
# one voice across the call.
MERGE_THRESHOLD = 0.65
# The distance given to two local speakers of one window: the segmentation model heard them as two voices
# at once, which no embedding of a few seconds of telephone speech knows better (pyannote's own pipeline
# forbids such a merge too). The largest cosine distance, not infinity, so a bound on the count can still
# force it.
CANNOT_LINK = 2.0
ACTIVE = 0.5  # local activity above which a frame counts as a speaker's
MIN_SPEAKER_S = 1.0  # a cluster with less speech than this is folded into the nearest (_fold_small)
BATCH = 32


@dataclass(frozen=True)
class Turn:
    start_s: float
    end_s: float
    speaker: int


@dataclass(frozen=True)
class Diarization:
    """A channel's speakers: `activity` [frames, speakers] on the segmentation's frame grid (frame i at
    i * FRAME_STEP_S), and the turns it binarises to."""

    activity: np.ndarray
    turns: tuple[Turn, ...]

    @property
    def speakers(self) -> int:
        return int(self.activity.shape[1])

    def speaker_of(self, start_s: float, end_s: float) -> int | None:
        """The speaker of the span (the overlap rule above); None when no speaker has been found at all.
        A span where no one is active (a word the segmentation missed) takes the nearest turn's speaker."""
        if not self.speakers:
            return None
        lo = max(0, int(start_s / FRAME_STEP_S))
        hi = min(len(self.activity), max(lo + 1, int(np.ceil(end_s / FRAME_STEP_S))))
        totals = self.activity[lo:hi].sum(axis=0) if hi > lo else np.zeros(self.speakers)
        if totals.max(initial=0.0) > 0.05:
            return int(totals.argmax())
        if not self.turns:
            return 0
        mid = (start_s + end_s) / 2
        nearest = min(
            self.turns,
            key=lambda t: (
                0.0 if t.start_s <= mid <= t.end_s else min(abs(t.start_s - mid), abs(t.end_s - mid))
            ),
        )
        return nearest.speaker


# Recorded work in a frontend process: one diarization at a time, on one core, so that the engine and the
# live calls this frontend serves keep the rest of the machine (live calls come before recorded work).
_ONE_AT_A_TIME = threading.Lock()


def diarize(audio: np.ndarray, min_speakers: int = 1, max_speakers: int = 0) -> Diarization:
    """`audio`: the channel at 16 kHz, float. `max_speakers` 0: no upper bound beyond what is found."""
    with _ONE_AT_A_TIME:
        torch.set_num_threads(1)
        return _diarize(audio, min_speakers, max_speakers)


def _diarize(audio: np.ndarray, min_speakers: int, max_speakers: int) -> Diarization:
    seg_model, emb_model = load_models()
    samples = len(audio)
    window = int(WINDOW_S * SAMPLE_RATE)
    duration_s = samples / SAMPLE_RATE
    step_s = max(WINDOW_STEP_S, (duration_s - WINDOW_S) / (MAX_WINDOWS - 1))
    starts = [0]
    while starts[-1] + window < samples:
        starts.append(min(round(len(starts) * step_s * SAMPLE_RATE), samples - window))
    wave = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    if samples < window:
        wave = torch.nn.functional.pad(wave, (0, window - samples))
    chunks = torch.stack([wave[s : s + window] for s in starts])

    with torch.inference_mode():
        local = torch.cat(
            [
                powerset_to_speakers(seg_model(chunks[i : i + BATCH, None]))
                for i in range(0, len(chunks), BATCH)
            ]
        ).numpy()  # [windows, frames, 3]
    frames_per_window = local.shape[1]
    # the sample range of window frame f (frames are 16.9 ms apart; the last frame runs to the window's end)
    bounds = np.linspace(0, window, frames_per_window + 1).astype(int)

    # 2. embeddings of each window's local speakers, from the samples where each speaks alone
    keys: list[tuple[int, int]] = []
    segments: list[torch.Tensor] = []
    for w, start in enumerate(starts):
        act = local[w] > ACTIVE
        alone = act & (act.sum(axis=1, keepdims=True) == 1)
        for s in range(LOCAL_SPEAKERS):
            frames = np.flatnonzero(alone[:, s])
            if len(frames) * FRAME_STEP_S < MIN_EMBED_S:
                continue
            idx = np.concatenate([np.arange(bounds[f], bounds[f + 1]) for f in frames])
            idx = idx[idx + start < samples]
            if len(idx) < MIN_EMBED_S * SAMPLE_RATE:
                continue
            keys.append((w, s))
            segments.append(wave[start + idx])
    embeddings = _embed(emb_model, segments)

    # 3. clusters, then every active local speaker (with an embedding or not) mapped to one
    labels = _cluster(embeddings, [w for w, _ in keys], min_speakers, max_speakers)
    k = int(labels.max()) + 1 if len(labels) else 0
    mapping: dict[tuple[int, int], int] = dict(zip(keys, labels.tolist(), strict=True))
    if k:
        centroids = np.stack([embeddings[labels == c].mean(axis=0) for c in range(k)])
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    total_frames = int(np.ceil(samples / SAMPLE_RATE / FRAME_STEP_S)) + 1
    summed = np.zeros((total_frames, max(k, 1)), dtype=np.float32)
    covered = np.zeros(total_frames, dtype=np.float32)
    for w, start in enumerate(starts):
        first = round(start / SAMPLE_RATE / FRAME_STEP_S)
        n = min(frames_per_window, total_frames - first)
        covered[first : first + n] += 1
        if not k:
            continue
        mine = np.zeros((n, k), dtype=np.float32)
        for s in range(LOCAL_SPEAKERS):
            if not (local[w, :n, s] > ACTIVE).any():
                continue
            c = mapping.get((w, s))
            if c is None:  # too little speech for its own embedding: the nearest cluster's
                c = _nearest_cluster(wave, start, bounds, local[w, :, s], samples, emb_model, centroids)
            # two local speakers of one window in one cluster: one voice, not twice the activity
            mine[:, c] = np.maximum(mine[:, c], local[w, :n, s])
        summed[first : first + n] += mine
    activity = summed / np.maximum(covered, 1)[:, None]
    if not k:
        activity = np.zeros((total_frames, 0), dtype=np.float32)
    else:
        activity = _fold_small(activity, centroids, min_speakers)
    activity, turns = _renumber(activity)
    return Diarization(activity, turns)


def _embed(model: torch.nn.Module, segments: Sequence[torch.Tensor]) -> np.ndarray:
    out = []
    with torch.inference_mode():
        feats = [fbank(s) for s in segments]
        # batched by similar length: padding a short segment with another's length would change its mean
        order = sorted(range(len(feats)), key=lambda i: len(feats[i]))
        vectors: dict[int, torch.Tensor] = {}
        for i in range(0, len(order), BATCH):
            group = order[i : i + BATCH]
            shortest = min(len(feats[j]) for j in group)
            batch = torch.stack([feats[j][:shortest] for j in group])
            for j, v in zip(group, model(batch), strict=True):
                vectors[j] = v
        out = [vectors[i] for i in range(len(feats))]
    if not out:
        return np.zeros((0, 192), dtype=np.float32)
    e = torch.stack(out).numpy()
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def _nearest_cluster(
    wave: torch.Tensor,
    start: int,
    bounds: np.ndarray,
    act: np.ndarray,
    samples: int,
    model: torch.nn.Module,
    centroids: np.ndarray,
) -> int:
    frames = np.flatnonzero(act > ACTIVE)
    idx = np.concatenate([np.arange(bounds[f], bounds[f + 1]) for f in frames])
    idx = idx[idx + start < samples]
    if len(idx) < 0.2 * SAMPLE_RATE:
        return 0  # too short to tell
    e = _embed(model, [wave[start + idx]])[0]
    return int(np.argmax(centroids @ e))


def _cluster(
    embeddings: np.ndarray, windows: Sequence[int], min_speakers: int, max_speakers: int
) -> np.ndarray:
    """Average-linkage agglomerative clustering on cosine distance, embeddings of one window kept apart
    (CANNOT_LINK); labels 0..k-1."""
    n = len(embeddings)
    if n == 0:
        return np.zeros(0, dtype=int)
    if n == 1:
        return np.zeros(1, dtype=int)
    dist = 1.0 - embeddings @ embeddings.T
    group = np.asarray(windows)
    dist[group[:, None] == group[None, :]] = CANNOT_LINK
    np.fill_diagonal(dist, np.inf)
    size = np.ones(n)
    alive = np.ones(n, dtype=bool)
    parent = np.arange(n)
    merges: list[tuple[int, int, float]] = []
    for _ in range(n - 1):
        flat = int(np.argmin(dist))
        i, j = divmod(flat, n)
        d = float(dist[i, j])
        merges.append((i, j, d))
        # Lance-Williams update for average linkage: j merges into i
        new = (size[i] * dist[i] + size[j] * dist[j]) / (size[i] + size[j])
        dist[i], dist[:, i] = new, new
        dist[i, i] = np.inf
        dist[j, :], dist[:, j] = np.inf, np.inf
        size[i] += size[j]
        alive[j] = False
    found = n - sum(1 for _, _, d in merges if d < MERGE_THRESHOLD)
    upper = max_speakers if max_speakers > 0 else n
    k = min(max(found, min(min_speakers, n)), upper)
    for i, j, _ in merges[: n - k]:
        parent[parent == j] = i
    _, labels = np.unique(parent, return_inverse=True)
    return labels


def _fold_small(activity: np.ndarray, centroids: np.ndarray, min_speakers: int) -> np.ndarray:
    """A cluster with less than MIN_SPEAKER_S of speech is one voice the segmentation split in a window
    or two, not a speaker: its activity goes to the nearest cluster by centroid (while more than
    `min_speakers` remain)."""
    keep = list(range(activity.shape[1]))
    while len(keep) > max(min_speakers, 1):
        spoken = {c: float((_active(activity)[:, c]).sum()) * FRAME_STEP_S for c in keep}
        smallest = min(keep, key=lambda c: spoken[c])
        if spoken[smallest] >= MIN_SPEAKER_S:
            break
        keep.remove(smallest)
        target = max(keep, key=lambda c: float(centroids[c] @ centroids[smallest]))
        activity[:, target] += activity[:, smallest]
        activity[:, smallest] = 0.0
    return activity


def _active(activity: np.ndarray) -> np.ndarray:
    """Which speakers speak in each frame: those above ACTIVE, and where the speakers' summed activity is
    above it but split between clusters (windows that mapped one voice differently), the likeliest."""
    active = activity > ACTIVE
    if activity.shape[1]:
        top = activity.argmax(axis=1)
        voiced = activity.sum(axis=1) > ACTIVE
        active[np.flatnonzero(voiced), top[voiced]] = True
    return active


def _renumber(activity: np.ndarray) -> tuple[np.ndarray, tuple[Turn, ...]]:
    """Speakers in order of first speech (a cluster that never speaks is dropped), and their turns: runs
    of active frames (_active)."""
    active = _active(activity)
    firsts = [(int(np.argmax(active[:, c])), c) for c in range(activity.shape[1]) if active[:, c].any()]
    order = [c for _, c in sorted(firsts)]
    activity = activity[:, order]
    active = active[:, order]
    turns = []
    for c in range(len(order)):
        padded = np.concatenate([[False], active[:, c], [False]])
        edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
        for a, b in zip(edges[::2], edges[1::2], strict=True):
            turns.append(Turn(a * FRAME_STEP_S, b * FRAME_STEP_S, c))
    turns.sort(key=lambda t: (t.start_s, t.speaker))
    return activity, tuple(turns)
