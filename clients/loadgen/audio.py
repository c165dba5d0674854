"""What asr-loadgen sends: a manifest's audio as wire bytes, line noise, a live call's audio, and each
stream's config and deadline."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from asr.v1 import asr_pb2

from clients.client import G711_RATE
from clients.manifest import ManifestEntry

STREAM_TIMEOUT_S = 300.0  # a stuck server shows as DEADLINE_EXCEEDED rather than a hung benchmark
LINE_NOISE_DBFS = -50.0  # an idle telephone line's hiss: the VAD hears no speech, the engine gets nothing


@dataclass(frozen=True)
class Utterance:
    index: int
    encoding: int  # asr_pb2.AudioEncoding
    sample_rate: int
    data: bytes  # raw samples, as sent on the wire
    bytes_per_second: int
    duration_s: float
    text: str


def load_utterances(entries: Sequence[ManifestEntry]) -> list[Utterance]:
    """Read every file once, up front, so disk reads never sit inside a timed stream."""
    out: list[Utterance] = []
    for i, e in enumerate(entries):
        if e.encoding == "MULAW":
            data = Path(e.audio).read_bytes()  # headerless G.711: already the wire format
            bps = e.sample_rate
            enc = asr_pb2.MULAW
        else:
            pcm, rate = sf.read(e.audio, dtype="int16", always_2d=True)
            if rate != e.sample_rate:
                raise ValueError(f"{e.audio}: file says {rate} Hz, manifest says {e.sample_rate}")
            data = pcm[:, 0].tobytes()
            bps = 2 * e.sample_rate
            enc = asr_pb2.LINEAR16
        out.append(Utterance(i, enc, e.sample_rate, data, bps, len(data) / bps, e.text))
    return out


def stream_config(u: Utterance) -> asr_pb2.StreamingRecognitionConfig:
    cfg = asr_pb2.RecognitionConfig(
        encoding=u.encoding,  # type: ignore[arg-type]
        sample_rate_hertz=u.sample_rate,
        audio_channel_count=1,
    )
    return asr_pb2.StreamingRecognitionConfig(config=cfg)


def chunk_bytes(u: Utterance, chunk_ms: int) -> int:
    """Bytes per message: `chunk_ms` of audio in whole samples."""
    step = max(1, u.bytes_per_second * chunk_ms // 1000)
    if u.encoding == asr_pb2.LINEAR16:
        step -= step % 2  # whole 16-bit samples per message
    return max(step, 2 if u.encoding == asr_pb2.LINEAR16 else 1)


def line_noise(seconds: float, seed: int) -> bytes:
    """`seconds` of white noise at LINE_NOISE_DBFS as 8 kHz G.711 mu-law (soundfile's encoder)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(round(G711_RATE * seconds)) * 10 ** (LINE_NOISE_DBFS / 20)
    buf = io.BytesIO()
    sf.write(buf, np.clip(x, -1.0, 1.0), G711_RATE, format="RAW", subtype="ULAW")
    return buf.getvalue()


def call_audio(utts: Sequence[Utterance], seconds: float, call: int) -> Utterance:
    """Call `call`'s audio: the utterances back to back from utterance `call` on (so calls differ),
    looped to `seconds`. Every utterance must share one encoding and rate."""
    first = utts[0]
    if any((u.encoding, u.sample_rate) != (first.encoding, first.sample_rate) for u in utts):
        raise ValueError("capacity --manifest: every utterance must have the same encoding and rate")
    want = round(seconds * first.bytes_per_second)
    want -= want % (2 if first.encoding == asr_pb2.LINEAR16 else 1)
    parts: list[bytes] = []
    have, i = 0, call
    while have < want:
        data = utts[i % len(utts)].data
        parts.append(data)
        have += len(data)
        i += 1
    data = b"".join(parts)[:want]
    text = " ".join(utts[j % len(utts)].text for j in range(call, i))
    return Utterance(call, first.encoding, first.sample_rate, data, first.bytes_per_second, seconds, text)
