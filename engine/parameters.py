"""What a caller asks of the engine for one utterance: its decoding options, its priority class, and the
bounds every entry point (the in-process engine, a frontend's client of the engine process) checks them
against. Plain data with no engine imports, so that it crosses the engine process's wire
(engine/process/ipc.py) and any layer may read it."""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from dataclasses import dataclass

# Bounds the prompt in characters before the tokenizer ever sees it (engine/decoding/prompt.py measures
# tokens): above what even Whisper's 223 prompt tokens spell, ~1000 characters of English.
MAX_PROMPT_CHARS = 2048


class Priority(enum.IntEnum):
    """Who is served first (engine/scheduling/policy.py): a class per kind of work, lower first."""

    LIVE = 0  # a live call's final: a caller is waiting for it
    BEST_EFFORT = 1  # a live call's interim or speculative offer: a preview, refused first
    RECORDED = 2  # recorded audio (Recognize, an HTTP upload): waits for the capacity live work leaves

    @property
    def label(self) -> str:
        """The `class` label of the engine's metrics."""
        return self.name.lower()


# Temperature fallback bounds: OpenAI's API takes temperatures 0-1; openai-whisper's schedule has six.
MAX_TEMPERATURE = 1.0
MAX_TEMPERATURES = 10
WHISPER_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # openai-whisper's transcribe() default schedule

# Keyterm bounds: what one utterance's list may hold (the trie and the prompt grow with it).
MAX_KEYTERMS = 100
MAX_KEYTERM_CHARS = 50
MAX_KEYTERM_TOKENS = 16  # as the model's tokenizer spells the term after a space (checked by the engine)


@dataclass(frozen=True)
class DecodeOptions:
    """Per-utterance decoding options (all optional)."""

    language: str | None = None  # Whisper code ("en"); None: English-only model's, or detected
    task: str = "transcribe"  # or "translate" on multilingual models
    prompt: str | None = None  # initial prompt: names, products, jargon
    timestamps: bool = False  # segment-level timestamps
    max_new_tokens: int | None = None  # None: as many as the slot holds
    interim: bool = False  # a partial hypothesis: never returned as silence-dropped, lower priority
    word_timestamps: bool = False  # per-word times and probabilities (engine/model/timing.py)
    priority: Priority = Priority.LIVE  # an interim is BEST_EFFORT whatever this says (unless RECORDED)
    # A BEST_EFFORT request that becomes LIVE at this time.monotonic(): a speculative offer ranks as a final
    # from when its end would be confirmed (engine/scheduling/policy.py); None: never.
    promote_at: float | None = None
    # Whose work this is (a live stream's id): the engine's live finals take turns by caller.
    caller: str = ""

    @property
    def work_class(self) -> Priority:
        """The class the engine admits and serves this request in."""
        if self.interim and self.priority is Priority.LIVE:
            return Priority.BEST_EFFORT
        return self.priority

    # Names and jargon the caller may say, boosted in decoding (engine/decoding/keyterms.py); bounds above.
    keyterms: tuple[str, ...] = ()
    # Beams searched at once (1: greedy). Each beam is a KV-cache row, so a request of n beams takes n of
    # the engine's rows; bounded by --max-beam-size (the engine checks it: validate_beam_size).
    beam_size: int = 1
    # The same channel's earlier final text, set by the server (never a client): conditioned on after the
    # prompt, as Whisper's long-form decoding conditions each window on the text before it. Only its tail
    # is kept, within what the prompt bound leaves after the caller's own prompt (engine/decoding/prompt.py).
    context: str | None = None
    # Temperature fallback (openai-whisper's transcribe): a window is decoded at temperatures[0] (0: greedy,
    # or beam_size beams; above 0: sampled), and again at the next one while its result fails Whisper's
    # thresholds (engine/scheduling/outcome.py failure_of). None: the engine's --temperatures.
    # An interim decodes at the first only (a preview waits for no second pass).
    temperatures: tuple[float, ...] | None = None
    # Seeds the request's own sampling generator (only read at temperatures above 0): the same seed, the
    # same tokens, whatever batch the request decodes in. None: derived from the window's audio.
    seed: int | None = None


def validate_options(options: DecodeOptions, *, multilingual: bool, languages: Collection[str]) -> None:
    """Raise ValueError naming the field if a model (multilingual or not, with these language codes)
    cannot serve `options`. One check for the in-process engine and for a client of the engine process."""
    if options.language is not None:
        if not multilingual and options.language != "en":
            raise ValueError(
                f"language_code {options.language!r} is not supported: this model is English-only (use 'en')"
            )
        if multilingual and options.language not in languages:
            raise ValueError(
                f"language_code {options.language!r} is not one of the model's {len(languages)} languages"
            )
    if options.task not in ("transcribe", "translate"):
        raise ValueError(f"task {options.task!r} must be 'transcribe' or 'translate'")
    if options.task == "translate" and not multilingual:
        raise ValueError("task 'translate' needs a multilingual model")
    if options.max_new_tokens is not None and options.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {options.max_new_tokens}")
    check_prompt_chars(options.prompt)  # its length in tokens is checked where the tokenizer is
    check_prompt_chars(options.context, "context")  # its tail is kept: never refused for its tokens
    if not isinstance(options.priority, Priority):
        raise ValueError(
            f"priority {options.priority!r} must be one of {', '.join(p.name for p in Priority)}"
        )
    validate_keyterms(options.keyterms)
    if options.temperatures is not None:
        validate_temperatures(options.temperatures)
    if options.seed is not None and (
        not isinstance(options.seed, int) or isinstance(options.seed, bool) or not 0 <= options.seed < 2**63
    ):
        raise ValueError(f"seed must be an integer from 0 to 2**63-1, got {options.seed!r}")


def validate_temperatures(temperatures: Collection[float], name: str = "temperatures") -> None:
    """Raise ValueError naming `name` and the bound for a temperature schedule the engine will not run."""
    if isinstance(temperatures, str) or not temperatures:
        raise ValueError(f"{name} must list at least one temperature (0: greedy)")
    if len(temperatures) > MAX_TEMPERATURES:
        raise ValueError(f"{name} lists {len(temperatures)} temperatures; at most {MAX_TEMPERATURES}")
    for i, t in enumerate(temperatures):
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= MAX_TEMPERATURE:
            raise ValueError(f"{name}[{i}] must be a number from 0 to {MAX_TEMPERATURE:g}, got {t!r}")


def validate_beam_size(beam_size: int, max_beam_size: int, flag: str = "--max-beam-size") -> None:
    """Raise ValueError naming the field and the flag (`flag`, whose value is max_beam_size) for a
    beam_size this engine will not search."""
    if not isinstance(beam_size, int) or isinstance(beam_size, bool) or beam_size < 1:
        raise ValueError(f"beam_size must be at least 1 (1: greedy), got {beam_size!r}")
    if beam_size > max_beam_size:
        raise ValueError(
            f"beam_size {beam_size} is more beams than this server searches ({flag} {max_beam_size})"
        )


def validate_keyterms(keyterms: Collection[str]) -> None:
    """Raise ValueError naming the field and the bound for a keyterm list past them (the token bound
    needs the model's tokenizer: DecodingRules.validate checks it)."""
    if isinstance(keyterms, str):
        raise ValueError("keyterms must be a list of terms, not one string")
    if len(keyterms) > MAX_KEYTERMS:
        raise ValueError(f"keyterms holds {len(keyterms)} terms; at most {MAX_KEYTERMS}")
    for i, term in enumerate(keyterms):
        if not isinstance(term, str) or not term.strip():
            raise ValueError(f"keyterms[{i}] is empty; each keyterm needs at least one character")
        if len(term.strip()) > MAX_KEYTERM_CHARS:
            raise ValueError(
                f"keyterms[{i}] is {len(term.strip())} characters long; at most {MAX_KEYTERM_CHARS} per keyterm"
            )
        if not term.isprintable():
            raise ValueError(f"keyterms[{i}] holds a control character; keyterms are printable text")


def check_keyterm_tokens(keyterms: Collection[str], tokens: Callable[[str], int]) -> None:
    """Raise ValueError naming the field past MAX_KEYTERM_TOKENS; `tokens(text)`: how many text tokens the
    model's tokenizer spells `text` in. The engine checks with its tokenizer, a frontend process with
    ModelInfo.prompts (the same tokenizer), so both refuse the same lists."""
    for i, term in enumerate(keyterms):
        n = tokens(" " + term.strip())
        if n > MAX_KEYTERM_TOKENS:
            raise ValueError(
                f"keyterms[{i}] is {n} tokens long; at most {MAX_KEYTERM_TOKENS} tokens per keyterm"
            )


def check_prompt_chars(prompt: str | None, name: str = "prompt") -> None:
    """Raise ValueError naming `name` and the limit if it is longer than MAX_PROMPT_CHARS characters
    (before its length is measured in tokens)."""
    if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(
            f"{name} has {len(prompt)} characters, over the limit of {MAX_PROMPT_CHARS} characters; "
            "keep it to the names and terms the call needs"
        )
