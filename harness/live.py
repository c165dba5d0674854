"""A live call's pacing, for benchmarks that measure end-of-speech -> final latency over asr.v1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from asr.v1 import asr_pb2


class PacedCall:
    """The requests of one live call: its config, then each frame of `audio` once that frame's audio has
    been spoken (frame k leaves at start + (k + 1) * frame_s), so a final's latency counts from the moment
    its audio ended (`latency_s`)."""

    def __init__(
        self, config: asr_pb2.StreamingRecognitionConfig, audio: bytes, frame_bytes: int, frame_s: float
    ) -> None:
        self.config = config
        self.audio = audio
        self.frame_bytes = frame_bytes
        self.frame_s = frame_s
        self.started_at = 0.0  # time.monotonic() when the first frame's audio began

    async def requests(self) -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
        yield asr_pb2.StreamingRecognizeRequest(streaming_config=self.config)
        self.started_at = time.monotonic()
        for k, i in enumerate(range(0, len(self.audio), self.frame_bytes)):
            delay = self.started_at + (k + 1) * self.frame_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            yield asr_pb2.StreamingRecognizeRequest(audio_content=self.audio[i : i + self.frame_bytes])

    def latency_s(self, end_offset_s: float, received_at: float) -> float:
        """`received_at` (time.monotonic()) less when the audio up to `end_offset_s` (a final's end) had
        been spoken."""
        return received_at - (self.started_at + end_offset_s)
