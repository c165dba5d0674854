"""A semantic end of turn: smart-turn v3.2 (pipecat-ai 1.14.0's `smart-turn-v3.2-cpu.onnx`, BSD-2-Clause)
judges from the sound of a turn's last 8 s whether the speaker is done.

The endpointer asks when silence-only endpointing would end a turn (service/pipeline/endpointing.py);
`TurnBatcher` answers every stream that asked in the same event-loop tick with one model call (as
service/pipeline/vad_batch.py does for the VAD). The weights are package data taken from the wheel by
scripts/fetch_turn_model.py into the server's cache; pipecat's code is not used.

Input, as pipecat 1.14.0 prepares it (pipecat/audio/turn/smart_turn/local_smart_turn_v3.py and
_whisper_features.py): the turn's audio at 16 kHz from 0.5 s before speech began, its last 8 s kept, or
zero-padded at the FRONT to 8 s; then the whole 8 s normalised to zero mean and unit variance
(transformers' do_normalize, eps 1e-7); then Whisper's log-mel (n_fft 400, hop 160, periodic Hann,
centred reflect padding, 80 Slaney mel bins 0-8 kHz, power spectrum, last frame dropped, log10 floored
at 1e-10, clamped to max - 8, (x + 4) / 4): [80, 800]. The model's output (named `logits`) is already a
sigmoid: P(turn complete).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service import metrics

log = logging.getLogger("service.pipeline.turn_model")

PIPECAT_VERSION = "1.14.0"
MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
MODEL_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"

RATE = 16000
WINDOW_S = 8  # the model hears the turn's last 8 s
N_SAMPLES = RATE * WINDOW_S
N_FFT = 400
HOP = 160
N_MELS = 80
FRAMES = N_SAMPLES // HOP  # 800
LEAD_S = 0.5  # pipecat's pre_speech_ms: audio before the speech start that goes in with the turn


def default_model_path() -> Path:
    """$ASR_TURN_MODEL (the container image's), else where scripts/fetch_turn_model.py puts the weights by
    default: beside the Whisper conversions' cache."""
    from engine.api import default_cache_dir

    return Path(os.environ.get("ASR_TURN_MODEL") or default_cache_dir() / "smart-turn" / MODEL_FILE)


def _slaney_mel(hz: np.ndarray) -> np.ndarray:
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    return np.where(log_region, 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) * 27.0 / np.log(6.4), mel)


def _slaney_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), hz)


@functools.cache
def _mel_filters() -> np.ndarray:
    """[n_mels, 201]: transformers' mel_filter_bank(norm="slaney", mel_scale="slaney"), the bank
    engine/model/features.py uses for Whisper, computed without importing transformers into the frontend."""
    bins = np.linspace(0, RATE // 2, N_FFT // 2 + 1)
    edges = _slaney_hz(np.linspace(_slaney_mel(np.array(0.0)), _slaney_mel(np.array(RATE / 2)), N_MELS + 2))
    diff = np.diff(edges)
    slopes = edges[None, :] - bins[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    return filters.T.astype(np.float64)


_HANN = np.hanning(N_FFT + 1)[:-1]  # periodic, as torch.hann_window


def features(audio: np.ndarray) -> np.ndarray:
    """One turn's audio (float32 16 kHz, any length) -> [80, 800] as smart-turn v3 expects it."""
    x = np.asarray(audio, dtype=np.float32)[-N_SAMPLES:]
    if len(x) < N_SAMPLES:
        x = np.concatenate([np.zeros(N_SAMPLES - len(x), dtype=np.float32), x])
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]
    power = np.abs(np.fft.rfft(frames * _HANN, axis=-1)) ** 2  # [801, 201]
    log_spec = np.log10(np.maximum(_mel_filters() @ power.T, 1e-10))[:, :-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


class TurnModel:
    """smart-turn v3.2 through onnxruntime, shared by every stream of a process."""

    def __init__(self, path: Path | None = None) -> None:
        path = path or default_model_path()
        if not path.is_file():
            raise RuntimeError(
                f"the turn model {path} is missing: run scripts/fetch_turn_model.py (scripts/setup.sh does), "
                "or start the server with --turn-model off"
            )
        opts = ort.SessionOptions()
        # One thread per call, as the VAD: the engine needs the cores, and a batch is parallel work already.
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        self.calls = 0  # model calls made (tests check the batching)

    def complete(self, audios: Sequence[np.ndarray]) -> np.ndarray:
        """P(turn complete) for each turn's audio, in one model call."""
        if not audios:
            return np.zeros(0, dtype=np.float32)
        batch = np.stack([features(a) for a in audios])
        self.calls += 1
        (out,) = self._session.run(None, {"input_features": batch})
        return np.asarray(out, dtype=np.float32).reshape(-1)


@functools.cache
def load_turn_model() -> TurnModel:
    """The process-wide turn model (loaded once, on the first stream that uses it)."""
    return TurnModel()


# P(complete) of each asked turn, in the order asked, or the error the pass raised
OnJudged = Callable[[list[float] | Exception], None]


class TurnBatcher:
    """One turn-model call per event-loop tick for every stream whose endpointer asked in it.

    The VAD pass's handlers run the endpointers, which ask; the pass scheduled here runs in the loop's next
    turn, so the questions of every stream that one VAD pass scored share one call."""

    def __init__(self, model: TurnModel | None = None) -> None:
        self._model = model
        self._waiting: list[tuple[list[np.ndarray], OnJudged]] = []
        self._scheduled = False

    @property
    def model(self) -> TurnModel:
        if self._model is None:
            self._model = load_turn_model()
        return self._model

    def request(self, audios: list[np.ndarray], on_judged: OnJudged) -> None:
        """Judge `audios` (one turn each) in this tick's pass, then call `on_judged`."""
        self._waiting.append((audios, on_judged))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        flat = [a for audios, _ in waiting for a in audios]
        try:
            started = time.perf_counter()
            p: list[float] | Exception = self.model.complete(flat).tolist()
            metrics.TURN_SECONDS.observe(time.perf_counter() - started)
            metrics.TURN_BATCH.observe(len(flat))
        except Exception as e:  # a broken model: each stream falls back on its own
            log.exception("turn model pass failed")
            p = e
        at = 0
        for audios, on_judged in waiting:
            mine = p if isinstance(p, Exception) else p[at : at + len(audios)]
            at += len(audios)
            try:
                on_judged(mine)
            except Exception:
                log.exception("turn result handler failed")


_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnBatcher] = weakref.WeakKeyDictionary()


def turn_batcher() -> TurnBatcher:
    """The batcher of the running event loop."""
    loop = asyncio.get_running_loop()
    batcher = _batchers.get(loop)
    if batcher is None:
        batcher = _batchers[loop] = TurnBatcher()
    return batcher
