"""Temperature fallback (openai-whisper's transcribe): a window whose result fails Whisper's thresholds is
decoded again at the next temperature, in its own rows from its one encoder pass; at a temperature above 0
a request samples with its own generator, so its tokens do not depend on its batch company."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from clients.scoring import normalize
from engine import DecodeOptions, Engine, EngineConfig
from engine.config import parse_temperatures
from engine.parameters import WHISPER_TEMPERATURES
from engine.scheduling import outcome
from engine.scheduling.request import Attempt, Request
from tests.engine.test_scheduler import noise, running
from tests.support.engine import jfk_16k
from tests.support.wait import wait_until


def fallbacks(temperature: str) -> float:
    """asr_temperature_fallbacks_total at this temperature, whatever the reason."""
    return sum(
        REGISTRY.get_sample_value(
            "asr_temperature_fallbacks_total", {"temperature": temperature, "reason": r}
        )
        or 0.0
        for r in ("compression", "logprob")
    )


def encoder_passes() -> float:
    return REGISTRY.get_sample_value("asr_encoder_batch_size_count") or 0.0


SAMPLED = DecodeOptions(max_new_tokens=16, temperatures=(0.7,), seed=7)
FALLING = DecodeOptions(max_new_tokens=12, temperatures=(0.0, 0.5, 1.0), seed=3)


def test_sampled_tokens_do_not_depend_on_the_batch(random_model: Path) -> None:
    """A request alone and in a batch with others (greedy, beams, another sampler joining mid-decode) samples
    the same tokens; its seed decides them."""
    clips = [noise(2.0, 31), noise(1.5, 32), noise(2.5, 33), noise(1.0, 34)]
    options = [
        SAMPLED,
        DecodeOptions(max_new_tokens=10),
        DecodeOptions(max_new_tokens=14, beam_size=3),
        FALLING,
    ]
    with running(random_model, batch_window_ms=1.0, kv_slots=12, encoder_context="full") as engine:
        alone = [engine.submit(c, o).future.result(timeout=120) for c, o in zip(clips, options, strict=True)]
        first = engine.submit(clips[0], options[0])
        wait_until(lambda: engine.stats()["active"], 30, "the sampler never started decoding")
        later = [engine.submit(c, o) for c, o in zip(clips[1:], options[1:], strict=True)]
        together = [h.future.result(timeout=120) for h in [first, *later]]
        greedy = engine.submit(clips[0], DecodeOptions(max_new_tokens=16)).future.result(timeout=60)
        reseeded = engine.submit(
            clips[0], DecodeOptions(max_new_tokens=16, temperatures=(0.7,), seed=8)
        ).future.result(timeout=60)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert alone[0].temperature == 0.7
    assert alone[0].tokens != greedy.tokens  # it sampled
    assert reseeded.tokens != alone[0].tokens  # another seed, other samples


def test_a_failing_window_is_decoded_at_each_temperature_from_one_encoder_pass(random_model: Path) -> None:
    """Random weights fail the log-probability threshold at every temperature: the window is decoded three
    times, the metric counts the two fallbacks, and only one encoder pass ran."""
    with running(random_model, batch_window_ms=1.0, encoder_context="full") as engine:
        before = (fallbacks("0.5"), fallbacks("1"), encoder_passes())
        result = engine.submit(noise(2.0, 35), FALLING).future.result(timeout=120)
        after = (fallbacks("0.5"), fallbacks("1"), encoder_passes())
        wait_until(lambda: engine.stats()["slots_used"] == 0, 30, "rows were not given back")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert after[2] - before[2] == 1  # the fallbacks reused the window's encoder output
    assert result.temperature in (0.0, 0.5, 1.0)


def prefills() -> float:
    return REGISTRY.get_sample_value("asr_prefill_seconds_count") or 0.0


@pytest.mark.parametrize("best_of", [1, 3])
def test_each_temperature_above_zero_decodes_best_of_samples(random_model: Path, best_of: int) -> None:
    """openai-whisper's best_of: a temperature above 0 decodes that many samples (each its own prefill in
    the window's row, none its own encoder pass) and the likeliest stands for it."""
    options = DecodeOptions(max_new_tokens=6, temperatures=(0.0, 0.5), seed=2)
    with running(random_model, batch_window_ms=1.0, encoder_context="full", best_of=best_of) as engine:
        before = (prefills(), encoder_passes(), fallbacks("0.5"))
        result = engine.submit(noise(1.0, 39), options).future.result(timeout=120)
        after = (prefills(), encoder_passes(), fallbacks("0.5"))
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1 + best_of, 1, 1)
    assert result.temperature in (0.0, 0.5)


def test_beams_fall_back_to_sampling_in_their_first_row(random_model: Path) -> None:
    options = DecodeOptions(max_new_tokens=12, beam_size=3, temperatures=(0.0, 0.4), seed=1)
    with running(random_model, batch_window_ms=1.0, kv_slots=6, encoder_context="full") as engine:
        before = fallbacks("0.4")
        alone = engine.submit(noise(1.5, 36), options).future.result(timeout=120)
        handles = [engine.submit(noise(1.5, 36), options), engine.submit(noise(1.0, 37), SAMPLED)]
        together = [h.future.result(timeout=120) for h in handles]
        wait_until(lambda: engine.stats()["slots_used"] == 0, 30, "rows were not given back")
    assert fallbacks("0.4") - before == 2
    assert together[0].tokens == alone.tokens


def test_interims_never_fall_back(random_model: Path) -> None:
    with running(random_model, batch_window_ms=1.0, encoder_context="full") as engine:
        before = fallbacks("0.5")
        result = engine.submit(
            noise(1.0, 38), DecodeOptions(max_new_tokens=8, interim=True, temperatures=(0, 0.5))
        )
        result.future.result(timeout=60)
    assert fallbacks("0.5") == before


def test_bad_temperatures_are_refused_naming_the_field(random_model: Path) -> None:
    with running(random_model) as engine:
        with pytest.raises(ValueError, match=r"temperatures\[1\] must be a number from 0 to 1"):
            engine.submit(noise(1.0, 1), DecodeOptions(temperatures=(0.0, 1.5)))
        with pytest.raises(ValueError, match="temperatures must list at least one"):
            engine.submit(noise(1.0, 1), DecodeOptions(temperatures=()))
        with pytest.raises(ValueError, match="seed must be an integer"):
            engine.submit(noise(1.0, 1), DecodeOptions(seed=-1))
    assert EngineConfig(temperatures="0,x").validate() == [
        "--temperatures must be comma-separated numbers, got '0,x'"
    ]
    assert parse_temperatures("0,0.2,0.4,0.6,0.8,1") == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def attempt(temperature: float, avg: float, ratio: float) -> Attempt:
    return Attempt(temperature, (1, 2), avg * 2, 2, avg, ratio)


def test_when_every_temperature_fails_the_best_unlooped_decode_is_kept() -> None:
    looped, weak, best_looped = attempt(0.0, -1.5, 1.2), attempt(0.2, -1.2, 1.5), attempt(1.0, -0.5, 3.0)
    assert outcome.best_attempt([looped, weak, best_looped]) == weak
    assert (
        outcome.best_attempt([best_looped, attempt(0.4, -0.9, 2.6)]) == best_looped
    )  # all looped: all count


def test_silence_does_not_fall_back() -> None:
    class Rules:
        class vocab:  # the shape outcome.TextRules reads
            eot = 99

        def text(self, tokens: list[int]) -> str:
            return "uh"

    req = Request("s", noise(1.0, 1), DecodeOptions(), Future())
    req.generated, req.sum_logprob, req.sampled = [5, 99], -3.0, 2
    req.no_speech_prob = 0.7
    assert outcome.failure_of(outcome.attempt(req, Rules()), req.no_speech_prob) is None
    req.no_speech_prob = 0.1
    assert outcome.failure_of(outcome.attempt(req, Rules()), req.no_speech_prob) == "logprob"


def test_real_speech_forced_to_fall_back_keeps_a_sensible_transcript(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny.en on real speech passes Whisper's thresholds at 0; with a threshold no decode can pass, the
    window is decoded at every temperature and the best keeps the speech."""
    engine = Engine(EngineConfig(threads=2, kv_slots=4, encoder_context="full"))
    engine.start()
    try:
        clip = jfk_16k()
        plain = engine.submit(clip, DecodeOptions(temperatures=WHISPER_TEMPERATURES)).future.result(
            timeout=300
        )
        monkeypatch.setattr(outcome, "LOGPROB_THRESHOLD", -0.001)
        before = [fallbacks(t) for t in ("0.2", "0.4", "0.6", "0.8", "1")]
        forced = engine.submit(clip, DecodeOptions(temperatures=WHISPER_TEMPERATURES, seed=5)).future.result(
            timeout=300
        )
        after = [fallbacks(t) for t in ("0.2", "0.4", "0.6", "0.8", "1")]
    finally:
        engine.stop()
    assert plain.temperature == 0.0
    assert [a - b for a, b in zip(after, before, strict=True)] == [1] * 5
    assert "ask not what your country can do for you" in normalize(forced.text)
    assert forced.temperature in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
