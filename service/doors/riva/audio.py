"""What Riva's audio is: a recording's container by its first bytes, a streamed WAV file's header, and
the audio of a stream as the core takes it (`AudioIn`: re-framed, the first channel only when asked)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from service.doors.riva.settings import RivaFieldError
from service.vocabulary.errors import Code, RecognitionError

# A WAV file streamed as audio_content (riva.client's AudioChunkFileIterator sends the file's bytes,
# header first): its header must be complete within this many bytes.
MAX_WAV_HEADER_BYTES = 64 << 10

# What a recording's first bytes say it is (a header always wins over the config's encoding, as Riva's
# own clients send WAV files with encoding LINEAR_PCM or none at all).
_MAGIC = ((b"RIFF", 8, b"WAVE", "WAV"), (b"fLaC", 0, b"", "FLAC"), (b"OggS", 0, b"", "OGG_OPUS"))


def sniff_container(data: bytes | bytearray | memoryview) -> str | None:
    """ "WAV", "FLAC" or "OGG_OPUS" when the bytes start with that container's header, else None."""
    head = bytes(data[:12])
    for magic, at, tag, name in _MAGIC:
        if head.startswith(magic) and head[at : at + len(tag)] == tag:
            return name
    return None


@dataclass(frozen=True)
class WavHeader:
    encoding: str  # LINEAR16, MULAW or ALAW
    sample_rate_hertz: int
    channels: int
    data_offset: int  # where the samples begin


# WAVE format tags (RFC 2361) of what a stream can carry; WAVE_FORMAT_EXTENSIBLE names one of them in
# the first two bytes of its SubFormat GUID.
_WAV_TAGS = {1: ("LINEAR16", 16), 6: ("ALAW", 8), 7: ("MULAW", 8)}
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def wav_header(data: bytes | bytearray) -> WavHeader | None:
    """A streamed WAV file's header (RIFF chunks up to `data`); None while more bytes are needed.

    Raises RivaFieldError for a WAV whose samples a stream cannot carry (24-bit, float, ...). Only the
    header is read here: the chunks are walked with `struct` because the stdlib `wave` module reads
    integer PCM only, and libsndfile wants the whole file."""
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"fmt ":
            if body + 16 > len(data):
                return None
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == _WAVE_FORMAT_EXTENSIBLE and size >= 40 and body + 26 <= len(data):
                tag = struct.unpack_from("<H", data, body + 24)[0]
            fmt = (tag, channels, rate, bits)
        elif cid == b"data":
            if fmt is None:
                break
            tag, channels, rate, bits = fmt
            known = _WAV_TAGS.get(tag)
            if known is None or known[1] != bits:
                raise RivaFieldError(
                    "audio_content",
                    f"audio_content is a WAV file of {bits}-bit samples in format {tag:#06x}: a stream "
                    "carries 16-bit PCM, mu-law or A-law (send other WAV files with Recognize)",
                )
            return WavHeader(known[0], rate, channels, body)
        pos = body + size + (size & 1)  # chunks are padded to an even size
    if len(data) >= MAX_WAV_HEADER_BYTES or (fmt is None and pos + 8 <= len(data)):
        raise RivaFieldError(
            "audio_content",
            f"audio_content starts a WAV file whose header has no fmt and data chunk within "
            f"{MAX_WAV_HEADER_BYTES} bytes",
        )
    return None


def _check_frames(data: bytes, frame_bytes: int, encoding: str, channels: int) -> None:
    if len(data) % frame_bytes:
        raise RecognitionError(
            Code.INVALID_ARGUMENT,
            f"audio_content has {len(data)} bytes, not a multiple of the {frame_bytes}-byte frame "
            f"({encoding}, {channels} channel(s)); send whole frames in every chunk",
            "audio_content",
        )


class AudioIn:
    """Riva's audio as the core's stream takes it: a streamed WAV file's samples after its header,
    re-framed (a file's bytes are cut anywhere, so a chunk may end inside a frame); and only the first
    channel when several come without enable_separate_recognition_per_channel (Riva: "we only recognize
    the first channel")."""

    def __init__(
        self, encoding: str, channels: int, *, first_only: bool, reframe: bool, max_chunk_bytes: int
    ) -> None:
        self.encoding = encoding
        self.width = 2 if encoding == "LINEAR16" else 1
        self.channels = channels
        self.frame_bytes = self.width * channels
        self.first_only = first_only and channels > 1
        self.reframe = reframe
        self.max_chunk_bytes = max_chunk_bytes  # of what the client sent, before the first channel is taken
        self._rest = b""

    def frames(self, data: bytes) -> bytes:
        """The core's bytes for one chunk (b"": none yet); raises RecognitionError for partial frames
        and, when only the first channel goes on, for a chunk over --max-chunk-bytes."""
        if self.reframe:
            data = self._rest + data
            cut = len(data) - len(data) % self.frame_bytes
            data, self._rest = data[:cut], data[cut:]
        if not self.first_only:
            return data
        if len(data) > self.max_chunk_bytes:
            raise RecognitionError(
                Code.INVALID_ARGUMENT,
                f"audio_content of {len(data)} bytes is over the limit of {self.max_chunk_bytes} bytes per "
                "request (max_chunk_bytes); send smaller chunks",
                "audio_content",
            )
        _check_frames(data, self.frame_bytes, self.encoding, self.channels)
        dtype = "<i2" if self.width == 2 else "u1"
        return np.frombuffer(data, dtype=dtype).reshape(-1, self.channels)[:, 0].tobytes()
