"""Engine micro-benchmark: what batching buys, measured side by side in one run.

  1. Encoder: B utterances as a loop of B single calls vs one batch-B call (log-mel,
     encoder and cross-attention K/V, as the scheduler runs them), per encoder context.
  2. Decoder: time of one decode step vs the number of sequences in it.

Runs unchanged on CUDA (`--device cuda`). Prints a markdown table and, with --write,
replaces the "Engine micro-benchmark" section of docs/benchmarks.md. End-to-end
throughput through the server (encoder batching off vs on) is scripts/bench_loadgen_ab.py.

    python scripts/bench_engine.py --model tiny.en --batch-sizes 1,4,16,64 --write

With --decode-step, instead: the decode step before (--before REF: the unfused model with host
reads, loaded from git) vs after (fused, sync-free: eager, and torch.compile'd at static shapes),
rules and token fetch included, at each batch size; the vocabulary projection's share of the step
(torch.profiler); and 16 real utterances submitted at once through the engine, before vs after
(each in its own process; the before one imports REF's engine package). Writes the "Decode step"
section with --write.

    python scripts/bench_engine.py --decode-step --batch-sizes 1,8,16 --write

With --against REF, instead: this tree's engine against REF's (git ref), each in its own process,
alternating, in one run: the encoder (loop of single calls and one batch at the largest size, trimmed
context), the decode step at each batch size, and N real utterances submitted at once through the
engine (utt/s, CPU seconds per utterance, identical transcripts). Writes the "Engine restructure"
section with --write.

    python scripts/bench_engine.py --against main --batch-sizes 1,16 --rounds 3 --write
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from docs_section import write_section  # beside this script

from engine.config import EngineConfig  # in the --throughput-json child these may be --before's
from engine.model.runner import ModelRunner
from engine.model.weights import load
from harness.server import source_tree
from harness.usage import Stopwatch, interleaved_median_wall_s, median_wall_s

SECTION = "## Engine micro-benchmark"
AGAINST_SECTION = "## Engine restructure: before and after"
STEP_SECTION = "## Decode step: fused, sync-free, graph-ready"
BEFORE_REF = "ef365cc"  # the last commit before the fused, sync-free step
REAL_SPEECH = Path("/usr/share/pocketsphinx/test/data")
REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def encode_loop(runner: ModelRunner, audio: list[np.ndarray]) -> None:
    """The baseline: one encoder call per utterance."""
    for row, clip in enumerate(audio):
        runner.encode([clip], [row], [runner.audio_ctx_for(len(clip))])


def encode_batch(runner: ModelRunner, audio: list[np.ndarray]) -> None:
    runner.encode(audio, list(range(len(audio))), [runner.audio_ctx_for(len(clip)) for clip in audio])


def real_clips(n: int) -> list[np.ndarray]:
    """n real utterances: the pocketsphinx librivox and cards clips and jfk.flac, repeated in turn."""
    import soundfile as sf
    import soxr

    paths = sorted((REAL_SPEECH / "librivox").glob("*.wav")) + sorted((REAL_SPEECH / "cards").glob("*.wav"))
    paths.append(REPO.parent / "shared" / "data" / "jfk.flac")
    clips = []
    for path in paths:
        audio, rate = sf.read(path, dtype="float32")
        mono = audio.mean(axis=1) if audio.ndim > 1 else audio
        clips.append(soxr.resample(mono, rate, 16000).astype(np.float32) if rate != 16000 else mono)
    return [clips[i % len(clips)] for i in range(n)]


def throughput_json(threads: int, n: int) -> None:
    """In its own process (importing whichever engine package PYTHONPATH gives): n real utterances
    submitted at once; prints utt/s and the transcripts as JSON."""
    from engine import Engine

    clips = real_clips(n)
    engine = Engine(EngineConfig(threads=threads, kv_slots=max(32, n), max_batch=n))
    engine.start()
    engine.warmup()
    try:
        for h in [engine.submit(c) for c in clips[:2]]:  # warm the shapes up, untimed
            h.future.result(timeout=600)
        with Stopwatch(descendants=False) as timed:
            results = [h.future.result(timeout=600) for h in [engine.submit(c) for c in clips]]
    finally:
        engine.stop()
    wall = timed.wall_s
    figures = {
        "utt_s": n / wall,
        "wall": wall,
        "cpu_s": timed.cpu_s,
        "tokens": [list(r.tokens) for r in results],
    }
    print(json.dumps(figures))


def median_cpu_s(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU seconds (this process, every thread) of `fn()` over `repeats` calls after one untimed
    warm-up: on a shared machine, what the call costs, where wall time also counts the others' work."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return float(np.median(samples))


def micro_json(args: argparse.Namespace) -> None:
    """In its own process (whichever engine package PYTHONPATH gives): the encoder as a loop of single
    calls and as one batch at the largest batch size (trimmed context, real clips), and the decode step
    at each batch size; prints median CPU seconds as JSON (CPU only: nothing waits for a device)."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    runner = ModelRunner(
        load(args.model), EngineConfig(model=args.model, threads=args.threads, kv_slots=max(sizes))
    )
    if runner.device.type != "cpu":
        raise SystemExit("--against measures CPU seconds: run it with --device cpu")
    clips = [c[: 16000 * 5] for c in real_clips(max(sizes))]
    figures = {
        "encoder_loop": median_cpu_s(partial(encode_loop, runner, clips), args.repeats),
        "encoder_batch": median_cpu_s(partial(encode_batch, runner, clips), args.repeats),
    }
    v = runner.rules.vocab
    for b in sizes:
        runner.prefill([[v.sot, v.no_timestamps]] * b, [0] * b, slice(0, b))
        step = partial(runner.step, [v.sot] * b, [40] * b)  # a step 40 tokens into each sequence
        figures[f"step_{b}"] = median_cpu_s(step, max(args.repeats, 10))
    print(json.dumps(figures))


def against(args: argparse.Namespace) -> None:
    """This tree's engine against args.against's, each child in its own process, alternating."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-against-"))
    trees = {"before": source_tree(args.against, tmp / "before", ["engine", "harness"]), "after": REPO}
    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    same: list[int] = []
    n = args.utterances
    for _ in range(args.rounds):
        tokens = {}
        for name, path in trees.items():
            env = {**os.environ, "PYTHONPATH": str(path), "PYTHONDONTWRITEBYTECODE": "1"}
            common = ["--threads", str(args.threads), "--model", args.model]
            micro = [sys.executable, __file__, "--micro-json", "--batch-sizes", args.batch_sizes, "--repeats",
                     str(args.repeats), *common]  # fmt: skip
            out = subprocess.run(micro, env=env, check=True, capture_output=True, text=True, cwd=path).stdout
            figures = json.loads(out.strip().splitlines()[-1])
            cmd = [sys.executable, __file__, "--throughput-json", str(n), *common]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=path).stdout
            throughput = json.loads(out.strip().splitlines()[-1])
            tokens[name] = throughput["tokens"]
            figures.update(utt_s=throughput["utt_s"], cpu_per_utt=throughput["cpu_s"] / n)
            runs[name].append(figures)
            print(name, {k: round(v, 4) for k, v in figures.items()}, flush=True)
        same.append(sum(a == b for a, b in zip(tokens["before"], tokens["after"], strict=True)))

    def median(name: str, key: str) -> float:
        return float(np.median([r[key] for r in runs[name]]))

    b = max(sizes)
    rows = [
        (f"encoder, loop of {b} single calls (CPU s)", "encoder_loop", False),
        (f"encoder, one batch-{b} call (CPU s)", "encoder_batch", False),
        *((f"decode step, batch {s} (CPU ms)", f"step_{s}", False) for s in sizes),
        (f"{n} utterances at once: utt/s (wall)", "utt_s", True),
        (f"{n} utterances at once: CPU s per utterance", "cpu_per_utt", False),
    ]
    lines = [
        AGAINST_SECTION,
        "",
        f"`python scripts/bench_engine.py --against {args.against} --batch-sizes {args.batch_sizes} --rounds "
        f"{args.rounds} --threads {args.threads}` on {machine()}, {datetime.date.today()}; load average "
        f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (a shared machine: CPU seconds, "
        "and read the ratios). "
        f"Before: {args.against}'s engine; after: this tree's; each figure in its own process, the two "
        f"alternating, median of {args.rounds} rounds. Real speech (pocketsphinx librivox and cards clips, jfk; "
        f"the encoder rows cut to 5 s, trimmed context; the decode step 40 tokens into each sequence), "
        f"{args.model}, default settings (--quantize auto).",
        "",
        "| figure | before | after | after / before |",
        "|---|---:|---:|---:|",
    ]
    for label, key, higher_is_better in rows:
        scale = 1000.0 if key.startswith("step_") else 1.0
        before, after = median("before", key) * scale, median("after", key) * scale
        ratio = after / before
        lines.append(
            f"| {label} | {before:.3f} | {after:.3f} | {ratio:.2f}x{' (higher is faster)' if higher_is_better else ''} |"
        )
    lines += [
        "",
        f"Identical transcripts, before vs after, per round: {', '.join(f'{k}/{n}' for k in same)}.",
    ]
    print("\n".join(lines))
    if args.write:
        write_section(AGAINST_SECTION, "scripts/bench_engine.py --against", "\n".join(lines[2:]))


def old_modules(ref: str, where: Path) -> tuple[ModuleType, ModuleType]:
    """engine/model/model.py and engine/decoding/rules.py as they were at `ref`, as modules beside today's engine."""
    modules = []
    for name in ("model", "decoding"):
        path = where / f"old_{name}.py"
        path.write_text(subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:engine/{name}.py"],
                                       check=True, capture_output=True, text=True).stdout)  # fmt: skip
        spec = importlib.util.spec_from_file_location(f"old_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


def decode_step_bench(args: argparse.Namespace) -> None:
    from engine.model.kv_cache import KVCache
    from engine.model.step import DecodeStepper
    from engine.parameters import DecodeOptions
    from engine.scheduling.request import Request

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    slots = max(sizes)
    weights = load(args.model)
    runner = ModelRunner(
        weights, EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_slots=slots)
    )
    clips = real_clips(slots)
    runner.encode(clips, list(range(slots)), [runner.audio_ctx_for(len(c)) for c in clips])
    v = runner.rules.vocab
    runner.prefill([[v.sot, v.no_timestamps]] * slots, [0] * slots, slice(0, slots))
    tmp = Path(tempfile.mkdtemp(prefix="bench-step-"))
    old_model_mod, old_decoding_mod = old_modules(args.before, tmp)
    old_model = old_model_mod.from_transformers(weights.hf_model()).to(runner.device, runner.dtype)
    old_rules = old_decoding_mod.DecodingRules(
        weights.tokenizer,
        weights.generation_config,
        runner.model.dims.n_vocab,
        runner.multilingual,
        runner.device,
    )
    c = runner.cache
    old_cache = KVCache(slots=slots, layers=len(c.self_k), heads=c.self_k[0].shape[1], head_dim=c.self_k[0].shape[3],
                        max_tokens=c.max_tokens, audio_ctx=c.cross_k[0].shape[2], device=runner.device,
                        dtype=runner.dtype)  # fmt: skip
    for new, old in ((c.cross_k, old_cache.cross_k), (c.cross_v, old_cache.cross_v)):
        for n, o in zip(new, old, strict=True):
            o.copy_(n)
    old_cache.cross_len.copy_(c.cross_len)
    with torch.inference_mode():
        prompt = torch.tensor([[v.sot, v.no_timestamps]] * slots, device=runner.device)
        old_model.decode(
            prompt, torch.zeros(slots, dtype=torch.long, device=runner.device), slice(0, slots), old_cache
        )
    reqs = [Request(id=str(i), audio=clips[i], options=DecodeOptions(), future=None) for i in range(slots)]  # type: ignore[arg-type]
    for r in reqs:
        r.generated = [v.no_timestamps, 440]  # past the first sampled token: the plain rules
    length = 40  # a step 40 tokens into each sequence

    @torch.inference_mode()
    def before(b: int) -> list[int]:
        # ef365cc's runner.step and scheduler._choose: tensors from lists, host reads in decode, two fetches.
        token_t = torch.tensor([v.sot] * b, device=runner.device)[:, None]
        start = torch.tensor([length] * b, device=runner.device)
        logits = old_model.decoder.logits(old_model.decode(token_t, start, slice(0, b), old_cache)[:, 0])
        tokens, logprobs = old_rules.next_tokens(logits[list(range(b))], reqs[:b])
        logprobs.tolist()
        return list(tokens.tolist())

    eager_stepper = runner.stepper
    compiled_stepper = DecodeStepper(runner.model, c, runner.device, compile=True, graphs=False, static=True)

    @torch.inference_mode()
    def after(b: int, stepper: DecodeStepper = eager_stepper) -> list[int]:
        runner.stepper = stepper
        logits = runner.step([v.sot] * b, [length] * b)
        choice = runner.rules.next_tokens(logits.clone(), reqs[:b])
        choice.logprobs.tolist()
        return list(choice.tokens.tolist())

    lines = [
        STEP_SECTION,
        "",
        f"`python scripts/bench_engine.py --decode-step --batch-sizes {args.batch_sizes} --compiled-sizes "
        f"{args.compiled_sizes} --threads {args.threads} --repeats {args.repeats}` on {machine()}, "
        f"{datetime.date.today()}, load average before the run {os.getloadavg()[0]:.1f} (a shared machine: "
        f"read ratios, not absolute times). {args.model}; a step {length} tokens into each sequence over "
        f"real-speech cross-attention (pocketsphinx librivox and cards clips, jfk; trimmed context); the step "
        f"includes the decoding rules and fetching the tokens, as the scheduler runs it; median of "
        f"{args.repeats} rounds, the variants interleaved in each round. Before: {args.before} (separate "
        "Q/K/V Linear layers, host reads in the step). Compiled: inductor, static shapes per bucket "
        "(first call per shape compiles; its time in the last column).",
        "",
        "| batch | before (ms) | after, eager (ms) | after, compiled (ms) | eager speed-up vs before "
        "| compiled vs eager | same tokens (before / compiled) | compile (s) |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    compiled_sizes = {int(b) for b in args.compiled_sizes.split(",") if b}
    for b in sizes:
        runs = {"before": partial(before, b), "eager": partial(after, b)}
        same = f"{before(b) == after(b)}"
        compile_s = 0.0
        if b in compiled_sizes:
            with Stopwatch(descendants=False) as compiling:
                compiled_tokens = after(b, compiled_stepper)
            compile_s = compiling.wall_s
            same += f" / {compiled_tokens == after(b)}"
            runs["compiled"] = partial(after, b, compiled_stepper)
        t = interleaved_median_wall_s(runs, args.repeats, runner.sync)
        compiled = (
            f"{1000 * t['compiled']:.2f} | {t['before'] / t['eager']:.2f}x | {t['eager'] / t['compiled']:.2f}x"
            if "compiled" in t
            else f"- | {t['before'] / t['eager']:.2f}x | -"
        )
        lines.append(
            f"| {b} | {1000 * t['before']:.2f} | {1000 * t['eager']:.2f} | {compiled} | {same} "
            f"| {f'{compile_s:.0f}' if compile_s else '-'} |"
        )
        print(lines[-1], flush=True)
    runner.stepper = eager_stepper

    lines += [
        "",
        "| batch | vocabulary projection's share of the step (eager, torch.profiler self CPU time) |",
        "|---:|---:|",
    ]
    from torch.profiler import ProfilerActivity, profile

    vocab = str(runner.model.dims.n_vocab)
    for b in sizes:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(10):
                after(b)
        events = prof.key_averages(group_by_input_shape=True)
        total = sum(e.self_cpu_time_total for e in events)
        proj = sum(
            e.self_cpu_time_total
            for e in events
            if e.key in ("aten::mm", "aten::addmm") and vocab in str(e.input_shapes)
        )
        lines.append(f"| {b} | {100 * proj / total:.0f}% |")
        print(lines[-1], flush=True)

    n = args.utterances
    old_tree = source_tree(args.before, tmp / "before", ["engine"])
    lines += [
        "",
        f"{n} real utterances submitted at once through the engine (default settings, {args.threads or 'default'} "
        "threads), each variant in its own process, alternating:",
        "",
        "| round | before utt/s | after utt/s | after / before | identical transcripts |",
        "|---:|---:|---:|---:|---:|",
    ]
    for round_ in range(1, args.rounds + 1):
        figures = {}
        for name, path in (("before", old_tree), ("after", REPO)):
            env = {**os.environ, "PYTHONPATH": str(path)}
            cmd = [sys.executable, __file__, "--throughput-json", str(n), "--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=path).stdout
            figures[name] = json.loads(out.strip().splitlines()[-1])
        same = sum(
            a == b for a, b in zip(figures["before"]["tokens"], figures["after"]["tokens"], strict=True)
        )
        lines.append(
            f"| {round_} | {figures['before']['utt_s']:.2f} | {figures['after']['utt_s']:.2f} "
            f"| {figures['after']['utt_s'] / figures['before']['utt_s']:.2f}x | {same}/{n} |"
        )
        print(lines[-1], flush=True)
    lines += ["", f"Load average after the run: {os.getloadavg()[0]:.1f}."]
    print("\n".join(lines))
    if args.write:
        write_section(STEP_SECTION, "scripts/bench_engine.py --decode-step", "\n".join(lines[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--utterance-seconds", type=float, default=4.0, help="length of each test utterance")
    parser.add_argument("--contexts", default="full,trim", help="encoder contexts to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="replace the section in docs/benchmarks.md")
    parser.add_argument("--decode-step", action="store_true", help="the decode-step benchmark instead")
    parser.add_argument("--before", default=BEFORE_REF, help="--decode-step: the git ref to compare with")
    parser.add_argument(
        "--utterances", type=int, default=16, help="--decode-step, --against: utterances submitted at once"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="--decode-step, --against: before/after throughput rounds"
    )
    parser.add_argument(
        "--compiled-sizes",
        default="1,8,16",
        help="--decode-step: batch sizes to compile (minutes each on a CPU)",
    )
    parser.add_argument(
        "--against", default="", help="this tree's engine against this git ref's, in one run (see above)"
    )
    parser.add_argument("--throughput-json", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--micro-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.throughput_json:
        throughput_json(args.threads, args.throughput_json)
        return
    if args.micro_json:
        micro_json(args)
        return
    if args.against:
        against(args)
        return
    if args.decode_step:
        decode_step_bench(args)
        return
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    weights = load(args.model)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_slots=max(sizes))
    rng = np.random.default_rng(0)
    audio = [
        (rng.standard_normal(int(16000 * args.utterance_seconds)) * 0.05).astype(np.float32)
        for _ in range(max(sizes))
    ]
    lines = [
        SECTION,
        "",
        f"`python scripts/bench_engine.py --model {args.model} --batch-sizes {args.batch_sizes}` on "
        f"{machine()}, {datetime.date.today()}; {args.utterance_seconds:g} s utterances, median of {args.repeats}.",
        "",
        "| encoder context | B | loop of B single calls (s) | one batch-B call (s) | per utterance: loop / batch (ms) | batch speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for context in args.contexts.split(","):
        config.encoder_context = context  # type: ignore[assignment]
        runner = ModelRunner(weights, config)
        for b in sizes:
            reps = (
                1
                if b * (30 if context == "full" else 1) > 200 and runner.device.type == "cpu"
                else args.repeats
            )
            loop = median_wall_s(partial(encode_loop, runner, audio[:b]), reps, runner.sync)
            batch = median_wall_s(partial(encode_batch, runner, audio[:b]), reps, runner.sync)
            lines.append(
                f"| {context} | {b} | {loop:.3f} | {batch:.3f} | {1000 * loop / b:.1f} / {1000 * batch / b:.1f} "
                f"| {loop / batch:.2f}x |"
            )
            print(lines[-1], flush=True)
        del runner
    config.encoder_context = "trim"
    runner = ModelRunner(weights, config)
    encode_batch(runner, audio)
    prompt = runner.rules.vocab
    lines += [
        "",
        "| decode batch | step time (ms) | per sequence (ms) | vs batch 1 per sequence |",
        "|---|---|---|---|",
    ]
    base = 0.0
    for b in sizes:
        runner.prefill([[prompt.sot, prompt.no_timestamps]] * b, [0] * b, slice(0, b))
        tokens, lengths = [prompt.sot] * b, [40] * b  # a step 40 tokens into each sequence
        step = median_wall_s(partial(runner.step, tokens, lengths), max(args.repeats, 10), runner.sync)
        base = base or step
        lines.append(f"| {b} | {1000 * step:.1f} | {1000 * step / b:.2f} | {base * b / step:.1f}x |")
        print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.write:
        write_section(SECTION, "scripts/bench_engine.py", "\n".join(lines[2:]))


if __name__ == "__main__":
    main()
