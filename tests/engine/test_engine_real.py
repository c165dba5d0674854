"""The engine on the real bundled tiny.en, real audio (jfk.flac, espeak-ng speech)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from prometheus_client import REGISTRY
from transformers import WhisperFeatureExtractor

from clients.scoring import corpus_wer, normalize
from engine import DecodeOptions, Engine, EngineConfig
from engine.model import weights
from tests.support.audio import silence, speak, white_noise
from tests.support.engine import jfk_16k
from tests.support.wait import wait_until

SENTENCES = [
    "Thank you for calling customer support, how can I help you today?",
    "I would like to check the status of my order please.",
    "My account number is four five seven two nine.",
    "Can you transfer me to the billing department?",
    "The package was supposed to arrive last Tuesday.",
    "I want to cancel my subscription at the end of the month.",
]
VOICES = ("en-us", "en-gb+f3")
# Measured 0.10 with full context (0.117 trimmed) on these 12 clips; held with headroom.
WER_BOUND = 0.16


def hf_generate_tokens(clip: np.ndarray) -> list[int]:
    """transformers' own greedy generate on the same converted checkpoint: the reference."""
    loaded = weights.load("tiny.en")
    features = WhisperFeatureExtractor(feature_size=80)(clip, sampling_rate=16000, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.hf_model().generate(features.input_features, generation_config=loaded.generation_config)
    eot = loaded.generation_config.eos_token_id
    return [t for t in out[0].tolist() if t < eot]


def test_jfk_transcribes_and_matches_transformers_generate_token_for_token(
    full_context_engine: Engine,
) -> None:
    result = full_context_engine.submit(jfk_16k()).future.result(timeout=120)
    text = normalize(result.text)
    assert "my fellow americans" in text
    assert "ask not what your country can do for you" in text
    assert list(result.tokens) == hf_generate_tokens(jfk_16k())
    assert result.is_speech and 0.5 < result.confidence <= 1.0 and result.no_speech_prob < 0.2


@pytest.mark.parametrize("context", ["full", "trim"])
def test_batched_equals_alone_with_different_lengths_joining_mid_decode(context: str) -> None:
    # A 300 ms window: utterances submitted back to back surely share it (asserted below).
    engine = Engine(EngineConfig(threads=2, encoder_context=context, batch_window_ms=300.0, kv_slots=8))  # type: ignore[arg-type]
    engine.start()
    try:
        clips = [
            jfk_16k(),
            speak(SENTENCES[0]),
            jfk_16k()[: 16000 * 4],
            speak(SENTENCES[4], voice="en-gb+f3"),
        ]
        alone = [engine.submit(c).future.result(timeout=120).tokens for c in clips]
        first = [engine.submit(c) for c in clips[:2]]
        wait_until(lambda: engine.stats()["active"], 60, "the first two utterances never started decoding")
        later = [engine.submit(c) for c in clips[2:]]  # they join while the first two decode
        together = [h.future.result(timeout=120) for h in [*first, *later]]
    finally:
        engine.stop()
    assert [r.tokens for r in together] == alone
    # batching did happen: each pair shared one encoder pass
    assert [r.stats.encoder_batch_size for r in together] == [2, 2, 2, 2]
    if context == "full":  # and both equal transformers'
        for clip, tokens in zip(clips[1:2], alone[1:2], strict=True):
            assert list(tokens) == hf_generate_tokens(clip)


def test_batched_equals_alone_at_the_trim_margin_bound() -> None:
    """At the smallest trim margin allowed (the log-mel's reflect padding), clips that end exactly that
    far before their trimmed window's end still decode the same in a batch as alone; one below is refused."""
    from engine.config import MIN_TRIM_MARGIN_S

    with pytest.raises(ValueError, match="--trim-margin-s must be"):
        Engine(EngineConfig(threads=2, trim_margin_s=MIN_TRIM_MARGIN_S * 0.99))
    engine = Engine(
        EngineConfig(
            threads=2,
            encoder_context="trim",
            trim_margin_s=MIN_TRIM_MARGIN_S,
            trim_floor_s=0.0,  # the clips' own lengths set their windows
            batch_window_ms=300.0,
        )
    )
    engine.start()
    rng = np.random.default_rng(1)
    try:
        clips = []
        for sentence, seconds in [(SENTENCES[1], 4), (SENTENCES[3], 3)]:
            clip = np.zeros(seconds * 16000 - 200, dtype=np.float32)  # ends 200 samples before a second
            speech = speak(sentence)[: len(clip)]
            clip[len(clip) - len(speech) :] = speech
            clip += (rng.standard_normal(len(clip)) * 0.01).astype(np.float32)  # no zeros at the end
            clips.append(clip)
        clips.append(jfk_16k()[: 11 * 16000 - 200])  # cut inside speech
        alone = [engine.submit(c).future.result(timeout=120).tokens for c in clips]
        together = [h.future.result(timeout=120) for h in [engine.submit(c) for c in clips]]
    finally:
        engine.stop()
    assert [r.stats.encoder_batch_size for r in together] == [3, 3, 3]
    assert [r.tokens for r in together] == alone


CARDS = Path("/usr/share/pocketsphinx/test/data/cards")  # pocketsphinx-testdata (scripts/setup.sh)


def encoder_fallbacks() -> float:
    return sum(
        REGISTRY.get_sample_value("asr_encoder_fallbacks_total", {"reason": reason}) or 0.0
        for reason in ("no_eot", "repeat", "compression")
    )


def test_short_real_utterances_mostly_decode_in_one_trimmed_pass(tiny_engine: Engine) -> None:
    """Real speech, 1.1-3.5 s ("ten of clubs", "five five"): call-center utterances are this short.
    With only 2 s of context after the audio tiny.en looped on three of these five ("Seven of clubs.
    Seven of clubs.") and each went back for a 30 s pass, six times the encoder work of its trimmed one.
    With the default --trim-floor-s (10 s) one still loops at 16 kHz ("ten of clubs", 1.1 s; none as
    8 kHz mu-law, docs/benchmarks.md); 15 s would stop that one too but costs every utterance more."""
    clips = [sf.read(path, dtype="float32")[0] for path in sorted(CARDS.glob("*.wav"))]
    assert len(clips) == 5 and max(len(c) for c in clips) < 4 * 16000
    before = encoder_fallbacks()
    texts = [tiny_engine.submit(c).future.result(timeout=120).text for c in clips]
    assert encoder_fallbacks() - before <= 1, texts
    lines = (CARDS / "cards.transcription").read_text().splitlines()
    references = [line.split("(")[0].replace("<s>", "").replace("</s>", "") for line in lines]
    assert corpus_wer(references, texts) <= 0.25, texts


def test_espeak_sentences_within_the_wer_bound(tiny_engine: Engine) -> None:
    handles = [tiny_engine.submit(speak(s, voice=v)) for s in SENTENCES for v in VOICES]
    hypotheses = [h.future.result(timeout=300).text for h in handles]
    references = [s for s in SENTENCES for _ in VOICES]
    assert corpus_wer(references, hypotheses) <= WER_BOUND


@pytest.mark.parametrize("audio", [silence(8.0), white_noise(8.0, dbfs=-30.0)], ids=["silence", "noise"])
def test_silence_and_noise_give_no_text(tiny_engine: Engine, audio: np.ndarray) -> None:
    result = tiny_engine.submit(audio).future.result(timeout=120)
    assert result.text == "" and not result.is_speech


def test_audio_longer_than_30_seconds_is_transcribed_window_by_window(tiny_engine: Engine) -> None:
    gap = np.zeros(16000 * 2, dtype=np.float32)
    audio = np.concatenate([jfk_16k(), gap, jfk_16k(), gap, jfk_16k()])  # 39 s
    text = normalize(tiny_engine.submit(audio).future.result(timeout=300).text)
    assert text.count("fellow americans") >= 2
    assert text.endswith("for your country")


def test_segment_timestamps_lie_inside_the_audio_and_increase(tiny_engine: Engine) -> None:
    result = tiny_engine.submit(jfk_16k(), DecodeOptions(timestamps=True)).future.result(timeout=120)
    assert result.segments
    assert "fellow americans" in normalize(" ".join(s.text for s in result.segments))
    starts = [s.start_s for s in result.segments]
    assert starts == sorted(starts)
    assert all(0.0 <= s.start_s < s.end_s <= 11.5 for s in result.segments)


def test_prompt_steers_spelling_of_names(tiny_engine: Engine) -> None:
    clip = speak("Please connect me with Kowalczyk in accounts.")
    prompted = tiny_engine.submit(clip, DecodeOptions(prompt="Kowalczyk, Nguyen, Zendesk")).future.result(120)
    assert "kowalczyk" in normalize(prompted.text)


def test_trimmed_encoder_context_transcribes_and_is_batch_invariant() -> None:
    engine = Engine(EngineConfig(threads=2, encoder_context="trim", batch_window_ms=300.0))
    engine.start()
    try:
        clips = [speak(SENTENCES[1]), jfk_16k(), speak(SENTENCES[3])]
        alone = [engine.submit(c).future.result(timeout=120) for c in clips]
        together = [h.future.result(timeout=120) for h in [engine.submit(c) for c in clips]]
    finally:
        engine.stop()
    assert [r.stats.encoder_batch_size for r in together] == [3, 3, 3]  # one shared encoder pass
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert "my fellow americans" in normalize(alone[1].text)
    assert corpus_wer([SENTENCES[1], SENTENCES[3]], [alone[0].text, alone[2].text]) <= WER_BOUND


def test_int8_quantized_engine_still_transcribes() -> None:
    engine = Engine(
        EngineConfig(threads=2, quantize="int8-per-tensor", quantize_parts="all", encoder_context="trim")
    )
    engine.start()
    try:
        text = normalize(engine.submit(jfk_16k()).future.result(timeout=120).text)
    finally:
        engine.stop()
    assert "ask not what your country can do for you" in text


def test_multilingual_base_detects_english_and_transcribes() -> None:
    engine = Engine(EngineConfig(model="base", threads=2, encoder_context="trim", kv_slots=4))
    engine.start()
    try:
        assert engine.info.multilingual and "de" in engine.info.languages
        detected = engine.submit(jfk_16k()).future.result(timeout=300)
        forced = engine.submit(jfk_16k(), DecodeOptions(language="en")).future.result(timeout=300)
    finally:
        engine.stop()
    assert detected.language == "en"
    assert "ask not what your country can do for you" in normalize(detected.text)
    assert detected.tokens == forced.tokens
