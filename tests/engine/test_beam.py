"""Beam search in the continuously batched decoder: beams are rows of the slot KV cache, so a beam
request's tokens must not depend on its batch company (beams and greedy sequences joining and leaving
mid-decode), beam_size=1 must be today's greedy decode bit for bit, and capacity counts rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.scoring import normalize
from engine import DecodeOptions, Engine, EngineConfig
from engine.decoding import beam
from engine.scheduling.request import Request
from tests.engine.test_scheduler import noise, running
from tests.support.engine import jfk_16k
from tests.support.wait import wait_until


def test_beam_size_one_is_greedy_bit_for_bit(random_model: Path) -> None:
    clips = [noise(2.0, 11), noise(1.2, 12)]
    with running(random_model, batch_window_ms=1.0) as engine:
        greedy = [engine.submit(c, DecodeOptions(max_new_tokens=30)).future.result(timeout=60) for c in clips]
        one = [
            engine.submit(c, DecodeOptions(max_new_tokens=30, beam_size=1)).future.result(timeout=60)
            for c in clips
        ]
    assert [r.tokens for r in one] == [r.tokens for r in greedy]
    assert [r.avg_logprob for r in one] == [r.avg_logprob for r in greedy]


def test_beams_batched_equal_beams_alone_joining_and_leaving_mid_decode(random_model: Path) -> None:
    clips = [noise(2.0, 1), noise(1.3, 2), noise(3.1, 3), noise(0.8, 4)]
    options = [
        DecodeOptions(max_new_tokens=24, beam_size=3),
        DecodeOptions(max_new_tokens=10),  # a greedy one leaves early
        DecodeOptions(max_new_tokens=30, beam_size=4, timestamps=True),  # the timestamp rules over beams
        DecodeOptions(max_new_tokens=6, beam_size=2),  # joins late, leaves first
    ]
    with running(random_model, batch_window_ms=1.0, kv_slots=12) as engine:
        alone = [engine.submit(c, o).future.result(timeout=120) for c, o in zip(clips, options, strict=True)]
        first = engine.submit(clips[0], options[0])
        wait_until(lambda: engine.stats()["active"], 30, "the first beam request never started decoding")
        second = engine.submit(clips[1], options[1])
        wait_until(lambda: engine.stats()["slots_used"] >= 4, 30, "the greedy request never joined")
        later = [engine.submit(c, o) for c, o in zip(clips[2:], options[2:], strict=True)]
        together = [h.future.result(timeout=120) for h in [first, second, *later]]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    # scores may differ in the last bits (a matmul over another batch size rounds differently), as greedy
    # log-probabilities do; the tokens, the beams' choices, may not
    assert [r.avg_logprob for r in together] == pytest.approx([r.avg_logprob for r in alone], rel=1e-5)


def test_a_request_of_five_beams_takes_five_rows(random_model: Path) -> None:
    # the full context: a trimmed window that loops would give its rows back for a fallback meanwhile
    with running(random_model, batch_window_ms=1.0, kv_slots=6, encoder_context="full") as engine:
        first = engine.submit(noise(3.0, 5), DecodeOptions(max_new_tokens=200, beam_size=5))
        wait_until(lambda: engine.stats()["slots_used"] == 5, 30, "the beams never took their rows")
        assert engine.stats()["slots_free"] == 1
        # a second 5-beam request does not fit in the one free row: it waits for the first to finish
        second = engine.submit(noise(1.0, 6), DecodeOptions(max_new_tokens=4, beam_size=5))
        # the engine's loop takes the submission in on its next turn (seconds on a loaded machine)
        wait_until(lambda: engine.stats()["waiting"] == 1, 30, "the second search never queued")
        assert not first.future.done() and not second.future.done()
        assert engine.stats()["slots_used"] <= 6
        first.cancel()
        second.future.result(timeout=60)
        wait_until(lambda: engine.stats()["slots_used"] == 0, 30, "rows were not given back")


def test_too_large_beam_size_is_refused_naming_the_field_and_the_limit(random_model: Path) -> None:
    with running(random_model, max_beam_size=4) as engine:
        with pytest.raises(ValueError, match=r"beam_size 5 .*--max-beam-size 4"):
            engine.submit(ONE, DecodeOptions(beam_size=5))
        with pytest.raises(ValueError, match="beam_size must be at least 1"):
            engine.submit(ONE, DecodeOptions(beam_size=0))
        assert engine.submit(noise(1.0, 7), DecodeOptions(beam_size=4, max_new_tokens=3)).future.result(60)


ONE = np.zeros(16000, dtype=np.float32)


def test_beam_five_on_real_speech_is_sensible_and_batch_invariant() -> None:
    engine = Engine(EngineConfig(threads=2, kv_slots=12, batch_window_ms=300.0))
    engine.start()
    try:
        clip, short = jfk_16k(), jfk_16k()[: 16000 * 4]
        beam = DecodeOptions(beam_size=5, word_timestamps=True)
        alone = engine.submit(clip, beam).future.result(timeout=300)
        alone_short = engine.submit(short, DecodeOptions(beam_size=3)).future.result(timeout=300)
        handles = [engine.submit(clip, beam), engine.submit(short, DecodeOptions(beam_size=3))]
        together = [h.future.result(timeout=300) for h in handles]
    finally:
        engine.stop()
    text = normalize(alone.text)
    assert "my fellow americans" in text
    assert "ask not what your country can do for you" in text
    assert alone.is_speech and 0.5 < alone.confidence <= 1.0
    assert [w.word.strip().lower().strip(",.") for w in alone.words][:3] == ["and", "so", "my"]
    assert [r.tokens for r in together] == [alone.tokens, alone_short.tokens]


EOT = 99


def beam_request(size: int, max_new: int = 10) -> Request:
    from concurrent.futures import Future

    req = Request("b", ONE, DecodeOptions(beam_size=size), Future())
    req.max_new, req.length, req.audio_ctx = max_new, 3, 1500
    return req


def test_beams_are_chosen_as_whisper_chooses_them() -> None:
    """One hypothesis proposes its candidates; the likeliest `size` that do not end the text become the
    beams (each remembering which beam it continues), an ending one is kept as finished."""
    req = beam_request(2)
    beams = beam.begin(req)
    sources = beam.advance(req, beams, [[-0.1, -0.5, -2.0]], [[7, EOT, 8]], EOT)
    assert [(b.generated, b.sum_logprob) for b in req.beams] == [([7], -0.1), ([8], -2.0)]
    assert sources == [0, 0] and req.beam_finished == {(EOT,): -0.5}
    # the second step: beam 1's continuation overtakes beam 0's, and its rows take beam 1's K/V
    sources = beam.advance(
        req, req.beams, [[-3.0, -4.0, -5.0], [-0.2, -0.3, -6.0]], [[1, 2, EOT], [3, EOT, 4]], EOT
    )
    assert [(b.generated, b.sum_logprob) for b in req.beams] == [([8, 3], -2.2), ([7, 1], -3.1)]
    assert sources == [1, 0]
    assert beam.over(req, EOT, 224, 1500)  # two finished: as many as beams
    beam.finish(req, EOT)
    assert req.beam_finished == {} and req.generated == [EOT]  # -0.5 over length 1 beats [8, EOT]'s -2.3 / 1
    assert req.window_done and not req.beams


def test_the_result_is_ranked_by_log_probability_over_length() -> None:
    req = beam_request(2)
    req.beam_finished = {(5, EOT): -1.0, (5, 6, 7, 8, EOT): -2.0}  # -1.0 / 1 against -2.0 / 4
    req.beams = []
    beam.finish(req, EOT)
    assert req.generated == [5, 6, 7, 8, EOT] and req.sum_logprob == -2.0 and req.sampled == 5


def test_a_search_over_its_budget_ends_with_the_live_beams_ranked_too() -> None:
    req = beam_request(2, max_new=2)
    beam.begin(req)
    beam.advance(req, beam.begin(req), [[-0.1, -0.2, -9.0]], [[1, 2, 3]], EOT)
    assert not beam.over(req, EOT, 224, 1500)
    beam.advance(req, req.beams, [[-0.1, -0.2, -9.0], [-0.1, -0.3, -9.0]], [[4, 5, 6], [4, 5, 6]], EOT)
    assert beam.over(req, EOT, 224, 1500)  # two tokens sampled: the budget
    beam.finish(req, EOT)
    assert req.generated == [1, 4]  # no end of text: the window ran out (a trimmed one may fall back)


def test_a_beam_search_over_several_windows_and_fallbacks_is_batch_invariant(random_model: Path) -> None:
    """Audio past 30 s goes on window by window, and a trimmed window that loops falls back to the full
    context: a beam request leaves its rows and takes them again each time, in any company."""
    long, short = noise(33.0, 21), noise(1.5, 22)
    options = DecodeOptions(max_new_tokens=12, beam_size=3)
    with running(random_model, batch_window_ms=1.0, kv_slots=8) as engine:
        alone = engine.submit(long, options).future.result(timeout=300)
        handles = [engine.submit(long, options), engine.submit(short, DecodeOptions(beam_size=2))]
        together = [h.future.result(timeout=300) for h in handles]
        wait_until(lambda: engine.stats()["slots_used"] == 0, 30, "rows were not given back")
    assert together[0].tokens == alone.tokens
    assert alone.stats.decode_steps >= 2 * 2  # two windows at least, each at least a step or two


def test_masked_candidates_are_never_chosen() -> None:
    """Fewer tokens allowed than beams (the timestamp rules can leave one): the search goes on with fewer."""
    req = beam_request(3)
    inf = float("-inf")
    sources = beam.advance(req, beam.begin(req), [[-0.1, inf, inf, inf]], [[5, 6, 7, 8]], EOT)
    assert [b.generated for b in req.beams] == [[5]] and sources == [0]
    assert not beam.over(req, EOT, 224, 1500)


def one_term_bias(per_token: float = 2.0) -> beam.TermBias:
    """A list of one term spelled by tokens 10 then 11 (node 1, then node 2 ends term 0)."""
    trie = beam.HostTrie(edges=[{}, {11: 2}, {}], roots=({10: 1}, {10: 1}), term=[-1, -1, 0], reach=[0, 1, 1])
    return beam.TermBias(trie, np.ones(EOT + 2, dtype=bool), per_token)


def test_a_keyterm_spelling_outranks_a_likelier_beam_and_keeps_its_bonus_when_complete() -> None:
    req, bias = beam_request(1), one_term_bias()
    beams = beam.begin(req, bias)
    beam.advance(req, beams, [[-0.5, -1.0]], [[7, 10]], EOT, bias)
    assert [b.generated for b in req.beams] == [[10]]  # -1.0 + 2.0 (open) beats -0.5
    assert req.beams[0].sum_logprob == -1.0  # the model's own log-probability, not the bonus
    beam.advance(req, req.beams, [[-0.25, -0.5]], [[11, EOT]], EOT, bias)
    (spelled,) = req.beams
    assert spelled.generated == [10, 11] and spelled.terms is not None
    assert spelled.terms.node == 0 and spelled.terms.settled == 4.0 and spelled.terms.used == 1
    # the whole term is kept: ending the text now keeps the bonus in the ranking
    beam.advance(req, req.beams, [[-0.1]], [[EOT]], EOT, bias)
    assert req.beam_finished == {(10, 11, EOT): pytest.approx(-1.35)} and req.beam_bonus == {
        (10, 11, EOT): 4.0
    }


def test_a_failed_spelling_gives_its_bonus_back() -> None:
    req, bias = beam_request(2), one_term_bias()
    beams = beam.begin(req, bias)
    beam.advance(req, beams, [[-0.5, -1.0]], [[7, 10]], EOT, bias)
    assert [b.generated for b in req.beams] == [[10], [7]]
    # the spelling beam goes on with 8, not 11: its bonus is gone and the plain beam leads again
    beam.advance(req, req.beams, [[-0.2], [-0.2]], [[8], [8]], EOT, bias)
    assert [b.generated for b in req.beams] == [[7, 8], [10, 8]]
    assert [b.terms.bonus for b in req.beams if b.terms is not None] == [0.0, 0.0]


def test_a_text_ending_inside_a_spelling_is_ranked_without_its_bonus() -> None:
    req, bias = beam_request(2), one_term_bias(per_token=5.0)
    beam.advance(req, beam.begin(req, bias), [[-1.0, -1.5]], [[10, 7]], EOT, bias)
    beam.advance(req, req.beams, [[-0.1], [-0.1]], [[EOT], [EOT]], EOT, bias)
    assert req.beam_bonus == {(10, EOT): 0.0, (7, EOT): 0.0}
    beam.finish(req, EOT)
    assert req.generated == [10, EOT]  # -1.1 over 1 token beats -1.6: by the model alone
