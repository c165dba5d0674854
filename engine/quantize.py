"""Dynamic quantization of the model's Linear layers (CPU, float32 models only).

Weights are converted once at load time; the int8 schemes also quantize activations on the
fly, per batch (torch.ao `quantize_dynamic`, fbgemm/x86 kernels). Three schemes:

- `int8`: one scale per output channel (torch.ao `per_channel_dynamic_qconfig`): a row of the
  51,864 x 384 vocabulary projection or of an attention matrix keeps its own range instead of
  sharing the largest row's.
- `int8-per-tensor`: one scale for the whole matrix (the first scheme this engine shipped, the
  old `--quantize on`).
- `fp16`: weight-only, float16 weights and float32 activations (fbgemm's fp16 GEMM). The
  bundled tiny.en ships float16 weights, so this stores exactly what was loaded.
int8 quantizes activations too, with one scale per input tensor computed over the whole batch:
a row's result then depends on the other rows in its batch, so the engine's "batched equals
alone" property holds for off and fp16 only.
Which scheme and which parts the CPU default uses is decided by scripts/bench_levers.py on real
and espeak speech (docs/benchmarks.md, "Engine levers").

`parts` chooses which Linear layers are quantized: the vocabulary projection (tied to the token
embedding, so it gets its own Linear first), the decoder's other Linear layers, the encoder's.
Layers are picked by where they sit in the model, never by their names inside a block, so a
fused QKV projection or any other Linear is covered the same way.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

import torch
from torch import nn

from engine.config import QUANTIZE_MODES, QUANTIZE_PARTS, EngineConfig, parse_quantize_parts
from engine.model import Whisper

log = logging.getLogger(__name__)

QuantizeMode = Literal["off", "int8", "int8-per-tensor", "fp16"]


# The CPU default, from scripts/bench_levers.py (docs/benchmarks.md "Engine levers"): the fastest
# scheme that kept WER on real and espeak speech and keeps tokens independent of batch company.
AUTO_CPU_MODE: QuantizeMode = "fp16"


def resolve_mode(mode: str, device: torch.device, dtype: torch.dtype) -> QuantizeMode:
    """The scheme a model on `device` in `dtype` gets. `auto` means the measured CPU default
    (AUTO_CPU_MODE) on a float32 CPU model and off anywhere else (quantize_dynamic's kernels
    are CPU only; a GPU runs float16/bfloat16 instead). An explicit int8 mode where it cannot run
    is an error, not a silent fallback."""
    if mode == "auto":
        return AUTO_CPU_MODE if device.type == "cpu" and dtype == torch.float32 else "off"
    if mode == "on":
        mode = "int8-per-tensor"
    if mode == "off":
        return "off"
    if mode not in ("int8", "int8-per-tensor", "fp16"):
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_MODES)} (got {mode!r})")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"--quantize {mode} needs --device cpu and float32 (got {device.type}, {dtype}); "
            "on GPU use --dtype float16 or bfloat16, or --quantize auto"
        )
    return mode  # type: ignore[return-value]  # narrowed by the checks above


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


def quantize(model: Whisper, mode: QuantizeMode, parts: tuple[str, ...] = QUANTIZE_PARTS) -> Whisper:
    """`model` with the Linear layers of `parts` as dynamic int8 (`mode` from resolve_mode)."""
    if mode == "off" or not parts:
        return model
    from torch.ao.quantization import (
        default_dynamic_qconfig,
        float16_dynamic_qconfig,
        per_channel_dynamic_qconfig,
        quantize_dynamic,
    )

    qconfig = {
        "int8": per_channel_dynamic_qconfig,
        "int8-per-tensor": default_dynamic_qconfig,
        "fp16": float16_dynamic_qconfig,
    }[mode]
    if "projection" in parts:
        untie_projection(model)
    spec = dict.fromkeys(linear_names(model, parts), qconfig)
    dtype = torch.float16 if mode == "fp16" else torch.qint8
    with warnings.catch_warnings():  # torch.ao's eager quantization warns it moves to torchao
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return quantize_dynamic(model, qconfig_spec=spec, dtype=dtype)  # type: ignore[arg-type]


def quantize_for(model: Whisper, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Whisper:
    """The model as `config` asks (--quantize, --quantize-parts) for `device` and `dtype`."""
    # --compile traces the step in one graph, which the dynamic quantized layers break: auto yields.
    mode = (
        "off"
        if config.compile and config.quantize == "auto"
        else resolve_mode(config.quantize, device, dtype)
    )
    parts = parse_quantize_parts(config.quantize_parts)
    if mode != "off":
        log.info("quantizing %s to %s", ",".join(parts), mode)
    return quantize(model, mode, parts)
