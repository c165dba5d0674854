"""The per-stage failure isolation helper (engine/isolation.py) alone: plain items and functions, no model.
(On the real engine, stage by stage: tests/engine/test_failures.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY

from engine.hooks import EngineHooks
from engine.isolation import Stages, leaves_engine_unknown


@dataclass(eq=False)
class Item:
    id: str
    bad: bool = False


class Fatal(BaseException):
    pass


class Run:
    """A stage function that records its calls and raises when a bad item is in its batch."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.calls: list[list[str]] = []
        self.error = error

    def __call__(self, items: list[Item]) -> str:
        self.calls.append([i.id for i in items])
        if any(i.bad for i in items):
            raise self.error or ValueError(f"bad item in {[i.id for i in items]}")
        return "+".join(i.id for i in items)


def failures(stage: str) -> float:
    return REGISTRY.get_sample_value("asr_engine_failures_total", {"stage": stage}) or 0.0


def stages(hooks: EngineHooks | None = None) -> tuple[Stages[Item], list[tuple[str, str]]]:
    failed: list[tuple[str, str]] = []
    return Stages(hooks or EngineHooks(), lambda item, exc: failed.append((item.id, str(exc)))), failed


def items(*bad: int, n: int = 4) -> list[Item]:
    return [Item(f"i{k}", k in bad) for k in range(n)]


def ids(done: list[tuple[list[Item], str]]) -> list[list[str]]:
    return [[i.id for i in batch] for batch, _ in done]


def test_a_batch_that_succeeds_runs_once() -> None:
    s, failed = stages()
    run = Run()
    done = s.run("rules", items(), run)
    assert ids(done) == [["i0", "i1", "i2", "i3"]] and [r for _, r in done] == ["i0+i1+i2+i3"]
    assert run.calls == [["i0", "i1", "i2", "i3"]] and failed == []


@pytest.mark.parametrize("bad", [(0,), (2,), (3,), (1, 3)])
def test_a_failed_batch_is_run_again_request_by_request_and_only_the_culprits_fail(
    bad: tuple[int, ...],
) -> None:
    s, failed = stages()
    before = failures("encoder")
    batch = items(*bad)
    run = Run()
    done = s.run("encoder", batch, run)
    assert run.calls == [[i.id for i in batch]] + [[i.id] for i in batch]  # the batch, then each alone
    assert ids(done) == [[i.id] for i in batch if not i.bad]
    assert [result for _, result in done] == [i.id for i in batch if not i.bad]
    assert [rid for rid, _ in failed] == [f"i{k}" for k in bad]
    assert all("bad item in" in message for _, message in failed)  # each with its own run's error
    assert failures("encoder") - before == len(bad)


def test_a_single_request_is_not_run_twice() -> None:
    s, failed = stages()
    run = Run()
    assert s.run("prompt", [Item("x", bad=True)], run) == []
    assert run.calls == [["x"]] and [rid for rid, _ in failed] == ["x"]


def test_one_call_per_request_when_the_stage_runs_them_apart() -> None:
    s, failed = stages()
    run = Run()
    done = s.run("encoder", items(1), run, together=False)  # encoder batching off: the baseline loop
    assert run.calls == [["i0"], ["i1"], ["i2"], ["i3"]]
    assert [r for _, r in done] == ["i0", "i2", "i3"] and [rid for rid, _ in failed] == ["i1"]


def test_a_stage_that_cannot_run_a_request_alone_fails_the_whole_batch() -> None:
    s, failed = stages()
    before = failures("decode_step")
    run = Run()
    assert s.run("decode_step", items(2), run, alone=False) == []
    assert run.calls == [["i0", "i1", "i2", "i3"]]
    assert [rid for rid, _ in failed] == ["i0", "i1", "i2", "i3"]
    assert failures("decode_step") - before == 4


@pytest.mark.parametrize(
    "error", [Fatal("crash"), RuntimeError("CUDA error: an illegal memory access was encountered")]
)
def test_an_error_that_leaves_the_engine_unknown_is_never_caught(error: BaseException) -> None:
    assert leaves_engine_unknown(error)
    s, failed = stages()
    before = failures("rules")
    run = Run(error)
    with pytest.raises(type(error)):
        s.run("rules", items(1), run)
    assert run.calls == [["i0", "i1", "i2", "i3"]]  # not retried: nothing more runs on a suspect device
    assert failed == [] and failures("rules") == before
    with pytest.raises(type(error)):
        s.failed("rules", Item("x"), error)  # nor when a stage reports it itself
    assert failed == []


def test_ordinary_errors_stay_with_their_requests() -> None:
    assert not leaves_engine_unknown(ValueError("bad prompt"))
    assert not leaves_engine_unknown(RuntimeError("shape mismatch"))


def test_the_stage_hook_sees_every_call_and_can_inject_a_fault() -> None:
    seen: list[tuple[str, list[str]]] = []

    def hook(stage: str, batch: Sequence[object]) -> None:
        ids = [i.id for i in batch]  # type: ignore[attr-defined]
        seen.append((stage, ids))
        if "i2" in ids:
            raise ValueError("injected into i2")

    s, failed = stages(EngineHooks(stage=hook))
    run = Run()
    done = s.run("result", items(), run)
    assert seen == [("result", ["i0", "i1", "i2", "i3"]), *(("result", [f"i{k}"]) for k in range(4))]
    assert run.calls == [["i0"], ["i1"], ["i3"]]  # the hook's fault comes before the stage's work
    assert [r for _, r in done] == ["i0", "i1", "i3"] and failed == [("i2", "injected into i2")]


def test_a_seam_is_set_for_a_block_and_never_taken_from_another_test() -> None:
    hooks = EngineHooks()

    def fault(req: object) -> None:
        pass

    with hooks.installed(fault=fault):
        assert hooks.fault is fault and hooks.stage is None
        with pytest.raises(RuntimeError, match="already installed: fault"), hooks.installed(fault=fault):
            pass
        assert hooks.fault is fault  # the refused block took nothing away
    assert hooks.fault is None
