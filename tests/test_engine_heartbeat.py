"""A hung engine process (alive, but its scheduler loop stuck) is found by its heartbeat and ends the
server as a dead one does; a slow but live engine is not taken for a hung one. Real asr-server
subprocesses, real tiny.en, real espeak speech; the hang and the slowness come from the engine's test
seams (engine/faults.py)."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc

from service.runtime.supervisor import HeartbeatWatch
from tests.support.audio import make_conversation, to_linear16_bytes
from tests.support.calls import config_request
from tests.support.server import ServerProcess, watch_health

SENTENCE = "Thank you for calling, how can I help you today?"


def test_heartbeat_watch_tells_hung_from_idle_and_from_slow() -> None:
    t = 0.0
    watch = HeartbeatWatch(timeout_s=5.0, now=t)
    # idle: no progress owed, however long
    for t in (1.0, 10.0, 100.0):
        assert watch.check(published=t, progress=7, pending=0, now=t) is None
    # work arrives after a long idle: the clock starts when it does, not at the last progress
    assert watch.check(published=101.0, progress=7, pending=2, now=101.0) is None
    assert watch.check(published=105.5, progress=7, pending=2, now=105.5) is None
    # slow but alive: progress every 4 s (< 5) keeps it alive for as long as work lasts
    for i, t in enumerate((109.0, 113.0, 117.0, 121.0)):
        assert watch.check(published=t, progress=8 + i, pending=2, now=t) is None
    # no progress for longer than the timeout with work pending: hung
    hung = watch.check(published=126.5, progress=11, pending=2, now=126.5)
    assert hung is not None and "no progress" in hung and "2 utterances pending" in hung
    # a process that publishes nothing at all is hung whatever it last said
    silent = HeartbeatWatch(timeout_s=5.0, now=0.0)
    assert silent.check(published=1.0, progress=3, pending=0, now=5.0) is None
    assert "no heartbeat" in (silent.check(published=1.0, progress=3, pending=0, now=6.5) or "")


def _speech() -> bytes:
    audio, _ = make_conversation([SENTENCE], pause_s=0.8, lead_s=0.3)
    return to_linear16_bytes(audio)


def _recognize(target: str, audio: bytes, out: dict[str, object]) -> None:
    """One stream: config, all the audio, half-close; records the finals and the status in `out`."""
    with grpc.insecure_channel(target) as channel:
        call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(
            iter([config_request(), asr_pb2.StreamingRecognizeRequest(audio_content=audio)]), timeout=120
        )
        responses: list[asr_pb2.StreamingRecognizeResponse] = []
        with contextlib.suppress(grpc.RpcError):  # the status is read from the call below
            responses.extend(call)
        out["finals"] = [r.alternatives[0].transcript for x in responses for r in x.results if r.is_final]
        out["code"], out["details"] = call.code(), call.details() or ""


@pytest.mark.slow
def test_hung_engine_turns_not_serving_and_exits_non_zero() -> None:
    timeout_s = 3.0
    # the warm-up is utterance 1: the first call's utterance hangs the scheduler thread for ever
    server = ServerProcess(
        *("--frontends", "1", "--engine-heartbeat-timeout", str(timeout_s)),
        *("--debug-hang-scheduler-after", "1"),
    ).wait_serving()
    try:
        statuses, watcher = watch_health(server.target)
        result: dict[str, object] = {}
        started = time.monotonic()
        _recognize(server.target, _speech(), result)
        assert server.wait(30) == 1, server.log()[-3000:]
        ended = time.monotonic() - started
        watcher.join(10)
        log = server.log()
        assert "the scheduler hangs" in log  # the seam fired: the engine process was alive but stuck
        assert "engine process hung" in log and "no progress" in log, log[-3000:]
        assert result["code"] == grpc.StatusCode.UNAVAILABLE, result
        assert "engine" in str(result["details"]), result
        assert statuses[0] == "SERVING" and "NOT_SERVING" in statuses[1:], statuses
        # found within the timeout plus the time for the utterance to reach the engine and the exit
        assert ended < timeout_s + 20, ended
    finally:
        server.stop()


@pytest.mark.slow
def test_slow_but_live_engine_is_not_taken_for_hung() -> None:
    """Each encoder pass is 2.5 s slower, with a 5 s heartbeat timeout: four calls 1.5 s apart (each
    arrives while the previous one's pass runs) keep work pending for about twice the timeout, but the
    loop keeps making progress, so the server serves them all and lives on."""
    server = ServerProcess(
        *("--frontends", "1", "--engine-heartbeat-timeout", "5"), *("--debug-slow-encoder-s", "2.5")
    ).wait_serving()
    try:
        audio = _speech()
        results: list[dict[str, object]] = [{}, {}, {}, {}]
        threads = [threading.Thread(target=_recognize, args=(server.target, audio, r)) for r in results]
        started = time.monotonic()
        for t in threads:
            t.start()
            time.sleep(1.5)  # separate encoder passes: each arrives while the previous one runs
        for t in threads:
            t.join(120)
        busy = time.monotonic() - started
        for r in results:
            assert r["code"] == grpc.StatusCode.OK, r
            assert "thank you for calling" in " ".join(r["finals"]).lower(), r  # type: ignore[arg-type]
        assert busy > 7, busy  # work stayed pending for longer than the 5 s timeout
        assert server.proc.poll() is None, server.log()[-3000:]
        assert server.health() == "SERVING"
        assert "engine process hung" not in server.log()
    finally:
        server.stop()
