"""The end-of-turn model (service/pipeline/turn_model.py) and the endpointer's use of it, on the real
smart-turn v3.2 weights (scripts/fetch_turn_model.py) and real speech (pocketsphinx-testdata's librivox)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soundfile as sf
import torch

from engine.model.features import LogMel
from service.config import ServerConfig, validate
from service.pipeline.endpointing import Endpointer, SpeechEnded, TurnJudging, Utterance
from service.pipeline.session_settings import SessionSettings, turn_judging
from service.pipeline.turn_model import N_SAMPLES, TurnBatcher, TurnModel, features, load_turn_model
from service.pipeline.vad import RATE
from service.vocabulary.endpointing import EndpointingError, EndpointSettings

LIBRIVOX = "/usr/share/pocketsphinx/test/data/librivox"
# "and mister john dashwood had then leisure to consider how much there might be prudently in his power
# to do for them": a turn the model calls complete at its end (P 0.99) and incomplete cut after "how"
# (P 0.01; 4.10 s: midway between "how" and "much" in the engine's word timings)
DASHWOOD = f"{LIBRIVOX}/sense_and_sensibility_01_austen_64kb-0870.wav"
DASHWOOD_PAUSE_S = 4.10


def dashwood() -> np.ndarray:
    audio, rate = sf.read(DASHWOOD, dtype="float32")
    assert rate == RATE
    return audio


def with_pause(audio: np.ndarray, at_s: float, pause_s: float, tail_s: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    cut = round(at_s * RATE)

    def quiet(seconds: float) -> np.ndarray:
        return (rng.standard_normal(round(seconds * RATE)) * 1e-3).astype(np.float32)

    return np.concatenate([quiet(0.5), audio[:cut], quiet(pause_s), audio[cut:], quiet(tail_s)])


def test_features_are_whispers_log_mel_of_the_normalised_last_8_s() -> None:
    """Our numpy features equal the engine's Whisper log-mel (torch) of the same 8 s, front-padded with
    zeros and normalised to zero mean and unit variance, as pipecat prepares smart-turn's input."""
    audio = dashwood()
    x = np.concatenate([np.zeros(N_SAMPLES - len(audio), dtype=np.float32), audio])
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    reference = LogMel(80, torch.device("cpu"))([x.astype(np.float32)], [400])[0].numpy()
    ours = features(audio)
    assert ours.shape == (80, 800)
    assert np.abs(ours - reference).max() < 2e-3


def test_complete_and_incomplete_turns_of_real_speech() -> None:
    model = load_turn_model()
    audio = dashwood()
    cut = round(DASHWOOD_PAUSE_S * RATE)
    quiet = np.zeros(round(0.3 * RATE), dtype=np.float32)
    done, midway = model.complete([np.concatenate([audio, quiet]), np.concatenate([audio[:cut], quiet])])
    assert done >= 0.5 > midway, (done, midway)


async def test_one_model_call_answers_every_stream_that_asked_in_a_tick() -> None:
    model = TurnModel()
    batcher = TurnBatcher(model)
    audio = dashwood()
    got: dict[str, list[float] | Exception] = {}
    batcher.request([audio], lambda p: got.__setitem__("a", p))
    batcher.request([audio[: round(DASHWOOD_PAUSE_S * RATE)], audio], lambda p: got.__setitem__("b", p))
    batcher.request([audio[:RATE]], lambda p: got.__setitem__("c", p))
    assert model.calls == 0  # nothing runs before the loop turns
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert model.calls == 1
    a, b, c = got["a"], got["b"], got["c"]
    assert isinstance(a, list) and isinstance(b, list) and isinstance(c, list)
    assert (len(a), len(b), len(c)) == (1, 2, 1)
    assert b[1] == pytest.approx(a[0], abs=1e-6)  # the same turn gets the same answer in any row
    alone = model.complete([audio[: round(DASHWOOD_PAUSE_S * RATE)]])[0]
    assert b[0] == pytest.approx(alone, abs=1e-5)


def judged_run(
    audio: np.ndarray, verdicts: list[float], turn: TurnJudging | None
) -> tuple[list[object], int]:
    """Feed the endpointer in 20 ms slices, answering each question with the next verdict at once."""
    ep = Endpointer(EndpointSettings(min_silence_s=0.3), turn=turn)
    events: list[object] = []
    asked = 0
    for at in range(0, len(audio), 320):
        events += ep.feed(audio[at : at + 320])
        question = ep.question()
        if question is not None:
            assert len(question) <= N_SAMPLES
            events += ep.judged(verdicts[min(asked, len(verdicts) - 1)])
            asked += 1
    return events + ep.flush(), asked


def test_an_incomplete_pause_waits_and_a_complete_one_ends_the_turn() -> None:
    audio = with_pause(dashwood(), DASHWOOD_PAUSE_S, 0.7, 2.5)
    silence_only, asked = judged_run(audio, [], None)
    assert asked == 0 and len([e for e in silence_only if isinstance(e, Utterance)]) == 2  # cut at the pause
    events, asked = judged_run(audio, [0.1, 0.9], TurnJudging(0.5, 2.0))
    turns = [e for e in events if isinstance(e, Utterance)]
    assert asked == 2 and len(turns) == 1  # the pause was judged incomplete; the end complete
    assert turns[0].end_s > 0.5 + len(dashwood()) / RATE + 0.7 - 0.3
    ended = [e for e in events if isinstance(e, SpeechEnded)]
    assert len(ended) == 1


def test_an_incomplete_end_waits_up_to_the_maximum_silence() -> None:
    audio = with_pause(dashwood(), DASHWOOD_PAUSE_S, 0.7, 3.0)
    events, asked = judged_run(audio, [0.1], TurnJudging(0.5, 1.0))
    turns = [e for e in events if isinstance(e, Utterance)]
    # the pause (0.7 s < 1 s) did not end the turn; the end did, after the maximum silence, not at flush
    assert asked == 2 and len(turns) == 1
    assert turns[0].end_s < len(audio) / RATE - 1.5


def test_the_streams_setting_else_the_servers_flags() -> None:
    off, on = (
        SessionSettings.from_config(c)
        for c in (ServerConfig(), ServerConfig(turn_model=True, turn_threshold=0.6, turn_max_silence_s=1.5))
    )
    assert turn_judging(EndpointSettings(), off) is None  # off by default: silence alone ends turns
    assert turn_judging(EndpointSettings(), on) == TurnJudging(0.6, 1.5)
    assert turn_judging(EndpointSettings(turn_model=True), off) == TurnJudging(0.5, 2.0)
    assert turn_judging(EndpointSettings(turn_model=False), on) is None
    mine = EndpointSettings(min_silence_s=0.8, turn_model=True, turn_threshold=0.7, turn_max_silence_s=0.5)
    assert turn_judging(mine, off) == TurnJudging(0.7, 0.8)  # never shorter than the stream's own silence
    with pytest.raises(EndpointingError, match="turn_threshold"):
        EndpointSettings(turn_threshold=1.5).validate()
    with pytest.raises(SystemExit, match="--turn-max-silence-s"):
        validate(ServerConfig(turn_max_silence_s=60))
