"""Quantization (engine/model/quantize.py) on the real bundled tiny.en weights: which layers get which
scales, that int8 with a scale per row makes each row's result its own (batched equals alone, on real
speech, with utterances joining and leaving) while torch.ao's per-batch int8 does not, what
--quantize accepts where, and what the CPU default does to jfk's tokens."""

from __future__ import annotations

import math
import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from engine import Engine, EngineConfig
from engine.config import QUANTIZE_PARTS
from engine.model import quantize as quantize_module
from engine.model.features import LogMel
from engine.model.model import Whisper, from_hf
from engine.model.quantize import (
    Int8Linear,
    QuantizeMode,
    cpu_has_int8_dot_product,
    linear_names,
    quantize,
    quantize_for,
    resolve_mode,
    resolve_plan,
)
from engine.model.weights import LoadedWeights, load
from service.config import parse_args
from tests.support.engine import jfk_16k

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
POCKETSPHINX = Path("/usr/share/pocketsphinx/test/data")  # pocketsphinx-testdata (scripts/setup.sh)


@cache
def _tiny_checkpoint() -> LoadedWeights:
    return load("tiny.en")


def cpu_has_avx512() -> bool:
    return " avx512f" in Path("/proc/cpuinfo").read_text()


def tiny_model() -> Whisper:
    """A fresh float32 tiny.en (quantize_dynamic swaps the modules of the model it is given)."""
    return from_hf(_tiny_checkpoint().config, _tiny_checkpoint().state)


def test_int8_gives_each_output_channel_its_own_scale_on_the_chosen_parts_only() -> None:
    model = quantize(tiny_model(), "int8", ("decoder", "projection"))
    decoder = [m for n, m in model.named_modules() if n.startswith("decoder.") and isinstance(m, Int8Linear)]
    # every Linear in the decoder's blocks, whatever their names, and the (untied) projection
    assert len(decoder) == len(linear_names(tiny_model(), ("decoder",))) + 1 > 2
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n.startswith("decoder."))
    for layer in decoder:
        scales = layer.weight_scale
        assert scales.shape == (layer.out_features,)  # one per output channel
        assert scales.unique().numel() > 1  # really per channel, not one value repeated
    proj = model.decoder.proj
    assert isinstance(proj, Int8Linear) and (proj.out_features, proj.in_features) == (51864, 384)
    encoder = [m for n, m in model.named_modules() if n.startswith("encoder.") and isinstance(m, nn.Linear)]
    assert encoder and all(type(m) is nn.Linear for m in encoder)  # left float32
    assert not any(isinstance(m, Int8Linear) for n, m in model.named_modules() if n.startswith("encoder."))


def test_int8_per_batch_is_torch_ao_with_per_channel_weights() -> None:
    model = quantize(tiny_model(), "int8-per-batch", ("projection",))
    assert isinstance(model.decoder.proj, DynamicLinear)
    assert model.decoder.proj.weight().qscheme() == torch.per_channel_affine


def reference_int8(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Int8Linear's definition, written out: symmetric int8 weights per output channel and
    activations per row, their exact integer product, then the two scales and the bias."""
    w = linear.weight.detach().float()
    w_scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    w_q = torch.round(w / w_scale[:, None]).long()
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    x_q = torch.trunc(x / x_scale + 128.5).long() - 128  # round half up, as the layer does
    y = (x_q @ w_q.T).float() * w_scale * x_scale  # int64 products: exact
    return y if linear.bias is None else y + linear.bias.detach().float()


def test_int8_rows_are_the_exact_integer_product_for_every_shape_of_tiny_en() -> None:
    """With int8 dot products (VNNI, AMX) the kernel adds int8 products exactly in int32, whatever its
    blocking: every row equals the integer reference to the bit, for decode (1, 3, 16 rows), prefill
    and encoder-sized inputs. That is what makes a row's result independent of its batch company.
    Without them (AVX2) oneDNN sums pairs in 16 bits that saturate, so some rows are not the exact
    product: the reason auto leaves the encoder float32 there."""
    exact = cpu_has_int8_dot_product()
    inexact: list[tuple[str, int]] = []
    model = tiny_model()
    linears = {
        "encoder qkv": model.encoder.blocks[0].attn.qkv,
        "encoder fc2": model.encoder.blocks[0].mlp[2],
        "cross kv": model.decoder.blocks[0].cross_attn.kv,
        "decoder out": model.decoder.blocks[1].attn.out,
        "decoder fc1": model.decoder.blocks[3].mlp[0],
    }
    gen = torch.Generator().manual_seed(2)
    for name, linear in linears.items():
        layer = Int8Linear.from_float(linear)
        for rows in (1, 3, 16, 48, 300):
            x = torch.randn(rows, linear.in_features, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
            with torch.inference_mode():
                if not torch.equal(layer(x), reference_int8(linear, x)):
                    inexact.append((name, rows))
    proj = nn.Linear(384, 51864, bias=False)
    proj.weight = model.decoder.token_embedding.weight
    layer = Int8Linear.from_float(proj)
    for rows in (1, 5, 16):
        x = torch.randn(rows, 384, generator=gen)
        with torch.inference_mode():
            if not torch.equal(layer(x), reference_int8(proj, x)):
                inexact.append(("projection", rows))
    if exact:
        assert inexact == []
    else:
        assert inexact, "this CPU has no int8 dot products, yet every product was exact"


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


@pytest.mark.parametrize(
    ("mode", "batch_matters"),
    [("int8", False), ("fp16", False), ("int8-per-batch", True), ("int8-per-tensor", True)],
)
def test_a_projection_row_alone_equals_itself_in_loud_company_unless_activations_scale_per_batch(
    mode: QuantizeMode, batch_matters: bool
) -> None:
    """int8 scales each row by itself, fp16 keeps float32 activations: a row's logits are the same
    bits alone and among 15 louder rows, at any position. torch.ao's int8 schemes scale the whole
    input tensor at once (the negative control), so the company changes them. On a CPU without
    AVX-512, fbgemm's fp16 kernel (like float32's sgemm there) blocks one row differently from
    sixteen: the row then differs from alone in its last bits only, and tokens stay those of alone
    (test_the_cpu_default_decodes_real_speech_batched_as_alone_with_utterances_joining)."""
    h = torch.randn(16, 384, generator=torch.Generator().manual_seed(1))
    h[5:] *= 8  # louder company
    model = quantize(tiny_model(), mode, ("projection",))
    with torch.inference_mode():
        together = model.decoder.logits(h)
        differs = [
            bool((together[i : i + 1] != model.decoder.logits(h[i : i + 1])).any()) for i in (0, 4, 15)
        ]
    if batch_matters:
        assert differs[0], mode  # a quiet row among loud ones
    elif mode == "fp16" and not cpu_has_avx512():
        with torch.inference_mode():
            for i in (0, 4, 15):
                alone = model.decoder.logits(h[i : i + 1])
                assert torch.allclose(
                    together[i : i + 1], alone, rtol=1e-5, atol=1e-5 * float(alone.abs().max())
                )
    else:
        assert differs == [False, False, False], mode


def test_fp16_weight_only_keeps_float32_activations_on_the_chosen_parts() -> None:
    model = quantize(tiny_model(), "fp16", ("decoder", "projection"))
    fp16 = [n for n, m in model.named_modules() if isinstance(m, DynamicLinear)]
    assert "decoder.proj" in fp16 and all(n.startswith("decoder.") for n in fp16)
    assert all(model.get_submodule(n)._packed_params.dtype == torch.float16 for n in fp16)


def test_modes_resolve_per_device_and_refuse_int8_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a CPU with VNNI: the case the levers table measured (the test below takes a CPU without)
    monkeypatch.setattr(quantize_module, "cpu_has_int8_dot_product", lambda: True)
    every = QUANTIZE_PARTS
    # the levers table's pick
    assert resolve_plan("auto", every, CPU, torch.float32) == {
        "encoder": "int8",
        "decoder": "fp16",
        "projection": "fp16",
    }
    assert resolve_plan("auto", ("encoder", "projection"), CPU, torch.float32) == {
        "encoder": "int8",
        "projection": "fp16",
    }
    assert resolve_plan("auto", every, CPU, torch.bfloat16) == {}
    assert resolve_plan("auto", every, CUDA, torch.float16) == {}  # these kernels are CPU only
    assert resolve_plan("int8", ("decoder",), CPU, torch.float32) == {"decoder": "int8"}
    with pytest.raises(ValueError, match="got 'on'"):  # the old spelling is gone, refused by name
        resolve_mode("on", CPU, torch.float32)
    assert resolve_plan("off", every, CUDA, torch.float16) == {}
    with pytest.raises(ValueError, match="--quantize int8 needs --device cpu and float32"):
        resolve_mode("int8", CUDA, torch.float16)
    with pytest.raises(ValueError, match="--quantize int8-per-tensor needs --device cpu and float32"):
        resolve_plan("int8-per-tensor", every, CPU, torch.bfloat16)


def test_auto_leaves_the_encoder_float_on_a_cpu_without_int8_dot_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without VNNI/AMX oneDNN sums u8 x s8 pairs in 16 bits, which can saturate: auto does not
    choose int8 there (an explicit --quantize int8 still runs)."""
    monkeypatch.setattr(quantize_module, "cpu_has_int8_dot_product", lambda: False)
    assert resolve_plan("auto", QUANTIZE_PARTS, CPU, torch.float32) == {
        "decoder": "fp16",
        "projection": "fp16",
    }
    assert resolve_plan("int8", QUANTIZE_PARTS, CPU, torch.float32) == dict.fromkeys(QUANTIZE_PARTS, "int8")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--quantize", "int4"],
            "--quantize must be one of auto, off, int8, int8-per-batch, int8-per-tensor, fp16 (got 'int4')",
        ),
        (
            ["--quantize", "on"],
            "--quantize must be one of auto, off, int8, int8-per-batch, int8-per-tensor, fp16",
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


def test_the_cpu_default_makes_the_encoder_int8_where_the_cpu_has_int8_dot_products_and_the_decoder_fp16() -> (
    None
):
    """On this machine's CPU: with int8 dot products the encoder is int8 per row; without, float32."""
    model = quantize_for(tiny_model(), EngineConfig(), CPU, torch.float32)
    int8 = {n for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    fp16 = {n for n, m in model.named_modules() if isinstance(m, DynamicLinear)}
    encoder = set(linear_names(tiny_model(), ("encoder",)))
    assert int8 == (encoder if cpu_has_int8_dot_product() else set())
    assert fp16 == {*linear_names(tiny_model(), ("decoder",)), "decoder.proj"}
    assert all(model.get_submodule(n)._packed_params.dtype == torch.float16 for n in fp16)
    floats = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert floats == (set() if cpu_has_int8_dot_product() else encoder)
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


@cache
def real_clips() -> tuple[np.ndarray, ...]:
    """Real human speech: jfk.flac and two each of pocketsphinx-testdata's librivox sentences and
    cards utterances (16 kHz), of different lengths (2-11 s)."""
    clips = [jfk_16k()]
    for folder in ("librivox", "cards"):
        for path in sorted((POCKETSPHINX / folder).glob("*.wav"))[:2]:
            audio, rate = sf.read(path, dtype="float32")
            assert rate == 16000, path
            clips.append(audio)
    return tuple(clips)


@pytest.mark.parametrize("mode", ["off", "int8"])
def test_encoder_rows_are_the_same_bits_alone_and_among_rows_of_other_lengths(mode: QuantizeMode) -> None:
    """Each row of a trimmed encoder pass attends over its own positions in a call of its own, so
    its features are bit for bit what it gets alone (fp32 and int8). Attending under a mask over
    the longest row's keys rounds differently; int8's per-row scales then turn those last bits into
    other tokens (tests/engine/test_engine_real.py's trim-margin clips changed with int8)."""
    model = quantize(tiny_model(), mode, QUANTIZE_PARTS)
    logmel = LogMel(80, CPU)
    clips = list(real_clips()[:3])  # jfk (11 s) and two librivox sentences
    ctx = [50 * math.ceil(len(c) / 16000 + 2) for c in clips]
    assert len(set(ctx)) == len(ctx)
    with torch.inference_mode():
        batched = model.encoder(logmel(clips, ctx), ctx)
        for row, (clip, n) in enumerate(zip(clips, ctx, strict=True)):
            alone = model.encoder(logmel([clip], [n]))
            assert torch.equal(batched[row, :n], alone[0]), (mode, row)


def tokens_alone_and_batched(
    config: EngineConfig, join: bool
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Each real clip's tokens decoded alone, then all of them batched: the first two in one window
    and, with `join`, the rest joining while those two decode (and leaving at their own lengths)."""
    clips = real_clips()
    engine = Engine(config)
    engine.start()
    try:
        alone = [engine.submit(c).future.result(timeout=120).tokens for c in clips]
        if join:
            first = [engine.submit(c) for c in clips[:2]]
            deadline = time.monotonic() + 60
            while engine.stats()["active"] == 0:
                assert time.monotonic() < deadline, "the first window never started decoding"
                time.sleep(0.001)
            handles = [*first, *(engine.submit(c) for c in clips[2:])]
        else:
            handles = [engine.submit(c) for c in clips]
        results = [h.future.result(timeout=120) for h in handles]
    finally:
        engine.stop()
    if join:
        assert [r.stats.encoder_batch_size for r in results[:2]] == [2, 2]  # the first window batched
        assert all(r.stats.encoder_batch_size > 1 for r in results[2:])
    else:
        assert all(r.stats.encoder_batch_size == len(clips) for r in results)  # one shared encoder pass
    return alone, [r.tokens for r in results]


def test_the_cpu_default_decodes_real_speech_batched_as_alone_with_utterances_joining() -> None:
    assert EngineConfig().quantize == "auto"  # int8 encoder, fp16 decoder (resolve_plan's test above)
    alone, batched = tokens_alone_and_batched(
        EngineConfig(threads=2, batch_window_ms=300.0, kv_slots=8), join=True
    )
    assert batched == alone


def test_int8_per_batch_decodes_real_speech_differently_batched_than_alone() -> None:
    """The negative control of the test above: torch.ao's int8, one activation scale per batch,
    changes a real utterance's tokens with its batch company (all five in one window, so the
    company is the same every run)."""
    alone, batched = tokens_alone_and_batched(
        EngineConfig(
            threads=2, quantize="int8-per-batch", quantize_parts="all", batch_window_ms=300.0, kv_slots=8
        ),
        join=False,
    )
    assert batched != alone
