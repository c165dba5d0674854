"""service.pipeline.endpointing with the real silero-vad model on real (espeak-ng / sox) speech."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.pipeline.audio import StreamDecoder
from service.pipeline.endpointing import Endpointer, Event, SpeechEnded, SpeechStarted, Utterance
from service.pipeline.vad import load_vad
from service.vocabulary.endpointing import EndpointingError, EndpointSettings
from tests.support.audio import (
    RATE,
    make_conversation,
    silence,
    speak,
    speech_bounds,
    to_mulaw_8k_bytes,
    white_noise,
)

CALL = [
    "Thank you for calling the support line, my name is Alex.",
    "I can see that your order was shipped on Monday morning.",
    "The tracking number should arrive in your email within the hour.",
    "Is there anything else I can help you with today?",
]
MORE = [
    "Please stay on the line for a short survey about this call.",
    "Your feedback helps us improve the service we give our customers.",
    "The survey takes about two minutes and has five short questions.",
    "Thank you again and have a wonderful afternoon.",
]


@pytest.fixture(scope="module")
def conversation() -> tuple[np.ndarray, list[tuple[float, float]]]:
    return make_conversation(CALL, pause_s=1.0)


def run(audio: np.ndarray, settings: EndpointSettings | None = None, chunk: int | None = None) -> list[Event]:
    ep = Endpointer(settings)
    chunk = chunk or len(audio) or 1
    events = [e for i in range(0, len(audio), chunk) for e in ep.feed(audio[i : i + chunk])]
    return events + ep.flush()


def utterances(events: list[Event]) -> list[Utterance]:
    return [e for e in events if isinstance(e, Utterance)]


def test_four_sentences_give_four_utterances_at_the_true_bounds(conversation) -> None:
    audio, truth = conversation
    events = run(audio)
    utts = utterances(events)
    assert [u.index for u in utts] == [0, 1, 2, 3]
    for u, (start, end) in zip(utts, truth, strict=True):
        assert abs(u.start_s - start) < 0.3 and abs(u.end_s - end) < 0.3, (u, start, end)
        assert not u.forced_cut and u.audio.dtype == np.float32
        # the audio is exactly the stream's samples from audio_start_s, pad included
        first = round(u.audio_start_s * RATE)
        np.testing.assert_array_equal(u.audio, audio[first : first + len(u.audio)])
        assert u.lead_s == pytest.approx(0.2) and len(u.audio) / RATE >= u.end_s - u.start_s + 0.2
    # each utterance is announced, then ended, then delivered
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["SpeechStarted", "SpeechEnded", "Utterance"] * 4
    starts = [e.offset_s for e in events if isinstance(e, SpeechStarted)]
    ends = [e.offset_s for e in events if isinstance(e, SpeechEnded)]
    assert starts == [u.start_s for u in utts] and ends == [u.end_s for u in utts]


def test_utterance_is_emitted_once_silence_reaches_min_silence(conversation) -> None:
    audio, truth = conversation
    ep = Endpointer(EndpointSettings(min_silence_s=0.5))
    first_end = truth[0][1]
    assert not utterances(ep.feed(audio[: round((first_end + 0.3) * RATE)]))  # silence too short yet
    assert ep.in_speech
    assert (
        len(utterances(ep.feed(audio[round((first_end + 0.3) * RATE) : round((first_end + 0.8) * RATE)])))
        == 1
    )
    assert not ep.in_speech


def test_sixty_seconds_of_silence_give_no_events() -> None:
    ep = Endpointer()
    assert ep.feed(silence(60)) == [] and ep.flush() == []
    assert ep.buffered_s < 1.5  # idle: only the pre-roll and the last slice are kept


@pytest.mark.parametrize("dbfs", [-40.0, -30.0, -20.0])
def test_white_noise_gives_no_utterances(dbfs: float) -> None:
    assert run(white_noise(20, dbfs=dbfs)) == []


def test_speech_over_background_noise_is_still_found() -> None:
    audio, truth = make_conversation(CALL[:2], pause_s=1.0)
    noisy = audio + white_noise(len(audio) / RATE, dbfs=-40, seed=3)
    utts = utterances(run(noisy))
    assert len(utts) == 2 and all(abs(u.start_s - t[0]) < 0.3 for u, t in zip(utts, truth, strict=True))


def test_telephone_audio_through_the_decoder(conversation) -> None:
    audio, truth = conversation
    decoder, ep = StreamDecoder("MULAW", 8000, 1), Endpointer()
    data, events = to_mulaw_8k_bytes(audio), []
    for i in range(0, len(data), 160):  # 20 ms telephone frames
        events += ep.feed(decoder.feed(data[i : i + 160])[0])
    events += ep.feed(decoder.flush()[0]) + ep.flush()
    utts = utterances(events)
    assert len(utts) == 4
    assert all(abs(u.end_s - t[1]) < 0.3 for u, t in zip(utts, truth, strict=True))


def test_long_speech_is_cut_at_quiet_points() -> None:
    audio, truth = make_conversation(CALL + MORE, pause_s=0.15)
    assert len(audio) / RATE > 25
    utts = utterances(run(audio, EndpointSettings(max_utterance_s=10.0)))
    assert len(utts) >= 3 and [u.index for u in utts] == list(range(len(utts)))
    assert all(len(u.audio) / RATE <= 10.0 for u in utts)
    assert all(u.forced_cut for u in utts[:-1]) and not utts[-1].forced_cut
    speech_rms = float(np.sqrt(np.mean(audio[round(truth[0][0] * RATE) : round(truth[0][1] * RATE)] ** 2)))
    for u, nxt in itertools.pairwise(utts):
        assert nxt.start_s == u.end_s  # nothing lost or doubled at a cut
        cut = round(u.end_s * RATE)
        around = audio[cut - 320 : cut + 320]  # +-20 ms
        assert np.sqrt(np.mean(around**2)) < 0.05 * speech_rms, u.end_s
        # in the last 30% of the allowed span
        assert u.end_s - u.audio_start_s >= 0.7 * 10.0 - 0.05
    # every sentence is inside some utterance's audio
    for start, end in truth:
        assert any(
            u.audio_start_s <= start + 0.1 and end - 0.1 <= u.audio_start_s + len(u.audio) / RATE
            for u in utts
        )


def test_flush_emits_the_utterance_in_progress() -> None:
    speech = speak("I would like to cancel my subscription please")
    _, end = speech_bounds(speech)
    cut_short = np.concatenate(
        [silence(0.5), speech[: round(end * RATE)]]
    )  # hang-up right after the last word
    ep = Endpointer()
    fed = ep.feed(cut_short)
    assert any(isinstance(e, SpeechStarted) for e in fed) and not utterances(fed)
    pending = ep.partial()
    assert ep.in_speech and pending is not None and len(pending) > RATE
    flushed = ep.flush()
    assert [type(e) for e in flushed] == [SpeechEnded, Utterance]
    u = utterances(flushed)[0]
    assert abs(u.end_s - (0.5 + end)) < 0.1
    np.testing.assert_array_equal(
        u.audio[-RATE // 10 :], cut_short[-RATE // 10 :]
    )  # the very last samples too
    assert not ep.in_speech and ep.partial() is None and ep.flush() == []


def test_twenty_ms_chunks_equal_one_shot(conversation) -> None:
    audio, _ = conversation
    one, chunked = run(audio), run(audio, chunk=320)
    assert len(one) == len(chunked) == 12
    for a, b in zip(one, chunked, strict=True):
        assert type(a) is type(b)
        if isinstance(a, Utterance) and isinstance(b, Utterance):
            assert (a.start_s, a.end_s, a.index, a.lead_s) == (b.start_s, b.end_s, b.index, b.lead_s)
            np.testing.assert_array_equal(a.audio, b.audio)
        else:
            assert a == b


def test_bursts_shorter_than_min_speech_are_dropped() -> None:
    word = speak("yes")
    start, _ = speech_bounds(word)
    burst = word[round(start * RATE) : round((start + 0.1) * RATE)]  # 100 ms of a word
    audio = np.concatenate([silence(1), burst, silence(1)])
    assert run(audio, EndpointSettings(min_speech_s=0.3)) == []
    assert len(utterances(run(audio, EndpointSettings(min_speech_s=0.0)))) == 1


def test_partial_follows_the_utterance(conversation) -> None:
    audio, truth = conversation
    ep = Endpointer()
    assert ep.partial() is None
    ep.feed(audio[: round((truth[0][0] + 1.0) * RATE)])
    first = ep.partial()
    ep.feed(audio[round((truth[0][0] + 1.0) * RATE) : round((truth[0][0] + 2.0) * RATE)])
    second = ep.partial()
    assert first is not None and second is not None
    assert len(second) - len(first) == RATE
    np.testing.assert_array_equal(second[: len(first)], first)


def test_streams_do_not_share_state(conversation) -> None:
    audio, _ = conversation
    noise = white_noise(len(audio) / RATE, dbfs=-30)
    a, b = Endpointer(), Endpointer()
    assert a._vad is b._vad is load_vad()  # one model per process
    events_a: list[Event] = []
    for i in range(0, len(audio), 320):  # interleaved, as two channels of one call
        events_a += a.feed(audio[i : i + 320])
        assert b.feed(noise[i : i + 320]) == []
    events_a += a.flush()
    assert [type(e) for e in events_a] == [type(e) for e in run(audio)]
    assert [u.end_s for u in utterances(events_a)] == [u.end_s for u in utterances(run(audio))]


def test_memory_stays_bounded_in_endless_speech() -> None:
    audio, _ = make_conversation(CALL + MORE, pause_s=0.15)
    ep, held = Endpointer(EndpointSettings(max_utterance_s=5.0)), []
    for i in range(0, len(audio), 1600):
        ep.feed(audio[i : i + 1600])
        held.append(ep.buffered_s)
    assert max(held) <= 5.0 + 0.1 + 0.064


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"speech_start_threshold": 1.0}, "endpointing.speech_start_threshold"),
        ({"speech_end_threshold": 0.0}, "endpointing.speech_end_threshold"),
        ({"speech_start_threshold": 0.4, "speech_end_threshold": 0.6}, "endpointing.speech_end_threshold"),
        ({"min_silence_s": 0.05}, "endpointing.min_silence_duration"),
        ({"min_silence_s": 6.0}, "endpointing.min_silence_duration"),
        ({"max_utterance_s": 31.0}, "endpointing.max_utterance_duration"),
        ({"max_utterance_s": 0.5}, "endpointing.max_utterance_duration"),
        ({"min_speech_s": -0.1}, "endpointing.min_speech_duration"),
        ({"min_speech_s": 12.0, "max_utterance_s": 10.0}, "endpointing.min_speech_duration"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(EndpointingError) as e:
        EndpointSettings(**kwargs).validate()
    assert e.value.field == field and field in str(e.value)
    with pytest.raises(EndpointingError):
        Endpointer(EndpointSettings(**kwargs))


def test_zero_overrides_mean_defaults() -> None:
    assert EndpointSettings.from_overrides() == EndpointSettings()
    s = EndpointSettings.from_overrides(speech_start_threshold=0.3, min_silence_s=1.0)
    assert s.speech_end_threshold == pytest.approx(0.15) and s.min_silence_s == 1.0
    with pytest.raises(EndpointingError, match="max_utterance_duration"):
        EndpointSettings.from_overrides(max_utterance_s=60.0)


def test_vad_does_not_import_torch_or_touch_its_threads() -> None:
    # silero_vad's own package import calls torch.set_num_threads(1) process-wide: the engine's torch would
    # silently lose its cores. The endpointer must work without importing it.
    code = (
        "import sys, numpy as np\n"
        "from service.pipeline.endpointing import Endpointer\n"
        "Endpointer().feed(np.zeros(16000, dtype=np.float32))\n"
        "assert 'silero_vad' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
