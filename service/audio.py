"""Audio in: validate the client's format, decode PCM / G.711 / FLAC / WAV, resample to 16 kHz float32.

Everything downstream (endpointing, the engine) sees float32 in [-1, 1] at 16 kHz, shaped
[channels, n]. No gRPC here: errors are AudioFormatError, which the service maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf
import soxr

TARGET_RATE = 16000
MIN_RATE, MAX_RATE = 8000, 48000
MIN_CHANNELS, MAX_CHANNELS = 1, 8
STREAM_ENCODINGS = ("LINEAR16", "MULAW", "ALAW")
FILE_ENCODINGS = ("FLAC", "WAV")
# soxr "HQ" (20-bit) is transparent for speech and costs little more than "MQ" at these rates.
_QUALITY = "HQ"


class AudioFormatError(ValueError):
    """Bad audio or audio settings; `field` is the proto field to blame."""

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
    """Check a StreamingRecognize config; returns (rate, channels) with channels 0 -> 1."""
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

    def _decode(self, chunk: bytes) -> np.ndarray:
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

    def feed(self, chunk: bytes) -> np.ndarray:
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
    """[n, channels] -> contiguous [channels, n] float32, clipped (resampling can overshoot full scale)."""
    return np.ascontiguousarray(np.clip(x.T, -1.0, 1.0), dtype=np.float32)


def decode_file(data: bytes, encoding: str, sample_rate_hertz: int, channels: int) -> tuple[np.ndarray, int]:
    """Decode a whole recording (Recognize). Returns ([channels, n] float32 16 kHz, channel count).

    FLAC and WAV take rate and channels from their header; raw encodings use the arguments.
    """
    if encoding in STREAM_ENCODINGS:
        decoder = StreamDecoder(encoding, sample_rate_hertz, channels)
        x = decoder.feed(data)
        return np.concatenate([x, decoder.flush()], axis=1), decoder.channels
    if encoding not in FILE_ENCODINGS:
        raise AudioFormatError(
            "encoding",
            f"encoding must be one of {', '.join(STREAM_ENCODINGS + FILE_ENCODINGS)}, "
            f"got {encoding or 'none'}",
        )
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            found = f.format
            rate = f.samplerate
            pcm = f.read(dtype="float32", always_2d=True)  # [n, channels]
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioFormatError("audio_content", f"audio_content is not a valid {encoding} file ({e})") from e
    if found != encoding:
        raise AudioFormatError(
            "audio_content",
            f"audio_content is not a valid {encoding} file (it is {found}); set encoding={found}",
        )
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioFormatError(
            "audio_content", f"{encoding} sample rate must be between {MIN_RATE} and {MAX_RATE}, got {rate}"
        )
    if not MIN_CHANNELS <= pcm.shape[1] <= MAX_CHANNELS:
        raise AudioFormatError(
            "audio_content",
            f"{encoding} channel count must be between {MIN_CHANNELS} and {MAX_CHANNELS}, got {pcm.shape[1]}",
        )
    if rate != TARGET_RATE:
        pcm = soxr.resample(pcm, rate, TARGET_RATE, quality=_QUALITY)
    return _finish(pcm.reshape(-1, pcm.shape[1])), pcm.shape[1]


def mixdown(x: np.ndarray) -> np.ndarray:
    """[channels, n] -> [n], the mean of the channels."""
    return x[0] if x.shape[0] == 1 else x.mean(axis=0, dtype=np.float32)
