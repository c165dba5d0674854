"""The scheduler: every decision about requests, and no model (vLLM v1's Scheduler).

It holds the requests and their lifecycle, the scheduling policy (engine/scheduling/policy.py, pure) and the
KV-cache rows: which request holds which row is decided here; the runner's cache (engine/model/kv_cache.py)
only stores what the rows hold, and copies a row when this scheduler moves it. The core loop
(engine/core.py) asks it for a SchedulerOutput, has the model runner execute it, and tells it what
came out; the scheduler decides what that means (a window ended, looped, goes on to its next 30 s, a
request finished, failed or was cancelled).

Lifecycle (engine/scheduling/request.py RequestStatus), every transition made here:

    WAITING --schedule--> ENCODING --prefilled--> DECODING --window_end--> FINISHED
                                                      |--> WAITING (next 30 s window, or full-context fallback)
                                                      |--> ENCODING (temperature fallback: same rows, prefill again)
    any status but FINISHED --> CANCELLED (cancel) or FAILED (fail)

Rows are dense: the requests that hold one are rows 0..n-1 (a decode step reads the cache through
plain slices). Capacity is counted in rows: a beam search holds one row per beam (Request.width), its
beams' rows need not be adjacent, and it waits in its turn until that many are free (engine/scheduling/policy.py). A request that leaves gives its row back at the next `settle`, which moves the last row
into the gap (the cache copies it) and only then resolves the futures of the requests that left: a
caller who sees a result sees its row free. Between settles rows never move, so the core can index a
step's outputs by position while it works through them.

Imports neither torch nor a model (tests/engine/test_scheduler_unit.py checks it in a subprocess).
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np

from engine import metrics as m
from engine.config import EngineConfig
from engine.constants import SAMPLE_RATE
from engine.errors import EngineOverloaded
from engine.outputs import Transcript
from engine.parameters import Priority
from engine.scheduling import outcome
from engine.scheduling.policy import Policy, Snapshot, Waiting, encoder_positions
from engine.scheduling.request import Attempt, Request, RequestStatus

TRIMMED_TOKENS_PER_SECOND = 12
TRIMMED_TOKENS_MIN = 16
ENCODER_COST_SMOOTHING = 0.3  # weight of the newest encoder pass in the per-position cost estimate

Move = tuple[int, int]  # (row that moves, row it moves into)


@dataclass(frozen=True)
class SchedulerOutput:
    """What the core executes this turn."""

    encode: tuple[Request, ...] = ()  # ONE encoder pass, each holding its row (ENCODING), in row order
    step: bool = False  # one decode step for every decoding sequence (after this output's encode)
    blocked: bool = False  # sequences held rows when the pass was planned: it holds them up


@dataclass(frozen=True)
class WindowEnd:
    """What a finished window leads to."""

    request: Request
    action: Literal["publish", "next_window", "fallback", "retry", "resample"]
    reason: outcome.LoopReason | None = None  # why a fallback: the trimmed window looped
    failure: outcome.TemperatureFailure | None = None  # why a retry at the next temperature
    # The decode the window keeps (the best of a temperature's samples, or when every temperature
    # failed, outcome.best_attempt); a retry's: the failed decode it sets aside.
    keep: Attempt | None = None


def sampling_rng(req: Request) -> np.random.Generator | None:
    """The request's own generator for this window at this temperature (None at 0: nothing is drawn):
    seeded by its seed (or its window's audio), the window and the temperature's place in the schedule,
    so its samples depend on nothing else: not its batch, not what was drawn before. Its own best_of
    samples each get their own."""
    if req.temperature == 0:
        return None
    seed = req.options.seed
    if seed is None:
        seed = zlib.crc32(np.ascontiguousarray(req.window_audio()).data)
    return np.random.default_rng((seed, req.window, req.attempt, len(req.samples)))


class KVRows:
    """Which request holds which KV-cache row: held[i] holds row i, always rows 0..n-1. A beam search
    holds one row per beam (Request.width), so a request may appear more than once."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.held: list[Request] = []

    @property
    def used(self) -> int:
        return len(self.held)

    @property
    def free(self) -> int:
        return self.slots - len(self.held)

    def take(self, reqs: Sequence[Request]) -> None:
        """Give `reqs` the rows at the end of the dense block, in order (Request.width rows each)."""
        need = sum(r.width for r in reqs)
        if need > self.free:
            raise RuntimeError(f"KV cache: asked for {need} rows, {self.free} free")
        for req in reqs:
            start = len(self.held)
            req.rows = list(range(start, start + req.width))
            self.held.extend([req] * req.width)

    def release(self, leaving: Iterable[Request]) -> list[Move]:
        """Free these requests' rows, highest first, so that each move takes a row that stays. Returns
        the moves (the last row into the freed one), in the order the cache must copy them."""
        moves = []
        reqs = list(dict.fromkeys(leaving))
        for row in sorted((row for r in reqs for row in r.rows), reverse=True):
            last = self.held.pop()
            end = len(self.held)  # the row `last` held
            if end != row:
                self.held[row] = last
                last.rows[last.rows.index(end)] = row
                moves.append((end, row))
        for req in reqs:
            req.rows = []
        return moves


class Scheduler:
    """`rules`: the end-of-text token and the text of tokens (engine/scheduling/outcome.py TextRules), what the
    loop checks need; `full_audio_ctx`: the model's encoder positions (Whisper's 30 s)."""

    def __init__(self, config: EngineConfig, rules: outcome.TextRules, full_audio_ctx: int) -> None:
        self.config = config
        self.rules = rules
        self.full_audio_ctx = full_audio_ctx
        self.policy = Policy(config, partial(encoder_positions, config, full_audio_ctx))
        self.rows = KVRows(config.kv_slots)
        self.waiting: list[Request] = []  # WAITING, in arrival order (the policy orders them)
        # Submitted, not yet in a row, per class (indexed by Priority): what admission counts.
        self._queued = [0] * len(Priority)
        self._lock = threading.Lock()  # _queued: submitters count, the loop thread uncounts
        # Requests that left while holding a row, with how their future resolves: at the next settle.
        self._leaving: list[tuple[Request, Callable[[], object]]] = []
        # When the current window opened: the first moment an utterance waited with a row free
        # (time spent waiting for a row is queueing, measured by asr_queue_wait_seconds).
        self._window_opened: float | None = None
        # Measured wall time of one padded encoder position (s; smoothed): what the policy uses to
        # keep an encoder pass within its budgets. 0 until the first pass.
        self.encoder_s_per_position = 0.0

    # --- any thread ---
    def admit(self, req: Request) -> None:
        """Count `req` into the queue of its class, or raise EngineOverloaded naming the bound."""
        req.priority = req.options.work_class
        with self._lock:
            refusal = self.policy.admit(req.priority, (self._queued[0], self._queued[1], self._queued[2]))
            if refusal is not None:
                m.ENGINE_REFUSED.labels(req.priority.label).inc()
                raise EngineOverloaded(refusal)
            self._queued[req.priority] += 1
        req.submitted = time.monotonic()

    def withdraw(self, req: Request) -> None:
        """Uncount a request admitted that never reached the loop."""
        with self._lock:
            self._queued[req.priority] -= 1

    def stats(self) -> dict[str, int]:
        """waiting, active (= slots_used), slots_used, slots_free; queued (admitted, not yet in a row, what
        the admission bounds count); and per class (live, best_effort, recorded) waiting_<class> and
        rows_<class>."""
        held, waiting = list(self.rows.held), list(self.waiting)
        with self._lock:
            queued = sum(self._queued)
        stats = {
            "waiting": len(waiting),
            "active": len(held),
            "slots_used": len(held),
            "slots_free": self.rows.slots - len(held),
            "queued": queued,
        }
        for p in Priority:
            stats[f"waiting_{p.label}"] = sum(1 for r in waiting if r.priority is p)
            stats[f"rows_{p.label}"] = sum(1 for r in held if r.priority is p)
        return stats

    # --- the loop thread: arrivals and schedules ---
    def add(self, req: Request) -> None:
        """A request from the inbox joins the waiting queue."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def snapshot(self, now: float) -> Snapshot:
        """What the policy decides from: no tensors, no references it could change."""
        held = self.rows.held
        recorded_rows = sum(1 for r in held if r.priority is Priority.RECORDED)
        return Snapshot(
            now=now,
            waiting=tuple(
                Waiting(
                    id=r.id,
                    interim=r.options.interim,
                    submitted=r.submitted,
                    samples=len(r.window_audio()),
                    # Timestamps and prompts lean on Whisper's 30 s framing: trimmed, timestamps looped
                    # and a prompt's spellings were lost on tiny.en; they keep the full context.
                    full_context=r.full_context or r.options.timestamps or bool(r.options.prompt),
                    cancelled=r.future.cancelled(),
                    priority=r.priority,
                    promote_at=r.options.promote_at,
                    caller=r.options.caller,
                    rows=r.width,
                )
                for r in self.waiting
            ),
            decoding=sum(1 for r in dict.fromkeys(held) if r.status is RequestStatus.DECODING),
            free_rows=self.rows.free,
            window_opened=self._window_opened,
            encoder_s_per_position=self.encoder_s_per_position,
            recorded_rows=recorded_rows,
            live_rows=len(held) - recorded_rows,
        )

    def idle_wait(self, now: float) -> float:
        """How long the loop may block on its inbox before the next schedule."""
        return self.policy.idle_wait(self.snapshot(now))

    def schedule(self, now: float) -> SchedulerOutput:
        """The policy's plan for this turn, made real: cancelled waiting requests leave, the encoder
        batch takes its rows (ENCODING)."""
        plan = self.policy.plan(self.snapshot(now))
        for request_id in plan.drop:
            self.cancel(request_id)
        self._window_opened = plan.window_opened
        if plan.window_waited_s is not None:
            m.WINDOW_WAIT_SECONDS.observe(plan.window_waited_s)
        if not plan.encode:
            return SchedulerOutput(step=plan.step)
        blocked = self.rows.used > 0
        batch = [self._take_waiting(admit.id) for admit in plan.encode]
        self.rows.take(batch)
        for req, admit in zip(batch, plan.encode, strict=True):
            req.status = RequestStatus.ENCODING
            req.audio_ctx = admit.audio_ctx
            req.window_start = (req.sum_logprob, req.sampled)
            if req.encode_start is None:  # first admission (not a later window or a fallback)
                req.encode_start = now
                req.encoder_batch_size = len(batch)
                m.QUEUE_WAIT_SECONDS.labels(req.priority.label).observe(now - req.ready_time)
                with self._lock:
                    self._queued[req.priority] -= 1
        return SchedulerOutput(encode=tuple(batch), step=plan.step, blocked=blocked)

    def _take_waiting(self, request_id: str) -> Request:
        for i, req in enumerate(self.waiting):
            if req.id == request_id:
                return self.waiting.pop(i)
        raise RuntimeError(f"the plan admits {request_id}, which is not waiting")

    # --- the loop thread: what came out of the model ---
    def observe_encoder(self, elapsed_s: float, reqs: Sequence[Request]) -> None:
        """An encoder pass over `reqs` took elapsed_s: every row of a pass is padded to its widest
        context, which is what the pass costs."""
        per_position = elapsed_s / (len(reqs) * max(r.audio_ctx for r in reqs))
        previous = self.encoder_s_per_position
        self.encoder_s_per_position = (
            per_position if previous == 0 else previous + ENCODER_COST_SMOOTHING * (per_position - previous)
        )

    def token_budget(self, req: Request) -> None:
        """The window's token budget (req.max_new), once its prompt is known: what the caller and the
        row allow; a trimmed window far beyond ~5 tokens/s of speech is looping, so it gets less."""
        max_tokens = self.config.max_tokens
        req.max_new = min(
            req.options.max_new_tokens or max_tokens,
            max_tokens - len(req.prompt_tokens) - len(req.forced) - 2,
        )
        if req.audio_ctx < self.full_audio_ctx:
            budget = TRIMMED_TOKENS_PER_SECOND * len(req.window_audio()) / SAMPLE_RATE
            req.max_new = min(req.max_new, TRIMMED_TOKENS_MIN + int(budget))

    def prefilled(self, reqs: Sequence[Request]) -> None:
        """Their prompts are in their rows: they decode from here."""
        for req in reqs:
            req.length = len(req.prompt_tokens)
            req.status = RequestStatus.DECODING

    @property
    def decoding(self) -> list[Request]:
        """The requests of the next decode step, in the order of their first rows; they hold rows 0..n-1
        (settled: every row decodes). Without beam searches, request i holds row i."""
        held = self.rows.held
        if any(r.status is not RequestStatus.DECODING for r in held):
            raise RuntimeError("a decode step over rows whose requests do not decode: settle first")
        return list(dict.fromkeys(held))

    def stepped(self, reqs: Sequence[Request]) -> None:
        """A decode step wrote one more token into each of their rows."""
        for req in reqs:
            req.length += 1
            req.decode_steps += 1

    def ended(self, reqs: Sequence[Request]) -> list[Request]:
        """Of the sequences that just took a token, those whose window is over (cancelled ones leave)."""
        eot, done = self.rules.vocab.eot, []
        for req in reqs:
            if req.status is not RequestStatus.DECODING:
                continue
            if req.future.cancelled():
                self._cancel(req)
            elif req.beams:  # a beam search still under way (engine/decoding/beam.py decides when it ends)
                continue
            elif req.window_done or outcome.window_ended(
                req, eot, self.config.max_tokens, self.full_audio_ctx
            ):
                done.append(req)
        return done

    def window_end(self, req: Request) -> WindowEnd:
        """What a finished window leads to (decides only: close_window acts). A trimmed window that looped
        is decoded again at 30 s; one that fails Whisper's thresholds is decoded again at the next
        temperature (in its rows, from its encoder output), and above 0 sampled best_of times, the
        likeliest sample standing for the temperature; audio past this window goes on to the next; else
        the request is done."""
        reason = outcome.loop_reason(req, self.rules, self.full_audio_ctx)
        if reason is not None:
            return WindowEnd(req, "fallback", reason)
        if req.temperature > 0 and len(req.samples) + 1 < self.config.best_of:
            return WindowEnd(req, "resample")  # another of this temperature's samples first
        decode = outcome.attempt(req, self.rules)
        if req.samples:
            decode = outcome.best_sample([*req.samples, decode])
        failure = outcome.failure_of(decode, req.no_speech_prob)
        keep = decode
        if failure is not None:
            if req.attempt + 1 < len(req.temperatures):
                return WindowEnd(req, "retry", failure=failure, keep=decode)
            if req.attempts:  # every temperature failed: the best of them
                keep = outcome.best_attempt([*req.attempts, decode])
        action: Literal["publish", "next_window"] = (
            "next_window" if req.window + 1 < req.windows else "publish"
        )
        return WindowEnd(req, action, keep=keep)

    def keep_attempt(self, end: WindowEnd) -> None:
        """Put the decode the window keeps back in place, before its words are aligned: the best of its
        temperature's samples, or when every temperature failed the best of them (an earlier decode)."""
        req, keep = end.request, end.keep
        if (
            end.action not in ("publish", "next_window")
            or keep is None
            or keep.generated == tuple(req.generated)
        ):
            return
        req.generated = list(keep.generated)
        req.sum_logprob = req.window_start[0] + keep.sum_logprob
        req.sampled = req.window_start[1] + keep.sampled
        req.attempt = req.temperatures.index(keep.temperature)

    def close_window(self, end: WindowEnd) -> None:
        """Act on a window's end: keep its tokens (unless it looped or is decoded again) and, for a
        fallback or the next window, send the request back to the queue (its row is given back at the
        next settle). Its age (from `submitted`) puts it ahead of younger finals. A retry keeps its rows
        and their encoder output: the core prompts and prefills it again (ENCODING)."""
        req = end.request
        if end.action in ("retry", "resample"):
            if end.action == "retry":
                assert end.failure is not None and end.keep is not None
                req.attempts.append(end.keep)
                req.samples = []
                req.attempt += 1
                m.TEMPERATURE_FALLBACKS.labels(f"{req.temperature:g}", end.failure).inc()
            else:
                req.samples.append(outcome.attempt(req, self.rules))
            req.sum_logprob, req.sampled = req.window_start
            req.generated = []
            req.beams, req.beam_finished, req.beam_bonus = [], {}, {}
            req.window_done = False
            req.rng = sampling_rng(req)
            req.status = RequestStatus.ENCODING
            return
        if end.action == "fallback":
            assert end.reason is not None
            m.ENCODER_FALLBACKS.labels(end.reason).inc()
            req.full_context = True
            req.sum_logprob, req.sampled = req.window_start
        else:
            req.window_tokens.append([t for t in req.generated if t != self.rules.vocab.eot])
            req.window_temperatures.append(req.temperature)
            if end.action == "publish":
                return
            req.window += 1
            req.full_context = False
        req.attempt, req.attempts, req.samples = 0, [], []
        req.rng = sampling_rng(req)
        req.generated = []
        req.window_done = False
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, transcript: Transcript) -> None:
        kind = "interim" if req.options.interim else "final"
        m.ENGINE_REQUESTS.labels(kind, "text" if transcript.is_speech else "empty").inc()
        m.ENGINE_AUDIO_SECONDS.labels(kind).inc(req.audio_s)
        self._leave(req, RequestStatus.FINISHED, partial(req.future.set_result, transcript))

    # --- leaving: cancel, failure, rows given back ---
    def cancel(self, request_id: str) -> None:
        """Cancel the request wherever it is (waiting, or holding a row); unknown ids are ignored (it
        finished, or was never here)."""
        for req in self.waiting:
            if req.id == request_id:
                self._cancel(req)
                return
        for req in dict.fromkeys(self.rows.held):
            if req.id == request_id and req.status.holds_row:
                self._cancel(req)
                return

    def _cancel(self, req: Request) -> None:
        kind = "interim" if req.options.interim else "final"
        m.ENGINE_REQUESTS.labels(kind, "cancelled").inc()
        self._leave(req, RequestStatus.CANCELLED, req.future.cancel)

    def fail(self, req: Request, exc: BaseException) -> None:
        if req.status.done:
            return
        kind = "interim" if req.options.interim else "final"
        m.ENGINE_REQUESTS.labels(kind, "error").inc()
        self._leave(req, RequestStatus.FAILED, partial(req.future.set_exception, exc))

    def _leave(self, req: Request, status: RequestStatus, resolve: Callable[[], object]) -> None:
        if req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
            if req.encode_start is None:  # never admitted: still counted by the admission bound
                with self._lock:
                    self._queued[req.priority] -= 1
        req.status = status
        if req.row is None:
            with contextlib.suppress(InvalidStateError):
                resolve()
        else:
            self._leaving.append((req, resolve))

    def settle(self, move_row: Callable[[int, int], None]) -> None:
        """Give back the rows of the requests that no longer hold one (finished, failed, cancelled, back
        in the queue): `move_row(src, dst)` copies each row that moves into a gap, in order. Then the
        futures of the requests that left resolve."""
        leaving, self._leaving = self._leaving, []
        for src, dst in self.rows.release([r for r in self.rows.held if not r.status.holds_row]):
            move_row(src, dst)
        for _, resolve in leaving:
            with contextlib.suppress(InvalidStateError):
                resolve()

    def fail_all(self, exc: BaseException) -> None:
        """The engine stops: every request still here fails with `exc`."""
        for req in [*self.waiting, *dict.fromkeys(self.rows.held)]:
            self.fail(req, exc)
        self.settle(lambda src, dst: None)  # nothing decodes again: no row needs its contents

    def update_gauges(self) -> None:
        waiting = [0] * len(Priority)  # by class as submitted (a promoted offer still counts as best effort)
        for req in self.waiting:
            waiting[req.priority] += 1
        for p in Priority:
            m.UTTERANCES_WAITING.labels(p.label).set(waiting[p])
        m.ACTIVE_SEQUENCES.set(self.rows.used)
        m.KV_SLOTS_USED.set(self.rows.used)
        m.KV_SLOTS_FREE.set(self.rows.free)
