"""The engine core: the loop that owns the device (vLLM v1's EngineCore).

One thread runs `step()` over and over: schedule -> execute -> update.

    schedule  the scheduler (engine/scheduling/scheduler.py, no model) turns the policy's plan into a
              SchedulerOutput: cancelled requests leave, an encoder batch takes its KV-cache rows
    execute   the model runner (engine/model/runner.py) runs it: ONE encoder pass (or, with encoder batching
              off, the baseline loop of per-utterance calls), the window prompts, their prefill and
              first-token rules, then one decode step for every decoding sequence, each followed by the
              choice of the next tokens through the decoding rules' logit processors
    update    the scheduler decides what came out means: a window ended, looped (fallback to the full
              context), failed Whisper's thresholds (decoded again at the next temperature, prompted and
              prefilled again in its own rows), goes on to its next 30 s, or the request is done
              (respelling and word timings first, while its row still holds its audio); rows of requests
              that left are given back (`settle`)

Each stage runs under engine/isolation.py: an ordinary error fails the requests at fault (a batch is
run again request by request to find them) and the engine goes on; an error that leaves the engine
unknown stops it. Test seams come in as one EngineHooks object (engine/hooks.py).

Apart from the decisions: the thread, its inbox (submits and cancels from any thread, taken at the top
of each turn) and the stop. `loop_iterations` is the engine process's heartbeat (engine/process/core_process.py):
it grows while the loop runs, idle (it wakes every IDLE_POLL_S) or busy; a hung loop stops it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine import metrics as m
from engine.config import EngineConfig, parse_temperatures
from engine.decoding import beam
from engine.errors import EngineStopped, ModelInfo
from engine.hooks import EngineHooks
from engine.isolation import Stages, leaves_engine_unknown
from engine.parameters import DecodeOptions
from engine.scheduling import outcome
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import Scheduler, SchedulerOutput, WindowEnd, sampling_rng

if TYPE_CHECKING:
    from torch import Tensor

    from engine.decoding.rules import Choice
    from engine.model.runner import FirstTokens, ModelRunner

log = logging.getLogger("engine.core")


class EngineCore:
    def __init__(self, config: EngineConfig, hooks: EngineHooks, runner: ModelRunner | None = None) -> None:
        if runner is None:
            from engine.model.runner import ModelRunner  # torch and the weights: only when an engine is built

            runner = ModelRunner.load(config)
        self.config = config
        self.hooks = hooks
        self.runner = runner
        self.rules = runner.rules
        self.scheduler = Scheduler(config, self.rules, runner.full_audio_ctx)
        self.temperatures = parse_temperatures(config.temperatures)
        self.stages: Stages[Request] = Stages(hooks, self.scheduler.fail)
        vocab = self.rules.vocab
        self.model_info = ModelInfo(
            name=runner.name,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            multilingual=vocab.multilingual,
            languages=frozenset(vocab.languages) if vocab.multilingual else frozenset({"en"}),
            kv_cache_bytes=runner.cache.nbytes,
            prompts=runner.prompts,
            max_beam_size=config.beam_bound,
        )
        m.KV_CACHE_BYTES.set(runner.cache.nbytes)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Set (under _lock) when the loop drains its inbox for the last time: a submit either enqueues
        # before that drain (and is failed by it) or sees this flag and is refused.
        self._closed = False
        # keyterm lists not yet compiled are compiled here, one at a time, before their request reaches the
        # inbox; the ids in flight there, and those of them cancelled meanwhile (under _lock)
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr-keyterm-compile")
        self._compiling: set[str] = set()
        self._cancelled_compiling: set[str] = set()
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self.loop_iterations = 0
        self.scheduler.update_gauges()

    # --- any thread ---
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def validate(self, options: DecodeOptions) -> None:
        self.rules.validate(options)

    def start(self, on_failure: Callable[[BaseException], None] | None) -> None:
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="asr-engine-core", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> None:
        if self._dead is not None or self._stopping.is_set():
            raise EngineStopped("the engine is not running")
        # On the caller's thread, once per distinct prompt (engine/decoding/prompt.py), never per window or fallback.
        prompts = self.runner.prompts
        prompt_ids = self.rules.previous_text(req.options, prompts.encode(req.options.prompt))
        req.prompt_ids = prompts.with_context(prompt_ids, req.options.context)  # the channel's text after it
        # Its temperature schedule: its own or the engine's; a preview never waits for a second pass.
        req.temperatures = req.options.temperatures or self.temperatures
        if req.options.interim:
            req.temperatures = req.temperatures[:1]
        req.rng = sampling_rng(req)
        # Its keyterm list, compiled once per distinct list (~0.3-0.4 s of Python for 100 terms) on the
        # compile thread: never on the loop every sequence shares, nor on the thread that submits (the engine
        # process's IPC thread, a frontend's event loop), which carries every other call's messages.
        compile_first = self.rules.keyterms.needs_compile(req)
        if not compile_first:
            self.rules.keyterms.prepare(req)  # a lookup, or nothing to do
        with self._lock:
            self.scheduler.admit(req)  # raises EngineOverloaded
            try:
                if self.hooks.enqueue is not None:
                    self.hooks.enqueue(req)
                if self._closed:
                    raise EngineStopped("the engine is not running")
            except BaseException:
                self.scheduler.withdraw(req)
                raise
            if compile_first:
                self._compiling.add(req.id)
                self._compiler.submit(self._compile_then_submit, req)
            else:
                self._inbox.put(("submit", req))

    def _compile_then_submit(self, req: Request) -> None:
        """On the compile thread: the request's keyterm list, then the request into the loop's inbox (a
        cancel that came meanwhile follows it there)."""
        try:
            self.rules.keyterms.prepare(req)
        except Exception:  # the window's start compiles it again, where a failure fails this request only
            log.exception("compiling a keyterm list failed")
        with self._lock:
            self._compiling.discard(req.id)
            if self._closed:
                self.scheduler.fail(req, EngineStopped("the engine is not running"))
                return
            self._inbox.put(("submit", req))
            if req.id in self._cancelled_compiling:
                self._cancelled_compiling.discard(req.id)
                self._inbox.put(("cancel", req.id))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._compiling:  # not in the loop's hands yet: sent after its submit
                self._cancelled_compiling.add(request_id)
                return
        self._inbox.put(("cancel", request_id))

    def stats(self) -> dict[str, int]:
        return self.scheduler.stats()

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._compiler.shutdown(wait=False)
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the loop thread ---
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.loop_iterations += (
                    1  # the engine process's heartbeat reads it (engine/process/core_process.py)
                )
                self._take_inbox(block=self.scheduler.idle_wait(time.monotonic()))
                self.step()
        except BaseException as exc:
            log.exception("engine loop died")
            self._dead = exc
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            self._close(EngineStopped("the engine stopped"))

    def _take_inbox(self, block: float) -> None:
        try:
            item = self._inbox.get(timeout=block) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self.scheduler.add(payload)
            elif kind == "cancel":
                self.scheduler.cancel(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def step(self) -> None:
        """One turn: schedule -> execute -> update."""
        self._settle()  # rows of what the inbox cancelled
        output = self.scheduler.schedule(time.monotonic())
        if output.encode:
            wall, cpu = time.perf_counter(), time.process_time()
            self._admit(output)
            self._busy("encode", wall, cpu)
        if output.step and self.scheduler.rows.used:
            wall, cpu = time.perf_counter(), time.process_time()
            self._decode_step(self.scheduler.decoding)
            self._busy("decode", wall, cpu)
        self.scheduler.update_gauges()

    @staticmethod
    def _busy(stage: str, wall: float, cpu: float) -> None:
        m.ENGINE_BUSY_SECONDS.labels(stage).inc(time.perf_counter() - wall)
        m.ENGINE_BUSY_CPU_SECONDS.labels(stage).inc(time.process_time() - cpu)

    def _settle(self) -> None:
        self.scheduler.settle(self.runner.move_row)

    # --- execute: a new window's encoder pass, prompt and prefill ---
    def _admit(self, output: SchedulerOutput) -> None:
        batch = list(output.encode)
        start = time.perf_counter()
        self.stages.run("encoder", batch, self._encode, together=self.config.encoder_batching)
        m.SCHEDULER_BLOCKED_SECONDS.observe(time.perf_counter() - start if output.blocked else 0.0)
        encoded = [r for r in batch if r.status is RequestStatus.ENCODING]
        prompted = [rs[0] for rs, _ in self.stages.run("prompt", encoded, self._prompt, together=False)]
        # The rows of those that failed go: the rows after them move into their place, so the survivors
        # still fill the block at the end of the cache that this pass was given (rows below it never
        # move), no longer in admission order. Prefill addresses that block in row order.
        self._settle()
        if prompted:
            prompted.sort(key=lambda r: r.kv_row)
            rows = sorted(row for r in prompted for row in r.rows)
            if rows != list(range(rows[0], rows[0] + len(rows))):
                raise RuntimeError(f"KV-cache rows of an admitted window are not dense: {rows}")
            for reqs, (last, sot) in self.stages.run("prefill", prompted, self._prefill):
                self._first_tokens(reqs, last, sot)
        self._settle()

    def _encode(self, reqs: list[Request]) -> None:
        if self.hooks.fault is not None:
            for req in reqs:
                self.hooks.fault(req)
        start = time.perf_counter()
        audios, ctx = [r.window_audio() for r in reqs], [r.audio_ctx for r in reqs]
        if all(len(r.rows) == 1 for r in reqs):
            timings = self.runner.encode(audios, [r.kv_row for r in reqs], ctx)
        else:  # a beam search's rows all take its one encoder output
            rows = [(row, i) for i, r in enumerate(reqs) for row in r.rows]
            timings = self.runner.encode(audios, [row for row, _ in rows], ctx, [i for _, i in rows])
        elapsed = time.perf_counter() - start
        m.ENCODER_SECONDS.observe(elapsed)
        m.ENCODER_BATCH_SIZE.observe(len(reqs))
        m.FEATURE_SECONDS.observe(timings.features_s)
        m.CROSS_KV_SECONDS.observe(timings.cross_kv_s)
        self.scheduler.observe_encoder(elapsed, reqs)

    def _prompt(self, reqs: list[Request]) -> None:
        """The window's prompt tokens (later windows keep the language of the first), its token budget,
        and the rules' per-window state."""
        (req,) = reqs
        self.rules.build_prompt(
            req, self.config.max_tokens, language=req.language if req.window > 0 else None
        )
        self.scheduler.token_budget(req)
        self.rules.start_window(req)

    def _prefill(self, reqs: list[Request]) -> tuple[Tensor, Tensor]:
        """reqs hold consecutive rows (in row order; a beam search's rows, one per beam, each take its
        prompt). Returns the logits of each request's first row: row i is reqs[i]."""
        if all(len(r.rows) == 1 for r in reqs):
            rows = slice(reqs[0].kv_row, reqs[-1].kv_row + 1)
            start = time.perf_counter()
            last, sot = self.runner.prefill(
                [r.prompt_tokens for r in reqs], [r.sot_index for r in reqs], rows
            )
        else:
            owner = {row: r for r in reqs for row in r.rows}
            first, end = min(owner), max(owner) + 1
            if len(owner) != end - first:
                raise RuntimeError(f"KV-cache rows to prefill are not consecutive: {sorted(owner)}")
            held = [owner[row] for row in range(first, end)]
            start = time.perf_counter()
            last, sot = self.runner.prefill(
                [r.prompt_tokens for r in held], [r.sot_index for r in held], slice(first, end)
            )
            index = [r.kv_row - first for r in reqs]
            last, sot = last[index], sot[index]
        m.PREFILL_SECONDS.observe(time.perf_counter() - start)
        self.scheduler.prefilled(reqs)
        return last, sot

    def _first_tokens(self, reqs: list[Request], last: Tensor, sot: Tensor) -> None:
        """No-speech probability and language detection, then the first token of those that know their
        language; row i of the prefill logits `last` and `sot` is reqs[i]."""
        position = {id(r): i for i, r in enumerate(reqs)}

        def first_tokens(rs: list[Request]) -> FirstTokens:
            if len(rs) == len(reqs):
                return self.runner.first_tokens(last, sot, rs)
            index = [position[id(r)] for r in rs]
            return self.runner.first_tokens(last[index], sot[index], rs)

        for rs, first in self.stages.run("rules", reqs, first_tokens):
            for req, no_speech, language in zip(rs, first.no_speech, first.language, strict=True):
                if req.window == 0:
                    req.no_speech_prob = no_speech
                if language is not None:
                    req.language = self.rules.language_code(language)
                    req.generated.append(language)
        # Those that detected their language took it as this turn's token.
        rest = [i for i, r in enumerate(reqs) if r.status is RequestStatus.DECODING and not r.detect_language]
        if rest:
            chosen = [reqs[i] for i in rest]
            logits = last if len(rest) == len(reqs) else last[rest]
            if any(r.searches_beams for r in chosen):  # row i of these logits is chosen[i]
                self._choose_rows(chosen, logits, [[i] for i in range(len(chosen))])
            else:
                self._choose(chosen, logits)
        self._end_windows(reqs)

    # --- execute: the decode step ---
    def _decode_step(self, active: list[Request]) -> None:
        # A step runs rows 0..n-1 together: no request can take it alone.
        for reqs, logits in self.stages.run("decode_step", active, self._step, alone=False):
            if any(len(r.rows) > 1 for r in reqs):  # row r.rows[b] of the logits is beam b of r
                self._choose_rows(reqs, logits, [r.rows for r in reqs])
            else:  # one row each, in row order: row i is reqs[i]
                self._choose(reqs, logits)
            self._end_windows(reqs)
        self._settle()

    def _step(self, reqs: list[Request]) -> Tensor:
        start = time.perf_counter()
        if all(len(r.rows) == 1 for r in reqs):
            tokens, lengths = [r.generated[-1] for r in reqs], [r.length for r in reqs]
        else:  # rows 0..n-1, each beam's last token in its own row
            n = sum(len(r.rows) for r in reqs)
            tokens, lengths = [0] * n, [0] * n
            for r in reqs:
                last = [b.generated[-1] for b in r.beams] if r.beams else [r.generated[-1]]
                # rows without a beam of their own (before the search branches, or if fewer tokens were
                # allowed than beams) repeat the first one: computed, never read
                last += last[:1] * (len(r.rows) - len(last))
                for row, token in zip(r.rows, last, strict=True):
                    tokens[row], lengths[row] = token, r.length
        logits = self.runner.step(tokens, lengths)
        m.DECODE_STEP_SECONDS.observe(time.perf_counter() - start)
        m.DECODE_BATCH_SIZE.observe(len(tokens))
        self.scheduler.stepped(reqs)
        return logits

    def _choose_rows(self, reqs: list[Request], logits: Tensor, rows: list[list[int]]) -> None:
        """The next tokens when beam searches take part: reqs[i]'s logits are rows[i] of `logits` (one row
        per beam). Greedy requests choose together as always; each beam search chooses on its own."""
        greedy = [i for i, r in enumerate(reqs) if not r.searches_beams]
        if greedy:
            self._choose([reqs[i] for i in greedy], logits[[rows[i][0] for i in greedy]])
        where = {id(r): rs for r, rs in zip(reqs, rows, strict=True)}
        searching = []
        for r in reqs:
            if not r.searches_beams:
                continue
            if r.forced:  # the task tokens after a detected language: every row takes them alike
                r.generated.append(r.forced.pop(0))
            else:
                searching.append(r)

        def search(rs: list[Request]) -> None:
            self._search(rs[0], logits, where[id(rs[0])])

        self.stages.run("rules", searching, search, together=False)  # a failed search fails its request alone

    def _search(self, req: Request, logits: Tensor, rows: list[int]) -> None:
        """One step of req's beam search (engine/decoding/beam.py) over its rows of `logits`."""
        bias = self.rules.keyterms.beam_bias(req)
        beams = req.beams if req.beams else beam.begin(req, bias)
        rows = rows[: len(beams)]
        values, tokens = self.runner.beam_candidates(logits[rows], beams, req.options.beam_size + 1, bias)
        eot = self.rules.vocab.eot
        sources = beam.advance(req, beams, values, tokens, eot, bias)
        m.TOKENS_GENERATED.inc(len(req.beams))
        self.runner.reorder(req.rows[: len(sources)], [req.rows[s] for s in sources], req.length)
        if beam.over(req, eot, self.config.max_tokens, self.runner.full_audio_ctx):
            beam.finish(req, eot)

    def _choose(self, reqs: list[Request], logits: Tensor) -> None:
        """Append each request's next token: forced ones first, else greedy under the rules (row i of
        logits is reqs[i])."""
        free = [i for i, r in enumerate(reqs) if not r.forced]
        for r in reqs:
            if r.forced:
                r.generated.append(r.forced.pop(0))
        if not free:
            return
        rows = [reqs[i] for i in free]
        position = {id(reqs[i]): i for i in free}

        def sample(rs: list[Request]) -> Choice:
            # A copy either way: the rules edit in place, and `logits` stays untouched for a request's run
            # alone. clone() when every row is free, since indexing by a list copies the index to the device.
            if len(rs) == len(rows):
                return self.runner.sample(logits.clone() if len(free) == len(reqs) else logits[free], rs)
            return self.runner.sample(logits[[position[id(r)] for r in rs]], rs)

        taken = 0
        for rs, choice in self.stages.run("rules", rows, sample):
            failed = self.rules.take(rs, choice)
            taken += len(rs) - len(failed)
            for req, error in failed:
                self.stages.failed("rules", req, error)
        m.TOKENS_GENERATED.inc(taken)

    # --- update: what finished windows lead to ---
    def _end_windows(self, reqs: Sequence[Request]) -> None:
        ended = self.scheduler.ended(reqs)
        ends = [end for _, end in self.stages.run("loop_check", ended, self._window_end, together=False)]
        # Respelling and word timings need the rows' cross-attention K/V: before the rows are given back;
        # respelling first, since it changes the tokens the words are timed on. A window decoded again
        # (fallback, retry, resample) is neither: its tokens are not yet the ones that go out.
        going_out = [
            e.request
            for e in ends
            if e.action not in ("fallback", "retry", "resample") and not e.request.options.interim
        ]
        self._respell([r for r in going_out if r.options.keyterms])
        self._align_words([r for r in going_out if r.options.word_timestamps])
        for end in ends:
            self.scheduler.close_window(end)
            if end.action == "publish":
                self.stages.run("result", [end.request], self._publish, together=False)
        self._redecode([e.request for e in ends if e.action in ("retry", "resample")])

    def _window_end(self, reqs: list[Request]) -> WindowEnd:
        (req,) = reqs
        end = self.scheduler.window_end(req)
        self.scheduler.keep_attempt(end)
        return end

    def _redecode(self, reqs: list[Request]) -> None:
        """Temperature fallback: each window decoded again at its next temperature, in its first row,
        whose cross-attention K/V still hold the window's encoder output (no second encoder pass): its
        prompt again, its prefill alone (its row stays where it is), then its first token."""
        prompted = [rs[0] for rs, _ in self.stages.run("prompt", reqs, self._prompt, together=False)]
        for rs, (last, sot) in self.stages.run("prefill", prompted, self._prefill_again, together=False):
            self._first_tokens(rs, last, sot)

    def _prefill_again(self, reqs: list[Request]) -> tuple[Tensor, Tensor]:
        (req,) = reqs
        start = time.perf_counter()
        row = req.kv_row
        last, sot = self.runner.prefill([req.prompt_tokens], [req.sot_index], slice(row, row + 1))
        m.PREFILL_SECONDS.observe(time.perf_counter() - start)
        self.scheduler.prefilled(reqs)
        return last, sot

    def _respell(self, reqs: list[Request]) -> None:
        if not reqs:
            return
        try:
            self.runner.respell(reqs)
        except Exception as exc:  # respelling is extra: the decoded text still goes out
            if leaves_engine_unknown(exc):
                raise
            log.exception("keyterm respelling failed for %d utterances", len(reqs))

    def _align_words(self, reqs: list[Request]) -> None:
        if not reqs:
            return
        try:
            self.runner.align(reqs)
        except Exception as exc:  # words are extra: the transcript still goes out
            if leaves_engine_unknown(exc):
                raise
            log.exception("word timings failed for %d utterances", len(reqs))

    def _publish(self, reqs: list[Request]) -> None:
        (req,) = reqs
        self.scheduler.finish(req, outcome.transcript(req, self.rules))

    # --- the stop ---
    def _close(self, exc: BaseException) -> None:
        if self.hooks.closing is not None:
            try:
                self.hooks.closing()
            except Exception:
                log.exception("the closing hook failed")
        self.scheduler.fail_all(exc)
        with self._lock:
            self._closed = True
        # Nothing can enter the inbox from here on (submit checks _closed under the lock).
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self.scheduler.fail(payload, exc)
        self.scheduler.update_gauges()
