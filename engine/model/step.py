"""The decode step with static shapes: what a CUDA graph captures and `torch.compile` compiles.

Live sequences occupy cache rows 0..n-1 (engine/model/kv_cache.py). A step for them runs at a StepShape:
`batch` rows (n, or n rounded up to a batch bucket: the rows past n are free cache rows, computed and
ignored), `keys` self-attention positions (past every live row's position; masked per row) and
`cross` audio positions (at least every live row's context; masked per row). Everything the shape
depends on is known on the host (the scheduler's lengths, the cache's host copy of each row's audio
context), so a step never reads the device back, and its tokens and positions go through one
preallocated input buffer (pinned on CUDA) instead of new tensors.

Three ways to run the same function, `Whisper.decode_step`:
  eager     exact shapes (no padding work), plain PyTorch;
  compiled  `torch.compile(fullgraph=True)`: a host synchronisation or a value-dependent shape in the
            step would break the graph and fail compilation (tests/engine/test_step.py, on CPU);
  graphs    on CUDA, one CUDA graph per (batch bucket, cross bucket), keys fixed at the cache's
            max_tokens, captured on first use and replayed after, as vLLM and SGLang do. Only the
            capture/replay (`_replay`) is CUDA-only; the shapes, buffers and the step function are
            the ones the CPU tests run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.model.kv_cache import KVCache
from engine.model.model import Whisper

# Static shapes: self-attention keys round up to a multiple of this (CPU compiled path), and the
# audio context to a fraction of Whisper's 1500 positions, so that a handful of shapes repeat.
KEY_BLOCK = 32
CROSS_BUCKETS = 4


@dataclass(frozen=True)
class StepShape:
    batch: int
    keys: int
    cross: int


def batch_buckets(slots: int) -> list[int]:
    """1, 2, 4, ... below `slots`, then `slots` itself."""
    sizes = [1]
    while sizes[-1] * 2 < slots:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != slots:
        sizes.append(slots)
    return sizes


def _round_up(value: int, block: int, cap: int) -> int:
    return min(cap, -(-value // block) * block)


StepFn = Callable[..., Tensor]


class DecodeStepper:
    """Runs decode steps for cache rows 0..n-1 at static shapes (see the module docstring)."""

    def __init__(
        self,
        model: Whisper,
        cache: KVCache,
        device: torch.device,
        *,
        compile: bool,
        graphs: bool,
        static: bool,
        backend: str = "inductor",
    ) -> None:
        if graphs and device.type != "cuda":
            raise ValueError(f"--cuda-graphs on needs a CUDA device (the engine runs on {device})")
        self.model, self.cache, self.device = model, cache, device
        self.graphs = graphs
        # Bucketed shapes: needed to replay graphs; with compile, they bound recompilations.
        self.static = static or graphs
        self.compiled = compile
        self.buckets = batch_buckets(cache.slots)
        self.audio_ctx = model.dims.n_audio_ctx
        self.cross_block = -(-self.audio_ctx // CROSS_BUCKETS)
        fn: StepFn = model.decode_step
        if compile:
            # One compilation per shape (static, like the graphs); room for every shape there is.
            shapes = len(self.buckets) * -(-cache.max_tokens // KEY_BLOCK) * CROSS_BUCKETS
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, shapes)
            dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, shapes)
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
        self.fn = fn
        # tokens (row 0) and positions (row 1) of a step, at fixed addresses for the graphs.
        self.inputs = torch.zeros(2, cache.slots, dtype=torch.long, device=device)
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(2, cache.slots, dtype=torch.long, pin_memory=True) if on_cuda else self.inputs
        self.host_np = self.host.numpy()
        self._args: dict[StepShape, tuple[Any, ...]] = {}
        self._captured: dict[StepShape, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool: Any = None

    def shape(self, n: int, max_length: int, max_cross: int) -> StepShape:
        """The shape a step of n rows runs at: the longest row is at position max_length and the
        longest audio context is max_cross positions."""
        if not self.static:
            return StepShape(n, max_length + 1, max_cross)
        batch = next(b for b in self.buckets if b >= n)
        max_tokens = self.cache.max_tokens
        keys = max_tokens if self.graphs else _round_up(max_length + 1, KEY_BLOCK, max_tokens)
        return StepShape(batch, keys, _round_up(max_cross, self.cross_block, self.audio_ctx))

    def arguments(self, shape: StepShape) -> tuple[Any, ...]:
        """decode_step's arguments at `shape`: views of the input buffer and the cache (no device memory;
        kept per shape when shapes are bucketed, since then there are few)."""
        args = self._args.get(shape)
        if args is None:
            c, b, k, x = self.cache, shape.batch, shape.keys, shape.cross
            args = (
                self.inputs[0, :b],
                self.inputs[1, :b],
                c.cross_len[:b],
                [t[:b, :, :k] for t in c.self_k],
                [t[:b, :, :k] for t in c.self_v],
                [t[:b, :, :x] for t in c.cross_k],
                [t[:b, :, :x] for t in c.cross_v],
            )
            if self.static:
                self._args[shape] = args
        return args

    def step(self, tokens: list[int], lengths: list[int]) -> Tensor:
        """Token i goes to position lengths[i] of row i. Returns logits [n, V]; with graphs, a view of
        the graph's output (valid until the next step)."""
        n = len(tokens)
        shape = self.shape(n, max(lengths), self.cache.max_cross_len(slice(0, n)))
        self.host_np[0, :n] = tokens
        self.host_np[1, :n] = lengths
        self.host_np[:, n : shape.batch] = 0  # padding rows: token 0 at position 0 of a free row
        if self.host is not self.inputs:  # pinned -> device, queued behind the previous step
            self.inputs[:, : shape.batch].copy_(self.host[:, : shape.batch], non_blocking=True)
        args = self.arguments(shape)
        logits = self._replay(shape, args) if self.graphs else self.fn(*args)
        return logits[:n]

    def _replay(self, shape: StepShape, args: tuple[Any, ...]) -> Tensor:  # pragma: no cover - CUDA only
        """Capture the step at `shape` on first use (after warm-up runs on a side stream, as
        torch.cuda.graphs asks), then replay it. Warm-up runs are real steps with the current inputs:
        they write the same K/V at the same positions as the replay, so repeating them is harmless.
        All graphs share one memory pool: an output is valid until the next replay."""
        captured = self._captured.get(shape)
        if captured is None:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fn(*args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.fn(*args)
            self._pool = self._pool or graph.pool()
            captured = self._captured[shape] = (graph, out)
        graph, out = captured
        graph.replay()
        return out

    @property
    def captured_shapes(self) -> list[StepShape]:
        return list(self._captured)
