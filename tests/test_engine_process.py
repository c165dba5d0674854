"""The engine in its own process behind `EngineClient` (ZeroMQ IPC), against the in-process `Engine`:
same tokens for the same audio, the same exceptions, cancel and stats across the boundary, and a
client that learns at once when the engine process dies."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine import DecodeOptions, Engine, EngineConfig, EngineOverloaded
from engine.api import EngineStopped
from engine.client import EngineClient
from service.supervisor import engine_main, start_child, tell_to_stop
from tests.support.audio import make_conversation
from tests.support.engine import jfk_16k

pytestmark = pytest.mark.slow


class EngineProcess:
    """engine.core_process in a spawned child, as asr-server starts it."""

    def __init__(self, config: EngineConfig) -> None:
        self.dir = tempfile.mkdtemp(prefix="asr-engine-test-")
        self.address = f"ipc://{Path(self.dir) / 'engine.sock'}"
        ctx = multiprocessing.get_context("spawn")
        ready, child_end = ctx.Pipe(duplex=False)
        self.proc: BaseProcess = ctx.Process(
            target=engine_main, args=(config, self.address, child_end, os.getpid(), "warning", "text")
        )
        start_child(self.proc)
        child_end.close()
        assert ready.poll(180), "the engine process never reported"
        message = ready.recv()
        assert message[0] == "ready", message

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
    assert client.stats() == {"waiting": 0, "active": 0, "slots_used": 0, "slots_free": 32}


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

        pending = [client.submit(jfk_16k()) for _ in range(3)]
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
