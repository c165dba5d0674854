"""Language detection keeps Whisper's first-token rules (issue 10, scenario 6), on the bundled multilingual
`base`: with no language given, the detected language token and the forced task tokens come first, and
the rules for the first sampled token (no blank or end-of-text first; a timestamp first when timestamps
are on) still apply to the token after them, as in openai/whisper (`sample_begin`) and transformers."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import soxr
import torch
from transformers import WhisperFeatureExtractor

from engine import DecodeOptions, Engine, EngineConfig
from engine.model import weights
from engine.model.runner import ModelRunner
from tests.support.audio import sox_decode_g711, speak, to_mulaw_8k_bytes
from tests.support.engine import jfk_16k

SPEECH = {
    "es": ("es", "Buenos días, quiero consultar el estado de mi pedido, por favor."),
    "fr": ("fr", "Bonjour, je voudrais vérifier le solde de mon compte, s'il vous plaît."),
}


def telephone(audio: np.ndarray) -> np.ndarray:
    """As a call arrives: 8 kHz mu-law (sox), decoded by sox, back to 16 kHz (soxr, as the service does)."""
    pcm = sox_decode_g711(to_mulaw_8k_bytes(audio), "mu-law").astype(np.float32) / 32768.0
    return np.asarray(soxr.resample(pcm, 8000, 16000), dtype=np.float32)


def clip(name: str) -> np.ndarray:
    if name == "en":
        return jfk_16k()
    lang, text = SPEECH[name.removesuffix("-8k")]
    audio = speak(text, voice=lang)
    return telephone(audio) if name.endswith("-8k") else audio


def hf_generate_tokens(audio: np.ndarray) -> list[int]:
    """transformers' greedy generate on the same converted `base` checkpoint, language left to it."""
    loaded = weights.load("base")
    features = WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=16000, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.hf_model().generate(
            features.input_features, generation_config=loaded.generation_config, task="transcribe"
        )
    eot = loaded.generation_config.eos_token_id
    return [t for t in out[0].tolist() if t < eot]


# Whisper's full 30 s context in fp32: what transformers' generate runs, so tokens compare exactly.
BASE = EngineConfig(model="base", threads=2, encoder_context="full", kv_slots=4, warmup=False, quantize="off")


@pytest.fixture(scope="module")
def base_runner() -> ModelRunner:
    return ModelRunner.load(BASE)


@pytest.fixture(scope="module")
def base_engine(base_runner: ModelRunner) -> Iterator[Engine]:
    engine = Engine(BASE, runner=base_runner)
    engine.start()
    yield engine
    engine.stop()


CLIPS = ["es", "fr", "es-8k", "fr-8k", "en"]


@pytest.mark.parametrize("name", CLIPS)
def test_language_unset_equals_language_set_equals_transformers(base_engine: Engine, name: str) -> None:
    audio = clip(name)
    detected = base_engine.submit(audio).future.result(timeout=300)
    assert detected.language == name[:2]
    given = base_engine.submit(audio, DecodeOptions(language=detected.language)).future.result(timeout=300)
    assert detected.tokens == given.tokens
    assert list(detected.tokens) == hf_generate_tokens(audio)


@pytest.mark.parametrize("name", ["es", "fr-8k"])
def test_timestamps_with_language_unset_equal_language_set(base_engine: Engine, name: str) -> None:
    audio = clip(name)
    options = DecodeOptions(timestamps=True)
    detected = base_engine.submit(audio, options).future.result(timeout=300)
    given = base_engine.submit(
        audio, DecodeOptions(timestamps=True, language=detected.language)
    ).future.result(timeout=300)
    assert detected.segments and detected.segments == given.segments
    assert detected.tokens == given.tokens


def test_the_first_sampled_token_after_detection_obeys_begin_suppress(base_runner: ModelRunner) -> None:
    """Logits that most favour end-of-text, then a blank: at the first sampled position (after the
    detected language and the forced task tokens) neither may be chosen, exactly as with the language
    given; one token later, end-of-text may be."""
    from concurrent.futures import Future

    from engine.scheduling.request import Request

    rules = base_runner.rules
    v = rules.vocab
    blank = rules.tokenizer.encode(" ", add_special_tokens=False)[0]
    results = {}
    for language in (None, "es"):
        req = Request(
            id="r",
            audio=np.zeros(16000, np.float32),
            options=DecodeOptions(language=language),
            future=Future(),
        )
        rules.build_prompt(req, 224)
        if req.detect_language:
            req.generated = [v.languages["es"], *req.forced]
            req.forced = []
        logits = torch.zeros(1, rules.n_vocab)
        logits[0, v.eot], logits[0, blank], logits[0, 1000] = 30.0, 20.0, 10.0
        first = rules.next_tokens(logits.clone(), [req]).tokens
        req.generated.append(int(first))
        second = rules.next_tokens(logits.clone(), [req]).tokens
        results[language] = (int(first), int(second))
    assert results[None] == results["es"] == (1000, v.eot)


@pytest.mark.parametrize("name", ["es", "fr-8k"])
def test_a_beam_search_after_detection_equals_one_with_the_language_given(
    base_engine: Engine, name: str
) -> None:
    """Beams begin after the detected language and the forced task tokens (every beam row takes them
    alike), at the same sampled token as when the language is given (issue 29)."""
    audio = clip(name)
    detected = base_engine.submit(audio, DecodeOptions(beam_size=3)).future.result(timeout=300)
    assert detected.language == name[:2]
    given = base_engine.submit(audio, DecodeOptions(beam_size=3, language=detected.language)).future.result(
        timeout=300
    )
    assert detected.tokens == given.tokens and detected.text
