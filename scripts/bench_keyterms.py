#!/usr/bin/env python
"""Keyterms: recall with and without each layer, false insertions, WER on real speech with an
unrelated list, and what the bias costs a decode step.

    python scripts/bench_keyterms.py [--variants "none,bias (default)"] [--set NAME:FLAG=VALUE,...]
                                     [--write-docs]

Speech (scripts/keyterm_clips.py, all 8 kHz mu-law as a telephone delivers it): espeak-ng sentences
with 8 invented names in 3 voices, a `dev` set (the one the bonus was tuned on) and a held-out `test`
set of other sentences (the same names and voices), with a 16-term list (the 8 names and 8 said
nowhere); 18 control sentences without names, with that list; the 11 real clips of
scripts/real_speech.py (jfk.flac, pocketsphinx librivox and cards) twice: with that unrelated list,
and with a list of their own words (OWN_WORDS: the names and card words of each source). The real
engine (engine.Engine, tiny.en, default quantization), one engine per variant, every clip submitted
at once (batched as the server would).

Figures per variant: recall (a clip's name in its transcript, as a word, any case); false insertions
(clips whose transcript holds a keyterm of its list that its speech does not say); WER on the name
clips and on real speech (with the unrelated list it must not move from `none`); how many of the
listed own words said in real speech are written; decode steps in all and engine CPU seconds. Then
the rules' CPU cost per step (the logit processors, the choice and the host copy, with and without
the bias) at batch 1 and 16 on real logits, beside the decode step's own.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.server import short_commit  # noqa: E402
from scripts.keyterm_clips import (  # noqa: E402
    KEYTERMS,
    Clip,
    control_clips,
    name_clips,
    real_clips,
    real_clips_own_words,
    said,
    telephone_audio,
)

# Variant name -> EngineConfig keyterm settings ("as_prompt": the list as DecodeOptions.prompt instead,
# which the scheduler decodes with Whisper's full 30 s context). Every variant sends the 16 keyterms;
# "none" turns both layers off. "bias" is the default configuration.
VARIANTS: dict[str, dict[str, object]] = {
    "none": {"keyterm_prompt": False, "keyterm_bias": False, "keyterm_respell": False},
    "respelling alone": {"keyterm_prompt": False, "keyterm_bias": False},
    "prompt": {"keyterm_prompt": True, "keyterm_bias": False, "keyterm_respell": False},
    "prompt as DecodeOptions.prompt": {
        "keyterm_prompt": False,
        "keyterm_bias": False,
        "keyterm_respell": False,
        "as_prompt": True,
    },
    "bias without respelling": {"keyterm_respell": False},
    "bias (default)": {"keyterm_prompt": False, "keyterm_bias": True},
    # Respelling's margin (nats per token of the term) around the default.
    "respelling margin 5": {"keyterm_respell_margin": 5.0},
    "respelling margin 7": {"keyterm_respell_margin": 7.0},
    "prompt+bias": {"keyterm_prompt": True, "keyterm_bias": True},
    "bias without take-back": {"keyterm_take_back": False},
    # The neighbourhood of the default: the bonus and the evidence bound one at a time.
    "bias with bonus 3": {"keyterm_bonus": 3.0},
    "bias with bonus 6": {"keyterm_bonus": 6.0},
    "bias with max gap 8": {"keyterm_max_gap": 8.0},
    "bias with max gap 16": {"keyterm_max_gap": 16.0},
    "bias with max gap 20": {"keyterm_max_gap": 20.0},
    # Beam search ("beam_size": DecodeOptions.beam_size), with and without the bias over the beams.
    "beams 5": {"keyterm_prompt": False, "keyterm_bias": False, "keyterm_respell": False, "beam_size": 5},
    "bias over beams 5": {"beam_size": 5},
}


@dataclass
class Result:
    variant: str
    texts: dict[str, str]
    steps: int
    cpu_s: float


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_variant(name: str, settings: dict[str, object], clips: Sequence[Clip], threads: int) -> Result:
    from engine import DecodeOptions, Engine, EngineConfig

    settings = dict(settings)
    # The list as the caller's own prompt instead (DecodeOptions.prompt: Whisper's full 30 s context).
    as_prompt = bool(settings.pop("as_prompt", False))
    beam_size = int(settings.pop("beam_size", 1))  # type: ignore[call-overload]
    engine = Engine(EngineConfig(model="tiny.en", threads=threads, **settings))  # type: ignore[arg-type]
    engine.start()
    try:
        engine.warmup()
        audio = {c.name: telephone_audio(c) for c in clips}

        def options(c: Clip) -> DecodeOptions:
            prompt = ", ".join(c.keyterms) if as_prompt else None
            return DecodeOptions(keyterms=c.keyterms, prompt=prompt, beam_size=beam_size)

        start = cpu_seconds()
        handles = {c.name: engine.submit(audio[c.name], options(c)) for c in clips}
        results = {k: h.future.result(timeout=1800) for k, h in handles.items()}
        cpu = cpu_seconds() - start
    finally:
        engine.stop()
    return Result(
        name,
        {k: r.text for k, r in results.items()},
        sum(r.stats.decode_steps for r in results.values()),
        cpu,
    )


def frac(hit: int, total: int) -> str:
    return f"{hit}/{total} ({hit / total:.2f})" if total else "0/0"


def inserted(result: Result, clips: Sequence[Clip]) -> int:
    """Clips whose transcript holds a keyterm of their list that their speech does not say."""
    return sum(any(said(t, result.texts[c.name]) and not said(t, c.text) for t in c.keyterms) for c in clips)


def espeak_table(results: list[Result], clips: Sequence[Clip]) -> str:
    from clients.scoring import corpus_wer

    names = [c for c in clips if c.term is not None]
    controls = [c for c in clips if c.term is None and c.source is None]
    lines = [
        "| layers | recall dev | recall test (held out) | recall heldout (new names, list, voices) "
        "| false insertions: other-name clips | controls | WER name clips | decode steps (all clips) | engine CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        recall = []
        for split in ("dev", "test", "heldout"):
            chosen = [c for c in names if c.name.startswith(split)]
            recall.append(frac(sum(said(c.term or "", r.texts[c.name]) for c in chosen), len(chosen)))
        wer = corpus_wer([c.text for c in names], [r.texts[c.name] for c in names])
        lines.append(
            f"| {r.variant} | {recall[0]} | {recall[1]} | {recall[2]} | {inserted(r, names)}/{len(names)} "
            f"| {inserted(r, controls)}/{len(controls)} | {wer:.1%} | {r.steps} | {r.cpu_s:.0f} |"
        )
    return "\n".join(lines)


def real_table(results: list[Result], clips: Sequence[Clip]) -> str:
    from clients.scoring import corpus_wer

    unrelated = [c for c in clips if c.source is not None and c.keyterms == KEYTERMS]
    own = [c for c in clips if c.source is not None and c.keyterms != KEYTERMS]
    lines = [
        "| layers | WER, unrelated list | false insertions | WER, own words listed | own words said: written "
        "| false insertions |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        pairs = [(c, t) for c in own for t in c.keyterms if said(t, c.text)]
        written = sum(said(t, r.texts[c.name]) for c, t in pairs)
        lines.append(
            f"| {r.variant} | {corpus_wer([c.text for c in unrelated], [r.texts[c.name] for c in unrelated]):.2%} "
            f"| {inserted(r, unrelated)}/{len(unrelated)} "
            f"| {corpus_wer([c.text for c in own], [r.texts[c.name] for c in own]):.2%} "
            f"| {frac(written, len(pairs))} | {inserted(r, own)}/{len(own)} |"
        )
    return "\n".join(lines)


def step_cost(batches: Sequence[int], repeats: int = 50) -> str:
    """CPU ms per sampling step of the rules (processors, choice, host copy) on real decode-step logits,
    without keyterms and with the 16-term list on every row, and of the decode step itself for scale.
    One torch thread, timed by the thread's CPU clock: what the work costs, whatever else the machine
    runs (wall time on a shared machine is not)."""
    from concurrent.futures import Future

    import numpy as np
    import torch

    from engine import DecodeOptions, EngineConfig
    from engine.model.runner import ModelRunner
    from engine.model.weights import load
    from engine.scheduling.request import Request

    torch.set_num_threads(1)
    runner = ModelRunner(load("tiny.en"), EngineConfig(model="tiny.en", kv_slots=max(batches)))
    rules = runner.rules

    def cpu_ms(*fns: Callable[[], object], rounds: int = 10) -> list[float]:
        """Each fn's CPU ms per call: the least disturbed of `rounds` runs, the fns taking turns
        so that a busy moment of the machine falls on all of them alike."""
        best = [float("inf")] * len(fns)
        for fn in fns:
            fn()
        for _ in range(rounds):
            for k, fn in enumerate(fns):
                start = time.thread_time()
                for _ in range(repeats):
                    fn()
                best[k] = min(best[k], (time.thread_time() - start) / repeats * 1000)
        return best

    lines = [
        "| batch | decode step, CPU ms | rules, no keyterms | rules, 16 keyterms per row | the bias adds |",
        "|---:|---:|---:|---:|---:|",
    ]
    the = rules.tokenizer.encode(" the", add_special_tokens=False)[0]
    for batch in batches:
        with torch.inference_mode():
            tokens, lengths = [rules.vocab.sot] * batch, [3] * batch
            step: Callable[[], object] = functools.partial(runner.step, tokens, lengths)
            (step_ms,) = cpu_ms(step, rounds=3)
            logits = runner.step(tokens, lengths).clone()
            rows = []
            for keyterms in ((), KEYTERMS):
                reqs = []
                for i in range(batch):
                    req = Request(str(i), np.zeros(1, np.float32), DecodeOptions(keyterms=keyterms), Future())
                    rules.build_prompt(req, 224)
                    req.generated, req.max_new = [the], 100
                    rules.start_window(req)
                    reqs.append(req)
                rows.append(reqs)
            costs = cpu_ms(*(lambda x=logits, r=reqs: rules.next_tokens(x.clone(), r) for reqs in rows))
        lines.append(
            f"| {batch} | {step_ms:.2f} | {costs[0]:.3f} | {costs[1]:.3f} | {costs[1] - costs[0]:+.3f} "
            f"({(costs[1] - costs[0]) / step_ms:.1%} of the step) |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="NAME:FLAG=VALUE,...",
        help="an extra variant of EngineConfig keyterm flags, e.g. 'b6:keyterm_bonus=6,keyterm_max_gap=14'",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-docs", action="store_true", help="put the tables into docs/benchmarks.md")
    args = p.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants.split(",") if name}
    for spec in args.set:
        name, _, flags = spec.partition(":")
        settings: dict[str, object] = {}
        for flag in flags.split(","):
            key, _, value = flag.partition("=")
            on_off = value.lower() in ("on", "off")
            settings[key] = value.lower() == "on" if on_off else float(value)
        variants[name] = settings
    clips = [
        *name_clips("dev"),
        *name_clips("test"),
        *name_clips("heldout"),
        *control_clips(),
        *real_clips(),
        *real_clips_own_words(),
    ]
    load_start = os.getloadavg()[0]
    results = []
    for name, settings in variants.items():
        results.append(run_variant(name, settings, clips, args.threads))
        print(
            f"{name}: done ({results[-1].steps} steps, {results[-1].cpu_s:.0f} CPU s)",
            file=sys.stderr,
            flush=True,
        )
    espeak, real = espeak_table(results, clips), real_table(results, clips)
    cost = step_cost([1, 16])
    commit = short_commit()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    real_words = sum(len(c.text.split()) for c in real_clips())
    note = (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {commit}{' + local changes' if dirty else ''}; "
        f"{os.cpu_count()} CPUs, load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
        f"{args.threads} torch threads. Clips: {len(name_clips('dev'))} dev + {len(name_clips('test'))} test + "
        f"{len(name_clips('heldout'))} heldout name clips and {len(control_clips())} controls (espeak), {len(real_clips())} real clips twice: with the "
        f"16-term list and with their own words ({real_words} reference words: one word is ~0.9 pt of real WER)."
    )
    for r in results:
        print(f"\n{r.variant}:", file=sys.stderr)
        for c in clips:
            print(f"  {c.name}: {r.texts[c.name]}", file=sys.stderr)
    out = f"Espeak telephone speech:\n\n{espeak}\n\nReal speech:\n\n{real}\n\nCost of the rules per step:\n\n{cost}\n\n{note}\n"
    print(out)
    if args.write_docs:
        from scripts.docs_section import write_section

        write_section("## Keyterms", "scripts/bench_keyterms.py", out)


if __name__ == "__main__":
    main()
