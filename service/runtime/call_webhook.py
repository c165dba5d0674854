"""Every telephony call's messages (call_started, transcript, call_ended: service/recognizer/call_hub.py) POSTed
to one URL (`--call-webhook-url`), signed, retried, never holding up a call.

Each frontend process posts the messages of the calls it carries, one JSON message per request, in the
order they were published. The body is signed with the shared secret (`CALL_WEBHOOK_SECRET`, or
`--call-webhook-secret-file`): `X-ASR-Timestamp: <unix seconds>` and `X-ASR-Signature: sha256=<hex>`, the
HMAC-SHA256 of `<timestamp>.<body>` (the timestamp signed too, so that a receiver can refuse a replay).
A 2xx is delivered; anything else, or no answer within 10 s, is retried with backoff (0.5 s doubling to
30 s) for as long as the message waits. At most `--call-webhook-queue` messages wait: past it the oldest
is dropped and counted (`asr_call_webhook_dropped_total`), so a receiver that is down costs memory once,
never a call. On drain the server waits for the queue to empty within what is left of --drain-seconds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import time
from typing import Any

import aiohttp

from service import metrics

log = logging.getLogger("service.runtime.call_webhook")

TIMEOUT_S = 10.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0


def signature(secret: bytes, timestamp: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class CallWebhook:
    """Posts messages in order from one task; `deliver` never waits. Every method runs on the event loop."""

    def __init__(self, url: str, secret: bytes, max_waiting: int) -> None:
        self.url = url
        self.secret = secret
        self.max_waiting = max_waiting
        self._waiting: collections.deque[bytes] = collections.deque()
        self._arrived = asyncio.Event()
        self._emptied = asyncio.Event()
        self._emptied.set()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def deliver(self, message: dict[str, Any]) -> None:
        if len(self._waiting) >= self.max_waiting:
            self._waiting.popleft()
            metrics.CALL_WEBHOOK_DROPPED.inc()
        self._waiting.append(json.dumps(message).encode())
        metrics.CALL_WEBHOOK_WAITING.set(len(self._waiting))
        self._emptied.clear()
        self._arrived.set()
        if self._task is None:
            self._task = asyncio.create_task(self._post_in_order(), name="call-webhook")

    async def _post_in_order(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        while True:
            if not self._waiting:
                self._emptied.set()
                self._arrived.clear()
                await self._arrived.wait()
                continue
            body = self._waiting[0]
            backoff = FIRST_BACKOFF_S
            while not await self._post(body):
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                if not self._waiting or self._waiting[0] is not body:
                    break  # dropped while it was being retried: the queue was full
            else:
                if self._waiting and self._waiting[0] is body:  # not dropped while it was being posted
                    self._waiting.popleft()
                metrics.CALL_WEBHOOK_POSTS.labels("delivered").inc()
            metrics.CALL_WEBHOOK_WAITING.set(len(self._waiting))

    async def _post(self, body: bytes) -> bool:
        assert self._session is not None
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            "X-ASR-Timestamp": timestamp,
            "X-ASR-Signature": signature(self.secret, timestamp, body),
        }
        try:
            async with self._session.post(self.url, data=body, headers=headers) as response:
                if 200 <= response.status < 300:
                    return True
                log.warning("call webhook answered %d; retrying", response.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("call webhook unreachable (%s); retrying", type(e).__name__)
        metrics.CALL_WEBHOOK_POSTS.labels("retried").inc()
        return False

    async def flush(self, within_s: float) -> bool:
        """Wait until every waiting message is delivered, at most `within_s`; True if they all were."""
        try:
            async with asyncio.timeout(max(within_s, 0.0)):
                await self._emptied.wait()
            return True
        except TimeoutError:
            log.warning("drain: %d call webhook messages were not delivered in time", len(self._waiting))
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()
