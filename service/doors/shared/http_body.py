"""An HTTP upload read with its bounds, for every door that takes one (the OpenAI door's multipart form,
Deepgram's pre-recorded body), and the port's body allowance (service/runtime/http_server.py, aiohttp's
client_max_size). A door maps BodyError to its own error shape."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

# On top of the largest recording a door takes (--max-recognize-bytes): multipart boundaries and text fields.
BODY_OVERHEAD_BYTES = 1 << 20

T = TypeVar("T")


class BodyError(Exception):
    """An upload refused: 413 (over its bound), 408 (too slow), 400 (malformed, as its parser said)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class BoundedBody:
    """A request's body as it streams: over `max_bytes` is refused as soon as it is (413, `too_large`'s
    words, given the declared Content-Length when that alone is over, else None), each read within
    `read_timeout` s and the whole at `min_rate` bytes/s on average after that grace (408, naming
    --http-read-timeout or --http-min-upload-rate)."""

    def __init__(
        self,
        request: web.Request,
        max_bytes: int,
        too_large: Callable[[int | None], str],
        read_timeout: float,
        min_rate: int,
    ) -> None:
        if request.content_length is not None and request.content_length > max_bytes:
            raise BodyError(413, too_large(request.content_length))
        self.content = request.content
        self.max_bytes, self.too_large = max_bytes, too_large
        self.read_timeout, self.min_rate = read_timeout, min_rate
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()

    async def read(self, step: Awaitable[T]) -> T:
        """One read of the body (`step`: of its stream, or of a parser over it), within the time it has.
        The parser's own errors about a malformed body (aiohttp's multipart: ValueError, LookupError,
        RuntimeError, AssertionError; a truncated chunk: RequestPayloadError) are a 400."""
        received = self.content.total_bytes
        idle_deadline = self.loop.time() + self.read_timeout
        rate_deadline = (
            self.start + self.read_timeout + received / self.min_rate if self.min_rate else math.inf
        )
        try:
            async with asyncio.timeout_at(min(idle_deadline, rate_deadline)):
                value = await step
        except TimeoutError:
            raise BodyError(408, self._too_slow(idle_deadline <= rate_deadline)) from None
        except (ValueError, LookupError, RuntimeError, AssertionError, web.RequestPayloadError) as e:
            raise BodyError(400, str(e)) from e
        if self.content.total_bytes > self.max_bytes:
            raise BodyError(413, self.too_large(None))
        return value

    async def read_all(self) -> bytearray:
        """The whole body, in one buffer."""
        data = bytearray()
        while chunk := await self.read(self.content.readany()):
            data += chunk
        return data

    def _too_slow(self, idle: bool) -> str:
        if idle:
            why = f"the upload sent nothing for {self.read_timeout:g} s (http_read_timeout)"
        else:
            elapsed = self.loop.time() - self.start
            rate = self.content.total_bytes / elapsed if elapsed > 0 else 0.0
            why = (
                f"the upload arrived at {rate:.0f} bytes/s, under the minimum of {self.min_rate} bytes/s "
                f"(http_min_upload_rate) after {self.read_timeout:g} s of grace"
            )
        return why + "; send the request again, faster"
