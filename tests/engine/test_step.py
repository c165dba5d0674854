"""The decode step as a static graph (engine/model/step.py), on the real bundled tiny.en and real audio.

What a CUDA graph needs of the step: one graph for the whole function (`torch.compile(fullgraph=True)`
fails on value-dependent control flow) and no read of the device from the host inside it (which
torch 2.13's Dynamo can trace through, so every op the step dispatches is checked as well). The
CUDA-graph path runs this same function at these same bucketed shapes; only its capture/replay call
(`DecodeStepper._replay`) needs a GPU. Dynamo's "eager" backend keeps compile time to seconds: the
capture, which is what fails, is the same as with inductor (scripts/bench_engine.py runs inductor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import DecodeOptions, Engine, EngineConfig
from engine.model.runner import ModelRunner
from engine.model.step import DecodeStepper, StepShape
from engine.scheduling.request import Request
from tests.support.audio import speak
from tests.support.engine import jfk_16k
from tests.support.wait import wait_until

# 4 slots: batch buckets 1, 2, 4; a 300 ms window so that submits back to back share it.
# unquantized: what --compile on and a GPU run (--quantize auto means off for both)
CONFIG = EngineConfig(threads=2, batch_window_ms=300.0, kv_slots=4, quantize="off")


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    """The model runner the engine below runs (built here, so the tests can reach its model and stepper)."""
    return ModelRunner.load(CONFIG)


@pytest.fixture(scope="module")
def engine(runner: ModelRunner) -> Iterator[Engine]:
    engine = Engine(CONFIG, runner=runner)
    engine.start()
    yield engine
    engine.stop()


# Ops that make the host wait for the device: a scalar read (int(), bool(), .item()), an output whose
# shape depends on values (nonzero, boolean-mask indexing), or a tensor made from host data in the step
# (lift_fresh of more than a scalar: `logits[a:b] = float("-inf")` lifts a 0-d fill value, harmlessly).
HOST_READS = {
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::masked_select",
}


class HostReads(TorchDispatchMode):
    """Records the ops dispatched inside it that would synchronise a CUDA device with the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        boolean_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None
        )
        host_data = name == "aten::lift_fresh" and args[0].dim() > 0
        if name in HOST_READS or boolean_index or host_data:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def host_reads(fn: Callable[..., Any], *args: Any) -> list[str]:
    with torch.inference_mode(), HostReads() as mode:
        fn(*args)
    return mode.seen


class CountingBackend:
    """Dynamo's eager backend, counting graphs compiled and calls into them."""

    def __init__(self) -> None:
        self.compiled = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.compiled += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run


def step_arguments(runner: ModelRunner, shape: StepShape) -> tuple[Any, ...]:
    """decode_step's arguments at `shape` over free cache rows: sot at position 3."""
    stepper = runner.stepper
    stepper.inputs[0, : shape.batch] = runner.rules.vocab.sot
    stepper.inputs[1, : shape.batch] = 3
    return stepper.arguments(shape)


def test_the_decode_step_compiles_as_one_graph_and_never_reads_the_device(runner: ModelRunner) -> None:
    args = step_arguments(runner, StepShape(batch=2, keys=32, cross=375))
    with torch.inference_mode():
        compiled = torch.compile(runner.model.decode_step, fullgraph=True, backend="eager")(*args)
        eager = runner.model.decode_step(*args)
    assert compiled.shape == (2, runner.model.dims.n_vocab)
    assert torch.equal(compiled, eager)
    assert host_reads(runner.model.decode_step, *args) == []
    # Nor does the runner's whole step (input buffers, shapes from the host) or the token choice.
    assert host_reads(runner.step, [runner.rules.vocab.sot] * 3, [3, 5, 4]) == []
    v = runner.rules.vocab
    first, later, stamped = (
        Request(
            id=str(i),
            audio=np.zeros(1, np.float32),
            options=DecodeOptions(timestamps=i == 2),
            future=Future(),
        )
        for i in range(3)
    )
    later.generated = [v.timestamp_begin + 1, 1000]  # a sampled token already: no first-token rules
    logits = runner.step([v.sot] * 3, [3, 5, 4])
    assert host_reads(runner.rules.next_tokens, logits.clone(), [first, later, stamped]) == []
    # Nor does the keyterm bias, once its list is compiled and stacked (per batch composition, not per step).
    boosted = Request(
        id="3", audio=np.zeros(1, np.float32), options=DecodeOptions(keyterms=("Kestoria",)), future=Future()
    )
    runner.rules.build_prompt(boosted, 224)
    runner.rules.start_window(boosted)
    logits = runner.step([v.sot] * 4, [3, 5, 4, 3])
    runner.rules.next_tokens(logits.clone(), [first, later, stamped, boosted])
    assert host_reads(runner.rules.next_tokens, logits.clone(), [first, later, stamped, boosted]) == []


HOST_READ_VARIANTS = {
    # What engine/model/model.py's `decode` did before: keys sized by int(start.max()), the cross mask
    # skipped when bool((cross_len != n).any()).
    "int(start.max())": lambda positions, cross_len: (positions[: int(positions.max()) + 1], cross_len),
    "bool(cross_len.any())": lambda positions, cross_len: (
        positions,
        cross_len + 1 if bool((cross_len != 0).any()) else cross_len,
    ),
}


@pytest.mark.parametrize("variant", list(HOST_READ_VARIANTS))
def test_a_host_read_in_the_step_is_caught(runner: ModelRunner, variant: str) -> None:
    """The checks above can fail: the same step with one of the host reads it used to have."""
    args = step_arguments(runner, StepShape(batch=2, keys=32, cross=375))
    change = HOST_READ_VARIANTS[variant]

    def with_host_read(
        tokens: torch.Tensor, positions: torch.Tensor, cross_len: torch.Tensor, *rest: Any
    ) -> Any:
        positions, cross_len = change(positions, cross_len)
        return runner.model.decode_step(tokens, positions, cross_len, *rest)

    assert host_reads(with_host_read, *args) != []
    if variant.startswith("bool"):  # control flow on a value: no single graph either
        with torch.inference_mode(), pytest.raises(torch._dynamo.exc.UserError):
            torch.compile(with_host_read, fullgraph=True, backend="eager")(*args)


def staggered(engine: Engine, clips: list[np.ndarray]) -> list[tuple[int, ...]]:
    """Two utterances start; the others join while they decode; all leave as each finishes."""
    first = [engine.submit(c) for c in clips[:2]]
    wait_until(lambda: engine.stats()["active"], 60, "the first two utterances never started decoding")
    later = [engine.submit(c) for c in clips[2:]]
    return [h.future.result(timeout=300).tokens for h in [*first, *later]]


def test_bucketed_compiled_steps_give_the_eager_tokens_as_utterances_join_and_leave(
    engine: Engine, runner: ModelRunner
) -> None:
    clips = [
        jfk_16k()[: 16000 * 5],
        speak("I would like to check the status of my order please."),
        speak("My account number is four five seven two nine.", voice="en-gb+f3"),
        jfk_16k()[16000 * 5 : 16000 * 9],
    ]
    eager_stepper = runner.stepper
    assert not eager_stepper.static and not eager_stepper.compiled  # exact shapes, plain PyTorch
    eager = staggered(engine, clips)

    backend = CountingBackend()
    stepper = DecodeStepper(
        runner.model, runner.cache, runner.device, compile=True, graphs=False, static=True, backend=backend
    )
    seen: list[tuple[int, StepShape]] = []
    shape_of = stepper.shape

    def spy(n: int, max_length: int, max_cross: int) -> StepShape:
        shape = shape_of(n, max_length, max_cross)
        seen.append((n, shape))
        return shape

    stepper.shape = spy  # type: ignore[method-assign]
    runner.stepper = stepper  # the scheduler is idle: every utterance above has finished
    try:
        compiled = staggered(engine, clips)
    finally:
        runner.stepper = eager_stepper
    assert compiled == eager
    assert all(len(tokens) > 5 for tokens in eager)
    assert backend.calls == len(seen)  # every step ran through a compiled graph
    assert backend.compiled == len({shape for _, shape in seen})  # one per shape, reused after
    assert {n for n, _ in seen} >= {1, 2, 3}  # rows joined and left
    assert any(shape.batch > n for n, shape in seen)  # padding rows of a bucket ran too


def test_step_flags_are_validated(runner: ModelRunner) -> None:
    assert EngineConfig(cuda_graphs="on", device="cpu").validate() == [
        "--cuda-graphs on needs a CUDA device (got --device cpu)"
    ]
    assert "--cuda-graphs must be auto, on or off" in EngineConfig(cuda_graphs="always").validate()[0]  # type: ignore[arg-type]
    assert (
        "--compile on does not combine with --quantize int8"
        in EngineConfig(compile=True, quantize="int8").validate()[0]
    )
    assert EngineConfig(cuda_graphs="auto", compile=True).validate() == []
    # runner: --device auto that resolved to the CPU
    with pytest.raises(ValueError, match="--cuda-graphs on needs a CUDA device"):
        DecodeStepper(runner.model, runner.cache, runner.device, compile=False, graphs=True, static=True)
    assert not runner.stepper.graphs  # auto on a CPU: no graphs
