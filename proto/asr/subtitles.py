"""Timed text as SRT and WebVTT: the HTTP door's `response_format=srt|vtt` and asr-client's bulk `.srt` files.

Pure functions over (start_s, end_s, text) cues, so both sides render captions the same way: here, in the
API's package, because clients import no server code and the server no client code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Cue(NamedTuple):
    start_s: float
    end_s: float
    text: str


def _clock(seconds: float, separator: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def srt(cues: Iterable[Cue]) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm` times, a blank line after each."""
    blocks = [
        f"{i}\n{_clock(c.start_s, ',')} --> {_clock(c.end_s, ',')}\n{c.text}\n"
        for i, c in enumerate(cues, start=1)
    ]
    return "\n".join(blocks)


def vtt(cues: Iterable[Cue]) -> str:
    """WebVTT: the `WEBVTT` header, `HH:MM:SS.mmm` times."""
    blocks = [f"{_clock(c.start_s, '.')} --> {_clock(c.end_s, '.')}\n{c.text}\n" for c in cues]
    return "WEBVTT\n\n" + "\n".join(blocks)
