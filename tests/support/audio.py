"""Real test audio made on the spot: espeak-ng speech with known text, telephone audio made by sox.

Arrays are float32 in [-1, 1], 16 kHz unless a rate is given; multi-channel arrays are [channels, n].
Generated files are cached in one temporary folder per test session.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

RATE = 16000
SHARED = Path(__file__).resolve().parents[2].parent / "shared"
JFK_FLAC = SHARED / "data" / "jfk.flac"
JFK_TEXT = (
    "And so my fellow Americans, ask not what your country can do for you, "
    "ask what you can do for your country."
)


@functools.cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="asr-test-audio-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _run(*args: str | Path) -> None:
    subprocess.run([str(a) for a in args], check=True, capture_output=True)


@functools.cache
def _speak_file(text: str, voice: str, speed: int, rate: int) -> Path:
    key = abs(hash((text, voice, speed, rate)))
    raw, out = _workdir() / f"say-{key}-22k.wav", _workdir() / f"say-{key}.wav"
    _run("espeak-ng", "-v", voice, "-s", str(speed), "-w", raw, text)
    _run("sox", "-D", raw, "-r", str(rate), "-c", "1", "-b", "16", out)
    return out


def speak(text: str, voice: str = "en-us", speed: int = 160, rate: int = RATE) -> np.ndarray:
    """espeak-ng speech, mono float32 at `rate` (with espeak's own short silence at the end)."""
    audio, _ = sf.read(_speak_file(text, voice, speed, rate), dtype="float32")
    return audio


def speech_bounds(audio: np.ndarray, rate: int = RATE, rel_db: float = -35.0) -> tuple[float, float]:
    """(start_s, end_s) of the part louder than `rel_db` below the loudest 10 ms frame."""
    hop = rate // 100
    frames = audio[: len(audio) // hop * hop].reshape(-1, hop)
    rms = np.sqrt((frames**2).mean(axis=1))
    loud = np.flatnonzero(rms > rms.max() * 10 ** (rel_db / 20))
    return loud[0] * hop / rate, (loud[-1] + 1) * hop / rate


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(round(seconds * rate), dtype=np.float32)


def white_noise(seconds: float, dbfs: float = -30.0, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """Gaussian white noise with RMS `dbfs` relative to full scale."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(round(seconds * rate)) * 10 ** (dbfs / 20)).astype(np.float32)


def make_conversation(
    sentences: list[str], pause_s: float, lead_s: float = 0.5, **voice: object
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Sentences spoken one after another with `pause_s` of silence between speech (and after the last).

    Returns the audio and the true speech (start_s, end_s) of each sentence, espeak's own leading and
    trailing silence trimmed by energy.
    """
    parts, bounds, t = [silence(lead_s)], [], lead_s
    for text in sentences:
        audio = speak(text, **voice)  # type: ignore[arg-type]
        start, end = speech_bounds(audio)
        audio = audio[round(start * RATE) : round(end * RATE)]
        bounds.append((t, t + len(audio) / RATE))
        parts += [audio, silence(pause_s)]
        t += len(audio) / RATE + pause_s
    return np.concatenate(parts), bounds


def stereo(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two mono signals as [2, n], the shorter padded with silence."""
    n = max(len(a), len(b))
    return np.stack([np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))]).astype(np.float32)


def to_linear16_bytes(audio: np.ndarray) -> bytes:
    """[n] or [channels, n] float32 -> interleaved signed 16-bit little-endian PCM."""
    x = np.atleast_2d(audio).T  # [n, channels]
    return (np.clip(x, -1, 1) * 32767).round().astype("<i2").tobytes()


def _sox_to_raw(audio: np.ndarray, rate: int, out_rate: int, encoding: str) -> bytes:
    src = _workdir() / f"in-{abs(hash(audio.tobytes()))}.wav"
    dst = src.with_suffix(f".{encoding}.raw")
    sf.write(src, np.atleast_2d(audio).T, rate, subtype="PCM_16")
    _run("sox", "-D", src, "-r", str(out_rate), "-e", encoding, "-b", "8", "-t", "raw", dst)
    return dst.read_bytes()


def to_mulaw_8k_bytes(audio: np.ndarray, rate: int = RATE) -> bytes:
    """Telephone audio: resampled to 8 kHz and mu-law encoded by sox."""
    return _sox_to_raw(audio, rate, 8000, "mu-law")


def to_alaw_8k_bytes(audio: np.ndarray, rate: int = RATE) -> bytes:
    """Telephone audio: resampled to 8 kHz and A-law encoded by sox."""
    return _sox_to_raw(audio, rate, 8000, "a-law")


def sox_decode_g711(data: bytes, encoding: str, rate: int = 8000) -> np.ndarray:
    """sox's own decode of raw 8-bit G.711 ("mu-law" or "a-law") to int16: the reference decoder."""
    src = _workdir() / f"g711-{abs(hash(data))}.{encoding}"
    dst = src.with_suffix(".s16")
    src.write_bytes(data)
    _run(
        "sox",
        *("-t", "raw", "-r", str(rate), "-e", encoding, "-b", "8", "-c", "1", src),
        *("-t", "raw", "-e", "signed", "-b", "16", "-L", dst),
    )
    return np.frombuffer(dst.read_bytes(), dtype="<i2")


def sox_sine(freq: float, seconds: float, rate: int, encoding: str) -> bytes:
    """A sine made and G.711-encoded by sox itself (no code of ours involved)."""
    dst = _workdir() / f"sine-{freq}-{seconds}-{rate}.{encoding}"
    _run(
        "sox",
        *("-n", "-r", str(rate), "-c", "1", "-e", encoding, "-b", "8", "-t", "raw", dst),
        *("synth", str(seconds), "sine", str(freq), "vol", "0.7"),
    )
    return dst.read_bytes()
