"""The scheduler (engine/scheduling/scheduler.py) alone: admission, KV-cache rows, the request lifecycle, cancels at
each status, fallback and next-window decisions, priority classes. No model, no torch, no thread: each
case builds a Scheduler, moves requests through it as the core loop would, and asserts its decisions.
(That the loop executes them on a real model: tests/engine/test_scheduler.py and test_failures.py.)"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import CancelledError, Future
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine.config import EngineConfig
from engine.errors import EngineOverloaded, EngineStopped
from engine.outputs import Transcript, UtteranceStats
from engine.parameters import DecodeOptions, Priority
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import Scheduler

EOT = 50256
FULL_CTX = 1500
SECOND = 16000
REPO = Path(__file__).resolve().parents[2]


class Vocab:
    eot = EOT


class Rules:
    """What the scheduler needs of the decoding rules (engine/scheduling/outcome.py TextRules): the end-of-text token,
    and text (here each token's number, so that repeats compress as text would)."""

    vocab = Vocab()

    def text(self, tokens: list[int]) -> str:
        return " ".join(str(t) for t in tokens if t < EOT)


def scheduler(**overrides: object) -> Scheduler:
    config = replace(EngineConfig(), **{"batch_window_ms": 0.0, "kv_slots": 4, **overrides})  # type: ignore[arg-type]
    return Scheduler(config, Rules(), FULL_CTX)


def request(rid: str, seconds: float = 2.0, **options: object) -> Request:
    return Request(
        id=rid,
        audio=np.zeros(int(seconds * SECOND), dtype=np.float32),
        options=DecodeOptions(**options),  # type: ignore[arg-type]
        future=Future(),
    )


def submitted(s: Scheduler, *reqs: Request) -> list[Request]:
    """Admitted and taken from the inbox, as EngineCore.submit and its loop do."""
    for r in reqs:
        s.admit(r)
        s.add(r)
    return list(reqs)


class Moves:
    """The cache's side of `settle`: the row copies it was asked for, in order."""

    def __init__(self) -> None:
        self.done: list[tuple[int, int]] = []

    def __call__(self, src: int, dst: int) -> None:
        self.done.append((src, dst))


def decoding(s: Scheduler, reqs: list[Request], prompt: int = 3) -> None:
    """Their encoder pass and prompt went through: they decode."""
    for r in reqs:
        r.prompt_tokens = list(range(prompt))
        s.token_budget(r)
    s.prefilled(reqs)


def took(req: Request, *tokens: int) -> None:
    """The sequence chose these tokens (as the rules' take would append them)."""
    for t in tokens:
        req.generated.append(t)
        req.sampled += 1


def transcript() -> Transcript:
    stats = UtteranceStats(audio_s=1.0, queue_wait_s=0.0, encoder_batch_size=1, decode_steps=1, latency_s=0.0)
    return Transcript("", (), 0.0, 0.0, "en", (), False, stats)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- no model, no torch ---


@pytest.mark.parametrize(
    ("module", "loads_torch"),
    [
        ("engine.scheduling.scheduler", False),
        ("engine.isolation", False),
        ("engine.hooks", False),
        # what a frontend process imports to reach the engine process (import-linter's
        # process-without-torch contract says the same of the import graph)
        ("engine.process.client", False),
        ("engine.process.core_process", False),
        ("engine.model.runner", True),
    ],
)
def test_the_scheduler_imports_no_torch(module: str, loads_torch: bool) -> None:
    """In a fresh interpreter: importing the scheduler (and the isolation helper and hooks it is tested
    with, and the engine process's modules) leaves torch unloaded; the runner, the control case, loads it."""
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == str(loads_torch)


# --- admission ---


def test_admission_counts_each_class_against_its_own_bound() -> None:
    s = scheduler(max_queue=2, max_queue_recorded=1)
    submitted(s, request("f1"), request("i1", interim=True))
    with pytest.raises(EngineOverloaded, match="best effort"):  # 1 final + 1 interim fill --max-queue 2
        s.admit(request("i2", interim=True))
    submitted(s, request("f2"))  # a live final still goes in: interims never count against it
    with pytest.raises(EngineOverloaded, match=r"2 live finals waiting; --max-queue 2"):
        s.admit(request("f3"))
    submitted(s, request("r1", priority=Priority.RECORDED))
    with pytest.raises(EngineOverloaded, match="--max-queue-recorded 1"):
        s.admit(request("r2", priority=Priority.RECORDED))
    stats = s.stats()
    assert (
        stats["queued"],
        stats["waiting_live"],
        stats["waiting_best_effort"],
        stats["waiting_recorded"],
    ) == (
        4,
        2,
        1,
        1,
    )


def test_a_request_withdrawn_before_the_inbox_frees_its_place() -> None:
    s = scheduler(max_queue=1)
    r = request("f1")
    s.admit(r)
    s.withdraw(r)  # e.g. the engine closed between admission and the inbox
    submitted(s, request("f2"))
    assert s.stats()["queued"] == 1


# --- rows ---


def test_an_encoder_batch_takes_consecutive_rows_and_leaves_the_queue_count() -> None:
    s = scheduler()
    a, *_ = submitted(s, request("a", 1.0), request("b", 2.0), request("c", 3.0))
    out = s.schedule(now=a.submitted + 1.0)
    assert [r.id for r in out.encode] == ["a", "b", "c"]  # shortest first
    assert [r.row for r in out.encode] == [0, 1, 2]
    assert all(r.status is RequestStatus.ENCODING for r in out.encode)
    assert not out.blocked and out.step
    stats = s.stats()
    assert (stats["queued"], stats["waiting"], stats["slots_used"], stats["slots_free"]) == (0, 0, 3, 1)
    assert [r.audio_ctx for r in out.encode] == [500] * 3  # trimmed, to the 10 s floor (50 positions/s)


def test_no_more_rows_than_slots_and_a_pass_planned_while_others_decode_is_blocking() -> None:
    s = scheduler(kv_slots=2)
    reqs = submitted(s, *(request(f"u{i}") for i in range(3)))
    first = s.schedule(now=reqs[0].submitted + 1.0)
    assert len(first.encode) == 2 and not first.blocked
    decoding(s, list(first.encode))
    assert s.schedule(now=reqs[0].submitted + 1.0).encode == ()  # no row free: it waits
    took(reqs[0], EOT)
    ended = s.ended([reqs[0]])
    s.close_window(s.window_end(ended[0]))
    s.finish(reqs[0], transcript())
    s.settle(Moves())
    third = s.schedule(now=reqs[0].submitted + 1.0)
    assert [r.id for r in third.encode] == ["u2"] and third.blocked  # u1 still decodes


def test_a_row_freed_in_the_middle_is_filled_by_the_last_and_futures_resolve_after() -> None:
    s = scheduler()
    reqs = submitted(s, *(request(f"u{i}", 1.0 + i) for i in range(4)))
    s.schedule(now=reqs[0].submitted + 1.0)
    decoding(s, reqs)
    seen_free: list[int] = []
    reqs[1].future.add_done_callback(lambda f: seen_free.append(s.stats()["slots_free"]))
    s.fail(reqs[1], RuntimeError("bad"))
    assert reqs[1].status is RequestStatus.FAILED and not reqs[1].future.done()  # rows do not move mid-stage
    assert [r.row for r in reqs] == [0, 1, 2, 3]
    moves = Moves()
    s.settle(moves)
    assert moves.done == [(3, 1)]  # the last row moves into the gap: the cache copies it
    assert [r.row for r in reqs] == [0, None, 2, 1]
    assert [r.id for r in s.decoding] == ["u0", "u3", "u2"]  # rows 0..n-1, in row order
    assert seen_free == [1]  # the future resolved once the row was free
    with pytest.raises(RuntimeError, match="bad"):
        reqs[1].future.result()


def test_several_rows_freed_at_once_move_highest_first() -> None:
    s = scheduler(kv_slots=6)
    reqs = submitted(s, *(request(f"u{i}", 1.0 + i) for i in range(6)))
    s.schedule(now=reqs[0].submitted + 1.0)
    decoding(s, reqs)
    for i in (1, 2, 5):
        s.fail(reqs[i], RuntimeError("bad"))
    moves = Moves()
    s.settle(moves)
    # u5 (the last) just goes; u2's row takes u4, u1's takes u3: every copy reads a row that stays
    assert moves.done == [(4, 2), (3, 1)]
    assert [r.id for r in s.decoding] == ["u0", "u3", "u4"]


def test_a_decode_step_over_unsettled_rows_is_refused() -> None:
    s = scheduler()
    reqs = submitted(s, request("a"), request("b"))
    s.schedule(now=reqs[0].submitted + 1.0)
    decoding(s, reqs)
    s.fail(reqs[0], RuntimeError("bad"))
    with pytest.raises(RuntimeError, match="settle first"):
        s.decoding  # noqa: B018 - the property is the check
    s.settle(Moves())
    assert s.decoding == [reqs[1]]


# --- lifecycle and window decisions ---


def test_a_window_that_ends_in_end_of_text_is_published_and_its_row_given_back() -> None:
    s = scheduler()
    (r,) = submitted(s, request("a", 2.0))
    s.schedule(now=r.submitted + 1.0)
    decoding(s, [r])
    assert r.status is RequestStatus.DECODING and r.length == 3
    assert r.max_new == 16 + 12 * 2  # a trimmed window's budget: 16 + 12 tokens per second of audio
    took(r, 11, 12)
    assert s.ended([r]) == []
    took(r, EOT)
    (ended,) = s.ended([r])
    end = s.window_end(ended)
    assert end.action == "publish"
    s.close_window(end)
    assert r.window_tokens == [[11, 12]]
    result = transcript()
    s.finish(r, result)
    assert r.status is RequestStatus.FINISHED and not r.future.done()
    s.settle(Moves())
    assert r.future.result() is result and s.stats()["slots_used"] == 0


def test_audio_past_30_s_goes_on_to_its_next_window() -> None:
    s = scheduler()
    (r,) = submitted(s, request("long", 35.0))
    s.schedule(now=r.submitted + 1.0)
    decoding(s, [r])
    took(r, 11, 12, EOT)
    end = s.window_end(s.ended([r])[0])
    assert end.action == "next_window"
    s.close_window(end)
    assert (r.status, r.window, r.generated, r.window_tokens) == (RequestStatus.WAITING, 1, [], [[11, 12]])
    s.settle(Moves())
    assert r.row is None and s.stats()["waiting"] == 1
    again = s.schedule(now=r.submitted + 2.0)
    assert again.encode == (r,) and len(r.window_audio()) == 5 * SECOND
    assert r.encoder_batch_size == 1 and s.stats()["queued"] == 0  # counted once, at its first admission


@pytest.mark.parametrize(
    ("tokens", "reason"),
    [
        ((11, 12, 13, 14, 11, 12, 13, 14), "repeat"),
        ((11,) * 3, "no_eot"),
        ((1, 2, 3, 4, 5) * 10 + (99, EOT), "compression"),
    ],
)
def test_a_trimmed_window_that_loops_falls_back_to_the_full_context(
    tokens: tuple[int, ...], reason: str
) -> None:
    s = scheduler()
    (r,) = submitted(s, request("a", 2.0))
    s.schedule(now=r.submitted + 1.0)
    decoding(s, [r])
    r.max_new = len(tokens) if reason == "no_eot" else r.max_new  # its budget spent without end of text
    before = sample("asr_encoder_fallbacks_total", reason=reason)
    took(r, *tokens)
    (ended,) = s.ended([r])
    end = s.window_end(ended)
    assert (end.action, end.reason) == ("fallback", reason)
    s.close_window(end)
    assert sample("asr_encoder_fallbacks_total", reason=reason) - before == 1
    assert (r.status, r.full_context, r.generated, r.sampled, r.window_tokens) == (
        RequestStatus.WAITING,
        True,
        [],
        0,
        [],
    )
    s.settle(Moves())
    again = s.schedule(now=r.submitted + 2.0)
    assert again.encode == (r,) and r.audio_ctx == FULL_CTX


def test_a_full_context_window_never_falls_back() -> None:
    s = scheduler(encoder_context="full")
    (r,) = submitted(s, request("a", 2.0))
    s.schedule(now=r.submitted + 1.0)
    decoding(s, [r])
    took(r, *([11, 12, 13, 14] * 2))
    assert s.ended([r]) == []  # a full-context decode is Whisper's own: a repeat does not end it
    took(r, EOT)
    assert s.window_end(s.ended([r])[0]).action == "publish"


# --- cancel at each status ---


def test_cancel_while_waiting_resolves_at_once_and_frees_its_queue_place() -> None:
    s = scheduler(max_queue=1)
    (r,) = submitted(s, request("a"))
    before = sample("asr_engine_requests_total", kind="final", outcome="cancelled")
    s.cancel("a")
    assert r.status is RequestStatus.CANCELLED and r.future.cancelled()
    assert s.stats()["waiting"] == 0 and s.stats()["queued"] == 0
    submitted(s, request("b"))  # its place in --max-queue is free again
    assert sample("asr_engine_requests_total", kind="final", outcome="cancelled") - before == 1


def test_a_future_cancelled_by_its_caller_leaves_the_queue_unencoded() -> None:
    s = scheduler()
    a, _ = submitted(s, request("a"), request("b"))
    a.future.cancel()
    out = s.schedule(now=a.submitted + 1.0)
    assert [r.id for r in out.encode] == ["b"] and a.status is RequestStatus.CANCELLED


@pytest.mark.parametrize("status", [RequestStatus.ENCODING, RequestStatus.DECODING])
def test_cancel_while_holding_a_row_frees_it_at_the_next_settle(status: RequestStatus) -> None:
    s = scheduler()
    a, b = submitted(s, request("a", 1.0), request("b", 2.0))
    s.schedule(now=a.submitted + 1.0)
    if status is RequestStatus.DECODING:
        decoding(s, [a, b])
    assert a.status is status
    s.cancel("a")
    assert a.status is RequestStatus.CANCELLED and not a.future.done()
    moves = Moves()
    s.settle(moves)
    assert moves.done == [(1, 0)] and b.row == 0
    with pytest.raises(CancelledError):
        a.future.result()
    assert s.stats()["slots_used"] == 1


def test_a_caller_cancelling_mid_decode_is_noticed_when_its_token_comes() -> None:
    s = scheduler()
    (r,) = submitted(s, request("a"))
    s.schedule(now=r.submitted + 1.0)
    decoding(s, [r])
    r.future.cancel()
    took(r, 11)
    assert s.ended([r]) == [] and r.status is RequestStatus.CANCELLED
    s.settle(Moves())
    assert s.stats()["slots_used"] == 0


def test_cancel_after_the_result_changes_nothing() -> None:
    s = scheduler()
    (r,) = submitted(s, request("a"))
    s.schedule(now=r.submitted + 1.0)
    decoding(s, [r])
    took(r, 11, EOT)
    s.close_window(s.window_end(s.ended([r])[0]))
    result = transcript()
    s.finish(r, result)
    s.settle(Moves())
    s.cancel("a")
    s.fail(r, RuntimeError("late"))
    assert r.status is RequestStatus.FINISHED and r.future.result() is result


def test_cancel_of_a_request_waiting_for_its_next_window() -> None:
    s = scheduler()
    (r,) = submitted(s, request("long", 35.0))
    s.schedule(now=r.submitted + 1.0)
    decoding(s, [r])
    took(r, 11, EOT)
    s.close_window(s.window_end(s.ended([r])[0]))  # back in the queue, its row not yet given back
    s.cancel("long")
    s.settle(Moves())
    assert r.future.cancelled() and s.stats()["waiting"] == 0 and s.stats()["slots_used"] == 0


def test_stopping_fails_everything_still_here() -> None:
    s = scheduler()
    reqs = submitted(s, request("a"), request("b"), request("c"))
    s.schedule(now=reqs[0].submitted + 1.0)  # all three hold rows
    late = submitted(s, request("d"))[0]
    s.fail_all(EngineStopped("the engine stopped"))
    for r in [*reqs, late]:
        with pytest.raises(EngineStopped):
            r.future.result(timeout=0)
    assert s.stats()["slots_used"] == 0 and s.stats()["waiting"] == 0


# --- priority classes ---


def test_live_finals_then_best_effort_then_recorded_and_recorded_rows_are_capped() -> None:
    s = scheduler(kv_slots=8, max_recorded_rows=2, max_batch=8)
    rec = submitted(s, *(request(f"rec{i}", priority=Priority.RECORDED) for i in range(4)))
    interim = submitted(s, request("interim", interim=True))[0]
    final = submitted(s, request("final"))[0]
    out = s.schedule(now=final.submitted + 1.0)
    assert [r.id for r in out.encode] == ["final", "interim"]  # a pass is all live or all recorded
    assert (final.priority, interim.priority) == (Priority.LIVE, Priority.BEST_EFFORT)
    decoding(s, list(out.encode))
    assert s.schedule(now=final.submitted + 1.0).encode == ()  # live work decodes: recorded waits
    for r in (final, interim):
        took(r, 11, EOT)
        s.close_window(s.window_end(s.ended([r])[0]))
        s.finish(r, transcript())
    s.settle(Moves())
    out = s.schedule(now=final.submitted + 1.0)
    assert [r.id for r in out.encode] == ["rec0", "rec1"]  # at most --max-recorded-rows
    assert s.stats()["rows_recorded"] == 2 and rec[2].status is RequestStatus.WAITING


def test_live_finals_take_turns_by_the_caller_their_options_name() -> None:
    """The scheduler hands each request's caller (DecodeOptions.caller, a stream's id) to the policy,
    which serves callers' finals in turns: one caller's flood of short finals does not go ahead of
    another caller's one longer final."""
    s = scheduler(kv_slots=8, max_batch=2, batch_window_ms=0.0)
    flood = submitted(s, *(request(f"flood{i}", 0.4, caller="s-flood") for i in range(4)))
    good = submitted(s, request("good", 4.0, caller="s-good"))[0]
    out = s.schedule(now=good.submitted + 0.1)
    assert [r.id for r in out.encode] == [flood[0].id, "good"]


def test_a_beam_search_holds_a_row_per_beam_and_its_rows_are_refilled_beam_by_beam() -> None:
    """Capacity counts rows (issue 29): a 3-beam request takes three; a greedy request that leaves is
    filled by the last row, which may be one beam of the search (whose beam keeps its place in `rows`)."""
    s = scheduler(kv_slots=6)
    a, b, c = submitted(s, request("a", 1.0), request("b", 2.0, beam_size=3), request("c", 3.0))
    out = s.schedule(now=c.submitted + 1.0)
    assert [r.id for r in out.encode] == ["a", "b", "c"]
    assert (a.rows, b.rows, c.rows) == ([0], [1, 2, 3], [4])
    assert s.stats()["slots_used"] == 5
    decoding(s, [a, b, c])
    s.fail(a, RuntimeError("gone"))
    moves = Moves()
    s.settle(moves)
    assert moves.done == [(4, 0)] and c.rows == [0] and b.rows == [1, 2, 3]
    s.fail(c, RuntimeError("gone"))
    s.settle(moves)
    assert moves.done[1:] == [(3, 0)] and b.rows == [1, 2, 0]  # beam 2 now decodes in row 0
    assert [r.id for r in s.decoding] == ["b"] and s.stats()["slots_used"] == 3


def test_a_beam_search_waits_in_its_turn_for_its_rows() -> None:
    s = scheduler(kv_slots=4)
    first, wide, small = submitted(
        s, request("first", 1.0), request("wide", 2.0, beam_size=4), request("small", 3.0)
    )
    out = s.schedule(now=small.submitted + 1.0)
    # "wide" needs 4 rows and 3 are left once "first" has one: it waits, and "small" behind it waits too
    assert out.encode == (first,) and first.rows == [0] and wide.row is None and small.row is None
