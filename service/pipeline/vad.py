"""The voice-activity model: silero-vad through onnxruntime, one per process (`load_vad()`), scoring 32 ms
windows of 16 kHz audio for any number of channels at once (`SileroVad.score`: batched across channels,
a window depth at a time). Each channel keeps its own `VadState` (the model's LSTM state, the last
samples of context, its noise gate). What the probabilities mean for an utterance is
service/pipeline/endpointing.py's; who gathers the channels of every stream into one pass is
service/pipeline/vad_batch.py's.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service import metrics
from service.pipeline.noise_gate import MARGIN_DB, NoiseFloor, levels_db

RATE = 16000
WINDOW = 512  # samples the model scores at a time (32 ms)
_CONTEXT = 64  # samples of the previous window the model sees in front of each window
MAX_WINDOWS_PER_CALL = 32  # ~1 s: batching windows into one call costs ~half per window
# The sequence export runs many windows of one stream per call (16 kHz only) and gives bit-identical
# probabilities to the stock model, which runs one window of many streams per call at 8 or 16 kHz.
_MODEL = "silero_vad_16k_sequence.onnx"
_BATCH_MODEL = "silero_vad.onnx"


@dataclass
class VadState:
    """Per-channel recurrent state of the model (the LSTM's h and c, stacked as the stock model keeps
    them) and the tail of the last window scored: a few KB."""

    state: np.ndarray = field(default_factory=lambda: np.zeros((2, 128), dtype=np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(_CONTEXT, dtype=np.float32))
    noise: NoiseFloor = field(default_factory=NoiseFloor)  # the noise gate's, per channel


class SileroVad:
    """silero-vad through onnxruntime: shared by all streams of a process (run() is thread-safe).

    `score()` is the one place probabilities are computed: any number of channels, each with any number
    of windows. Channels are batched a window at a time (the LSTM makes a channel's own
    windows sequential), so N streams with a window each cost one call, not N. A channel's line noise,
    once the model has called it non-speech, is not scored at all (service/pipeline/noise_gate.py; the
    margin is the channel's own, in its VadState).
    """

    def __init__(self, path: Path | None = None) -> None:
        opts = ort.SessionOptions()
        # One thread per call: 64 streams are parallel work already, and the engine needs the cores.
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._session = ort.InferenceSession(
            str(path or _model_path()), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self._batch = ort.InferenceSession(
            str(_model_path(_BATCH_MODEL)), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self._rate = np.array(RATE, dtype=np.int64)

    def new_state(self, gate_margin_db: float = MARGIN_DB) -> VadState:
        """A channel's state; `gate_margin_db` is its noise gate's (0: every window scored)."""
        return VadState(noise=NoiseFloor(margin_db=gate_margin_db))

    def __call__(self, state: VadState, windows: np.ndarray) -> np.ndarray:
        """Speech probability of each window of one channel ([n, window]); advances `state`."""
        return self.score([state], [windows])[0]

    def score(self, states: Sequence[VadState], windows: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Speech probability of each window of each channel (windows[i] is [n_i, WINDOW]); advances
        every state. Skipped line noise scores 0. The gate decides window by window, so how the windows
        are split into passes never changes a probability: each round skips what it can, then scores
        each channel's windows up to the next one the gate might skip (one channel: the sequence export,
        many windows in one call; more: batched across channels, a window depth at a time)."""
        out = [np.zeros(len(w), dtype=np.float32) for w in windows]
        levels = [levels_db(w) if len(w) else _EMPTY for w in windows]
        at = [0] * len(states)  # each channel's next window
        skipped = 0
        while True:
            runs: dict[int, int] = {}  # channel -> windows to score this round from at[channel]
            for i, state in enumerate(states):
                skip = state.noise.leading_skips(levels[i][at[i] :])
                at[i] += skip
                skipped += skip
                if at[i] < len(windows[i]):
                    runs[i] = min(len(windows[i]) - at[i], state.noise.scored_before_gating())
            if not runs:
                break
            if len(runs) == 1:
                ((i, n),) = runs.items()
                scored = {i: self._sequence(states[i], windows[i], at[i], n)}
            else:
                scored = self._batched(states, windows, at, runs)
            for i, probs in scored.items():
                out[i][at[i] : at[i] + len(probs)] = probs
                states[i].noise.heard(levels[i][at[i] : at[i] + len(probs)], probs)
                at[i] += len(probs)
        for state, w in zip(states, windows, strict=True):
            if len(w):
                state.context = w[-1, -_CONTEXT:].copy()
        if skipped:
            metrics.VAD_WINDOWS_GATED.inc(skipped)
        return out

    def _sequence(self, state: VadState, windows: np.ndarray, first: int, n: int) -> np.ndarray:
        """windows[first:first + n] of one channel in one call."""
        before = state.context if first == 0 else windows[first - 1, -_CONTEXT:]
        run = windows[first : first + n]
        contexts = np.concatenate([before[None], run[:-1, -_CONTEXT:]])
        probs, h, c = self._session.run(
            None,
            {
                "input": np.concatenate([contexts, run], axis=1),
                "h": state.state[0].reshape(1, 1, -1),
                "c": state.state[1].reshape(1, 1, -1),
            },
        )
        state.state = np.concatenate([h.reshape(1, -1), c.reshape(1, -1)])
        return np.asarray(probs, dtype=np.float32).reshape(-1)

    def _batched(
        self, states: Sequence[VadState], windows: Sequence[np.ndarray], at: list[int], runs: dict[int, int]
    ) -> dict[int, np.ndarray]:
        """runs[i] windows of each channel i from at[i] on, one call per window depth."""
        window, ctx = WINDOW, _CONTEXT
        probs = {i: np.empty(n, dtype=np.float32) for i, n in runs.items()}
        # One call per window depth: every channel that has a window to score at depth d is in it. The
        # input row is [context | window], written straight into the batch (the one copy the model needs).
        for d in range(max(runs.values())):
            live = [i for i, n in runs.items() if d < n]
            batch = np.empty((len(live), ctx + window), dtype=np.float32)
            state = np.empty((2, len(live), 128), dtype=np.float32)
            for row, i in enumerate(live):
                w, k = windows[i], at[i] + d
                batch[row, :ctx] = states[i].context if k == 0 else w[k - 1, -ctx:]
                batch[row, ctx:] = w[k]
                state[:, row] = states[i].state
            p, state_n = self._batch.run(None, {"input": batch, "state": state, "sr": self._rate})
            p = np.asarray(p).reshape(-1)
            for row, i in enumerate(live):
                probs[i][d] = p[row]
                states[i].state = state_n[:, row]
        return probs


_EMPTY = np.zeros(0, dtype=np.float32)


def _model_path(name: str = _MODEL) -> Path:
    # Locate the wheel's model without importing silero_vad: its import runs torch.set_num_threads(1),
    # which would silently slow the engine's torch down for the whole process.
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("silero-vad is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / name


@functools.cache
def load_vad() -> SileroVad:
    """The process-wide VAD model (loaded once, ~10 ms)."""
    return SileroVad()
