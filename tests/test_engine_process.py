"""The engine in its own process behind `EngineClient` (ZeroMQ IPC), against the in-process `Engine`:
same tokens for the same audio, the same exceptions, cancel and stats across the boundary, and a
client that learns at once when the engine process dies. The IPC trusts neither peer: the engine
frees what a vanished or restarted frontend held, counts and drops malformed messages without dying,
and a frontend fails an utterance whose reply the engine dropped."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import cast

import grpc
import numpy as np
import pytest
import zmq
from asr.v1 import asr_pb2
from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

from engine import DecodeOptions, Engine, EngineConfig, EngineOverloaded
from engine.api import EngineStopped, ModelInfo
from engine.outputs import Transcript, UtteranceStats
from engine.process import ipc
from engine.process.client import EngineClient
from service.config import ServerConfig
from service.runtime.supervisor import engine_main, start_child, tell_to_stop
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import config_request
from tests.support.engine import jfk_16k
from tests.support.server import ServerThread, sync_stream

pytestmark = pytest.mark.slow


class EngineProcess:
    """engine.process.core_process in a spawned child, as asr-server starts it; its metrics go to a
    prometheus-client multiprocess folder, as under asr-server's supervisor."""

    def __init__(self, config: EngineConfig) -> None:
        self.dir = tempfile.mkdtemp(prefix="asr-engine-test-")
        self.address = f"ipc://{Path(self.dir) / 'engine.sock'}"
        self.metrics_dir = Path(self.dir) / "metrics"
        self.metrics_dir.mkdir()
        ctx = multiprocessing.get_context("spawn")
        ready, child_end = ctx.Pipe(duplex=False)
        self.proc: BaseProcess = ctx.Process(
            target=engine_main, args=(config, self.address, child_end, os.getpid(), "warning", "text")
        )
        # the child reads it as it imports prometheus-client; this process's metrics stay as they are
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PROMETHEUS_MULTIPROC_DIR", str(self.metrics_dir))
            start_child(self.proc)
        child_end.close()
        assert ready.poll(180), "the engine process never reported"
        message = ready.recv()
        assert message[0] == "ready", message

    def metric(self, name: str, labels: dict[str, str]) -> float:
        """A sample of the engine process's own metrics (0 where it has none yet)."""
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(self.metrics_dir))
        return registry.get_sample_value(name, labels) or 0.0

    def stop(self) -> None:
        if self.proc.is_alive():
            tell_to_stop(self.proc)  # as the supervisor does: the engine ignores SIGTERM from outside
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def engine_process() -> Iterator[EngineProcess]:
    process = EngineProcess(EngineConfig(model="tiny.en", threads=2))
    yield process
    process.stop()
    assert process.proc.exitcode == 0  # told to stop: a clean stop


@pytest.fixture()
def client(engine_process: EngineProcess) -> Iterator[EngineClient]:
    c = EngineClient(engine_process.address)
    yield c
    c.stop()


def clips() -> list[np.ndarray]:
    audio, _ = make_conversation(["Thank you for calling, how can I help you today?"], pause_s=0.3)
    return [jfk_16k(), audio.astype(np.float32), jfk_16k()[: 16000 * 3]]


def test_audio_across_the_ipc_gives_the_in_process_engines_tokens(
    service_engine: Engine, client: EngineClient
) -> None:
    options = [DecodeOptions(), DecodeOptions(timestamps=True), DecodeOptions(prompt="Kennedy")]
    for clip, opts in zip(clips(), options, strict=True):
        local = service_engine.submit(clip, opts).future.result(120)
        remote = client.submit(clip, opts).future.result(120)
        assert remote.tokens == local.tokens and remote.tokens
        assert remote.text == local.text
        assert remote.segments == local.segments
    assert client.info == service_engine.info


def test_ipc_time_is_measured_per_utterance(client: EngineClient) -> None:
    before = REGISTRY.get_sample_value("asr_ipc_seconds_count") or 0.0
    client.submit(jfk_16k()[:16000]).future.result(60)
    assert (REGISTRY.get_sample_value("asr_ipc_seconds_count") or 0.0) == before + 1


def test_validate_answers_as_the_engine_does(service_engine: Engine, client: EngineClient) -> None:
    cases = [
        DecodeOptions(language="en"),
        DecodeOptions(language="de"),
        DecodeOptions(task="translate"),
        DecodeOptions(task="dance"),
        DecodeOptions(max_new_tokens=0),
        DecodeOptions(max_new_tokens=5),
        DecodeOptions(beam_size=0),
        DecodeOptions(beam_size=3),
        DecodeOptions(beam_size=6),  # past the engine's --max-beam-size (5): the client refuses it too
    ]
    for opts in cases:
        errors = []
        for target in (service_engine, client):
            try:
                target.validate(opts)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        assert errors[0] == errors[1], opts
    with pytest.raises(ValueError, match="language_code 'de'"):
        client.submit(np.zeros(16000, np.float32), DecodeOptions(language="de"))
    with pytest.raises(ValueError, match=r"beam_size 6 .*\(--max-beam-size 5\)"):
        client.submit(np.zeros(16000, np.float32), DecodeOptions(beam_size=6))


def test_cancel_and_stats_cross_the_boundary(client: EngineClient) -> None:
    handles = [client.submit(jfk_16k()) for _ in range(6)]
    for h in handles[1:]:
        h.cancel()
    assert handles[0].future.result(120).text
    cancelled = 0
    for h in handles[1:]:
        try:
            h.future.result(120)
        except concurrent.futures.CancelledError:
            cancelled += 1
    assert cancelled >= 1  # the ones not yet finished when the cancel arrived
    stats = client.stats()
    assert {k: stats[k] for k in ("waiting", "active", "slots_used", "slots_free", "queued")} == {
        "waiting": 0,
        "active": 0,
        "slots_used": 0,
        "slots_free": 32,
        "queued": 0,
    }


def test_overload_and_engine_death_reach_the_client_as_engine_exceptions() -> None:
    process = EngineProcess(EngineConfig(model="tiny.en", threads=2, max_queue=2, warmup=False))
    client = EngineClient(process.address)
    failed = threading.Event()
    client.start(on_failure=lambda exc: failed.set())
    try:
        handles = [client.submit(jfk_16k()) for _ in range(8)]
        outcomes = []
        for h in handles:
            try:
                h.future.result(180)
                outcomes.append("ok")
            except EngineOverloaded as e:
                assert "--max-queue" in str(e)
                outcomes.append("overloaded")
        assert "overloaded" in outcomes and "ok" in outcomes, outcomes

        # no more than --max-queue (2): a third could be refused overloaded before the kill reaches it
        pending = [client.submit(jfk_16k()) for _ in range(2)]
        assert process.proc.pid is not None
        os.kill(process.proc.pid, signal.SIGKILL)
        for h in pending:
            with pytest.raises(EngineStopped, match="engine process exited"):
                h.future.result(30)
        assert failed.wait(10)
        assert not client.alive
        with pytest.raises(EngineStopped):
            client.submit(jfk_16k())
    finally:
        client.stop()
        process.stop()


# --- a frontend gone or restarted: the engine frees what it held ---

BURST = 120  # at two slots a pass, minutes of work: waiting for it to finish on its own fails the test
LONG = DecodeOptions(timestamps=True)  # the full 30 s context: every encoder pass is the longest kind
IDLE = {"waiting": 0, "active": 0, "slots_used": 0}


@pytest.fixture(scope="module")
def small_engine() -> Iterator[EngineProcess]:
    """Two KV slots, two utterances a pass: most of a burst waits in the queue, and whatever the engine
    is doing when a frontend goes takes one short pass to finish."""
    process = EngineProcess(
        EngineConfig(model="tiny.en", threads=2, kv_slots=2, max_batch=2, max_queue=512, warmup=False)
    )
    yield process
    process.stop()


def busy_clip() -> np.ndarray:
    return jfk_16k()[: 16000 * 5]


def wait_busy(client: EngineClient, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while (stats := client.stats())["waiting"] == 0:
        if time.monotonic() > deadline:
            pytest.fail(f"the burst never reached the engine's queue: {stats}")
        time.sleep(0.05)


def wait_idle(client: EngineClient, deadline_s: float = 30.0) -> float:
    """Seconds until the engine holds nothing (nothing waiting, decoding or in a slot)."""
    started = time.monotonic()
    while True:
        stats = client.stats()
        if {k: stats[k] for k in IDLE} == IDLE:
            return time.monotonic() - started
        if time.monotonic() - started > deadline_s:
            pytest.fail(f"the engine still holds the work {deadline_s:g} s after its frontend went: {stats}")
        time.sleep(0.1)


def _frontend_that_dies(address: str, count: int, sent: Connection) -> None:
    """A frontend process: submits a burst, says so, and waits to be killed."""
    client = EngineClient(address, name="frontend-doomed")
    for _ in range(count):
        client.submit(busy_clip(), LONG)
    client.stats()  # a round trip behind the submissions: the engine has every one of them
    sent.send("sent")
    time.sleep(600)


def test_a_killed_frontends_work_leaves_the_engine(small_engine: EngineProcess) -> None:
    ctx = multiprocessing.get_context("spawn")
    sent, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_frontend_that_dies, args=(small_engine.address, BURST, child_end))
    child.start()
    child_end.close()
    watcher = EngineClient(small_engine.address, name="watcher")
    try:
        assert sent.poll(120), "the frontend process never submitted its burst"
        wait_busy(watcher)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        took = wait_idle(watcher)
        print(f"idle {took:.1f} s after the frontend was killed")
        ended = {"reason": "disconnected"}
        assert small_engine.metric("asr_ipc_sessions_ended_total", ended) >= 1
        assert watcher.submit(busy_clip()).future.result(120).text  # the engine serves on
    finally:
        if child.is_alive():
            child.kill()
        watcher.stop()


def test_a_frontend_back_under_its_identity_frees_its_old_sessions_work(small_engine: EngineProcess) -> None:
    old = EngineClient(small_engine.address, name="frontend-7")
    new: EngineClient | None = None
    try:
        handles = [old.submit(busy_clip(), LONG) for _ in range(BURST)]
        wait_busy(old)
        # a restarted frontend: same ZeroMQ identity (ROUTER_HANDOVER gives it the route), new session
        new = EngineClient(small_engine.address, name="frontend-7")
        wait_idle(new)
        assert small_engine.metric("asr_ipc_sessions_ended_total", {"reason": "replaced"}) >= 1
        assert new.submit(busy_clip()).future.result(120).text
        assert not any(
            h.future.done() and not h.future.cancelled() and h.future.exception() is None
            for h in handles[10:]
        )  # the old burst was not run to the end
    finally:
        old.stop()
        if new is not None:
            new.stop()


def test_a_stopping_client_frees_its_work_cancels_included(small_engine: EngineProcess) -> None:
    client = EngineClient(small_engine.address, name="frontend-stopping")
    watcher = EngineClient(small_engine.address, name="watcher-2")
    try:
        handles = [client.submit(busy_clip(), LONG) for _ in range(BURST)]
        wait_busy(client)
        for h in handles[: BURST // 2]:
            h.cancel()  # still in the client's outbox when it stops: they must reach the engine
        client.stop()
        for h in handles:
            with pytest.raises((EngineStopped, concurrent.futures.CancelledError)):
                h.future.result(10)
        wait_idle(watcher)
        assert small_engine.metric("asr_ipc_sessions_ended_total", {"reason": "closed"}) >= 1
    finally:
        client.stop()
        watcher.stop()


# --- the IPC trusts neither peer ---


class RawPeer:
    """A DEALER speaking the wire by hand, to send what no EngineClient would."""

    def __init__(self, address: str, *, hello: bool = True) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        if hello:
            self.send(ipc.HELLO, os.urandom(8))
            assert self.replies()[0][0] == ipc.HELLO

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def replies(self, timeout_s: float = 30.0) -> list[list[bytes]]:
        """Every reply up to a STATS round trip (replies come in order: all earlier ones are in)."""
        token = os.urandom(8)
        self.send(ipc.STATS, token)
        out: list[list[bytes]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(round(left * 1000)):
                pytest.fail("the engine process stopped answering")
            frames = self.socket.recv_multipart()
            if frames[0] == ipc.STATS and frames[1:2] == [token]:
                return out
            if frames[0] != ipc.PING:
                out.append(frames)

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


class Touch:
    """A pickle that would create a file when loaded by an unrestricted unpickler."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.path,))


def test_malformed_messages_are_counted_and_dropped_and_the_engine_serves_on(
    engine_process: EngineProcess, client: EngineClient, tmp_path: Path
) -> None:
    audio = np.zeros(1600, np.float32).tobytes()
    header = pickle.dumps((DecodeOptions(), time.monotonic()))
    touched = tmp_path / "unpickled"
    cases: list[tuple[list[bytes], str, bytes | None]] = [  # frames, reason counted, rid answered FAILED
        ([ipc.SUBMIT], "frames", None),
        ([ipc.SUBMIT, b"r-1"], "frames", b"r-1"),
        ([ipc.SUBMIT, b"r-2", b"not a pickle", audio], "header", b"r-2"),
        ([ipc.SUBMIT, b"r-3", pickle.dumps({"options": 1}), audio], "header", b"r-3"),
        ([ipc.SUBMIT, b"r-4", pickle.dumps((Touch(touched), 0.0)), audio], "header", b"r-4"),
        ([ipc.SUBMIT, b"r-5", header, audio[:-2]], "audio", b"r-5"),
        ([ipc.SUBMIT, b"r-6", header, np.full(160, np.nan, np.float32).tobytes()], "audio", b"r-6"),
        ([ipc.SUBMIT, b"\xff\xfe", header, audio], "request_id", None),
        ([b"Z", b"x"], "kind", None),
        ([b""], "kind", None),
        ([ipc.CANCEL], "frames", None),
        ([ipc.STATS], "frames", None),
        ([ipc.HELLO], "frames", None),
    ]
    before = {
        reason: engine_process.metric("asr_ipc_malformed_total", {"receiver": "engine", "reason": reason})
        for reason in ("frames", "header", "audio", "request_id", "kind", "duplicate", "session")
    }
    peer = RawPeer(engine_process.address)
    stranger = RawPeer(engine_process.address, hello=False)
    try:
        for frames, _, rid in cases:
            peer.send(*frames)
            replies = peer.replies()
            if rid is None:
                assert replies == [], (frames, replies)
            else:
                assert [r[:2] for r in replies] == [[ipc.FAILED, rid]], (frames, replies)
                kind, message, *_ = pickle.loads(replies[0][2])
                # the frontend raises RemoteEngineError("malformed"): INTERNAL, the server's own fault
                error = ipc.failure_exception(kind, message)
                assert isinstance(error, ipc.RemoteEngineError) and error.remote_type == "malformed"
                assert rid.decode() in message, (frames, message)
        # one request id twice in a session: the second is refused (a cancel could not tell them apart)
        peer.send(ipc.SUBMIT, b"r-7", header, audio)
        peer.send(ipc.SUBMIT, b"r-7", header, audio)
        replies = peer.replies()
        assert [r[:2] for r in replies if r[0] == ipc.FAILED] == [[ipc.FAILED, b"r-7"]], replies
        # work with no session (no HELLO): refused, never run for nobody
        stranger.send(ipc.SUBMIT, b"s-1", header, audio)
        replies = stranger.replies()
        assert [r[:2] for r in replies] == [[ipc.FAILED, b"s-1"]], replies
        assert pickle.loads(replies[0][2])[0] == ipc.STOPPED
    finally:
        peer.close()
        stranger.close()
    assert not touched.exists()  # the header was never unpickled with arbitrary globals
    assert engine_process.proc.is_alive()
    assert client.submit(jfk_16k()).future.result(120).text  # and it serves on
    counted = {
        reason: engine_process.metric("asr_ipc_malformed_total", {"receiver": "engine", "reason": reason})
        - before[reason]
        for reason in before
    }
    expected = Counter(reason for _, reason, _ in cases) + Counter(duplicate=1, session=1)
    assert counted == dict(expected)


def test_the_client_counts_and_drops_malformed_replies(tmp_path: Path) -> None:
    """The frontend side: a fake engine (a bare ROUTER) answers with what no engine would send."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path / 'fake.sock'}"
    router.bind(address)
    made: list[EngineClient] = []
    connecting = threading.Thread(target=lambda: made.append(EngineClient(address, connect_timeout=30)))
    connecting.start()
    try:
        assert router.poll(30_000)
        identity, kind, *_ = router.recv_multipart()
        assert kind == ipc.HELLO
        info = ModelInfo("fake", "cpu", "float32", False, frozenset({"en"}), 0)
        router.send_multipart([identity, ipc.HELLO, pickle.dumps((info, 16))])
        connecting.join(30)
        client = made[0]
        bad, good = client.submit(np.zeros(1600, np.float32)), client.submit(np.zeros(1600, np.float32))
        for _ in range(2):
            assert router.poll(30_000)
            assert router.recv_multipart()[1] == ipc.SUBMIT

        def counted(reason: str) -> float:
            labels = {"receiver": "frontend", "reason": reason}
            return REGISTRY.get_sample_value("asr_ipc_malformed_total", labels) or 0.0

        before = {r: counted(r) for r in ("frames", "kind", "header")}
        transcript = Transcript("hello", (1,), -0.1, 0.0, "en", (), True, UtteranceStats(0.1, 0.0, 1, 1, 0.1))
        now = time.monotonic()
        for frames in (
            [ipc.DONE],
            [b"?", b"x"],
            [ipc.DONE, bad.id.encode(), b"junk"],
            [ipc.DONE, good.id.encode(), pickle.dumps((transcript, now, now))],
        ):
            router.send_multipart([identity, *frames])
        assert good.future.result(30) == transcript
        with pytest.raises(ipc.RemoteEngineError, match="malformed"):
            bad.future.result(30)
        assert client.alive
        assert {r: counted(r) - before[r] for r in before} == {"frames": 1, "kind": 1, "header": 1}
        client.stop()
    finally:
        connecting.join(30)
        router.close(0)
        context.term()


def test_a_reply_the_engine_drops_fails_that_utterance_within_the_bound() -> None:
    # the engine process drops the replies of its first two utterances (a test seam)
    process = EngineProcess(EngineConfig(model="tiny.en", threads=2, warmup=False, debug_drop_replies=2))
    client = EngineClient(process.address)
    server: ServerThread | None = None
    try:
        lost = client.submit(jfk_16k()[: 16000 * 3])
        started = time.monotonic()
        with pytest.raises(ipc.ReplyLost, match="no reply"):
            lost.future.result(30)  # the bound is ~2 s (ipc.CHECK_INTERVAL_S); 30 s: a loaded machine
        print(f"lost reply failed after {time.monotonic() - started:.1f} s")
        # through a stream: the stream ends with a status saying so, not waiting for ever
        config = ServerConfig(speculative_endpointing=False)
        server = ServerThread(config, cast(Engine, client)).start()
        speech, _ = make_conversation(["Thank you for calling, how can I help you today?"], pause_s=0.8)
        requests = [
            config_request(),
            asr_pb2.StreamingRecognizeRequest(audio_content=to_linear16_bytes(speech)),
        ]
        _, code, details = sync_stream(server.target, requests, timeout=60)
        assert code == grpc.StatusCode.INTERNAL, (code, details)
        assert "no reply" in details
        assert client.submit(jfk_16k()).future.result(120).text  # the third reply comes: it serves on
        assert client.alive
    finally:
        if server is not None:
            server.stop()
        client.stop()
        process.stop()
