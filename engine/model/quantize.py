"""Quantization of the model's Linear layers (CPU, float32 models only).

Weights are converted once at load time; the int8 schemes also quantize activations on the
fly. Four schemes:

- `int8`: Int8Linear below. Symmetric int8 weights with one scale per output channel, and
  activations with one scale per row (a token, an encoder frame), multiplied exactly in int32 by
  oneDNN. A row's result depends on that row alone, bit for bit. In the encoder, whose attention
  runs row by row (engine/model/model.py), that keeps "batched equals alone" exact; in the decoder it
  would not: a decode step's attention over keys padded to the longest row differs from alone in
  the last bits (in fp32 too), and int8 can turn those bits into other tokens.
- `int8-per-batch`: torch.ao `quantize_dynamic` with per-channel weight scales
  (`per_channel_dynamic_qconfig`, fbgemm), but ONE activation scale per input tensor, computed over
  the whole batch: a row's result depends on the other rows in its call, so tokens can change with
  batch company (kept to measure against; tests/engine/test_quantize.py shows the mechanism).
- `int8-per-tensor`: as int8-per-batch with one weight scale for the whole matrix (the first scheme
  this engine shipped).
- `fp16`: weight-only, float16 weights and float32 activations (fbgemm's fp16 GEMM). The
  bundled tiny.en ships float16 weights, so this stores exactly what was loaded.
Which scheme each part gets by default (`auto`: AUTO_CPU_PLAN, int8 on the encoder and fp16 on
the decoder and projection) is decided by scripts/bench_levers.py on real and espeak speech
(docs/benchmarks.md, "Engine levers"); scripts/bench_int8_kernels.py times the kernels per Linear
shape.

`parts` chooses which Linear layers are quantized: the vocabulary projection (tied to the token
embedding, so it gets its own Linear first), the decoder's other Linear layers, the encoder's.
Layers are picked by where they sit in the model, never by their names inside a block, so a
fused QKV projection or any other Linear is covered the same way.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, cast

import torch
from torch import Tensor, nn

from engine.config import QUANTIZE_MODES, QUANTIZE_PARTS, EngineConfig, parse_quantize_parts
from engine.model.model import Whisper

log = logging.getLogger(__name__)

QuantizeMode = Literal["off", "int8", "int8-per-batch", "int8-per-tensor", "fp16"]


# The CPU default, from scripts/bench_levers.py (docs/benchmarks.md "Engine levers"): per part, the
# fastest scheme that kept WER on real speech and keeps tokens independent of batch company. int8 per
# row on the encoder, whose rows are then bit for bit what they are alone; fp16 weights on the
# decoder and projection: a decode step's attention over padded keys differs from alone in the last
# bits (in fp32 too), and int8 there would turn those bits into other tokens.
AUTO_CPU_PLAN: dict[str, QuantizeMode] = {"encoder": "int8", "decoder": "fp16", "projection": "fp16"}
# Without int8 dot-product instructions (VNNI, AMX) oneDNN multiplies u8 x s8 pairs through 16-bit
# sums that can saturate: auto then leaves the encoder float32.
AUTO_CPU_FALLBACK_PLAN: dict[str, QuantizeMode] = {"decoder": "fp16", "projection": "fp16"}
INT8_CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# Schemes whose activation scale spans the batch: a row's result depends on its company.
BATCH_DEPENDENT_MODES = ("int8-per-batch", "int8-per-tensor")
_TINY = torch.finfo(torch.float32).tiny
_HALF_PAST_ZERO_POINT = torch.tensor(128.5)


@functools.cache
def cpu_has_int8_dot_product() -> bool:
    """Whether this CPU has exact int8 dot-product instructions that oneDNN uses (x86 Linux flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return torch.backends.mkldnn.is_available() and any(f" {flag}" in flags for flag in INT8_CPU_FLAGS)


def resolve_mode(mode: str, device: torch.device, dtype: torch.dtype) -> QuantizeMode:
    """The scheme an explicit --quantize gives a model on `device` in `dtype` (`auto` is per part:
    resolve_plan). A mode where it cannot run is an error, not a silent fallback."""
    if mode == "off":
        return "off"
    if mode not in ("int8", "int8-per-batch", "int8-per-tensor", "fp16"):
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_MODES)} (got {mode!r})")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"--quantize {mode} needs --device cpu and float32 (got {device.type}, {dtype}); "
            "on GPU use --dtype float16 or bfloat16, or --quantize auto"
        )
    if mode == "int8" and not torch.backends.mkldnn.is_available():
        raise ValueError("--quantize int8 needs a torch built with oneDNN (mkldnn); use fp16 or auto")
    return mode  # type: ignore[return-value]  # narrowed by the checks above


def resolve_plan(
    mode: str, parts: tuple[str, ...], device: torch.device, dtype: torch.dtype
) -> dict[str, QuantizeMode]:
    """The scheme each of `parts` gets (a part left out stays float). `auto`: AUTO_CPU_PLAN on a
    float32 CPU model (AUTO_CPU_FALLBACK_PLAN on a CPU without int8 dot products), nothing anywhere
    else (these kernels are CPU only; a GPU runs float16/bfloat16 instead); any other mode: that
    scheme on every part."""
    if mode == "auto":
        if device.type != "cpu" or dtype != torch.float32:
            return {}
        plan = AUTO_CPU_PLAN if cpu_has_int8_dot_product() else AUTO_CPU_FALLBACK_PLAN
        return {part: scheme for part, scheme in plan.items() if part in parts}
    scheme = resolve_mode(mode, device, dtype)
    return {} if scheme == "off" else dict.fromkeys(parts, scheme)


def tokens_can_follow_company(plan: Mapping[str, QuantizeMode]) -> bool:
    """Whether `plan` lets a row's tokens depend on the rows batched with it: a scheme whose
    activation scale spans the batch anywhere, or int8 in the decoder or projection (exact per row
    itself, but fed by attention whose last bits differ from alone; tests/engine/test_quantize.py)."""
    return any(scheme in BATCH_DEPENDENT_MODES for scheme in plan.values()) or any(
        plan.get(part) == "int8" for part in ("decoder", "projection")
    )


def describe(plan: Mapping[str, QuantizeMode]) -> str:
    """`plan` in words, e.g. "int8 on encoder, fp16 on decoder,projection"."""
    if not plan:
        return "off"
    by_scheme: dict[str, list[str]] = {}
    for part, scheme in plan.items():
        by_scheme.setdefault(scheme, []).append(part)
    return ", ".join(f"{scheme} on {','.join(parts)}" for scheme, parts in by_scheme.items())


class Int8Linear(nn.Module):
    """A Linear in int8 whose every output row depends on its own input row alone.

    Weights: int8 with one symmetric scale per output channel, packed once for oneDNN.
    Activations: int8 with one symmetric scale per input row (a token, or an encoder frame),
    computed on the fly and shifted to uint8 (zero point 128: oneDNN's fast u8 x s8 path). The
    product accumulates exactly in int32 (oneDNN's s8/u8 matmul through
    `torch.ops.onednn.qlinear_pointwise`, the kernel of torch's x86 int8 backend) and is scaled by
    the weight's channel scale there; the row scale and the bias follow elementwise. Integer sums do
    not depend on how a kernel blocks or splits them, so a row's result is the same bits whichever
    rows share its call: batched equals alone by construction (tests/engine/test_quantize.py).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = w.abs().amax(dim=1).clamp(min=_TINY) / 127
        q = torch.round(w / scale[:, None]).to(torch.int8)
        self.register_buffer("weight_packed", torch.ops.onednn.qlinear_prepack(q, None))
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.int64))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        # an all-zero row (padding) gets the smallest scale and quantizes to zeros
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=_TINY).div_(127)
        # x / scale + 128 lies in [1, 255]; + 0.5 and truncation round it (one op fewer than round)
        q = torch.addcdiv(_HALF_PAST_ZERO_POINT, rows, scale).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 128, self.weight_packed, self.weight_scale, self.weight_zero_point,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        # one IEEE operation per pass (no fused multiply-add that a vector body and its scalar tail
        # might round differently): an element's value cannot depend on where a kernel split the rows
        y.mul_(scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


def untie_projection(model: Whisper) -> None:
    """Give the vocabulary projection its own Linear (a copy of the tied token embedding), so
    quantization can reach it while the embedding lookup stays float."""
    emb = model.decoder.token_embedding.weight
    proj = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device=emb.device, dtype=emb.dtype)
    proj.weight = nn.Parameter(emb.detach().clone(), requires_grad=False)
    model.decoder.proj = proj


def linear_names(model: Whisper, parts: tuple[str, ...]) -> list[str]:
    """Qualified names of the Linear layers that belong to `parts`."""
    chosen: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name == "decoder.proj":
            part = "projection"
        elif name.startswith("decoder."):
            part = "decoder"
        elif name.startswith("encoder."):
            part = "encoder"
        else:
            continue
        if part in parts:
            chosen.append(name)
    return chosen


def quantize(
    model: Whisper,
    scheme: QuantizeMode | Mapping[str, QuantizeMode],
    parts: tuple[str, ...] = QUANTIZE_PARTS,
) -> Whisper:
    """`model` with its Linear layers quantized: `scheme` on every one of `parts`, or a plan
    (part -> scheme, from resolve_plan)."""
    plan = dict.fromkeys(parts, scheme) if isinstance(scheme, str) else dict(scheme)
    plan = {part: s for part, s in plan.items() if s != "off"}
    if not plan:
        return model
    if "projection" in plan:
        untie_projection(model)
    for name in linear_names(model, tuple(part for part, s in plan.items() if s == "int8")):
        model.set_submodule(name, Int8Linear.from_float(cast(nn.Linear, model.get_submodule(name))))
    dynamic = {part: s for part, s in plan.items() if s != "int8"}
    if not dynamic:
        return model
    from torch.ao.quantization import (
        default_dynamic_qconfig,
        float16_dynamic_qconfig,
        per_channel_dynamic_qconfig,
        quantize_dynamic,
    )

    qconfigs = {
        "int8-per-batch": per_channel_dynamic_qconfig,
        "int8-per-tensor": default_dynamic_qconfig,
        "fp16": float16_dynamic_qconfig,
    }
    spec = {name: qconfigs[s] for part, s in dynamic.items() for name in linear_names(model, (part,))}
    with warnings.catch_warnings():  # torch.ao's eager quantization warns it moves to torchao
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # in place: the int8 layers above hold oneDNN-packed weights, which cannot be deep-copied
        return quantize_dynamic(model, qconfig_spec=spec, inplace=True)  # type: ignore[arg-type]


def quantize_for(model: Whisper, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Whisper:
    """The model as `config` asks (--quantize, --quantize-parts) for `device` and `dtype`."""
    parts = parse_quantize_parts(config.quantize_parts)
    # --compile traces the step in one graph, which the dynamic quantized layers break: auto yields.
    auto_yields = config.compile and config.quantize == "auto"
    plan = {} if auto_yields else resolve_plan(config.quantize, parts, device, dtype)
    if plan:
        log.info("quantizing: %s", describe(plan))
    return quantize(model, plan)
