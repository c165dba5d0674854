"""Per-Linear-shape speed of the CPU kernels --quantize can choose from, on tiny.en's shapes.

    python scripts/bench_int8_kernels.py [--threads 2] [--json out.json] [--write]

For each Linear of tiny.en (d_model 384, FFN 1536, vocabulary 51,864) and each row count M (decode
steps at batch 1, 8, 16; a prefill of 16 prompts; one trimmed and one full encoder window), the time of
one call of:

- fp32: `F.linear` (MKL/oneDNN sgemm), the unquantized engine;
- fp16 weights: torch.ao's dynamic fp16 Linear (fbgemm), the default before int8-per-row;
- int8 torch.ao: torch.ao's dynamic int8 Linear, per-channel weights and ONE activation scale per
  input tensor (fbgemm): the batch-dependent scheme;
- int8 per-row: engine/model/quantize.py's Int8Linear (one scale per input row, `torch._int_mm`);
- int8 weight-only: `torch.ops.aten._weight_int8pack_mm` (int8 weights, float32 activations), at
  decode rows only (M <= 16): 10-40x slower than fp32 already there on this CPU (its AVX-512 path is
  not built into this torch), so the larger shapes would only cost minutes.

Times are the median of `torch.utils.benchmark` blocks (wall, in microseconds) and CPU microseconds per
call (process time over the same loop): on a shared machine the CPU figure is the steadier one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from docs_section import write_section  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils import benchmark  # noqa: E402

from engine.model.quantize import Int8Linear  # noqa: E402
from harness.server import short_commit  # noqa: E402
from harness.usage import cpu_model  # noqa: E402

SHAPES = {  # name: (in_features, out_features)
    "attn qkv": (384, 1152),
    "attn out / cross query": (384, 384),
    "cross kv": (384, 768),
    "mlp fc1": (384, 1536),
    "mlp fc2": (1536, 384),
    "vocab projection": (384, 51864),
}
ROWS = {
    "step b1": 1,
    "step b8": 8,
    "step b16": 16,
    "prefill 16x3": 48,
    "encoder 7 s": 350,
    "encoder 30 s": 1500,
}


def kernels(linear: nn.Linear) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp16 = DynamicLinear.from_float(_with_qconfig(linear, torch.ao.quantization.float16_dynamic_qconfig))
        ao8 = DynamicLinear.from_float(_with_qconfig(linear, per_channel_dynamic_qconfig))
    row8 = Int8Linear.from_float(linear)
    w = linear.weight.detach()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
    wq = torch.round(w / scale[:, None]).to(torch.int8)
    bias = linear.bias.detach() if linear.bias is not None else None

    def weight_only(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x, wq, scale)
        return y + bias if bias is not None else y

    return {
        "fp32": lambda x: F.linear(x, w, bias),
        "fp16 weights": fp16,
        "int8 torch.ao": ao8,
        "int8 per-row": row8,
        "int8 weight-only": weight_only,
    }


def _with_qconfig(linear: nn.Linear, qconfig: object) -> nn.Linear:
    linear.qconfig = qconfig  # type: ignore[assignment]
    return linear


def time_one(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[float, float]:
    timer = benchmark.Timer("fn(x)", globals={"fn": fn, "x": x}, num_threads=torch.get_num_threads())
    wall = timer.blocked_autorange(min_run_time=0.2).median
    n = max(3, int(0.2 / max(wall, 1e-6)))
    c0 = time.process_time()
    for _ in range(n):
        fn(x)
    return wall * 1e6, (time.process_time() - c0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", action="store_true", help="replace the table in docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results: list[dict[str, object]] = []
    load_start = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    names: list[str] = []
    for shape, (k, n) in SHAPES.items():
        linear = nn.Linear(k, n, bias=shape != "vocab projection")
        ks = kernels(linear)
        names = list(ks)
        for rows_name, m in ROWS.items():
            encoder_rows = rows_name.startswith("encoder")
            if shape == ("vocab projection" if encoder_rows else "cross kv"):
                continue  # the projection never sees encoder frames; cross K/V only sees them
            x = torch.randn(m, k)
            with torch.inference_mode():
                timings = {
                    name: time_one(fn, x) for name, fn in ks.items() if name != "int8 weight-only" or m <= 16
                }
            results.append({"shape": shape, "k": k, "n": n, "rows": rows_name, "m": m, "timings": timings})
            print(shape, rows_name, json.dumps(timings), flush=True)
    load_end = os.getloadavg()
    commit = short_commit()
    cpu = cpu_model()
    lines = [
        f"`python scripts/bench_int8_kernels.py --threads {args.threads}` at commit {commit}, "
        f"{started:%Y-%m-%d %H:%M} UTC, {cpu}, {args.threads} thread(s), torch {torch.__version__}; load "
        f"average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_start)} at the start, "
        f"{'/'.join(f'{x:.1f}' for x in load_end)} at the end. One call of each kernel: median wall "
        "microseconds (torch.utils.benchmark), and in brackets CPU microseconds per call over the same "
        "loop; the last column is fp16 weights' CPU time over int8 per-row's (above 1: int8 per row is "
        "cheaper).",
        "",
        "| Linear (in x out) | rows | "
        + " | ".join(f"{n} µs (CPU)" for n in names)
        + " | fp16 / int8 per row (CPU) |",
        "|---|---|" + "---:|" * (len(names) + 1),
    ]
    for r in results:
        t = r["timings"]
        assert isinstance(t, dict)
        cells = " | ".join(f"{t[n][0]:.0f} ({t[n][1]:.0f})" if n in t else "—" for n in names)
        ratio = t["fp16 weights"][1] / t["int8 per-row"][1]
        lines.append(
            f"| {r['shape']} ({r['k']}x{r['n']}) | {r['rows']} (M={r['m']}) | {cells} | {ratio:.2f}x |"
        )
    text = "\n".join(lines)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.write:
        write_section("### int8 kernels per Linear shape", "scripts/bench_int8_kernels.py", text)


if __name__ == "__main__":
    main()
