"""Audio as doors receive it: a byte stream split wherever the client's transport split it (pure helpers).

A client may split it anywhere (a browser's buffer, a file read in fixed sizes, a platform's packets),
while a stream takes whole sample frames: `Reframer` carries a partial frame over to the next message
(the Deepgram, AudioHook and Asterisk chan_websocket doors). `container_of` recognises a container's
header in a raw stream's first bytes, so that a door refuses it (Deepgram's DATA-0000) rather than
transcribe a header and compressed bytes as noise.
"""

from __future__ import annotations

# Magic numbers at the start of the container formats Deepgram detects (file(1)'s database has the same).
_CONTAINERS = (
    (b"RIFF", 8, b"WAVE", "WAV"),
    (b"fLaC", 0, b"", "FLAC"),
    (b"OggS", 0, b"", "Ogg"),
    (b"\x1a\x45\xdf\xa3", 0, b"", "WebM/Matroska"),
    (b"ID3", 0, b"", "MP3"),
)


def container_of(head: bytes | bytearray) -> str | None:
    """The container format the stream's first bytes announce, or None for raw audio."""
    for magic, at, more, name in _CONTAINERS:
        if head.startswith(magic) and (not more or head[at : at + len(more)] == more):
            return name
    if len(head) >= 8 and head[4:8] == b"ftyp":
        return "MP4"
    return None


class Reframer:
    """Cuts a byte stream into whole frames of `frame_bytes` (all channels of one sample)."""

    def __init__(self, frame_bytes: int) -> None:
        self.frame_bytes = frame_bytes
        self._rest = b""

    def push(self, data: bytes) -> bytes:
        """The whole frames now available (possibly b""); the partial one waits for the next push."""
        if self._rest:
            data = self._rest + data
        cut = len(data) - len(data) % self.frame_bytes
        self._rest = data[cut:]
        return data[:cut]

    def push_within(self, data: bytes, limit: int) -> list[bytes]:
        """`push`, cut into pieces of whole frames of at most `limit` bytes (a carried partial frame can
        take a message of `limit` bytes past it)."""
        frames = self.push(data)
        step = max(limit - limit % self.frame_bytes, self.frame_bytes)
        return [frames[i : i + step] for i in range(0, len(frames), step)]

    @property
    def pending(self) -> int:
        return len(self._rest)
