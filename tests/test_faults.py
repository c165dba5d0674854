"""Faults against real loopback servers and the real tiny.en: cancels and disconnects mid-utterance,
deadlines, a slow reader, an exception inside one utterance, a dead scheduler, overload, a model that
cannot load. After each, nothing is left behind: engine stats back to zero, no stream open.

Where timing would decide the outcome, the engine's own test seams (engine/hooks.py: `fault`, called per
request at its encoder pass; `stage`, called as each stage begins, which also records each encoder call's
requests) hold the engine's loop thread still, so each case happens exactly as named:
an utterance cancelled while it waits in the window, one cancelled while it holds a KV slot, two
utterances that share one encoder pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from clients.scoring import corpus_wer
from engine import Engine
from engine.hooks import EngineHooks
from engine.model.weights import ModelLoadError
from engine.scheduling.request import Request as EngineRequest
from service.config import ServerConfig
from service.runtime.server import AsrServer
from tests.support.audio import JFK_FLAC, make_conversation, to_linear16_bytes
from tests.support.calls import OpenStream, config_request, run_stream
from tests.support.server import HOST, REPO, ServerProcess, ServerThread, free_port, watch_health

pytestmark = pytest.mark.slow

SENTENCES = [
    "The technician will visit your home on Thursday afternoon.",
    "Thank you for calling, how can I help you today?",
    "I would like to check the status of my order.",
]


def speech(i: int) -> bytes:
    """Sentence i, then 0.8 s of pause (so the endpointer ends the utterance), as LINEAR16 16 kHz."""
    audio, _ = make_conversation([SENTENCES[i]], pause_s=0.8, lead_s=0.3)
    return to_linear16_bytes(audio)


def engine_requests(outcome: str, kind: str = "final") -> float:
    return REGISTRY.get_sample_value("asr_engine_requests_total", {"kind": kind, "outcome": outcome}) or 0.0


def utterances(outcome: str) -> float:
    return REGISTRY.get_sample_value("asr_utterances_total", {"outcome": outcome}) or 0.0


async def wait_for(predicate: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.01)


async def assert_all_free(engine: Engine, server: ServerThread, within_s: float = 5.0) -> None:
    """Engine back to idle (nothing waiting, decoding or holding a slot) and no stream open."""
    await wait_for(
        lambda: engine.stats() == {**engine.stats(), "waiting": 0, "active": 0, "slots_used": 0},
        within_s,
        f"engine idle (stats {engine.stats()})",
    )
    assert engine.stats()["slots_free"] == engine.config.kv_slots
    await wait_for(lambda: not server.server.recognizer.sessions, within_s, "no stream left open")
    # every place under max_streams given back (the gauge moves with it)
    assert REGISTRY.get_sample_value("asr_active_streams") == 0


class Hook:
    """The engine's fault and stage hooks for one test: holds the scheduler thread inside the encoder pass of a
    chosen request (`hold_on`), fails chosen requests (`fail_prefix`), and records each encoder call."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seen: list[tuple[str, int]] = []  # (request id, size of its encoder batch)
        self.encoder_calls: list[list[str]] = []  # the request ids of each encoder call, in order
        self.hold_on: Callable[[str], bool] = lambda rid: False
        self.fail_prefix: str | None = None
        self.fail_stage = "encoder"  # where fail_prefix's utterances fail
        self.held = threading.Event()
        self.release = threading.Event()
        self.gate_id = f"gate-{uuid.uuid4().hex[:8]}"

    def __call__(self, req: EngineRequest) -> None:
        self.seen.append((req.id, req.encoder_batch_size))
        if req.id == self.gate_id or self.hold_on(req.id):
            self.held.set()
            if not self.release.wait(30):
                raise RuntimeError("test hook never released")
        if self.fail_stage == "encoder" and self.fail_prefix and req.id.startswith(self.fail_prefix):
            raise RuntimeError("fault injected by the test into this one utterance")

    def stage(self, stage: str, reqs: list[EngineRequest]) -> None:
        if stage == "encoder":
            self.encoder_calls.append([r.id for r in reqs])
        elif stage == self.fail_stage and any(
            self.fail_prefix and r.id.startswith(self.fail_prefix) for r in reqs
        ):
            raise RuntimeError(f"fault injected by the test into this one utterance at stage {stage}")

    def shared_encoder_call(self, *prefixes: str) -> bool:
        """Whether one encoder call held an utterance of each prefix."""
        return any(all(any(r.startswith(p) for r in call) for p in prefixes) for call in self.encoder_calls)

    def queued(self) -> int:
        """Utterances submitted and not yet in a slot (what --max-queue bounds)."""
        return self.engine.stats()["queued"]

    async def close_gate(self) -> None:
        """Hold the scheduler thread in the encoder pass of a silent sentinel utterance: what is
        submitted meanwhile waits in the queue until `open_gate`."""
        self.engine.submit(np.zeros(8000, dtype=np.float32), request_id=self.gate_id)
        assert await asyncio.to_thread(self.held.wait, 10), "the scheduler never reached the gate"

    def open_gate(self) -> None:
        self.release.set()

    def encoded(self, prefix: str) -> list[int]:
        return [size for rid, size in self.seen if rid.startswith(prefix)]


@pytest.fixture(autouse=True)
def no_speculation(asr_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count one utterance's engine requests and queue places exactly while the scheduler is
    held; a speculative miss (speech(1) pauses 0.2-0.5 s at its comma) adds a request, whose cancel then
    waits for the held scheduler. Speculation's own fault cases are in tests/test_speculation.py."""
    monkeypatch.setattr(asr_server.config, "speculative_endpointing", False)


@pytest.fixture
def hook(service_engine: Engine, engine_hooks: EngineHooks) -> Iterator[Hook]:
    h = Hook(service_engine)
    try:
        with engine_hooks.installed(fault=h, stage=h.stage):
            yield h
    finally:
        h.release.set()


# --- cancel and disconnect ---


async def test_cancel_while_waiting_in_the_window_frees_it_at_once(
    asr_server: ServerThread, service_engine: Engine, hook: Hook
) -> None:
    cancelled = engine_requests("cancelled")
    await hook.close_gate()
    async with aio.insecure_channel(asr_server.target) as channel:
        stream = OpenStream(channel)
        stream_id = await stream.open()
        assert stream_id
        await stream.send(speech(0))
        await wait_for(lambda: hook.queued() == 1, 20, "the utterance was submitted")
        stream.call.cancel()
        outcome = await stream.finish(half_close=False)
    assert outcome.code == grpc.StatusCode.CANCELLED
    # the server lets go of the stream (and cancels its utterance) while the scheduler is still held
    await wait_for(lambda: not asr_server.server.recognizer.sessions, 5, "stream closed")
    hook.open_gate()
    await assert_all_free(service_engine, asr_server)
    assert engine_requests("cancelled") - cancelled == 1
    assert hook.encoded(stream_id) == [], "a cancelled utterance must leave the window unencoded"


async def test_disconnect_while_holding_a_kv_slot_frees_it_at_once(
    asr_server: ServerThread, service_engine: Engine, hook: Hook, tmp_path: Path
) -> None:
    """A client process killed mid-utterance (SIGKILL: no cancel, no goodbye, just a dead socket)."""
    audio = tmp_path / "speech.s16"
    audio.write_bytes(speech(1))
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        DISCONNECTING_CLIENT,
        asr_server.target,
        str(audio),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert client.stdout is not None
        stream_id = (await asyncio.wait_for(client.stdout.readline(), 60)).decode().strip()
        assert stream_id.startswith("s"), stream_id
        cancelled = engine_requests("cancelled")
        hook.hold_on = lambda rid: rid.startswith(stream_id + "-")
        assert await asyncio.wait_for(client.stdout.readline(), 30) == b"sent\n"
        # held inside its own encoder pass: the utterance owns a KV slot now
        assert await asyncio.to_thread(hook.held.wait, 20)
        assert service_engine.stats()["slots_used"] >= 1
        client.send_signal(signal.SIGKILL)
        await asyncio.wait_for(client.wait(), 10)
        await wait_for(lambda: not asr_server.server.recognizer.sessions, 10, "the server saw the disconnect")
        hook.open_gate()
        await assert_all_free(service_engine, asr_server)
        assert engine_requests("cancelled") - cancelled == 1
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()


DISCONNECTING_CLIENT = """
import asyncio, sys
from grpc import aio
from tests.support.calls import OpenStream

async def main() -> None:
    async with aio.insecure_channel(sys.argv[1]) as channel:
        stream = OpenStream(channel)
        print(await stream.open(), flush=True)
        await stream.send(open(sys.argv[2], "rb").read())
        print("sent", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


# --- deadlines and slow readers ---


async def test_stream_deadline_ends_the_call_and_frees_everything(
    asr_server: ServerThread, service_engine: Engine
) -> None:
    data = b"".join(speech(i) for i in range(3))

    async def realtime() -> AsyncIterator[asr_pb2.StreamingRecognizeRequest]:
        yield config_request()
        for i in range(0, len(data), 3200):  # 100 ms chunks at the pace of speech
            yield asr_pb2.StreamingRecognizeRequest(audio_content=data[i : i + 3200])
            await asyncio.sleep(0.1)

    started = time.monotonic()
    async with aio.insecure_channel(asr_server.target) as channel:
        outcome = await run_stream(channel, realtime(), deadline_s=2.5)
    assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
    assert outcome.ended_at - started < 5.0
    await assert_all_free(service_engine, asr_server)


async def test_recognize_deadline_ends_the_call_and_frees_everything(
    asr_server: ServerThread, service_engine: Engine
) -> None:
    # Eight JFK passages (88 s of real speech at its own 44.1 kHz): with the int8 encoder one passage alone can
    # finish inside the deadline on a fast machine, eight cannot.
    jfk, rate = sf.read(JFK_FLAC, dtype="float32")
    config = asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=rate)
    audio = to_linear16_bytes(np.tile(jfk, 8))
    async with aio.insecure_channel(asr_server.target) as channel:
        stub = asr_pb2_grpc.RecognizerStub(channel)
        with pytest.raises(aio.AioRpcError) as e:
            await stub.Recognize(asr_pb2.RecognizeRequest(config=config, audio_content=audio), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await assert_all_free(service_engine, asr_server, within_s=15)


async def test_slow_reader_does_not_stall_other_streams(
    asr_server: ServerThread, service_engine: Engine
) -> None:
    """One client sends a whole call at once with interim results on, then reads nothing; another
    stream runs start to finish meanwhile. The slow reader still gets every final when it reads."""
    slow_data = b"".join(speech(i) for i in range(3))
    async with (
        aio.insecure_channel(asr_server.target) as slow_channel,
        aio.insecure_channel(asr_server.target) as channel,
    ):
        slow = asr_pb2_grpc.RecognizerStub(slow_channel).StreamingRecognize(timeout=120)
        request = config_request()
        request.streaming_config.interim_results = True
        await slow.write(request)
        for i in range(0, len(slow_data), 3200):
            await slow.write(asr_pb2.StreamingRecognizeRequest(audio_content=slow_data[i : i + 3200]))
        await slow.done_writing()
        other = await run_stream(
            channel, [config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=speech(1))]
        )
        assert other.code == grpc.StatusCode.OK, other
        assert corpus_wer([SENTENCES[1]], [other.text]) <= 0.2, other.text
        received = [response async for response in slow]  # only now does the slow reader read
    finals = [r for x in received for r in x.results if r.is_final]
    assert [r.utterance_index for r in finals] == [0, 1, 2]
    assert corpus_wer(SENTENCES, [r.alternatives[0].transcript for r in finals]) <= 0.2
    await assert_all_free(service_engine, asr_server)


# --- an exception inside one utterance ---


# encoder: a model call; rules, result: errors outside the model (decoding rules, building the result)
@pytest.mark.parametrize("stage", ["encoder", "rules", "result"])
async def test_exception_in_one_utterance_fails_that_stream_only(
    asr_server: ServerThread, service_engine: Engine, hook: Hook, stage: str
) -> None:
    hook.fail_stage = stage
    errors = utterances("error")
    async with aio.insecure_channel(asr_server.target) as c1, aio.insecure_channel(asr_server.target) as c2:
        faulty, good = OpenStream(c1), OpenStream(c2)
        faulty_id, good_id = await faulty.open(), await good.open()
        hook.fail_prefix = faulty_id + "-"
        # both utterances reach the engine while it is held, so they go through ONE encoder pass
        await hook.close_gate()
        await asyncio.gather(faulty.send(speech(0)), good.send(speech(1)))
        await wait_for(lambda: hook.queued() == 2, 20, "both utterances submitted")
        hook.open_gate()
        bad_outcome, good_outcome = await asyncio.gather(faulty.finish(), good.finish())
    assert bad_outcome.code == grpc.StatusCode.INTERNAL, bad_outcome
    assert "recognition failed on utterance 0" in bad_outcome.details
    assert "fault injected by the test" in bad_outcome.details
    assert good_outcome.code == grpc.StatusCode.OK, good_outcome
    assert corpus_wer([SENTENCES[1]], [good_outcome.text]) <= 0.2, good_outcome.text
    # they did share a pass: the batched encoder call held both (it failed), then each went alone and
    # only the faulty one failed
    assert hook.shared_encoder_call(faulty_id + "-", good_id + "-"), hook.encoder_calls
    assert utterances("error") - errors == 1
    assert service_engine.alive
    await assert_all_free(service_engine, asr_server)
    # and the engine keeps serving
    async with aio.insecure_channel(asr_server.target) as channel:
        after = await run_stream(
            channel, [config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=speech(2))]
        )
    assert after.code == grpc.StatusCode.OK and corpus_wer([SENTENCES[2]], [after.text]) <= 0.2


# --- overload ---


async def test_full_admission_queue_refuses_at_once(
    asr_server: ServerThread, service_engine: Engine, hook: Hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-queue 2 with the scheduler held: the third utterance is refused while the engine is still
    busy (RESOURCE_EXHAUSTED at once, not a wait); the two admitted ones get their finals."""
    monkeypatch.setattr(service_engine.config, "max_queue", 2)
    await hook.close_gate()
    async with contextlib.AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(aio.insecure_channel(asr_server.target)) for _ in range(3)
        ]
        streams = [OpenStream(c) for c in channels]
        for s in streams:
            await s.open()
        for s in streams:
            await s.send(speech(0))
        finishing = [asyncio.create_task(s.finish()) for s in streams]
        done, _ = await asyncio.wait(finishing, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        assert done, "nobody was refused"
        refused = done.pop().result()
        assert not hook.release.is_set()  # the engine has not moved: the refusal did not wait for it
        hook.open_gate()
        outcomes = await asyncio.gather(*finishing)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "engine admission queue is full (2 live finals waiting; --max-queue 2)" in refused.details
    served = [o for o in outcomes if o is not refused]
    assert [o.code for o in served] == [grpc.StatusCode.OK] * 2, served
    for o in served:
        assert corpus_wer([SENTENCES[0]], [o.text]) <= 0.2, o.text
    await assert_all_free(service_engine, asr_server)


@pytest.fixture(scope="module")
def two_stream_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(max_streams=2), service_engine).start()
    yield server
    server.stop()


async def test_stream_limit_refuses_at_once_and_admits_again_when_one_ends(
    two_stream_server: ServerThread, service_engine: Engine
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(aio.insecure_channel(two_stream_server.target)) for _ in range(4)
        ]
        first, second = OpenStream(channels[0]), OpenStream(channels[1])
        assert await first.open() and await second.open()
        started = time.monotonic()
        third = await run_stream(channels[2], [config_request()])
        assert third.code == grpc.StatusCode.RESOURCE_EXHAUSTED, third
        assert "limit of 2 concurrent streams (max_streams)" in third.details
        assert third.ended_at - started < 2.0
        # the admitted streams are untouched by the refusal
        await first.send(speech(0))
        one = await first.finish()
        assert one.code == grpc.StatusCode.OK and corpus_wer([SENTENCES[0]], [one.text]) <= 0.2
        # one ended: room for a new one
        fourth = await run_stream(
            channels[3], [config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=speech(2))]
        )
        assert fourth.code == grpc.StatusCode.OK and corpus_wer([SENTENCES[2]], [fourth.text]) <= 0.2
        second.call.cancel()
        await second.finish(half_close=False)
    await assert_all_free(service_engine, two_stream_server)


# --- a dead scheduler, a model that cannot load: the process ---


def test_dead_scheduler_turns_health_not_serving_and_exits_non_zero() -> None:
    server = ServerProcess("--debug-crash-scheduler-after", "1", "--encoder-context", "trim")
    try:
        server.wait_serving()
        statuses, watcher = watch_health(server.target)
        # the warm-up was utterance 1; this stream's utterance kills the scheduler thread
        with grpc.insecure_channel(server.target) as channel:
            call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(
                iter([config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=speech(0))]),
                timeout=60,
            )
            with contextlib.suppress(grpc.RpcError):
                list(call)
            code, details = call.code(), call.details() or ""
        assert server.wait(30) == 1
        watcher.join(10)
        log = server.log()
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), (code, details)
        if code == grpc.StatusCode.UNAVAILABLE:
            assert "stopped" in details or "draining" in details or "Socket closed" in details, details
        assert statuses[0] == "SERVING" and "NOT_SERVING" in statuses[1:], statuses
        assert "engine scheduler died; exiting" in log and "InjectedSchedulerCrash" in log
    finally:
        server.stop()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def _run_until_exit(
    argv: list[str], ports: list[int], watch_health_port: int | None = None
) -> tuple[int, str, bool, list[str]]:
    """Start asr-server, probe its ports until it exits: (exit code, stderr, ever listened, health seen)."""
    proc = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    listened, health = False, []
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        listened |= any(_listening(p) for p in ports)
        if watch_health_port is not None:
            with (
                contextlib.suppress(grpc.RpcError),
                grpc.insecure_channel(f"{HOST}:{watch_health_port}") as ch,
            ):
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                health.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    _, stderr = proc.communicate(timeout=30)
    return proc.returncode, stderr, listened, health


def test_missing_model_exits_non_zero_before_opening_any_port() -> None:
    port, metrics_port = free_port(), free_port()
    argv = [str(Path(sys.executable).with_name("asr-server")), "--model", "/nonexistent/whisper"]
    argv += ["--host", HOST, "--port", str(port), "--metrics-port", str(metrics_port), "--http-port", "0"]
    code, stderr, listened, _ = _run_until_exit(argv, [port, metrics_port])
    assert code == 2, stderr
    assert "/nonexistent/whisper" in stderr and "no such folder" in stderr
    assert not listened, "a server that cannot load its model must never open a port"


def test_broken_model_folder_never_serves_and_exits_non_zero(tmp_path: Path) -> None:
    """A folder that looks like a checkpoint but holds no weights passes the start-up check and fails in
    the engine process's load. No frontend runs until the model is loaded, so neither the gRPC port nor the
    HTTP door takes a connection meanwhile: a probe or a client meets a refused connection (not ready),
    never SERVING; the process ends non-zero naming the folder."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    port, http_port = free_port(), free_port()
    argv = [str(Path(sys.executable).with_name("asr-server")), "--model", str(tmp_path)]
    argv += ["--host", HOST, "--port", str(port), "--metrics-port", "0", "--http-port", str(http_port)]
    code, stderr, listened, health = _run_until_exit(argv, [port, http_port], watch_health_port=port)
    assert not listened, f"a port took connections while the model failed to load (health seen: {health})"
    assert "SERVING" not in health, health
    assert code == 2, stderr
    assert f"could not load model '{tmp_path}'" in stderr
    assert "neither a Hugging Face Whisper folder" not in stderr, (
        "refused by the start-up check, not the load"
    )

    # In-process (an embedded AsrServer loads its own engine), the port opens first, behind NOT_SERVING,
    # and stays there when the load fails.
    async def in_process() -> list[str]:
        config = ServerConfig(host=HOST, port=0, metrics_port=0, http_port=0)
        config.engine.model = str(tmp_path)
        server = AsrServer(config)
        await server.start()
        try:
            seen = [await _health(server.port)]
            with pytest.raises(ModelLoadError, match=str(tmp_path)):
                await server.load()
            seen.append(await _health(server.port))
        finally:
            await server.stop(0)
        return seen

    assert asyncio.run(in_process()) == ["NOT_SERVING", "NOT_SERVING"]


async def _health(port: int) -> str:
    async with aio.insecure_channel(f"{HOST}:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
