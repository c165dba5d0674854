"""A failure stays with one utterance (issue 10, scenarios 1 and 2), on the real bundled tiny.en in
process. Faults go in through the engine's own test seams (engine/hooks.py: `fault`, `stage`, `enqueue`,
`closing`), so each case happens exactly as named, never by timing."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine import Engine, EngineConfig, EngineStopped, Transcript
from engine.hooks import EngineHooks
from engine.scheduling.request import Request
from tests.support.audio import speak

SENTENCES = [
    "Thank you for calling.",
    "My order has not arrived.",
    "Please check my balance.",
    "I need a new password.",
    "Can I speak to a manager?",
]


class InjectedFault(Exception):
    pass


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    # Shortest first: the order the scheduling policy gives young finals in one encoder pass, so
    # that utterance i of a window is row i of its pass (the cases fail first, middle and last rows).
    return sorted((speak(s) for s in SENTENCES), key=len)


@pytest.fixture(scope="module")
def hooks() -> EngineHooks:
    return EngineHooks()


@pytest.fixture(scope="module")
def engine(hooks: EngineHooks) -> Iterator[Engine]:
    e = Engine(
        EngineConfig(model="tiny.en", threads=2, encoder_context="trim", kv_slots=8, warmup=False),
        hooks=hooks,
    )
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def alone(engine: Engine, clips: list[np.ndarray]) -> list[tuple[int, ...]]:
    """Each clip's tokens when it is the only utterance in the engine."""
    return [engine.submit(c).future.result(timeout=120).tokens for c in clips]


class Gate:
    """Holds the scheduler inside the encoder pass of a silent sentinel utterance while the test submits,
    so that everything submitted meanwhile is admitted in ONE window; records each encoder call's
    request ids; fails chosen requests at a chosen stage."""

    def __init__(self, engine: Engine, hooks: EngineHooks) -> None:
        self.hooks = hooks
        self.engine = engine
        self.held = threading.Event()
        self.release = threading.Event()
        self.encoder_calls: list[list[str]] = []
        self.fail_at: tuple[str, str] | None = None  # (stage, request id)

    def fault(self, req: Request) -> None:
        if req.id == "gate":
            self.held.set()
            assert self.release.wait(30), "gate never opened"
        if self.fail_at == ("encoder", req.id):
            raise InjectedFault(f"injected into the encoder pass of {req.id}")

    def stage(self, stage: str, reqs: list[Request]) -> None:
        if stage == "encoder":
            self.encoder_calls.append([r.id for r in reqs])
        for req in reqs:
            if self.fail_at == (stage, req.id) or (
                self.fail_at == (f"{stage} mid-decode", req.id) and len(req.generated) >= 3
            ):
                raise InjectedFault(f"injected into stage {stage} of {req.id}")

    def __enter__(self) -> Gate:
        self.installed = self.hooks.installed(fault=self.fault, stage=self.stage)
        self.installed.__enter__()
        self.engine.submit(np.zeros(8000, dtype=np.float32), request_id="gate")
        assert self.held.wait(30), "the scheduler never reached the gate"
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.installed.__exit__(None, None, None)


def failures(stage: str) -> float:
    return REGISTRY.get_sample_value("asr_engine_failures_total", {"stage": stage}) or 0.0


def run_window(
    engine: Engine, hooks: EngineHooks, clips: list[np.ndarray], n: int, bad: int, stage: str, tag: str
) -> tuple[list[Future[Transcript]], list[list[str]]]:
    ids = [f"{tag}-{i}" for i in range(n)]
    with Gate(engine, hooks) as gate:
        gate.fail_at = (stage, ids[bad])
        futures = [engine.submit(clips[i], request_id=ids[i]).future for i in range(n)]
        gate.release.set()
        for f in futures:  # wait for all before the hooks go
            f.exception(timeout=120)
    window = [call for call in gate.encoder_calls if ids[0] in call]
    assert window and window[0] == ids, (
        f"the {n} utterances did not share one encoder pass: {gate.encoder_calls}"
    )
    return futures, gate.encoder_calls


def assert_only_bad_failed(
    engine: Engine, futures: list[Future[Transcript]], bad: int, alone: list[tuple[int, ...]]
) -> None:
    with pytest.raises(InjectedFault):
        futures[bad].result()
    for i, f in enumerate(futures):
        if i != bad:
            assert f.result().tokens == alone[i], f"utterance {i} differs from its transcript alone"
    assert engine.alive
    stats = engine.stats()
    assert (stats["active"], stats["slots_used"], stats["waiting"]) == (0, 0, 0), stats


WINDOW_CASES = [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (5, 0), (5, 2), (5, 4)]


@pytest.mark.parametrize(("n", "bad"), WINDOW_CASES, ids=[f"window{n}-fail{b}" for n, b in WINDOW_CASES])
def test_an_encoder_failure_in_a_window_leaves_every_other_utterance_as_alone(
    engine: Engine,
    hooks: EngineHooks,
    clips: list[np.ndarray],
    alone: list[tuple[int, ...]],
    n: int,
    bad: int,
) -> None:
    before = failures("encoder")
    futures, _ = run_window(engine, hooks, clips, n, bad, "encoder", f"w{n}b{bad}")
    assert_only_bad_failed(engine, futures, bad, alone)
    assert failures("encoder") - before == 1


@pytest.mark.parametrize("stage", ["prompt", "rules", "rules mid-decode", "loop_check", "result"])
def test_an_error_outside_the_model_fails_that_utterance_only(
    engine: Engine, hooks: EngineHooks, clips: list[np.ndarray], alone: list[tuple[int, ...]], stage: str
) -> None:
    counted = stage.split()[0]  # "rules mid-decode": the rules stage, at a decode step (not at prefill)
    before = failures(counted)
    futures, _ = run_window(engine, hooks, clips, 3, 1, stage, f"stage-{stage.replace(' ', '-')}")
    assert_only_bad_failed(engine, futures, 1, alone)
    assert failures(counted) - before == 1
    # and the engine keeps serving
    assert engine.submit(clips[1]).future.result(timeout=120).tokens == alone[1]


def test_a_prefill_failure_in_a_window_is_found_alone_and_fails_that_utterance_only(
    engine: Engine, hooks: EngineHooks, clips: list[np.ndarray], alone: list[tuple[int, ...]]
) -> None:
    """The window's prefill fails; run again request by request, only the culprit fails."""
    before = failures("prefill")
    futures, _ = run_window(engine, hooks, clips, 3, 1, "prefill", "prefill")
    assert_only_bad_failed(engine, futures, 1, alone)
    assert failures("prefill") - before == 1


def test_a_failed_decode_step_fails_the_sequences_in_it_and_the_engine_goes_on(
    engine: Engine, hooks: EngineHooks, clips: list[np.ndarray], alone: list[tuple[int, ...]]
) -> None:
    """A decode step runs its rows together, so no sequence can take it alone: every sequence in the
    failed step fails (here all three of the window, each a few tokens in), nothing else does."""
    before = failures("decode_step")
    futures, _ = run_window(engine, hooks, clips, 3, 1, "decode_step mid-decode", "step")
    for f in futures:
        with pytest.raises(InjectedFault):
            f.result()
    assert failures("decode_step") - before == 3
    assert engine.alive
    stats = engine.stats()
    assert (stats["active"], stats["slots_used"], stats["waiting"]) == (0, 0, 0), stats
    assert engine.submit(clips[1]).future.result(timeout=120).tokens == alone[1]


def test_an_error_that_leaves_the_device_unknown_stops_the_engine(clips: list[np.ndarray]) -> None:
    died = threading.Event()

    def device_lost(stage: str, reqs: Sequence[Request]) -> None:
        if stage == "rules":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine = Engine(
        EngineConfig(model="tiny.en", threads=2, warmup=False), hooks=EngineHooks(stage=device_lost)
    )
    engine.start(on_failure=lambda exc: died.set())
    try:
        handle = engine.submit(clips[0])
        assert died.wait(60)
        with pytest.raises(EngineStopped):
            handle.future.result(timeout=10)
        assert not engine.alive
    finally:
        engine.stop()


def test_an_utterance_submitted_while_the_engine_stops_is_refused_never_left_waiting(
    clips: list[np.ndarray],
) -> None:
    hooks = EngineHooks()
    engine = Engine(EngineConfig(model="tiny.en", threads=2, warmup=False), hooks=hooks)
    engine.start()
    stopper = threading.Thread(target=engine.stop, kwargs={"timeout": 30})
    closing = threading.Event()
    hooks.closing = closing.set

    def stop_between_check_and_enqueue(req: Request) -> None:
        # The submit has passed its "is the engine running?" check: now the engine stops and its loop
        # drains the inbox. (With the fix, the drain waits for this submit to finish, so the join below
        # times out; without it, the loop ends first and the request is lost.)
        hooks.enqueue = None
        stopper.start()
        assert closing.wait(10), "the engine's loop never began to stop"
        stopper.join(2)  # engine.stop() joins the loop thread

    hooks.enqueue = stop_between_check_and_enqueue
    try:
        future = engine.submit(clips[0]).future
    except EngineStopped:
        future = None  # refused at submit: also a refusal
    stopper.join(30)
    if future is not None:
        with pytest.raises(EngineStopped):
            future.result(timeout=10)
    with pytest.raises(EngineStopped):
        engine.submit(clips[0])
