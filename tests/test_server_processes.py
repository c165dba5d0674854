"""asr-server as a supervisor, an engine process and frontend processes (real subprocesses, real
tiny.en, real audio): the engine dies, a frontend dies, SIGTERM drains two frontends, the supervisor
is killed, the model cannot load. After each way of exiting no process of the server remains."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from clients.client import RecognizerClient
from service.runtime.supervisor import default_frontends, usable_cpus
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import OpenStream, config_request
from tests.support.server import HOST, ServerProcess, watch_health

pytestmark = pytest.mark.slow
Event = asr_pb2.StreamingRecognizeResponse.SpeechEventType
SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "I would like to check the status of my order.",
]


def children(server: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def engine_pid(server: ServerProcess) -> int:
    for line in server.log().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("message") == "engine process ready":
                return int(entry["pid"])
    raise AssertionError(f"no 'engine process ready' line:\n{server.log()}")


def frontend_pids(server: ServerProcess) -> set[int]:
    """Frontends: the children that are neither the engine nor multiprocessing's resource tracker."""
    engine = engine_pid(server)
    return {
        p.pid
        for p in children(server)
        if p.pid != engine and not any("resource_tracker" in part for part in p.cmdline())
    }


def assert_gone(pids: list[int], within_s: float = 15.0) -> None:
    """None of these processes is left (a zombie still waiting for its parent counts as gone only once
    that parent is gone too: then init reaps it)."""
    deadline = time.monotonic() + within_s
    left = pids
    while time.monotonic() < deadline:
        left = [pid for pid in pids if psutil.pid_exists(pid) and _not_reaped(pid)]
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left behind: {[(p, _describe(p)) for p in left]}")


def _not_reaped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pid: int) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(psutil.Process(pid).cmdline())[:120]
    return "?"


def scrape(server: ServerProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def speech() -> bytes:
    audio, _ = make_conversation([SENTENCES[0]], pause_s=0.8, lead_s=0.3)
    return to_linear16_bytes(audio)


def recognize_once(target: str) -> str:
    with grpc.insecure_channel(target) as channel:
        responses = list(
            asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(
                iter([config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=speech())]),
                timeout=60,
            )
        )
    return " ".join(r.alternatives[0].transcript for x in responses for r in x.results if r.is_final)


def recognize_retrying_unavailable(target: str, attempts: int = 5) -> str:
    """As a client should around a replica's process change (docs/operations.md: retry UNAVAILABLE): a
    connection the kernel handed to a frontend as it died or started is reset, and a retry reaches one
    that serves. Any other code still fails at once."""
    for attempt in range(attempts):
        try:
            return recognize_once(target)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def test_two_frontends_one_metrics_scrape_and_a_frontend_crash_is_replaced() -> None:
    # calls on every interface, /metrics on loopback only (--metrics-host; issue 26 #13)
    server = ServerProcess("--frontends", "2", "--host", "[::]", "--metrics-host", HOST).wait_serving()
    try:
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert (HOST, server.metrics_port) in listening and ("::", server.metrics_port) not in listening
        assert ("::", server.port) in listening
        pids = [p.pid for p in children(server)]
        frontends = frontend_pids(server)
        assert len(frontends) == 2, server.log()
        assert "thank you for calling" in recognize_once(server.target).lower()

        metrics = scrape(server)
        processes = {labels["process"] for labels, _ in metrics["process_cpu_seconds_total"]}
        assert processes == {"supervisor", "engine", "frontend-0", "frontend-1"}
        memory = {labels["process"]: v for labels, v in metrics["process_resident_memory_bytes"]}
        assert memory["engine"] > memory["frontend-0"] > 0  # the engine holds the model
        assert metrics["asr_ipc_seconds_count"][0][1] >= 1  # the stream's utterance (warm-up is in-engine)
        assert metrics["asr_vad_seconds_count"][0][1] >= 1  # a frontend's VAD passes (multiprocess histogram)
        assert metrics["asr_engine_requests_total"]  # the engine process's series
        handled = [v for labels, v in metrics["grpc_server_handled_total"] if labels["grpc_code"] == "OK"]
        assert sum(handled) >= 1  # a frontend's series
        assert [v for _, v in metrics["asr_serving"]] == [1.0]  # one series, not one per process
        assert [v for _, v in metrics["asr_kv_slots_free"]] == [32.0]

        # A frontend dies: the other keeps serving, and a new one takes its place.
        victim = min(frontends)
        os.kill(victim, signal.SIGKILL)
        # (a connection caught in a dying or starting listener is reset, as with any SO_REUSEPORT group:
        # clients retry UNAVAILABLE, and so does this test)
        assert_gone([victim])
        assert "thank you for calling" in recognize_retrying_unavailable(server.target).lower()
        deadline = time.monotonic() + 60
        while len(frontend_pids(server) - {victim}) < 2:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        assert "frontend-0 exited" in server.log() or "frontend-1 exited" in server.log()
        while server.log().count('"message": "listening"') < 3:  # the new frontend is serving too
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        for _ in range(4):  # own connections, spread over both frontends
            assert "thank you for calling" in recognize_retrying_unavailable(server.target).lower()
        assert server.proc.poll() is None
        pids += [p.pid for p in children(server)]

        server.terminate()
        assert server.wait(60) == 0, server.log()[-3000:]
        assert_gone(pids)
    finally:
        server.stop()


@pytest.mark.parametrize("to", ["supervisor", "process group"])
async def test_sigterm_drains_two_frontends_and_loses_no_final(to: str) -> None:
    """SIGTERM to the supervisor (Kubernetes, docker stop) or to every process of the server at once
    (systemd's KillMode=control-group, `kill -- -PGID`, a terminal's Ctrl-C as SIGINT): the same drain.
    The supervisor alone orders the shutdown: frontends drain first, the engine stops after them."""
    drain_seconds = 20
    audio, _ = make_conversation(SENTENCES, pause_s=1.0)
    server = ServerProcess(
        "--frontends", "2", "--drain-seconds", str(drain_seconds), own_process_group=to == "process group"
    ).wait_serving()
    n = 4  # own connections each, spread over the two frontends by SO_REUSEPORT
    received: list[list[asr_pb2.StreamingRecognizeResponse]] = [[] for _ in range(n)]
    second_sentence = [asyncio.Event() for _ in range(n)]
    try:
        pids = [p.pid for p in children(server)]

        async def stream(i: int) -> None:
            async with RecognizerClient(server.target) as client:
                begins = 0
                async for r in client.stream_file(audio, rate=16000, realtime=True):
                    received[i].append(r)
                    if r.speech_event_type == Event.SPEECH_ACTIVITY_BEGIN:
                        begins += 1
                        if begins == 2:
                            second_sentence[i].set()

        streams = [asyncio.create_task(stream(i)) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in second_sentence)), 60)
        await asyncio.sleep(0.8)  # a few words into the second sentence
        if to == "supervisor":
            server.terminate()
        else:
            os.killpg(server.proc.pid, signal.SIGTERM)  # its own group: the supervisor leads it
        await asyncio.wait_for(asyncio.gather(*streams), drain_seconds)
        code = await asyncio.to_thread(server.wait, drain_seconds + 10)
        assert code == 0, server.log()[-3000:]
        assert_gone(pids)
    finally:
        server.stop()
    for responses in received:
        finals = [r for x in responses for r in x.results if r.is_final]
        # the first sentence's final and the one cut short by the drain: none lost
        assert len(finals) == 2, responses
        assert "thank you for calling" in finals[0].alternatives[0].transcript.lower()
        assert [x.speech_event_type for x in responses].count(Event.RECONNECT) == 1


OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)  # a TCP connection per channel: any frontend


def frontend_of(stream_id: str) -> int:
    """The pid of the frontend that accepted a stream: its id is s<pid in hex>-<n>."""
    return int(stream_id.split("-")[0][1:], 16)


async def test_max_streams_is_the_servers_limit_shared_by_its_frontends() -> None:
    """--max-streams 2 with two frontends: one stream open on each fills the server (each frontend's own
    count would still be 1); a frontend that dies gives its places back."""
    server = ServerProcess("--frontends", "2", "--max-streams", "2").wait_serving()
    channels: list[aio.Channel] = []

    def connection() -> aio.Channel:
        channels.append(aio.insecure_channel(server.target, options=OWN_CONNECTION))
        return channels[-1]

    async def open_stream() -> tuple[OpenStream, str]:
        stream = OpenStream(connection(), deadline_s=120)
        return stream, await stream.open()

    async def assert_refused() -> None:
        stream, stream_id = await open_stream()
        outcome = await stream.finish()
        assert not stream_id and outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (stream_id, outcome)
        assert "limit of 2 concurrent streams (max_streams)" in outcome.details

    try:
        held: dict[int, OpenStream] = {}  # frontend pid -> the stream it holds
        # SO_REUSEPORT picks the frontend: until each holds one. For a while on a loaded machine only the
        # first frontend may be listening (the server is SERVING from its first), hence a time bound.
        deadline = time.monotonic() + 60
        while len(held) < 2 and time.monotonic() < deadline:
            stream, stream_id = await open_stream()
            assert stream_id, f"refused below the limit: {await stream.finish()}"
            if frontend_of(stream_id) in held:
                assert (await stream.finish()).code == grpc.StatusCode.OK  # its place is given back
                await asyncio.sleep(0.1)
            else:
                held[frontend_of(stream_id)] = stream
        assert len(held) == 2, "every stream went to one frontend"
        for _ in range(4):  # new connections, spread over both frontends
            await assert_refused()

        # a frontend dies with its stream: once the supervisor has seen it, its place is free again
        dead = next(iter(held))
        os.kill(dead, signal.SIGKILL)
        assert (await held.pop(dead).finish()).code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
        )
        deadline = time.monotonic() + 60
        while True:
            stream, stream_id = await open_stream()
            if stream_id:
                break
            outcome = await stream.finish()  # refused (not yet seen dead) or reset (a dying listener)
            assert outcome.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE), outcome
            assert time.monotonic() < deadline, f"the dead frontend's place never came back: {outcome}"
            await asyncio.sleep(0.2)
        held[frontend_of(stream_id)] = stream
        await assert_refused()  # two open again: the limit still holds
        for s in held.values():
            assert (await s.finish()).code == grpc.StatusCode.OK
        server.terminate()
        assert await asyncio.to_thread(server.wait, 60) == 0, server.log()[-3000:]
    finally:
        for c in channels:
            await c.close()
        server.stop()


def test_engine_process_death_fails_streams_unavailable_and_exits_non_zero() -> None:
    server = ServerProcess("--frontends", "2").wait_serving()
    try:
        pids = [p.pid for p in children(server)]
        statuses, watcher = watch_health(server.target)

        # an open stream (it never half-closes) whose utterance is in the engine, or just done, when it dies
        long_speech, _ = make_conversation([" ".join(SENTENCES * 3)], pause_s=0.8, lead_s=0.3)
        result: dict[str, object] = {}
        ended = threading.Event()

        def requests() -> Iterator[asr_pb2.StreamingRecognizeRequest]:
            yield config_request()
            yield asr_pb2.StreamingRecognizeRequest(audio_content=to_linear16_bytes(long_speech))
            ended.wait(60)

        def call() -> None:
            with grpc.insecure_channel(server.target) as channel:
                c = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(requests(), timeout=60)
                with contextlib.suppress(grpc.RpcError):
                    list(c)
                result.update(code=c.code(), details=c.details() or "")
                ended.set()

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(1.0)  # the audio is in; its utterance reaches the engine as the stream ends speech
        os.kill(engine_pid(server), signal.SIGKILL)
        caller.join(60)
        assert server.wait(30) == 1, server.log()[-3000:]
        watcher.join(10)
        assert result["code"] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), result
        if result["code"] == grpc.StatusCode.UNAVAILABLE:
            assert "engine" in str(result["details"]) or "Socket closed" in str(result["details"]), result
        assert statuses[0] == "SERVING" and "NOT_SERVING" in statuses[1:], statuses
        assert "engine process exited; exiting" in server.log()
        assert_gone(pids)
    finally:
        server.stop()


def test_sigkill_of_the_supervisor_leaves_no_process_behind() -> None:
    server = ServerProcess("--frontends", "2").wait_serving()
    try:
        pids = [p.pid for p in children(server)]
        assert len(pids) >= 3  # engine and two frontends (and multiprocessing's resource tracker)
        server.proc.kill()
        server.proc.wait(10)
        assert_gone(pids)
    finally:
        server.stop()


def test_failed_start_leaves_no_process_behind(tmp_path: Path) -> None:
    """A model folder without weights: the engine process fails to load, the server exits 2 without a
    frontend ever serving (they start beside the engine and wait for it), and every child is gone."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    server = ServerProcess("--model", str(tmp_path), "--frontends", "2")
    try:
        seen: set[int] = set()
        while server.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                seen |= {p.pid for p in children(server)}
            time.sleep(0.05)
        assert server.proc.returncode == 2, server.log()
        assert f"could not load model '{tmp_path}'" in server.log()
        assert seen, "the engine process was never seen"
        assert_gone(list(seen))
    finally:
        server.stop()


def test_sigterm_while_the_model_loads_exits_zero_and_leaves_no_process_behind() -> None:
    """The frontends wait for the engine beside it: a stop before the model is ready ends them too."""
    server = ServerProcess("--frontends", "2")
    try:
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while len(seen) < 3:  # the engine and both frontends, waiting
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            with contextlib.suppress(psutil.Error):
                seen |= {p.pid for p in children(server) if "resource_tracker" not in " ".join(p.cmdline())}
            time.sleep(0.05)
        server.terminate()
        assert server.wait(60) == 0, server.log()
        assert "engine process ready" not in server.log()
        assert_gone(list(seen))
    finally:
        server.stop()


def test_a_second_server_on_a_port_in_use_is_refused(two_frontend_process: ServerProcess) -> None:
    """Frontends share the gRPC and HTTP ports with SO_REUSEPORT; another server must never join them
    silently, on any of its three ports (gRPC, HTTP, metrics)."""
    first = two_frontend_process
    # the three start side by side (each takes its own free ports but the one in use): one start's time
    seconds = {
        f"{first.port} is not free": ServerProcess("--port", str(first.port), http=True),
        f"{first.http_port} is not free": ServerProcess("--http-port", str(first.http_port), http=True),
        f"metrics server on port {first.metrics_port}": ServerProcess(
            "--metrics-port", str(first.metrics_port), http=True
        ),
    }
    try:
        for message, second in seconds.items():
            assert second.wait(60) == 2, second.log()
            assert message in second.log(), second.log()
    finally:
        for second in seconds.values():
            second.stop()
    assert first.health() == "SERVING"
    assert "thank you for calling" in recognize_once(first.target).lower()


def closing_connections(port: int) -> set[str]:
    """States of this machine's TCP sockets on local `port` that are neither listening nor connected:
    connections the server closed and the kernel still keeps (FIN_WAIT*, TIME_WAIT, ...)."""
    return {
        c.status
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status not in (psutil.CONN_LISTEN, psutil.CONN_ESTABLISHED)
    }


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_restart_on_the_same_ports_serves_at_once_while_old_connections_close(stop: str) -> None:
    """A pod's container restarts in the same network namespace: the old server's connections are still
    closing (TIME_WAIT, FIN_WAIT2 towards a keep-alive client that never reads) when the new one starts
    on the same ports. It must serve, not exit 2 for up to a minute."""
    # a short drain: the connections held below keep a drain waiting to its end (gRPC waits for its own)
    first = ServerProcess("--frontends", "1", "--drain-seconds", "3", http=True).wait_serving()
    second: ServerProcess | None = None
    held: list[object] = []  # clients that keep their connections open through the stop, as real ones do
    try:
        pids = [p.pid for p in children(first)]
        keep_alive = http.client.HTTPConnection(HOST, first.http_port, timeout=10)
        keep_alive.request("GET", "/v1/models")
        assert keep_alive.getresponse().read() and keep_alive.sock is not None
        held.append(keep_alive)
        channel = grpc.insecure_channel(first.target)
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        held.append(channel)
        scrape(first)
        # gRPC and urllib clients close their end as soon as the server closes (or before): a client that
        # has gone quiet (a stalled process, a half-dead peer) leaves the server's end in FIN_WAIT2, as
        # the keep-alive client does, on every port
        for port in (first.port, first.http_port, first.metrics_port):
            held.append(socket.create_connection((HOST, port), timeout=10))
        if stop == "sigterm":
            first.terminate()
            assert first.wait(60) == 0, first.log()[-3000:]
        else:
            first.proc.kill()
            first.wait(10)
        assert_gone(pids)
        ports = {"gRPC": first.port, "HTTP": first.http_port, "metrics": first.metrics_port}
        closing = {name: closing_connections(port) for name, port in ports.items()}
        assert all(closing.values()), (
            f"nothing left closing on some port: the test would prove nothing: {closing}"
        )

        second = ServerProcess("--frontends", "1", ports_of=first).wait_serving()
        assert "thank you for calling" in recognize_once(second.target).lower()
        with urllib.request.urlopen(f"{second.http_url}/v1/models", timeout=10) as r:
            assert r.status == 200
        assert [v for _, v in scrape(second)["asr_serving"]] == [1.0]
    finally:
        for h in held:
            h.close()  # type: ignore[attr-defined]
        first.stop()
        if second is not None:
            second.terminate()
            second.wait(60)
            second.stop()


def test_default_frontends_leave_one_core_to_the_engine() -> None:
    assert [default_frontends(cpus) for cpus in (1, 2, 3, 4, 9, 16, 64)] == [1, 1, 2, 3, 8, 8, 8]
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
