"""Scheduling behaviour on a small random-weight Whisper: the window, joins and leaves,
cancels, slots, overload, fault isolation. (Accuracy is tested on real weights elsewhere.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine import DecodeOptions, Engine, EngineConfig, EngineOverloaded
from engine.api import EngineStopped
from engine.hooks import EngineHooks
from engine.parameters import Priority
from tests.support.wait import wait_until

ONE_SECOND = np.zeros(16000, dtype=np.float32)


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def fallbacks() -> dict[str, float]:
    """asr_encoder_fallbacks_total by reason."""
    return {
        reason: REGISTRY.get_sample_value("asr_encoder_fallbacks_total", {"reason": reason}) or 0.0
        for reason in ("no_eot", "repeat", "compression")
    }


class Delta:
    """Change of a set of Prometheus samples across a block."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.before = {n: sample(n) for n in names}

    def __getitem__(self, name: str) -> float:
        return sample(name) - self.before[name]


@contextmanager
def running(model: Path, hooks: EngineHooks | None = None, **overrides: object) -> Iterator[Engine]:
    # Random weights fail Whisper's fallback thresholds at every temperature: scheduling tests decode each
    # window once (tests/engine/test_fallback.py asks for the fallback per request).
    config = EngineConfig(model=str(model), threads=2, warmup=False, encoder_context="trim", temperatures="0")
    for key, value in overrides.items():
        setattr(config, key, value)
    engine = Engine(config, hooks=hooks)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)


def test_utterances_ready_within_one_window_share_one_encoder_pass(random_model: Path) -> None:
    # When the window closes is the policy's (tests/engine/test_policy.py); that the loop runs
    # the plan's batch as ONE encoder pass is this test's.
    with running(random_model, batch_window_ms=400.0) as engine:
        d = Delta("asr_encoder_batch_size_count", "asr_encoder_batch_size_sum")
        handles = [engine.submit(noise(1 + i, i), DecodeOptions(max_new_tokens=4)) for i in range(4)]
        results = [h.future.result(timeout=60) for h in handles]
    assert (d["asr_encoder_batch_size_count"], d["asr_encoder_batch_size_sum"]) == (1, 4)
    assert all(r.stats.encoder_batch_size == 4 for r in results)


def test_batching_off_runs_one_encoder_call_per_utterance(random_model: Path) -> None:
    with running(random_model, batch_window_ms=400.0, encoder_batching=False) as engine:
        d = Delta("asr_encoder_batch_size_count", "asr_encoder_batch_size_sum", "asr_encoder_seconds_count")
        handles = [engine.submit(noise(1, i), DecodeOptions(max_new_tokens=4)) for i in range(4)]
        for h in handles:
            h.future.result(timeout=60)
    assert (d["asr_encoder_batch_size_count"], d["asr_encoder_batch_size_sum"]) == (4, 4)
    assert d["asr_encoder_seconds_count"] == 4


def test_sequences_join_mid_decode_and_tokens_equal_running_alone(random_model: Path) -> None:
    clips = [noise(2.0, 1), noise(1.3, 2), noise(3.1, 3)]
    options = DecodeOptions(max_new_tokens=40)
    with running(random_model, batch_window_ms=1.0) as engine:
        alone = [engine.submit(c, options).future.result(timeout=60).tokens for c in clips]
        d = Delta("asr_decode_batch_size_sum", "asr_decode_batch_size_count")
        first = engine.submit(clips[0], options)
        wait_until(lambda: engine.stats()["active"], 30, "the first utterance never started decoding")
        later = [engine.submit(c, options) for c in clips[1:]]
        together = [h.future.result(timeout=60).tokens for h in [first, *later]]
    assert together == alone
    assert d["asr_decode_batch_size_sum"] > d["asr_decode_batch_size_count"]  # some steps ran >1 sequence


def test_cancel_while_decoding_frees_the_slot_at_once(random_model: Path) -> None:
    with running(random_model, batch_window_ms=1.0, kv_slots=4, encoder_context="full") as engine:
        handle = engine.submit(noise(2, 0), DecodeOptions(max_new_tokens=200))
        wait_until(lambda: engine.stats()["active"], 30, "the utterance never started decoding")
        handle.cancel()
        with pytest.raises(CancelledError):
            handle.future.result(timeout=10)
        wait_until(
            lambda: not engine.stats()["slots_used"], 10, "the cancelled utterance's slot was not freed"
        )
        stats = engine.stats()
        assert (stats["waiting"], stats["active"], stats["slots_used"], stats["slots_free"]) == (0, 0, 0, 4)
        # The freed slot serves the next utterance.
        assert engine.submit(noise(1, 1), DecodeOptions(max_new_tokens=3)).future.result(timeout=30).tokens


def test_cancel_while_waiting_in_the_window(random_model: Path) -> None:
    with running(random_model, batch_window_ms=60_000.0) as engine:
        handle = engine.submit(noise(1, 0), DecodeOptions(max_new_tokens=3))
        handle.cancel()
        with pytest.raises(CancelledError):
            handle.future.result(timeout=10)
        time.sleep(0.05)
        assert engine.stats()["waiting"] == 0


def test_more_utterances_than_slots_all_finish_and_never_exceed_the_slots(random_model: Path) -> None:
    with running(random_model, batch_window_ms=5.0, kv_slots=2) as engine:
        d = Delta("asr_decode_batch_size_count")
        peak = 0
        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, engine.stats()["slots_used"])
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            handles = [engine.submit(noise(1, i), DecodeOptions(max_new_tokens=8)) for i in range(6)]
            results = [h.future.result(timeout=60) for h in handles]
        finally:  # a failed result must not leave the watcher spinning
            stop.set()
            watcher.join(10)
    assert len(results) == 6 and peak <= 2 and d["asr_decode_batch_size_count"] > 0


def test_admission_queue_bound_refuses_at_once(random_model: Path) -> None:
    with running(random_model, batch_window_ms=60_000.0, max_queue=2) as engine:
        engine.submit(noise(1, 0))
        engine.submit(noise(1, 1))
        with pytest.raises(EngineOverloaded, match="max-queue"):
            engine.submit(noise(1, 2))


def test_each_class_has_its_own_share_of_the_queue_and_live_finals_are_never_crowded_out(
    random_model: Path,
) -> None:
    """Interims and recorded work fill their shares; a live final still goes in, and is refused only when
    live finals alone fill --max-queue. Each refusal is counted by class."""
    recorded = DecodeOptions(priority=Priority.RECORDED)
    refused = {
        c: REGISTRY.get_sample_value("asr_engine_refused_total", {"class": c}) or 0.0
        for c in ("live", "best_effort", "recorded")
    }
    with running(random_model, batch_window_ms=60_000.0, max_queue=2, max_queue_recorded=2) as engine:
        engine.submit(noise(1, 0), recorded)
        engine.submit(noise(1, 1), recorded)
        with pytest.raises(EngineOverloaded, match="--max-queue-recorded 2"):
            engine.submit(noise(1, 2), recorded)
        engine.submit(noise(1, 3), DecodeOptions(interim=True))
        engine.submit(noise(1, 4), DecodeOptions())
        with pytest.raises(EngineOverloaded, match="best effort"):  # 1 live + 1 interim: no room for more
            engine.submit(noise(1, 5), DecodeOptions(interim=True))
        engine.submit(noise(1, 6), DecodeOptions())  # the second live final: the others never counted
        with pytest.raises(EngineOverloaded, match="2 live finals waiting"):
            engine.submit(noise(1, 7), DecodeOptions())
    after = {c: REGISTRY.get_sample_value("asr_engine_refused_total", {"class": c}) or 0.0 for c in refused}
    assert {c: after[c] - refused[c] for c in refused} == {"live": 1, "best_effort": 1, "recorded": 1}


def test_recorded_work_waits_for_live_work_and_keeps_rows_free_for_it(random_model: Path) -> None:
    """Twelve recorded utterances and, behind them, three live finals: the live ones go into the first
    encoder pass, and recorded work never holds more than --max-recorded-rows rows."""
    order: list[str] = []
    peak_recorded = 0
    hooks = EngineHooks()
    with running(
        random_model, hooks, batch_window_ms=300.0, kv_slots=8, max_recorded_rows=2, max_batch=8
    ) as engine:

        def seen(stage: str, reqs: Sequence[object]) -> None:
            nonlocal peak_recorded
            if stage == "encoder":
                order.extend(r.id for r in reqs)  # type: ignore[attr-defined]
                peak_recorded = max(peak_recorded, engine.stats()["rows_recorded"])

        hooks.stage = seen
        short = DecodeOptions(max_new_tokens=4)  # random weights never end early: the caller's limit does
        rec = DecodeOptions(max_new_tokens=4, priority=Priority.RECORDED)
        handles = [engine.submit(noise(1, i), rec, request_id=f"rec{i}") for i in range(12)]
        handles += [engine.submit(noise(1, 20 + i), short, request_id=f"live{i}") for i in range(3)]
        for h in handles:
            h.future.result(timeout=120)
    assert order[:3] == ["live0", "live1", "live2"], order
    assert order[3:5] == ["rec0", "rec1"], order  # the room live work left, within recorded's two rows
    assert sorted(order) == sorted(h.id for h in handles)  # each once: every one finished
    assert peak_recorded <= 2


def test_the_encoder_budget_splits_passes_only_while_sequences_decode(random_model: Path) -> None:
    # A budget no pass fits: while the long utterance decodes, the loop must run the policy's cut
    # (one utterance per pass, from the measured encoder cost); with nothing decoding, one pass.
    with running(
        random_model, batch_window_ms=200.0, encoder_context="full", encoder_budget_while_decoding_ms=0.001
    ) as engine:
        d = Delta("asr_encoder_batch_size_count", "asr_encoder_batch_size_sum")
        idle = [engine.submit(noise(1, i), DecodeOptions(max_new_tokens=3)) for i in range(3)]
        for h in idle:
            h.future.result(timeout=60)
        assert (d["asr_encoder_batch_size_count"], d["asr_encoder_batch_size_sum"]) == (1, 3)
        d = Delta("asr_encoder_batch_size_count", "asr_encoder_batch_size_sum")
        long = engine.submit(noise(2, 9), DecodeOptions(max_new_tokens=150))
        # admitted (its pass may still run): the rest join it
        wait_until(lambda: engine.stats()["active"], 30, "the long utterance was never admitted")
        joining = [engine.submit(noise(1, 10 + i), DecodeOptions(max_new_tokens=3)) for i in range(3)]
        results = [h.future.result(timeout=60) for h in joining]
        assert not long.future.done(), "the long utterance finished first: nothing was decoding"
        long.future.result(timeout=120)
    # the long one's own pass, then one pass per joining utterance
    assert (d["asr_encoder_batch_size_count"], d["asr_encoder_batch_size_sum"]) == (4, 4)
    assert [r.stats.encoder_batch_size for r in results] == [1, 1, 1]


def test_encoder_blocking_is_measured_only_while_sequences_decode(random_model: Path) -> None:
    names = ("asr_scheduler_blocked_seconds_count", "asr_scheduler_blocked_seconds_sum")
    with running(random_model, batch_window_ms=1.0, encoder_context="full") as engine:
        # pass 1: nothing else in the engine
        d = Delta(*names)
        engine.submit(noise(1, 0), DecodeOptions(max_new_tokens=3)).future.result(timeout=30)
        assert (d[names[0]], d[names[1]]) == (1, 0.0)
        # pass 2: the long one, admitted while nothing decodes (observed before its decode begins)
        d = Delta(*names)
        long = engine.submit(noise(2, 1), DecodeOptions(max_new_tokens=150))
        wait_until(lambda: d[names[0]] >= 1, 30, "the long utterance's encoder pass was never observed")
        assert (d[names[0]], d[names[1]]) == (1, 0.0)
        # pass 3: admitted while the long one decodes: it held the long one up
        d = Delta(*names)
        engine.submit(noise(1, 2), DecodeOptions(max_new_tokens=3)).future.result(timeout=30)
        assert not long.future.done(), (
            "the long utterance finished before the third pass: nothing was blocked"
        )
        assert d[names[0]] == 1 and d[names[1]] > 0.0
        long.future.result(timeout=60)


def test_busy_time_is_counted_by_stage_and_not_while_idle(random_model: Path) -> None:
    series = [(name, stage) for name in ("asr_engine_busy_seconds", "asr_engine_busy_cpu_seconds")
              for stage in ("encode", "decode")]  # fmt: skip

    def busy() -> dict[tuple[str, str], float]:
        return {(n, s): REGISTRY.get_sample_value(f"{n}_total", {"stage": s}) or 0.0 for n, s in series}

    with running(random_model, batch_window_ms=1.0) as engine:
        before = busy()
        engine.submit(noise(1, 0), DecodeOptions(max_new_tokens=8)).future.result(timeout=30)
        time.sleep(0.2)  # the result resolves inside the decode stage, which is counted as it ends
        worked = busy()
        assert all(worked[k] > before[k] for k in series), (before, worked)
        time.sleep(0.3)  # the loop wakes while idle (its heartbeat): that is not work
        assert busy() == worked


def test_a_failing_utterance_fails_alone_and_the_engine_keeps_serving(random_model: Path) -> None:
    def hook(req: object) -> None:
        if getattr(req, "id", "") == "bad":
            raise RuntimeError("injected fault")

    with running(random_model, EngineHooks(fault=hook), batch_window_ms=300.0) as engine:
        good = [engine.submit(noise(1, i), DecodeOptions(max_new_tokens=3)) for i in range(2)]
        bad = engine.submit(noise(1, 9), DecodeOptions(max_new_tokens=3), request_id="bad")
        with pytest.raises(RuntimeError, match="injected fault"):
            bad.future.result(timeout=30)
        assert all(h.future.result(timeout=30).tokens for h in good)
        assert engine.submit(noise(1, 3), DecodeOptions(max_new_tokens=3)).future.result(timeout=30).tokens
        assert engine.stats()["slots_used"] == 0


class Fatal(BaseException):
    pass


def test_scheduler_death_is_reported_and_refuses_new_work(random_model: Path) -> None:
    died = threading.Event()
    with running(random_model, batch_window_ms=1.0) as engine:
        engine.stop()  # replace with one that reports failure
    config = EngineConfig(model=str(random_model), threads=2, encoder_context="trim")

    def hook(req: object) -> None:
        raise Fatal()

    engine = Engine(config, hooks=EngineHooks(fault=hook))
    engine.start(on_failure=lambda exc: died.set())
    handle = engine.submit(noise(1, 0))
    assert died.wait(30)
    with pytest.raises(EngineStopped):
        handle.future.result(timeout=10)
    assert not engine.alive
    with pytest.raises(EngineStopped):
        engine.submit(noise(1, 1))


def test_unknown_language_is_refused_naming_the_field(random_model: Path) -> None:
    with running(random_model) as engine, pytest.raises(ValueError, match="language_code"):
        engine.submit(ONE_SECOND, DecodeOptions(language="xx"))


def test_a_looping_trimmed_window_falls_back_to_the_full_context(random_model: Path) -> None:
    # Random weights never say end-of-text and repeat themselves: the trimmed pass stops at its
    # first repeated span (before its budget of 16 + 12 tokens per second of audio), and the window
    # is decoded again at 30 s, where nothing cuts it short.
    with running(random_model, batch_window_ms=1.0, max_tokens=96) as engine:
        d = Delta("asr_encoder_batch_size_count")
        before = fallbacks()
        result = engine.submit(noise(1, 0)).future.result(timeout=120)
        assert engine.stats()["slots_used"] == 0
    assert {reason: n - before[reason] for reason, n in fallbacks().items()} == {
        "no_eot": 0,
        "repeat": 1,
        "compression": 0,
    }
    assert d["asr_encoder_batch_size_count"] == 2  # the trimmed pass, then the full one
    assert len(result.tokens) > 16 + 12  # the full-context pass had the whole slot
