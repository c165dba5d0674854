#!/usr/bin/env python
"""Context carried across a channel's utterances (--context-carry): WER on real speech with and without,
whole utterances and fragments.

    python scripts/bench_context.py [--carry 0,32,64,111] [--write-docs]

Speech: the real clips of scripts/real_speech.py (jfk.flac, pocketsphinx librivox and cards) as a telephone
delivers them (8 kHz G.711 mu-law by sox, back to 16 kHz), as three calls: jfk alone, the 5 librivox
sentences one after another (one reader, consecutive sentences of one book), the 5 cards utterances one
after another, 0.8 s of silence between sentences. Each call is cut into utterances by the server's own
endpointer (service/pipeline/endpointing.py, the Silero VAD) as a stream would be:

  whole      the default endpointing (0.5 s of silence ends an utterance)
  fragments  0.1 s of silence ends one: the shortest asr.v1 allows, what Deepgram's endpointing=25 (LiveKit's
             setting) and a voice agent's own 0.2 s VAD flush amount to: turns cut between words
  fragments of at most 2 s
             and no utterance longer than 2 s (cut at its quietest point), as a client that commits its
             buffer every couple of seconds cuts: pieces of sentences

Each cut call is then decoded utterance by utterance in order, as a stream's channel is: each utterance
conditioned on the channel's carried text (service/pipeline/context.py ChannelContext with the engine's
tokenizer, its safeguards included) once the previous final is in, with `--carry` tokens (0: off, the
behaviour before issue 29; "64a": carried into an utterance that continues a cut at the length bound too,
which the server does not do). The three calls run side by side through one real engine (tiny.en, the default
quantization). This is the best case for carrying: in a live stream a fragment that ends before the
previous fragment's final is back is decoded without that final (tests/test_context_carry.py drives the
server's own path).

Figures per condition: WER over the three calls (each call's finals joined against its reference), the
utterances, how many were decoded with carried text and how many finals reset it, decode steps and
engine CPU seconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.server import short_commit  # noqa: E402
from scripts.keyterm_clips import Clip, real_clips, telephone_audio  # noqa: E402

RATE = 16000
PAUSE_S = 0.8
# (min_silence_s, max_utterance_s) of the endpointer
CUTS = {"whole": (0.5, 15.0), "fragments": (0.1, 15.0), "fragments of at most 2 s": (0.1, 2.0)}


@dataclass
class Call:
    name: str
    reference: str
    audio: np.ndarray


@dataclass
class Outcome:
    texts: list[str] = field(default_factory=list)
    with_context: int = 0
    resets: int = 0
    steps: int = 0


def calls() -> list[Call]:
    clips = real_clips()
    assert clips[0].source is not None and clips[0].source.suffix == ".flac", "jfk first"

    def joined(name: str, group: list[Clip]) -> Call:
        pause = np.zeros(round(PAUSE_S * RATE), np.float32)
        parts = [pause]
        for c in group:
            parts += [telephone_audio(c), pause]
        return Call(name, " ".join(c.text for c in group), np.concatenate(parts))

    librivox = [c for c in clips if c.source is not None and c.source.parent.name == "librivox"]
    cards = [c for c in clips if c.source is not None and c.source.parent.name == "cards"]
    return [joined("jfk", clips[:1]), joined("librivox", librivox), joined("cards", cards)]


def cut(audio: np.ndarray, min_silence_s: float, max_utterance_s: float) -> list[tuple[np.ndarray, bool]]:
    """The utterances the server's endpointer finds in a call's audio, each with whether it was cut at
    its length bound (speech goes on into the next)."""
    from service.pipeline.endpointing import Endpointer, Utterance
    from service.vocabulary.endpointing import EndpointSettings

    ep = Endpointer(EndpointSettings(min_silence_s=min_silence_s, max_utterance_s=max_utterance_s))
    events = ep.feed(audio) + ep.flush()
    return [(e.audio, e.forced_cut) for e in events if isinstance(e, Utterance)]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def decode_call(
    engine: object, utterances: list[tuple[np.ndarray, bool]], carry: int, after_cut: bool
) -> Outcome:
    """`after_cut` True: the context is carried into an utterance that continues speech cut at the length
    bound too (the server does not: service/pipeline/context.py)."""
    from engine import DecodeOptions
    from service.pipeline.context import ChannelContext

    prompts = engine.info.prompts  # type: ignore[attr-defined]
    context = ChannelContext(carry, prompts.tail)
    out = Outcome()
    for audio, forced in utterances:
        before = context.value
        t = engine.submit(audio, DecodeOptions(context=before)).future.result(timeout=600)  # type: ignore[attr-defined]
        context.submitted(forced_cut=forced and not after_cut)
        out.with_context += before is not None
        out.steps += t.stats.decode_steps
        if t.is_speech and t.text.strip():
            out.texts.append(t.text.strip())
            had = context.text
            context.final(t)
            out.resets += bool(had) and not context.text
    return out


def throughput(engine: object, utterances: list[np.ndarray], context: str, rounds: int) -> str:
    """16 utterances submitted at once (16 streams' finals arriving together), each with the same carried
    text of about 64 tokens or none, the two taking turns `rounds` times: wall and engine CPU seconds."""
    from engine import DecodeOptions

    batch = [utterances[i % len(utterances)] for i in range(16)]
    totals: dict[str, list[float]] = {"off": [0.0, 0.0, 0], "64 tokens": [0.0, 0.0, 0]}
    for _ in range(rounds):
        for name in totals:
            options = DecodeOptions(context=context if name != "off" else None)
            wall, cpu = time.monotonic(), cpu_seconds()
            handles = [engine.submit(a, options) for a in batch]  # type: ignore[attr-defined]
            steps = sum(h.future.result(timeout=600).stats.decode_steps for h in handles)
            totals[name][0] += time.monotonic() - wall
            totals[name][1] += cpu_seconds() - cpu
            totals[name][2] += steps
    audio_s = sum(len(a) for a in batch) / RATE
    lines = [
        "| context carried | audio s per wall s (16 at once) | engine CPU s per audio s | decode steps |",
        "|---|---:|---:|---:|",
    ]
    for name, (wall, cpu, steps) in totals.items():
        lines.append(
            f"| {name} | {audio_s * rounds / wall:.1f} | {cpu / (audio_s * rounds):.3f} | {steps / rounds:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--carry", default="0,32,64,111,64a",
        help="comma-separated --context-carry-tokens (0: off; a trailing a: carried after a cut at the length bound too)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="throughput: rounds of 16 utterances per condition")
    p.add_argument("--write-docs", action="store_true", help="put the table into docs/benchmarks.md")
    args = p.parse_args()
    from clients.scoring import corpus_wer
    from engine import Engine, EngineConfig

    the_calls = calls()
    cuts = {(c.name, kind): cut(c.audio, *s) for c in the_calls for kind, s in CUTS.items()}
    load_start = os.getloadavg()[0]
    engine = Engine(EngineConfig(model="tiny.en", threads=args.threads))
    engine.start()
    lines = [
        "| utterances cut as | context carried (tokens) | WER | utterances | decoded with carried text "
        "| finals that reset it | decode steps | engine CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    transcripts: list[str] = []
    try:
        engine.warmup()
        for kind in CUTS:
            for spec in args.carry.split(","):
                carry, after_cut = int(spec.rstrip("a")), spec.endswith("a")
                outcomes: dict[str, Outcome] = {}

                def run(
                    c: Call,
                    kind: str = kind,
                    carry: int = carry,
                    after_cut: bool = after_cut,
                    out: dict[str, Outcome] = outcomes,
                ) -> None:
                    out[c.name] = decode_call(engine, cuts[(c.name, kind)], carry, after_cut)

                start = cpu_seconds()
                threads = [threading.Thread(target=run, args=(c,)) for c in the_calls]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                cpu = cpu_seconds() - start
                wer = corpus_wer(
                    [c.reference for c in the_calls], [" ".join(outcomes[c.name].texts) for c in the_calls]
                )
                o = list(outcomes.values())
                n = sum(len(cuts[(c.name, kind)]) for c in the_calls)
                lines.append(
                    f"| {kind} | {(str(carry) + (', after a cut too' if after_cut else '')) if carry else 'off'} | {wer:.2%} | {n} | {sum(x.with_context for x in o)} "
                    f"| {sum(x.resets for x in o)} | {sum(x.steps for x in o)} | {cpu:.0f} |"
                )
                print(lines[-1], file=sys.stderr, flush=True)
                for c in the_calls:
                    transcripts.append(
                        f"  {kind} carry={spec} {c.name}: " + " | ".join(outcomes[c.name].texts)
                    )
        whole = [a for c in the_calls for a, _ in cuts[(c.name, "whole")]]
        context = engine.info.prompts.tail(" ".join(c.reference for c in the_calls), 64)  # type: ignore[union-attr]
        speed = throughput(engine, whole, context, args.rounds)
        print(speed, file=sys.stderr, flush=True)
    finally:
        engine.stop()
    commit = short_commit()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    words = sum(len(c.reference.split()) for c in the_calls)
    note = (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {commit}{' + local changes' if dirty else ''}; "
        f"{os.cpu_count()} CPUs, load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
        f"{args.threads} torch threads. Real speech: 3 calls (jfk, 5 librivox sentences, 5 cards utterances; "
        f"{words} reference words: one word is ~0.9 pt of WER)."
    )
    print("\n".join(transcripts), file=sys.stderr)
    out = "\n".join(lines) + f"\n\nThroughput, the whole utterances 16 at once:\n\n{speed}\n\n{note}\n"
    print(out)
    if args.write_docs:
        from scripts.docs_section import write_section

        write_section("## Context across a channel's utterances", "scripts/bench_context.py", out)


if __name__ == "__main__":
    main()
