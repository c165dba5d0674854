"""The scheduling policy: a pure function from a snapshot of the engine's state to a Plan.

No torch, no clock, no side effects. The scheduler (engine/scheduling/scheduler.py) takes a Snapshot of its
requests, asks `plan()` what to do, and turns the Plan into its SchedulerOutput (rows given, statuses
moved), which the core loop (engine/core.py) executes. As vLLM v1's `Scheduler.schedule()` returns a
SchedulerOutput that `EngineCore.step()` hands to the model runner; here the decisions are the ones an
encoder-decoder needs: which waiting utterances go into the next encoder pass, with how much
encoder context, and whether the decoding batch takes a step.

Priority classes (engine.parameters.Priority), served in this order:
  LIVE         a live call's final (and a speculative offer once its end would be confirmed);
  BEST_EFFORT  a live call's interim or speculative offer: a preview, or a final not yet confirmed;
  RECORDED     recorded audio (Recognize, HTTP uploads): takes only the capacity live work leaves.

Admission (`admit`, at submit): a LIVE final is refused only when `max_queue` LIVE finals are already
waiting for a row; BEST_EFFORT work only while it and the LIVE finals waiting stay below `max_queue`
(so it can never get a live final refused); RECORDED work has its own bound, `max_queue_recorded`.

Latency rules, in order:
  1. By class: LIVE, then BEST_EFFORT, then RECORDED. RECORDED work gets an encoder pass of its own
     only when no live request (LIVE or BEST_EFFORT) waits or decodes: it never pads a live request's
     pass, and its encoder work never holds up a live sequence's decoding. Its pass is cut to
     `recorded_encoder_budget_ms` of measured encoder time (at least one utterance), which bounds how
     long a live final arriving meanwhile waits; and it holds at most `config.recorded_rows` KV-cache
     rows, so the other rows stay free for live calls.
  2. Among LIVE finals that have waited less than MAX_REORDER_S, callers take turns (each caller's
     n-th waiting final goes in round n: one stream flushing many turns cannot push another call's
     final back), and within a round the shortest audio first: in a trimmed encoder pass every row
     pays for the longest one, so short finals sharing a pass with long ones wait for work that is
     not theirs. A final waiting longer goes by age, so no final starves.
     BEST_EFFORT work: speculative offers before interims, each oldest first; RECORDED oldest first.
  3. While sequences decode, every encoder pass holds all of them up: with
     `encoder_budget_while_decoding_ms`, a pass is cut to what the measured encoder cost says
     fits in that budget (at least one utterance, so waiting work always moves), and the rest
     waits one decode step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.constants import POSITIONS_PER_SECOND, SAMPLE_RATE
from engine.parameters import Priority

IDLE_POLL_S = 0.5  # nothing to do: how long the loop blocks on its inbox before looking again
MAX_REORDER_S = 1.0  # a final older than this is served by age, ahead of shorter newer ones


def encoder_positions(config: EngineConfig, full_audio_ctx: int, n_samples: int, full: bool = False) -> int:
    """Encoder positions for audio of n_samples: Whisper's 30 s (`full`, or --encoder-context full), or
    trimmed to the audio plus --trim-margin-s but never below --trim-floor-s, in whole seconds so that a
    handful of shapes repeat."""
    if full or config.encoder_context == "full":
        return full_audio_ctx
    seconds = max(math.ceil(n_samples / SAMPLE_RATE + config.trim_margin_s), math.ceil(config.trim_floor_s))
    return min(full_audio_ctx, seconds * POSITIONS_PER_SECOND)


@dataclass(frozen=True)
class Waiting:
    """A request waiting for an encoder pass, as the policy sees it."""

    id: str
    interim: bool
    submitted: float  # when the engine accepted it (monotonic s): opens the window, ages it
    samples: int  # audio this pass would encode (the current 30 s window)
    full_context: bool  # needs Whisper's whole 30 s (timestamps, a prompt, a fallback)
    cancelled: bool = False
    priority: Priority = Priority.LIVE  # its class as submitted (an interim is never LIVE)
    promote_at: float | None = None  # BEST_EFFORT until this instant, LIVE from then (a speculative offer)
    caller: str = ""  # whose work it is (a stream's id): live finals take turns by caller
    rows: int = 1  # KV-cache rows it takes: one per beam of a beam search

    def rank(self, now: float) -> Priority:
        """Its class now."""
        if self.interim and self.priority is Priority.LIVE:
            return Priority.BEST_EFFORT
        if self.priority is Priority.BEST_EFFORT and self.promote_at is not None and now >= self.promote_at:
            return Priority.LIVE
        return self.priority


@dataclass(frozen=True)
class Snapshot:
    now: float  # monotonic s
    waiting: tuple[Waiting, ...]
    decoding: int  # sequences holding a row that take the next decode step
    free_rows: int  # KV-cache rows free
    window_opened: float | None  # when the current micro-batching window opened (None: none open)
    encoder_s_per_position: float = 0.0  # measured cost of one padded encoder position (0: unknown)
    recorded_rows: int = 0  # KV-cache rows held by RECORDED requests
    live_rows: int = 0  # KV-cache rows held by the others (LIVE, BEST_EFFORT)


@dataclass(frozen=True)
class Admit:
    id: str
    audio_ctx: int  # encoder positions for this request's pass


@dataclass(frozen=True)
class Plan:
    drop: tuple[str, ...] = ()  # cancelled while waiting: leave without any work
    encode: tuple[Admit, ...] = ()  # ONE encoder pass, in this order (rows are given in this order)
    step: bool = False  # one decode step for every decoding sequence (after this plan's encode)
    window_opened: float | None = None  # the window still open after this plan (carry it over)
    window_waited_s: float | None = None  # the window this plan closes had been open this long


class Policy:
    def __init__(self, config: EngineConfig, audio_ctx_for: Callable[[int, bool], int]) -> None:
        """`audio_ctx_for(samples, full)`: encoder positions for audio of that many samples."""
        self.config = config
        self.audio_ctx_for = audio_ctx_for

    def admit(self, priority: Priority, queued: tuple[int, int, int]) -> str | None:
        """Whether a request of this class may join the queue, given how many of each class (LIVE,
        BEST_EFFORT, RECORDED) are waiting for a row: None if it may, else why not (naming the flag)."""
        live, best_effort, recorded = queued
        limit = self.config.max_queue
        if priority is Priority.LIVE:
            if live >= limit:
                return f"engine admission queue is full ({live} live finals waiting; --max-queue {limit})"
        elif priority is Priority.BEST_EFFORT:
            if live + best_effort >= limit:
                return (
                    f"no room for interims or speculative offers: {live} live finals and {best_effort} of "
                    f"them waiting (--max-queue {limit}); they are best effort"
                )
        elif recorded >= self.config.max_queue_recorded:
            return (
                f"recorded work is at its share of the engine queue ({recorded} recorded utterances "
                f"waiting; --max-queue-recorded {self.config.max_queue_recorded})"
            )
        return None

    def eligible(self, s: Snapshot) -> list[Waiting]:
        """The waiting requests that may go into the next encoder pass, in the order they go: the live
        ones (finals, offers, interims) if any wait; else, while no live request holds a row, recorded
        ones up to the rows recorded work may still take."""
        ordered = self.order([w for w in s.waiting if not w.cancelled], s.now)
        live = [w for w in ordered if w.rank(s.now) is not Priority.RECORDED]
        if live or s.live_rows:
            return live
        room = max(0, self.config.recorded_rows - s.recorded_rows)
        chosen = []
        for w in ordered:  # in order: a wide beam search at the head is not overtaken by narrower ones
            if w.rows > room:
                break
            chosen.append(w)
            room -= w.rows
        return chosen

    def idle_wait(self, s: Snapshot) -> float:
        """How long the loop may block on its inbox before planning: not at all while decoding;
        until the open window closes when something waits for a free row; else a slow poll."""
        if s.decoding:
            return 0.0
        ready = self.eligible(s)
        if ready and s.free_rows > 0:
            opened = min(w.submitted for w in ready)
            return max(0.0, opened + self.config.batch_window_ms / 1000 - s.now)
        return IDLE_POLL_S

    def order(self, waiting: list[Waiting], now: float) -> list[Waiting]:
        """Who goes first: by class; young live finals by turns of their callers (each caller's n-th
        waiting final in round n, so a caller that flushes many turns cannot push another call's final
        back), within a round shortest first; old ones by age; speculative offers before interims (an
        offer is a final not yet confirmed); otherwise oldest first."""
        turn: dict[str, int] = {}
        taken: dict[str, int] = {}
        for w in sorted(waiting, key=lambda w: w.submitted):
            if w.caller and w.rank(now) is Priority.LIVE:
                turn[w.id] = taken.get(w.caller, 0)
                taken[w.caller] = turn[w.id] + 1

        def key(w: Waiting) -> tuple[int, bool, int, float, float]:
            rank = w.rank(now)
            if rank is not Priority.LIVE:
                return (int(rank), w.interim, 0, w.submitted, 0.0)
            if now - w.submitted >= MAX_REORDER_S:
                return (int(rank), False, 0, w.submitted, w.submitted)
            return (int(rank), True, turn.get(w.id, 0), float(w.samples), w.submitted)

        return sorted(waiting, key=key)

    def plan(self, s: Snapshot) -> Plan:
        drop = tuple(w.id for w in s.waiting if w.cancelled)
        ready = self.eligible(s)
        step = s.decoding > 0
        if not ready or s.free_rows == 0:
            return Plan(drop=drop, step=step)  # waiting for a row is queueing, not a window
        opened = s.window_opened if s.window_opened is not None else s.now
        limit = min(self.config.max_batch, s.free_rows)
        bound = self.config.max_encoder_batch_while_decoding
        if s.decoding and bound > 0:
            limit = min(limit, bound)
        oldest = min(w.submitted for w in ready)
        if len(ready) < limit and s.now - oldest < self.config.batch_window_ms / 1000:
            return Plan(drop=drop, step=step, window_opened=opened)
        recorded = ready[0].rank(s.now) is Priority.RECORDED  # a pass is all live or all recorded
        chosen: list[Admit] = []
        widest = 0
        rows = s.free_rows
        for w in ready[:limit]:
            ctx = self.audio_ctx_for(w.samples, w.full_context)
            # Capacity is rows: a beam search takes one per beam. In order, so that a wide request at the
            # head waits for its rows rather than being overtaken for ever by narrower ones.
            if w.rows > rows:
                break
            if chosen and not self._fits(len(chosen) + 1, max(widest, ctx), s, recorded):
                break
            chosen.append(Admit(w.id, ctx))
            widest = max(widest, ctx)
            rows -= w.rows
        if not chosen:  # the head of the queue needs more rows than are free: queueing, as for a row
            return Plan(drop=drop, step=step)
        # The admitted sequences take their first step in the same turn as the others.
        return Plan(drop=drop, encode=tuple(chosen), step=True, window_waited_s=s.now - opened)

    def _fits(self, rows: int, widest_ctx: int, s: Snapshot, recorded: bool) -> bool:
        """Whether an encoder pass of `rows` rows padded to `widest_ctx` positions stays within its
        budgets: while sequences decode, the blocking budget; a recorded pass, its own (always, with no
        budget or no measurement yet)."""
        budgets = []
        if s.decoding and self.config.encoder_budget_while_decoding_ms > 0:
            budgets.append(self.config.encoder_budget_while_decoding_ms / 1000)
        if recorded and self.config.recorded_encoder_budget_ms > 0:
            budgets.append(self.config.recorded_encoder_budget_ms / 1000)
        if not budgets or s.encoder_s_per_position <= 0:
            return True
        return rows * widest_ctx * s.encoder_s_per_position <= min(budgets)
