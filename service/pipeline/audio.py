"""Audio in: validate the client's format, decode PCM / G.711 / FLAC / WAV / Ogg Opus, resample to 16 kHz float32.

Everything downstream (endpointing, the engine) sees float32 in [-1, 1] at 16 kHz, shaped
[channels, n]. No protocol here: errors are AudioFormatError, which the core makes INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf
import soxr

from engine.api import SAMPLE_RATE

TARGET_RATE = SAMPLE_RATE  # everything downstream hears the engine's rate (engine/constants.py)
G711_RATE = 8000  # G.711 (mu-law, A-law) is 8 kHz by definition: telephone audio, the API's floor
MIN_RATE, MAX_RATE = G711_RATE, 48000
MIN_CHANNELS, MAX_CHANNELS = 1, 8
STREAM_ENCODINGS = ("LINEAR16", "MULAW", "ALAW")
# A recording as it came (a Recognize request's audio_content, an HTTP upload's buffer): read in place
EncodedAudio = bytes | bytearray
FILE_ENCODINGS = ("FLAC", "WAV", "OGG_OPUS")
# soxr "HQ" (20-bit) is transparent for speech and costs little more than "MQ" at these rates.
_QUALITY = "HQ"
# Recognize decodes, resamples and endpoints a recording this many seconds at a time: a few MB at
# 48 kHz x 8 channels, whatever the recording's length.
DECODE_BLOCK_S = 10.0


class AudioFormatError(ValueError):
    """Bad audio or audio settings; `field` is the setting to blame (service/vocabulary/errors.py)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _mulaw_table() -> np.ndarray:
    # ITU-T G.711 mu-law expansion (as in Sun's g711.c): codes are stored bit-inverted.
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_table() -> np.ndarray:
    # ITU-T G.711 A-law expansion: even bits are inverted on the wire (XOR 0x55).
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


MULAW_TABLE = _mulaw_table()
ALAW_TABLE = _alaw_table()
# float32 versions, scaled like LINEAR16 so all encodings share one scale
_G711_FLOAT = {
    "MULAW": MULAW_TABLE.astype(np.float32) / 32768.0,
    "ALAW": ALAW_TABLE.astype(np.float32) / 32768.0,
}


def _check_rate_channels(sample_rate_hertz: int, audio_channel_count: int) -> tuple[int, int]:
    if not MIN_RATE <= sample_rate_hertz <= MAX_RATE:
        raise AudioFormatError(
            "sample_rate_hertz",
            f"sample_rate_hertz must be between {MIN_RATE} and {MAX_RATE}, got {sample_rate_hertz}",
        )
    channels = audio_channel_count or 1  # proto3 default 0 means mono
    if not MIN_CHANNELS <= channels <= MAX_CHANNELS:
        raise AudioFormatError(
            "audio_channel_count",
            f"audio_channel_count must be between {MIN_CHANNELS} and {MAX_CHANNELS} "
            f"(0 means 1), got {audio_channel_count}",
        )
    return sample_rate_hertz, channels


def validate_stream_format(
    encoding: str, sample_rate_hertz: int, audio_channel_count: int
) -> tuple[int, int]:
    """Check a stream's format; returns (rate, channels) with channels 0 -> 1."""
    if encoding in FILE_ENCODINGS:
        raise AudioFormatError(
            "encoding",
            f"encoding {encoding} is accepted by Recognize only (a whole file); "
            f"StreamingRecognize takes {', '.join(STREAM_ENCODINGS)}",
        )
    if encoding not in STREAM_ENCODINGS:
        raise AudioFormatError(
            "encoding", f"encoding must be one of {', '.join(STREAM_ENCODINGS)}, got {encoding or 'none'}"
        )
    return _check_rate_channels(sample_rate_hertz, audio_channel_count)


class StreamDecoder:
    """Decodes one stream's chunks to [channels, n] float32 at 16 kHz.

    The resampler keeps state across chunks, so chunking never changes the output.
    Chunks must hold whole frames (all channels of a sample): no partial frame is carried over.
    """

    def __init__(self, encoding: str, sample_rate_hertz: int, channels: int) -> None:
        self.encoding = encoding
        self.rate, self.channels = validate_stream_format(encoding, sample_rate_hertz, channels)
        self.frame_bytes = self.channels * (2 if encoding == "LINEAR16" else 1)
        self.samples_in = 0  # input frames (per channel) seen so far
        self._resampler = (
            None
            if self.rate == TARGET_RATE
            else soxr.ResampleStream(self.rate, TARGET_RATE, self.channels, dtype="float32", quality=_QUALITY)
        )

    def _decode(self, chunk: bytes | memoryview) -> np.ndarray:
        """bytes -> [n, channels] float32 at the input rate."""
        if len(chunk) % self.frame_bytes:
            raise AudioFormatError(
                "audio_content",
                f"audio_content has {len(chunk)} bytes, not a multiple of the {self.frame_bytes}-byte frame "
                f"({self.encoding}, {self.channels} channel(s)); send whole frames in every chunk",
            )
        if self.encoding == "LINEAR16":
            x = np.frombuffer(chunk, dtype="<i2").astype(np.float32) * (1.0 / 32768.0)
        else:
            x = _G711_FLOAT[self.encoding][np.frombuffer(chunk, dtype=np.uint8)]
        return x.reshape(-1, self.channels)

    def feed(self, chunk: bytes | memoryview) -> np.ndarray:
        x = self._decode(chunk)
        self.samples_in += x.shape[0]
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x)
        return _finish(x)

    def flush(self) -> np.ndarray:
        """End of stream: drain what the resampler still holds."""
        if self._resampler is None:
            return np.zeros((self.channels, 0), dtype=np.float32)
        empty = np.zeros((0, self.channels), dtype=np.float32)
        return _finish(self._resampler.resample_chunk(empty, last=True))


def _finish(x: np.ndarray) -> np.ndarray:
    """[n, channels] -> contiguous [channels, n] float32, clipped (resampling can overshoot full scale).
    Two ufuncs into one new array: np.clip's Python wrapper costs a third more per 20 ms chunk."""
    out = np.empty((x.shape[1], x.shape[0]), dtype=np.float32)
    np.maximum(x.T, -1.0, out=out)
    return np.minimum(out, 1.0, out=out)


class AudioTooLong(ValueError):
    """A recording longer than the limit; `field` names the limit's setting. The service maps it to
    OUT_OF_RANGE (the request is well formed, only too long for this server)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RecordingInfo:
    """What a recording holds, read from its header (FLAC, WAV) or its length (raw encodings)."""

    encoding: str
    rate: int
    channels: int
    frames: int  # samples per channel at `rate`

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


# soundfile's container name (and subtype, for Ogg) -> the RecognitionConfig encoding that carries it.
# WAVEX is WAVE_FORMAT_EXTENSIBLE: a RIFF/WAVE file whose format chunk names its sample type by GUID
# (what sox and most recorders write for 24-bit or more than two channels); libsndfile reads both the
# same way. Ogg Opus is what browsers and WebRTC gateways record (Riva's and Google's OGG_OPUS).
_ENCODING_OF_FORMAT = {"FLAC": "FLAC", "WAV": "WAV", "WAVEX": "WAV", "OGG/OPUS": "OGG_OPUS"}


def _check_file_format(encoding: str, found: str, subtype: str, rate: int, channels: int) -> None:
    carried_by = _ENCODING_OF_FORMAT.get(found) or _ENCODING_OF_FORMAT.get(f"{found}/{subtype}")
    if carried_by is None:
        kind = f"{found} {subtype}" if found == "OGG" else found
        raise AudioFormatError(
            "audio_content",
            f"audio_content is not a valid {encoding} file (it is {kind}, which Recognize does not take); "
            "send FLAC or WAV (or Ogg Opus)",
        )
    if carried_by != encoding:
        raise AudioFormatError(
            "audio_content",
            f"audio_content is not a valid {encoding} file (it is {carried_by}); set encoding={carried_by}",
        )
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioFormatError(
            "audio_content", f"{encoding} sample rate must be between {MIN_RATE} and {MAX_RATE}, got {rate}"
        )
    if not MIN_CHANNELS <= channels <= MAX_CHANNELS:
        raise AudioFormatError(
            "audio_content",
            f"{encoding} channel count must be between {MIN_CHANNELS} and {MAX_CHANNELS}, got {channels}",
        )


class _BufferFile(io.RawIOBase):
    """A read-only file over a recording, read in place: io.BytesIO copies anything that is not `bytes`,
    and the HTTP door's upload is the bytearray it was read into (held once)."""

    def __init__(self, data: EncodedAudio) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _open_file(data: EncodedAudio, encoding: str) -> sf.SoundFile:
    try:
        return sf.SoundFile(_BufferFile(data))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioFormatError("audio_content", f"audio_content is not a valid {encoding} file ({e})") from e


def probe_recording(
    data: EncodedAudio, encoding: str, sample_rate_hertz: int, channels: int
) -> RecordingInfo:
    """Check a recording's format and find its length without decoding it (header or byte count).

    FLAC and WAV take rate and channels from their header; raw encodings use the arguments.
    """
    if encoding in STREAM_ENCODINGS:
        rate, n_channels = _check_rate_channels(sample_rate_hertz, channels)
        frame_bytes = n_channels * (2 if encoding == "LINEAR16" else 1)
        if len(data) % frame_bytes:
            raise AudioFormatError(
                "audio_content",
                f"audio_content has {len(data)} bytes, not a multiple of the {frame_bytes}-byte frame "
                f"({encoding}, {n_channels} channel(s))",
            )
        return RecordingInfo(encoding, rate, n_channels, len(data) // frame_bytes)
    if encoding not in FILE_ENCODINGS:
        raise AudioFormatError(
            "encoding",
            f"encoding must be one of {', '.join(STREAM_ENCODINGS + FILE_ENCODINGS)}, "
            f"got {encoding or 'none'}",
        )
    with _open_file(data, encoding) as f:
        _check_file_format(encoding, f.format, f.subtype, f.samplerate, f.channels)
        return RecordingInfo(encoding, f.samplerate, f.channels, f.frames)


def decode_blocks(
    data: EncodedAudio,
    info: RecordingInfo,
    *,
    block_s: float = DECODE_BLOCK_S,
    max_seconds: float | None = None,
) -> Iterator[np.ndarray]:
    """Decode and resample a recording a block at a time: [channels, n] float32 16 kHz per block.

    Memory follows the block, not the file. The resampler keeps its state across blocks, so the
    output does not depend on the block size. `max_seconds` is enforced on what is actually decoded
    too, not only on the header's claim (a FLAC may leave its length out, a WAV may lie).
    """
    block = max(1, round(block_s * info.rate))
    if info.encoding in STREAM_ENCODINGS:  # the length is the byte count: probe_recording checked it
        decoder = StreamDecoder(info.encoding, info.rate, info.channels)
        view = memoryview(data)
        step = block * decoder.frame_bytes
        for i in range(0, len(view), step):
            yield decoder.feed(view[i : i + step])
        yield decoder.flush()
        return
    limit = None if max_seconds is None else round(max_seconds * info.rate)
    resampler = (
        None
        if info.rate == TARGET_RATE
        else soxr.ResampleStream(info.rate, TARGET_RATE, info.channels, dtype="float32", quality=_QUALITY)
    )

    def out(x: np.ndarray, last: bool = False) -> np.ndarray:
        if resampler is not None:
            x = resampler.resample_chunk(x, last=last)
        return _finish(x)

    frames = 0
    with _open_file(data, info.encoding) as f:
        while True:
            try:
                x = f.read(block, dtype="float32", always_2d=True)  # [n, channels]
            except (sf.LibsndfileError, RuntimeError) as e:
                raise AudioFormatError(
                    "audio_content", f"audio_content is not a valid {info.encoding} file ({e})"
                ) from e
            if len(x) == 0:
                break
            frames += len(x)
            if limit is not None and frames > limit:
                raise AudioTooLong(
                    "audio_content", f"audio_content decodes to more than {max_seconds:g} s of audio"
                )
            yield out(x)
    if resampler is not None:
        yield out(np.zeros((0, info.channels), dtype=np.float32), last=True)


def decode_file(data: bytes, encoding: str, sample_rate_hertz: int, channels: int) -> tuple[np.ndarray, int]:
    """Decode a whole recording at once (tools and tests; the server uses decode_blocks).
    Returns ([channels, n] float32 16 kHz, channel count)."""
    info = probe_recording(data, encoding, sample_rate_hertz, channels)
    blocks = list(decode_blocks(data, info))
    return np.concatenate(blocks, axis=1), info.channels


def mixdown(x: np.ndarray) -> np.ndarray:
    """[channels, n] -> [n], the mean of the channels."""
    return x[0] if x.shape[0] == 1 else x.mean(axis=0, dtype=np.float32)
