"""int8 quantization (engine/quantize.py) on the real bundled tiny.en weights: which layers get
which weight scales, what --quantize accepts where, and that the CPU default keeps jfk's tokens."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from engine import Engine, EngineConfig
from engine.model import Whisper, from_transformers
from engine.quantize import linear_names, quantize, quantize_for, resolve_mode
from engine.weights import load
from service.config import parse_args
from tests.support.engine import jfk_16k

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@cache
def _tiny_hf() -> object:
    return load("tiny.en").model


def tiny_model() -> Whisper:
    """A fresh float32 tiny.en (quantize_dynamic swaps the modules of the model it is given)."""
    return from_transformers(_tiny_hf())


def test_per_channel_int8_gives_each_output_row_its_own_scale_on_the_chosen_parts_only() -> None:
    model = quantize(tiny_model(), "int8", ("decoder", "projection"))
    decoder = [
        m for n, m in model.named_modules() if n.startswith("decoder.") and isinstance(m, DynamicLinear)
    ]
    # every Linear in the decoder's blocks, whatever their names, and the (untied) projection
    assert len(decoder) == len(linear_names(tiny_model(), ("decoder",))) + 1 > 2
    for layer in decoder:
        w = layer.weight()
        assert w.qscheme() == torch.per_channel_affine
        scales = w.q_per_channel_scales()
        assert scales.shape == (w.shape[0],)  # one per output row
        assert scales.unique().numel() > 1  # really per row, not one value repeated
    proj = model.decoder.proj
    assert isinstance(proj, DynamicLinear) and proj.weight().shape == (51864, 384)
    encoder = [m for n, m in model.named_modules() if n.startswith("encoder.") and isinstance(m, nn.Linear)]
    assert encoder and all(type(m) is nn.Linear for m in encoder)  # left float32
    assert not any(isinstance(m, DynamicLinear) for n, m in model.named_modules() if n.startswith("encoder."))


def test_per_tensor_int8_has_one_scale_per_matrix() -> None:
    model = quantize(tiny_model(), "int8-per-tensor", ("projection",))
    assert model.decoder.proj is not None
    assert model.decoder.proj.weight().qscheme() == torch.per_tensor_affine
    assert sum(isinstance(m, DynamicLinear) for m in model.modules()) == 1  # the projection alone


def test_quantized_projection_logits_stay_close_to_float() -> None:
    """Per-channel int8 on the projection changes logits by little against their spread (a
    broken scale or a transposed weight would not)."""
    ref = tiny_model()
    q = quantize(tiny_model(), "int8", ("projection",))
    h = torch.randn(4, 384, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = ref.decoder.logits(h), q.decoder.logits(h)
    assert ((a - b).abs().mean() / a.std()).item() < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_int8_activations_are_scaled_per_batch_and_fp16_weights_are_not() -> None:
    """Why the batch-invariance column of the levers table reads as it does: int8 scales a
    whole input tensor at once, so a row's logits depend on the rows beside it; fp16 weight-only
    keeps float32 activations and each row to itself."""
    h = torch.randn(16, 384, generator=torch.Generator().manual_seed(1))
    h[5:] *= 8  # louder company
    with torch.inference_mode():
        for mode, batch_matters in (("int8", True), ("fp16", False)):
            model = quantize(tiny_model(), mode, ("projection",))  # type: ignore[arg-type]
            together, alone = model.decoder.logits(h)[:1], model.decoder.logits(h[:1])
            assert bool((together != alone).any()) is batch_matters, mode


def test_fp16_weight_only_keeps_float32_activations_on_the_chosen_parts() -> None:
    model = quantize(tiny_model(), "fp16", ("decoder", "projection"))
    fp16 = [n for n, m in model.named_modules() if isinstance(m, DynamicLinear)]
    assert "decoder.proj" in fp16 and all(n.startswith("decoder.") for n in fp16)
    assert all(model.get_submodule(n)._packed_params.dtype == torch.float16 for n in fp16)


def test_modes_resolve_per_device_and_refuse_int8_where_it_cannot_run() -> None:
    assert resolve_mode("auto", CPU, torch.float32) == "fp16"  # the levers table's pick
    assert resolve_mode("auto", CPU, torch.bfloat16) == "off"
    assert resolve_mode("auto", CUDA, torch.float16) == "off"  # quantize_dynamic is CPU only
    assert resolve_mode("on", CPU, torch.float32) == "int8-per-tensor"  # the old spelling keeps its meaning
    assert resolve_mode("off", CUDA, torch.float16) == "off"
    with pytest.raises(ValueError, match="--quantize int8 needs --device cpu and float32"):
        resolve_mode("int8", CUDA, torch.float16)
    with pytest.raises(ValueError, match="--quantize int8-per-tensor needs --device cpu and float32"):
        resolve_mode("on", CPU, torch.bfloat16)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--quantize", "int4"],
            "--quantize must be one of auto, off, int8, int8-per-tensor, fp16, on (got 'int4')",
        ),
        (
            ["--quantize-parts", "decoder,lm_head"],
            "--quantize-parts must be all or a comma-separated subset of",
        ),
        (["--quantize-parts", ","], "--quantize-parts must be all or a comma-separated subset of"),
    ],
)
def test_bad_quantize_flags_exit_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_quantize_flags_parse() -> None:
    e = parse_args(["--quantize", "int8", "--quantize-parts", "projection,decoder"]).engine
    assert (e.quantize, e.quantize_parts) == ("int8", "projection,decoder")
    assert e.validate() == []


def test_the_cpu_default_stores_decoder_and_projection_weights_as_fp16_and_leaves_the_encoder() -> None:
    model = quantize_for(tiny_model(), EngineConfig(), CPU, torch.float32)
    reached = {n for n, m in model.named_modules() if isinstance(m, DynamicLinear)}
    assert reached == {*linear_names(tiny_model(), ("decoder",)), "decoder.proj"}
    assert all(model.get_submodule(n)._packed_params.dtype == torch.float16 for n in reached)
    assert not any(n.startswith("encoder.") for n in reached)
    assert quantize_for(tiny_model(), EngineConfig(quantize="off"), CPU, torch.float32).decoder.proj is None


def test_default_config_keeps_jfk_tokens_of_float32() -> None:
    """The CPU default (docs/benchmarks.md "Engine levers" picked it) against fp32 one flag away,
    on real speech, token for token."""
    results = {}
    for quantize_mode in (EngineConfig().quantize, "off"):
        engine = Engine(EngineConfig(threads=2, device="cpu", kv_slots=2, quantize=quantize_mode))
        engine.start()
        try:
            results[quantize_mode] = engine.submit(jfk_16k()).future.result(timeout=120)
        finally:
            engine.stop()
    default, fp32 = results[EngineConfig().quantize], results["off"]
    assert list(default.tokens) == list(fp32.tokens)
