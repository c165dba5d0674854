"""The call webhook: a telephony call's messages POSTed in order to a real receiver on loopback, signed
with the shared secret, retried while the receiver answers 503; a receiver that is down costs at most
--call-webhook-queue messages, the oldest dropped and counted."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from clients.scoring import normalize
from engine import Engine
from service.config import ServerConfig
from service.runtime.call_webhook import CallWebhook
from tests.doors.test_twilio import AGENT, send_call
from tests.support.audio import speak, to_mulaw_8k_bytes
from tests.support.server import ServerThread, free_port

SECRET = b"webhook-test-secret"


class Receiver:
    """A webhook receiver that answers `failures` 503s first, then 200s, keeping what it was sent."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.bodies: list[dict[str, Any]] = []
        self.bad_signatures = 0
        self.ended = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        expected = (
            "sha256="
            + hmac.new(
                SECRET, request.headers["X-ASR-Timestamp"].encode() + b"." + body, hashlib.sha256
            ).hexdigest()
        )
        if not hmac.compare_digest(expected, request.headers["X-ASR-Signature"]):
            self.bad_signatures += 1
            return web.Response(status=401)
        if self.failures:
            self.failures -= 1
            return web.Response(status=503)
        message = json.loads(body)
        self.bodies.append(message)
        if message["type"] == "call_ended":
            self.ended.set()
        return web.Response(status=204)


async def serve(receiver: Receiver, port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    r, port = Receiver(failures=2), free_port()
    runner = await serve(r, port)
    yield r, f"http://127.0.0.1:{port}/hook"
    await runner.cleanup()


async def test_a_twilio_call_reaches_the_webhook_signed_and_in_order(
    service_engine: Engine, receiver: tuple[Receiver, str], tmp_path: Path
) -> None:
    hook, url = receiver
    (tmp_path / "secret").write_bytes(SECRET)
    config = ServerConfig(call_webhook_url=url, call_webhook_secret_file=str(tmp_path / "secret"))
    server = await asyncio.to_thread(ServerThread(config, service_engine, http=True).start)
    retried = REGISTRY.get_sample_value("asr_call_webhook_posts_total", {"outcome": "retried"}) or 0.0
    try:
        call_sid = "CA" + "6" * 32
        async with asyncio.timeout(120):
            assert await send_call(server, call_sid, {"inbound": to_mulaw_8k_bytes(speak(AGENT))}) == 1000
            await hook.ended.wait()
    finally:
        await asyncio.to_thread(server.stop)
    assert hook.bad_signatures == 0
    kinds = [m["type"] for m in hook.bodies]
    assert kinds[0] == "call_started" and kinds[-1] == "call_ended" and "transcript" in kinds, kinds
    assert all(m["call_id"] == call_sid for m in hook.bodies)
    finals = " ".join(m["text"] for m in hook.bodies if m["type"] == "transcript" and m["is_final"])
    assert "thank you for calling" in normalize(finals)
    assert (
        REGISTRY.get_sample_value("asr_call_webhook_posts_total", {"outcome": "retried"}) or 0.0
    ) >= retried + 2


async def test_a_receiver_that_is_down_costs_the_queue_and_no_more() -> None:
    dropped = REGISTRY.get_sample_value("asr_call_webhook_dropped_total") or 0.0
    port = free_port()
    webhook = CallWebhook(f"http://127.0.0.1:{port}/hook", SECRET, max_waiting=3)
    try:
        for n in range(8):  # nothing listens yet: every post fails and is retried
            webhook.deliver({"type": "transcript", "call_id": "CA1", "n": n})
            await asyncio.sleep(0)
        assert (REGISTRY.get_sample_value("asr_call_webhook_dropped_total") or 0.0) == dropped + 5
        hook = Receiver()
        runner = await serve(hook, port)
        try:
            assert await webhook.flush(within_s=30)
        finally:
            await runner.cleanup()
    finally:
        await webhook.close()
    assert [m["n"] for m in hook.bodies] == [5, 6, 7]  # the newest kept, in order
