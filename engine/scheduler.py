"""The scheduler: one thread that owns the model and runs a loop of plans.

Each turn: take what arrived (submits, cancels), snapshot the state, ask the policy
(engine/policy.py, pure) for a Plan, and execute it:

    1. drop    — cancelled utterances leave the queue
    2. encode  — ONE batched encoder pass for the planned utterances (or, with encoder batching
                 off, the baseline loop of per-utterance calls), cross-attention K/V into their
                 rows, then their prompts are prefilled together
    3. decode  — one step for every decoding sequence
    4. finish  — windows that ended (engine/outcome.py) are published, or go back to the queue
                 for their next 30 s window or a full-context fallback

Request state is an explicit status (engine/request.py RequestStatus). Failure isolation lives
here: an error in one stage fails the utterances it belongs to and the engine goes on; an error
that leaves the device unknown stops the engine. Nothing else in the engine touches the model.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from typing import Any

import torch

from engine import metrics as m
from engine import outcome
from engine.config import EngineConfig
from engine.constants import SAMPLE_RATE
from engine.decoding import Choice
from engine.errors import EngineOverloaded, EngineStopped, ModelInfo
from engine.policy import Plan, Policy, Snapshot, Waiting
from engine.prompt import PromptEncoder, max_prompt_tokens
from engine.request import DecodeOptions, Priority, Request, RequestStatus
from engine.runner import ModelRunner
from engine.timing import WordAligner, alignment_heads
from engine.weights import load

log = logging.getLogger(__name__)

TRIMMED_TOKENS_PER_SECOND = 12
TRIMMED_TOKENS_MIN = 16
ENCODER_COST_SMOOTHING = 0.3  # weight of the newest encoder pass in the per-position cost estimate


def leaves_engine_unknown(exc: BaseException) -> bool:
    """An error after which the engine's state cannot be trusted: not an ordinary Exception (a
    crash, an interrupt), or the accelerator itself failing (a lost device, an illegal memory
    access, a device-side assert), after which every tensor on it is suspect. Anything else stays
    with the utterance that raised it."""
    if not isinstance(exc, Exception):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        weights = load(config.model, config.cache_dir or None)
        self.config = config
        self.runner = ModelRunner(weights, config)
        self.rules = self.runner.rules
        vocab = self.rules.vocab
        self.prompts = PromptEncoder(
            weights.tokenizer.backend_tokenizer.to_str(), vocab.eot, max_prompt_tokens(config.max_tokens)
        )
        self.model_info = ModelInfo(
            name=weights.name,
            device=str(self.runner.device),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            multilingual=vocab.multilingual,
            languages=frozenset(vocab.languages) if vocab.multilingual else frozenset({"en"}),
            kv_cache_bytes=self.runner.cache.nbytes,
            prompts=self.prompts,
        )
        m.KV_CACHE_BYTES.set(self.runner.cache.nbytes)
        dims = self.runner.model.dims
        heads = alignment_heads(weights.generation_config, dims.n_text_layer, dims.n_text_head)
        self.aligner = WordAligner(self.runner.model, self.runner.cache, self.rules, heads)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.policy = Policy(config, self.runner.audio_ctx_for)
        self._waiting: list[Request] = []  # WAITING, in arrival order (the policy orders them)
        self._active: list[Request] = []  # active[i] holds cache row i (ENCODING, then DECODING)
        # Submitted, not yet in a slot, per class (indexed by Priority): what admission counts.
        self._queued = [0] * len(Priority)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Set (under _lock) when the scheduler drains its inbox for the last time: a submit either
        # enqueues before that drain (and is failed by it) or sees this flag and is refused.
        self._closed = False
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        # When the current window opened: the first moment an utterance waited with a slot free
        # (time spent waiting for a slot is queueing, measured by asr_queue_wait_seconds).
        self._window_opened: float | None = None
        # Measured wall time of one padded encoder position (s; smoothed): what the policy uses to
        # keep an encoder pass within --encoder-budget-while-decoding-ms. 0 until the first pass.
        self._encoder_s_per_position = 0.0
        self._on_failure: Callable[[BaseException], None] | None = None
        # Test seams. fault_hook: called for each request as its encoder pass begins (raise to
        # inject a fault). stage_hook: called with (stage, requests) as each stage begins for those
        # requests: "encoder" once per encoder call with its whole batch, then per request "prompt",
        # "rules", "loop_check", "result" (raise to inject a fault into that stage).
        # enqueue_hook: called in submit() just before the request enters the inbox.
        self.fault_hook: Callable[[Request], None] | None = None
        self.stage_hook: Callable[[str, list[Request]], None] | None = None
        self.enqueue_hook: Callable[[Request], None] | None = None
        # Iterations of the loop so far: the engine process's heartbeat (core_process.py). It grows while
        # the loop runs, idle (it wakes every IDLE_POLL_S) or busy; a hung loop stops it.
        self.loop_iterations = 0
        self._update_gauges()

    # --- any thread ---
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def validate(self, options: DecodeOptions) -> None:
        self.rules.validate(options)

    def start(self, on_failure: Callable[[BaseException], None] | None) -> None:
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="asr-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        if self._dead is not None or self._stopping.is_set():
            raise EngineStopped("the engine is not running")
        req.priority = req.options.work_class
        # On the caller's thread, once per distinct prompt (engine/prompt.py), never per window or fallback.
        req.prompt_ids = self.rules.previous_text(req.options, self.prompts.encode(req.options.prompt))
        with self._lock:
            live, best_effort, recorded = self._queued
            refusal = self.policy.admit(req.priority, (live, best_effort, recorded))
            if refusal is not None:
                m.ENGINE_REFUSED.labels(req.priority.label).inc()
                raise EngineOverloaded(refusal)
            req.submitted = time.monotonic()
            if self.enqueue_hook is not None:
                self.enqueue_hook(req)
            if self._closed:
                raise EngineStopped("the engine is not running")
            self._queued[req.priority] += 1
            self._inbox.put(("submit", req))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stats(self) -> dict[str, int]:
        cache = self.runner.cache
        return {
            "waiting": len(self._waiting),
            "active": len(self._active),
            "slots_used": cache.used,
            "slots_free": cache.free,
        }

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # --- scheduler thread ---
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.loop_iterations += 1  # the engine process's heartbeat reads it (engine/core_process.py)
                self._take_inbox(block=self.policy.idle_wait(self._snapshot()))
                self._execute(self.policy.plan(self._snapshot()))
                self._update_gauges()
        except BaseException as exc:
            log.exception("scheduler thread died")
            self._dead = exc
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            self._fail_all(EngineStopped("the engine stopped"))
            self._update_gauges()

    def _snapshot(self) -> Snapshot:
        """What the policy decides from: no tensors, no references it could change."""
        recorded_rows = sum(1 for r in self._active if r.priority is Priority.RECORDED)
        return Snapshot(
            now=time.monotonic(),
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
                )
                for r in self._waiting
            ),
            decoding=sum(1 for r in self._active if r.status is RequestStatus.DECODING),
            free_rows=self.runner.cache.free,
            window_opened=self._window_opened,
            encoder_s_per_position=self._encoder_s_per_position,
            recorded_rows=recorded_rows,
            live_rows=len(self._active) - recorded_rows,
        )

    def _execute(self, plan: Plan) -> None:
        for request_id in plan.drop:
            self._cancel(request_id)
        self._window_opened = plan.window_opened
        if plan.window_waited_s is not None:
            m.WINDOW_WAIT_SECONDS.observe(plan.window_waited_s)
        if plan.encode:
            batch = [self._take_waiting(admit.id) for admit in plan.encode]
            self._admit(batch, [admit.audio_ctx for admit in plan.encode])
        if plan.step and self._active:
            self._decode_step()

    def _take_inbox(self, block: float) -> None:
        try:
            item = self._inbox.get(timeout=block) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "cancel":
                self._cancel(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _take_waiting(self, request_id: str) -> Request:
        for i, req in enumerate(self._waiting):
            if req.id == request_id:
                return self._waiting.pop(i)
        raise RuntimeError(f"the plan admits {request_id}, which is not waiting")

    def _admit(self, batch: list[Request], audio_ctx: list[int]) -> None:
        blocked = bool(self._active)
        cache = self.runner.cache
        rows = cache.allocate(len(batch))
        start = time.perf_counter()
        now = time.monotonic()
        for offset, (req, ctx) in enumerate(zip(batch, audio_ctx, strict=True)):
            req.row = rows.start + offset
            req.status = RequestStatus.ENCODING
            req.audio_ctx = ctx
            req.window_start = (req.sum_logprob, req.sampled)
            if req.encode_start is None:  # first admission (not a later window or a fallback)
                req.encode_start = now
                req.encoder_batch_size = len(batch)
                m.QUEUE_WAIT_SECONDS.labels(req.priority.label).observe(now - req.ready_time)
                with self._lock:
                    self._queued[req.priority] -= 1
        self._active.extend(batch)
        failed = self._encode(batch)
        if blocked:
            m.SCHEDULER_BLOCKED_SECONDS.observe(time.perf_counter() - start)
        else:
            m.SCHEDULER_BLOCKED_SECONDS.observe(0.0)
        self._release_all(failed)
        ok = [r for r in batch if r not in failed]
        if ok:
            self._prefill(ok)

    def _encode(self, batch: list[Request]) -> list[Request]:
        """Encode the batch; returns the requests that failed (each fails alone)."""
        if self.config.encoder_batching:
            try:
                self._encode_call(batch)
                return []
            except Exception as exc:
                if leaves_engine_unknown(exc):
                    raise
                log.exception("batched encoder pass failed; retrying each utterance alone")
        failed = []
        for req in batch:
            try:
                self._encode_call([req])
            except Exception as exc:
                if leaves_engine_unknown(exc):
                    raise
                log.error("utterance %s failed in stage encoder", req.id, exc_info=exc)
                m.ENGINE_FAILURES.labels("encoder").inc()
                self._fail(req, exc)
                failed.append(req)
        return failed

    def _encode_call(self, reqs: list[Request]) -> None:
        if self.stage_hook is not None:
            self.stage_hook("encoder", reqs)
        if self.fault_hook is not None:
            for req in reqs:
                self.fault_hook(req)
        start = time.perf_counter()
        timings = self.runner.encode(
            [r.window_audio() for r in reqs], [r.kv_row for r in reqs], [r.audio_ctx for r in reqs]
        )
        elapsed = time.perf_counter() - start
        m.ENCODER_SECONDS.observe(elapsed)
        m.ENCODER_BATCH_SIZE.observe(len(reqs))
        m.FEATURE_SECONDS.observe(timings.features_s)
        m.CROSS_KV_SECONDS.observe(timings.cross_kv_s)
        # Every row of a pass is padded to its widest context: that is what the pass costs.
        per_position = elapsed / (len(reqs) * max(r.audio_ctx for r in reqs))
        previous = self._encoder_s_per_position
        self._encoder_s_per_position = (
            per_position if previous == 0 else previous + ENCODER_COST_SMOOTHING * (per_position - previous)
        )

    def _prefill(self, reqs: list[Request]) -> None:
        for req in list(reqs):
            if req.window == 0:
                try:
                    self._stage("prompt", [req])
                    self.rules.build_prompt(req, self.config.max_tokens)
                except Exception as exc:
                    self._fail_in_stage(req, "prompt", exc)
                    reqs.remove(req)
                    continue
            req.max_new = min(
                req.options.max_new_tokens or self.config.max_tokens,
                self.config.max_tokens - len(req.prompt_tokens) - len(req.forced) - 2,
            )
            if req.audio_ctx < self.runner.full_audio_ctx:
                # Speech rarely passes ~5 tokens/s; a trimmed window far beyond that is looping.
                budget = TRIMMED_TOKENS_PER_SECOND * len(req.window_audio()) / SAMPLE_RATE
                req.max_new = min(req.max_new, TRIMMED_TOKENS_MIN + int(budget))
            self.rules.start_window(req)
        if not reqs:
            return
        # Releasing a failed row moves the last row into its place, so the survivors are no longer
        # in admission order; but they still fill the block at the end of the cache that their
        # window was given (rows below it never move). Address that block in row order.
        reqs = sorted(reqs, key=lambda r: r.kv_row)
        rows = slice(reqs[0].kv_row, reqs[-1].kv_row + 1)
        if [r.row for r in reqs] != list(range(rows.start, rows.stop)):
            raise RuntimeError(f"KV-cache rows of an admitted window are not dense: {[r.row for r in reqs]}")
        start = time.perf_counter()
        try:
            last, sot = self.runner.prefill(
                [r.prompt_tokens for r in reqs], [r.sot_index for r in reqs], rows
            )
        except Exception as exc:
            if leaves_engine_unknown(exc):
                raise
            log.exception("prefill failed")
            m.ENGINE_FAILURES.labels("prefill").inc(len(reqs))
            for req in reqs:
                self._fail(req, exc)
            self._release_all(reqs)
            return
        m.PREFILL_SECONDS.observe(time.perf_counter() - start)
        for req in reqs:
            req.length = len(req.prompt_tokens)
            req.status = RequestStatus.DECODING
        failed: list[tuple[Request, Exception]] = []
        try:
            self._first_token_rules(reqs, list(range(len(reqs))), last, sot)
        except Exception as exc:
            if leaves_engine_unknown(exc):
                raise
            for i, req in enumerate(reqs):  # find the sequence(s) at fault: each alone
                try:
                    self._first_token_rules([req], [i], last, sot)
                except Exception as alone_exc:
                    failed.append((req, alone_exc))
        rest = [i for i, r in enumerate(reqs) if not r.detect_language and all(r is not f for f, _ in failed)]
        if rest:
            self._choose([reqs[i] for i in rest], last[rest])
        # Released only now: a release moves rows, and `last` was indexed by position above.
        for req, error in failed:
            self._fail_in_stage(req, "rules", error)
        self._finish_done(reqs)

    def _first_token_rules(
        self, reqs: list[Request], index: list[int], last: torch.Tensor, sot: torch.Tensor
    ) -> None:
        """No-speech probability and language detection for reqs (rows `index` of the prefill logits)."""
        self._stage("rules", reqs)
        no_speech = self.rules.no_speech_prob(sot[index]).tolist()
        detect = [j for j, r in enumerate(reqs) if r.detect_language]
        languages = self.rules.detect_language(last[[index[j] for j in detect]]).tolist() if detect else []
        codes = [self.rules.language_code(token) for token in languages]
        for req, p in zip(reqs, no_speech, strict=True):
            if req.window == 0:
                req.no_speech_prob = p
        for j, token, code in zip(detect, languages, codes, strict=True):
            reqs[j].language = code
            reqs[j].generated.append(token)

    def _decode_step(self) -> None:
        active = self._active
        start = time.perf_counter()
        try:
            logits = self.runner.step([r.generated[-1] for r in active], [r.length for r in active])
        except Exception as exc:
            if leaves_engine_unknown(exc):
                raise
            log.exception("decode step failed; failing the %d sequences in it", len(active))
            m.ENGINE_FAILURES.labels("decode_step").inc(len(active))
            for req in active:
                self._fail(req, exc)
            self._release_all(list(active))
            return
        m.DECODE_STEP_SECONDS.observe(time.perf_counter() - start)
        m.DECODE_BATCH_SIZE.observe(len(active))
        for req in active:
            req.length += 1
            req.decode_steps += 1
        self._choose(list(active), logits)
        self._finish_done(list(active))

    def _choose(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Append each request's next token: forced ones first, else greedy under the rules."""
        free = [i for i, r in enumerate(reqs) if not r.forced]
        for r in reqs:
            if r.forced:
                r.generated.append(r.forced.pop(0))
        if not free:
            return
        choices: list[tuple[list[Request], Choice]] = []
        failed: list[tuple[Request, Exception]] = []
        try:
            rows = [reqs[i] for i in free]
            self._stage("rules", rows)
            # A copy either way (the rules edit in place; `logits` stays untouched for the retry below);
            # clone() when every row is free, since indexing by a list copies the index to the device.
            picked = logits.clone() if len(free) == len(reqs) else logits[free]
            choices.append((rows, self.rules.next_tokens(picked, rows)))
        except Exception as exc:
            if leaves_engine_unknown(exc):
                raise
            # Find the sequence(s) at fault: each alone, from its own untouched logits.
            for i in free:
                try:
                    self._stage("rules", [reqs[i]])
                    choices.append(([reqs[i]], self.rules.next_tokens(logits[[i]], [reqs[i]])))
                except Exception as alone_exc:
                    failed.append((reqs[i], alone_exc))
        for rows, choice in choices:
            failed.extend(self.rules.take(rows, choice))
        m.TOKENS_GENERATED.inc(sum(len(rows) for rows, _ in choices) - len(failed))
        # Released only now: a release moves rows, and `logits` was indexed by them above.
        for req, error in failed:
            self._fail_in_stage(req, "rules", error)

    def _finish_done(self, reqs: list[Request]) -> None:
        eot = self.rules.vocab.eot
        done = []
        for req in reqs:
            if req.status is not RequestStatus.DECODING or self._drop_if_cancelled(req):
                continue
            if outcome.window_ended(req, eot, self.config.max_tokens, self.runner.full_audio_ctx):
                done.append(req)
        self._align_words(done)  # word timings need the rows' cross-attention K/V: before release
        self._release_all(done)
        for req in done:
            try:
                self._stage("loop_check", [req])
                reason = outcome.loop_reason(req, self.rules, self.runner.full_audio_ctx)
            except Exception as exc:
                self._fail_in_stage(req, "loop_check", exc)
                continue
            if reason is not None or req.window + 1 < req.windows:
                if reason is None:
                    req.window_tokens.append([t for t in req.generated if t != eot])
                try:
                    self._stage("prompt", [req])
                    if reason is not None:
                        self._fall_back_to_full_context(req, reason)
                    else:
                        self._next_window(req)
                except Exception as exc:
                    self._fail_in_stage(req, "prompt", exc)
                continue
            req.window_tokens.append([t for t in req.generated if t != eot])
            try:
                self._stage("result", [req])
                self._publish(req)
            except Exception as exc:
                self._fail_in_stage(req, "result", exc)

    def _align_words(self, done: list[Request]) -> None:
        """Word timings (engine/timing.py) for the finished windows that asked for them, batched."""
        full_ctx = self.runner.full_audio_ctx
        wanted = [
            r
            for r in done
            if r.options.word_timestamps
            and not r.options.interim
            and outcome.loop_reason(r, self.rules, full_ctx) is None
        ]
        if not wanted:
            return
        try:
            self.aligner.align(wanted)
        except Exception:  # words are extra: the transcript still goes out
            log.exception("word timings failed for %d utterances", len(wanted))

    def _fall_back_to_full_context(self, req: Request, reason: outcome.LoopReason) -> None:
        """Decode this window again with Whisper's full 30 s context (greedy, like the rest)."""
        m.ENCODER_FALLBACKS.labels(reason).inc()
        req.full_context = True
        req.generated = []
        req.sum_logprob, req.sampled = req.window_start
        if req.window > 0:
            self.rules.build_prompt(req, self.config.max_tokens, language=req.language)
        self._requeue(req)

    def _next_window(self, req: Request) -> None:
        """Audio longer than 30 s: decode the next window as its own pass, same prompt and language."""
        req.window += 1
        req.generated = []
        req.full_context = False
        self.rules.build_prompt(req, self.config.max_tokens, language=req.language)
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        # Already admitted once: its age (from `submitted`) puts it ahead of younger finals.
        req.status = RequestStatus.WAITING
        self._waiting.append(req)

    def _publish(self, req: Request) -> None:
        transcript = outcome.transcript(req, self.rules)
        kind = "interim" if req.options.interim else "final"
        m.ENGINE_REQUESTS.labels(kind, "text" if transcript.is_speech else "empty").inc()
        m.ENGINE_AUDIO_SECONDS.labels(kind).inc(req.audio_s)
        req.status = RequestStatus.FINISHED
        with contextlib.suppress(InvalidStateError):
            req.future.set_result(transcript)

    # --- leaving: cancel, failure, slot release ---
    def _drop_if_cancelled(self, req: Request) -> bool:
        if not req.future.cancelled():
            return False
        self._cancel(req.id)
        return True

    def _cancel(self, request_id: str) -> None:
        for req in self._waiting:
            if req.id == request_id:
                self._waiting.remove(req)
                if req.encode_start is None:  # never admitted: still counted by the admission bound
                    with self._lock:
                        self._queued[req.priority] -= 1
                self._mark_cancelled(req)
                return
        for req in self._active:
            if req.id == request_id:
                self._release_all([req])
                self._mark_cancelled(req)
                return

    def _mark_cancelled(self, req: Request) -> None:
        kind = "interim" if req.options.interim else "final"
        m.ENGINE_REQUESTS.labels(kind, "cancelled").inc()
        req.status = RequestStatus.CANCELLED
        req.future.cancel()

    def _stage(self, stage: str, reqs: list[Request]) -> None:
        if self.stage_hook is not None:
            self.stage_hook(stage, reqs)

    def _fail_in_stage(self, req: Request, stage: str, exc: BaseException) -> None:
        """Fail this one utterance (freeing its slot) for an error in `stage`; re-raise an error that
        leaves the engine's state unknown, which stops the engine."""
        if leaves_engine_unknown(exc):
            raise exc
        log.error("utterance %s failed in stage %s", req.id, stage, exc_info=exc)
        m.ENGINE_FAILURES.labels(stage).inc()
        self._fail(req, exc)
        self._release_all([req])

    def _fail(self, req: Request, exc: BaseException) -> None:
        kind = "interim" if req.options.interim else "final"
        m.ENGINE_REQUESTS.labels(kind, "error").inc()
        req.status = RequestStatus.FAILED
        with contextlib.suppress(InvalidStateError):
            req.future.set_exception(exc)

    def _release_all(self, reqs: list[Request]) -> None:
        """Free these requests' rows, highest first, so each move takes a row that stays."""
        for req in sorted((r for r in reqs if r.row is not None), key=lambda r: r.kv_row, reverse=True):
            row = req.kv_row
            moved = self.runner.cache.release(row)
            last = self._active.pop()
            if moved is not None:
                self._active[row] = last
                last.row = row
            req.row = None

    def _fail_all(self, exc: BaseException) -> None:
        for req in [*self._waiting, *self._active]:
            self._fail(req, exc)
        self._release_all(list(self._active))
        self._waiting.clear()
        with self._lock:
            self._closed = True
        # Nothing can enter the inbox from here on (submit checks _closed under the lock).
        with contextlib.suppress(queue.Empty):
            while True:
                kind, payload = self._inbox.get_nowait()
                if kind == "submit":
                    self._fail(payload, exc)

    def _update_gauges(self) -> None:
        cache = self.runner.cache
        waiting = [0] * len(Priority)  # by class as submitted (a promoted offer still counts as best effort)
        for req in self._waiting:
            waiting[req.priority] += 1
        for p in Priority:
            m.UTTERANCES_WAITING.labels(p.label).set(waiting[p])
        m.ACTIVE_SEQUENCES.set(len(self._active))
        m.KV_SLOTS_USED.set(cache.used)
        m.KV_SLOTS_FREE.set(cache.free)
