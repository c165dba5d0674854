"""The model runner: owns the model, features, KV cache, decoding rules and word aligner on one device,
behind the narrow interface the core loop (engine/core.py) calls with the scheduler's plan: encode,
prefill, step, the first-token rules, sampling through the logit processors, word alignment, and
copying a row the scheduler moved. It decides nothing: which rows, which requests and what their
outputs mean are the scheduler's (engine/scheduling/scheduler.py)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.config import EngineConfig
from engine.decoding.beam import TermBias
from engine.decoding.keyterms import KeytermSettings
from engine.decoding.prompt import PromptEncoder, max_prompt_tokens
from engine.decoding.respell import RespellSettings
from engine.decoding.rules import Choice, DecodingRules
from engine.model.features import LogMel
from engine.model.kv_cache import KVCache
from engine.model.model import Whisper, from_hf
from engine.model.quantize import quantize_for
from engine.model.respell import Respeller
from engine.model.step import DecodeStepper
from engine.model.timing import WordAligner, alignment_heads
from engine.model.weights import LoadedWeights, load
from engine.process.cpus import usable_cpus
from engine.scheduling.policy import encoder_positions
from engine.scheduling.request import Beam, Request

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


@dataclass(frozen=True)
class FirstTokens:
    """The first-token rules' answers for a prefilled batch, per request: the no-speech probability, and
    the detected language token (None where the language was given)."""

    no_speech: list[float]
    language: list[int | None]


def engine_threads(config: EngineConfig) -> int:
    """The engine's intra-op threads: --threads, or with 0 the CPUs this process may use."""
    return config.threads if config.threads > 0 else usable_cpus()


class ModelRunner:
    @classmethod
    def load(cls, config: EngineConfig) -> ModelRunner:
        """The weights --model names, on --device, with --threads intra-op threads (0: the CPUs this
        process may use, quota included: engine/process/cpus.py)."""
        torch.set_num_threads(engine_threads(config))
        # The loop runs one op at a time: torch's inter-op pool (a thread per core) would only add threads
        # that compete with the intra-op ones. It can be set once per process, before any parallel work.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        return cls(load(config.model, config.cache_dir or None), config)

    def __init__(self, weights: LoadedWeights, config: EngineConfig) -> None:
        self.config = config
        self.name = weights.name
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model = from_hf(weights.config, weights.state).to(self.device, self.dtype)
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
            cache_bytes=config.keyterm_cache_bytes,
            beam_bonus=config.keyterm_beam_bonus,
        )
        self.rules = DecodingRules(
            weights.tokenizer,
            weights.generation_config,
            dims.n_vocab,
            multilingual,
            self.device,
            keyterms,
            config.beam_bound,
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
        heads = alignment_heads(weights.generation_config, dims.n_text_layer, dims.n_text_head)
        self.aligner = WordAligner(self.model, self.cache, self.rules, heads)
        self.respeller = (
            Respeller(
                self.model, self.cache, self.rules, RespellSettings(margin=config.keyterm_respell_margin)
            )
            if config.keyterm_respell
            else None
        )
        self.prompts = PromptEncoder(
            weights.tokenizer.backend_tokenizer.to_str(),
            self.rules.vocab.eot,
            max_prompt_tokens(config.max_tokens),
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
        return encoder_positions(self.config, self.full_audio_ctx, n_samples, full)

    @torch.inference_mode()
    def encode(
        self, audios: list[np.ndarray], rows: list[int], ctx: list[int], source: list[int] | None = None
    ) -> EncodeTimings:
        """One encoder pass over `audios` (audio i uses ctx[i] encoder positions); cross-attention
        K/V land in cache `rows`: rows[j] takes audio source[j] (None: audio j). A beam search's rows
        all take their utterance's one encoder output."""
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
        if source is None:
            self.model.write_cross_kv(features, row_t, self.cache)
            self.cache.set_cross_len(rows, ctx, ctx_t)
        else:
            source_t = torch.tensor(source, device=self.device)
            self.model.write_cross_kv(features, row_t, self.cache, source_t)
            self.cache.set_cross_len(rows, [ctx[i] for i in source], ctx_t.index_select(0, source_t))
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

    @torch.inference_mode()
    def first_tokens(self, last: Tensor, sot: Tensor, reqs: Sequence[Request]) -> FirstTokens:
        """No-speech probability (from the logits after <|startoftranscript|>, `sot`) and, for the requests
        that detect their language, the likeliest language token (from the prompt's last logits, `last`);
        row i of both is reqs[i]."""
        rules = self.rules
        no_speech = rules.no_speech_prob(sot).tolist()
        detect = [i for i, r in enumerate(reqs) if r.detect_language]
        detected = rules.detect_language(last[detect]).tolist() if detect else []
        language: list[int | None] = [None] * len(reqs)
        for i, token in zip(detect, detected, strict=True):
            language[i] = int(token)
        return FirstTokens(no_speech, language)

    @torch.inference_mode()
    def sample(self, logits: Tensor, reqs: Sequence[Request]) -> Choice:
        """The next token of each request (row i of logits [B, V] is reqs[i]) under the decoding rules'
        logit processors (engine/decoding/logits.py, engine/decoding/keyterms.py), greedy. The rules edit logits in place."""
        return self.rules.next_tokens(logits, reqs)

    @torch.inference_mode()
    def beam_candidates(
        self, logits: Tensor, beams: Sequence[Beam], k: int, bias: TermBias | None = None
    ) -> tuple[list[list[float]], list[list[int]]]:
        """Beam search's candidates: for each beam (row i of logits [B, V] is beams[i]), its `k` likeliest
        next tokens under the decoding rules' masks (engine/decoding/logits.py; edited in place) and the
        keyterm bonus, and their log-probabilities, on the host in one copy."""
        return self.rules.beam_candidates(logits, beams, k, bias)

    def reorder(self, rows: list[int], sources: list[int], length: int) -> None:
        """Beam search chose its beams: row rows[b] continues the hypothesis of row sources[b]."""
        self.cache.reorder(rows, sources, length)

    def respell(self, reqs: Sequence[Request]) -> None:
        """Listed keyterms the audio agrees with, spelled into finished windows (engine/model/respell.py)
        while their rows still hold their audio; nothing with --keyterm-respell off."""
        if self.respeller is not None:
            self.respeller.respell(reqs)

    def align(self, reqs: Sequence[Request]) -> None:
        """Word timings of finished windows (engine/model/timing.py), while their rows still hold their audio."""
        self.aligner.align(reqs)

    def move_row(self, src: int, dst: int) -> None:
        """The scheduler moved the sequence in row src into row dst."""
        self.cache.move(src, dst)
