"""The model runner: owns the model, features, KV cache and decoding rules on one device,
and offers the scheduler three batched operations: encode, prefill, step."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.config import EngineConfig
from engine.constants import POSITIONS_PER_SECOND, SAMPLE_RATE
from engine.decoding import DecodingRules
from engine.features import LogMel
from engine.keyterms import KeytermSettings
from engine.kv_cache import KVCache
from engine.model import Whisper, from_transformers
from engine.quantize import quantize_for
from engine.step import DecodeStepper
from engine.weights import LoadedWeights

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


@dataclass(frozen=True)
class EncodeTimings:
    features_s: float
    encoder_s: float
    cross_kv_s: float


class ModelRunner:
    def __init__(self, weights: LoadedWeights, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model = from_transformers(weights.model).to(self.device, self.dtype)
        model = quantize_for(model, config, self.device, self.dtype)
        self.model: Whisper = model
        dims = self.model.dims
        self.logmel = LogMel(dims.n_mels, self.device)
        multilingual = dims.n_vocab >= 51865
        keyterms = KeytermSettings(
            prompt=config.keyterm_prompt,
            bias=config.keyterm_bias,
            start_bonus=config.keyterm_bonus,
            max_gap=config.keyterm_max_gap,
            take_back=config.keyterm_take_back,
        )
        self.rules = DecodingRules(
            weights.tokenizer, weights.generation_config, dims.n_vocab, multilingual, self.device, keyterms
        )
        if config.max_tokens > dims.n_text_ctx:
            raise ValueError(
                f"max_tokens {config.max_tokens} exceeds the model's {dims.n_text_ctx} positions"
            )
        self.cache = KVCache(
            slots=config.kv_slots,
            layers=dims.n_text_layer,
            heads=dims.n_text_head,
            head_dim=dims.n_text_state // dims.n_text_head,
            max_tokens=config.max_tokens,
            audio_ctx=dims.n_audio_ctx,
            device=self.device,
            dtype=self.dtype,
        )
        graphs = config.cuda_graphs == "on" or (config.cuda_graphs == "auto" and self.device.type == "cuda")
        self.stepper = DecodeStepper(
            self.model, self.cache, self.device, compile=config.compile, graphs=graphs, static=config.compile
        )

    @property
    def multilingual(self) -> bool:
        return self.rules.vocab.multilingual

    def sync(self) -> None:
        """Make wall-clock timings honest on asynchronous devices."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def full_audio_ctx(self) -> int:
        return self.model.dims.n_audio_ctx

    def audio_ctx_for(self, n_samples: int, full: bool = False) -> int:
        """Encoder positions for audio of n_samples: Whisper's 30 s, or trimmed (--encoder-context trim)."""
        if full or self.config.encoder_context == "full":
            return self.full_audio_ctx
        # Whole seconds, so a handful of shapes repeat; the margin keeps trailing context.
        seconds = math.ceil(n_samples / SAMPLE_RATE + self.config.trim_margin_s)
        return min(self.full_audio_ctx, seconds * POSITIONS_PER_SECOND)

    @torch.inference_mode()
    def encode(self, audios: list[np.ndarray], rows: list[int], ctx: list[int]) -> EncodeTimings:
        """One encoder pass over `audios` (row i uses ctx[i] encoder positions); cross-attention
        K/V land in cache `rows`."""
        t0 = time.perf_counter()
        mel = self.logmel(audios, ctx).to(self.dtype)
        ctx_t = torch.tensor(ctx, device=self.device)
        self.sync()
        t1 = time.perf_counter()
        # The mel spans the longest context: rows all that long attend over all of it.
        features = self.model.encoder(mel, ctx if min(ctx) != max(ctx) else None)
        self.sync()
        t2 = time.perf_counter()
        row_t = torch.tensor(rows, device=self.device)
        self.model.write_cross_kv(features, row_t, self.cache)
        self.cache.set_cross_len(rows, ctx, ctx_t)
        self.sync()
        t3 = time.perf_counter()
        return EncodeTimings(t1 - t0, t2 - t1, t3 - t2)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], sot_index: list[int], rows: slice) -> tuple[Tensor, Tensor]:
        """Run the prompts of the sequences in `rows`. Returns logits [B, V] after each
        prompt's last token and after its <|startoftranscript|> (for no-speech)."""
        width = max(len(p) for p in prompts)
        pad = self.rules.vocab.eot  # padding positions are overwritten by later steps, never attended
        n = len(prompts)
        # One host tensor, one copy: the prompts, then the positions to read logits at.
        flat = [t for p in prompts for t in p + [pad] * (width - len(p))]
        host = torch.tensor([*flat, *(len(p) - 1 for p in prompts), *sot_index]).to(self.device)
        tokens, last, sot = host[: n * width].view(n, width), host[n * width : -n], host[-n:]
        hidden = self.model.prefill(tokens, rows, self.cache, self.cache.max_cross_len(rows))
        index = torch.arange(n, device=self.device)
        logits = self.model.decoder.logits(torch.cat([hidden[index, last], hidden[index, sot]]))
        self.sync()  # the caller times this call
        return logits[:n], logits[n:]

    @torch.inference_mode()
    def step(self, tokens: list[int], lengths: list[int]) -> Tensor:
        """One decode step for rows 0..n-1: token i goes to position lengths[i]. Returns logits [n, V]
        (with CUDA graphs, a view of the graph's output: valid until the next step)."""
        logits = self.stepper.step(tokens, lengths)
        self.sync()  # the caller times this call
        return logits
