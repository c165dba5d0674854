"""The Riva door (nvidia.riva.asr.RivaSpeechRecognition) driven by NVIDIA's own client, riva.client,
unmodified, at a real server on loopback (the bundled tiny.en): a real-speech telephone call with interim
and final results and word offsets, a two-channel call, recorded files, a WAV file streamed the way
riva.client's transcribe_file.py streams it, word boosting, each bad input answered INVALID_ARGUMENT
naming the Riva field, auth refused and accepted, and a drain.

Every call is bounded by a deadline in the channel's service config (riva.client's calls take none)."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import riva.client
import soundfile as sf
import soxr
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY
from riva.client.proto import riva_asr_pb2 as rasr

from clients.scoring import corpus_wer
from engine import Engine
from scripts.keyterm_clips import KEYTERMS, name_clips, said, telephone_audio
from service.config import ServerConfig
from service.doors.riva.audio import sniff_container, wav_header
from service.doors.riva.settings import Endpointing, endpointing
from tests.support.audio import (
    JFK_FLAC,
    make_conversation,
    silence,
    speak,
    stereo,
    to_linear16_bytes,
    to_mulaw_8k_bytes,
)
from tests.support.engine import JFK_TEXT, jfk_16k
from tests.support.server import DOOR_TOKEN, ServerThread
from tests.support.two_speakers import one_speaker_call, two_speaker_call, word_accuracy
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

SERVICE = "nvidia.riva.asr.RivaSpeechRecognition"
TOKEN = DOOR_TOKEN
DEADLINE_S = 120
# riva.client's calls take no timeout: the channel's service config gives each one a deadline, so a server
# bug fails the test instead of hanging the suite.
BOUNDED = (
    "grpc.service_config",
    json.dumps({"methodConfig": [{"name": [{"service": SERVICE}], "timeout": f"{DEADLINE_S}s"}]}),
)
# A Riva model id as an integrator's code names it; this server serves its own model whatever the name.
RIVA_MODEL = "parakeet-1.1b-en-US-asr-streaming"


@pytest.fixture(scope="session")
def server(door_server: ServerThread) -> ServerThread:
    return door_server


@contextlib.contextmanager
def riva_asr(
    target: str, token: str | None = TOKEN, metadata: Iterable[tuple[str, str]] = ()
) -> Iterator[riva.client.ASRService]:
    """riva.client pointed at this server, as the notes tell an integrator (Riva's own auth header)."""
    args = [["authorization", f"Bearer {token}"]] if token is not None else []
    args += [list(m) for m in metadata]
    auth = riva.client.Auth(uri=target, use_ssl=False, metadata_args=args or None, options=[BOUNDED])
    try:
        yield riva.client.ASRService(auth)
    finally:
        auth.channel.close()


def chunks(data: bytes, chunk_bytes: int, pace_s: float = 0.0) -> Iterator[bytes]:
    """The audio in chunks, each `pace_s` after the last (0: as fast as the client sends)."""
    for i in range(0, len(data), chunk_bytes):
        if pace_s and i:
            time.sleep(pace_s)
        yield data[i : i + chunk_bytes]


def streaming_config(**kwargs: object) -> rasr.StreamingRecognitionConfig:
    interim = bool(kwargs.pop("interim_results", False))
    return riva.client.StreamingRecognitionConfig(
        config=riva.client.RecognitionConfig(**kwargs), interim_results=interim
    )


def stream(
    asr: riva.client.ASRService, audio: Iterable[bytes], config: rasr.StreamingRecognitionConfig
) -> list[rasr.StreamingRecognizeResponse]:
    return list(asr.streaming_response_generator(audio_chunks=audio, streaming_config=config))


def results(responses: list[rasr.StreamingRecognizeResponse]) -> list[rasr.StreamingRecognitionResult]:
    return [r for x in responses for r in x.results]


def finals_text(rs: Iterable[rasr.StreamingRecognitionResult | rasr.SpeechRecognitionResult]) -> str:
    return " ".join(
        r.alternatives[0].transcript for r in rs if getattr(r, "is_final", True) and r.alternatives
    )


def refusal(call: object) -> grpc.RpcError:
    """The RpcError a call (a thunk) ends with; fails if it succeeds."""
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value


# --- the translation itself, without a server ------------------------------------------------------


def test_endpointing_config_becomes_the_silence_and_speech_that_end_and_start_an_utterance() -> None:
    config = rasr.RecognitionConfig()
    riva.client.add_endpoint_parameters_to_config(config, 300, 0.5, 800, 240, 0.9, 0.95)
    ep = endpointing(config, default_silence_s=0.5, default_speech_s=0.2)
    assert ep.min_silence_s == pytest.approx(0.72) and ep.min_speech_s == pytest.approx(0.15)
    only_threshold = rasr.RecognitionConfig(endpointing_config=rasr.EndpointingConfig(stop_threshold=0.8))
    assert endpointing(only_threshold, 0.5, 0.2).min_silence_s == pytest.approx(0.4)  # the server's window
    assert endpointing(rasr.RecognitionConfig(), 0.5, 0.2) == Endpointing()


@pytest.mark.parametrize("subtype, encoding", [("PCM_16", "LINEAR16"), ("ULAW", "MULAW"), ("ALAW", "ALAW")])
def test_a_wav_header_says_encoding_rate_channels_and_where_the_samples_begin(
    subtype: str, encoding: str
) -> None:
    samples = stereo(speak("one two", rate=8000), silence(0.5, 8000))
    wav = io.BytesIO()
    sf.write(wav, samples.T, 8000, subtype=subtype, format="WAV")
    data = wav.getvalue()
    header = wav_header(data)
    assert header is not None
    assert (header.encoding, header.sample_rate_hertz, header.channels) == (encoding, 8000, 2)
    width = 2 if encoding == "LINEAR16" else 1
    assert len(data) - header.data_offset == samples.shape[1] * 2 * width
    assert wav_header(data[: header.data_offset - 4]) is None, "a header cut short waits for more bytes"
    assert sniff_container(data) == "WAV" and sniff_container(b"fLaC\0\0") == "FLAC"
    assert sniff_container(bytes(16)) is None


# --- a real-speech telephone call ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def jfk_call(server: ServerThread) -> list[rasr.StreamingRecognizeResponse]:
    """jfk.flac as a call center receives it (8 kHz mu-law), 100 ms chunks paced in real time, with
    interim results, word offsets, an integrator's Riva model id and NVCF routing metadata."""
    audio = to_mulaw_8k_bytes(jfk_16k())
    config = streaming_config(
        encoding=riva.client.AudioEncoding.MULAW,
        sample_rate_hertz=8000,
        language_code="en-US",
        model=RIVA_MODEL,
        max_alternatives=1,
        enable_automatic_punctuation=True,
        verbatim_transcripts=True,
        enable_word_time_offsets=True,
        audio_channel_count=1,
        interim_results=True,
    )
    with riva_asr(server.target, metadata=[("function-id", "00000000-0000-0000-0000-000000000000")]) as asr:
        return stream(asr, chunks(audio, 800, pace_s=0.1), config)


def test_real_speech_call_finals_carry_the_text_and_word_offsets_in_ms(
    jfk_call: list[rasr.StreamingRecognizeResponse],
) -> None:
    finals = [r for r in results(jfk_call) if r.is_final]
    assert len(finals) >= 2, "jfk has four pauses: one final per utterance"
    assert corpus_wer([JFK_TEXT], [finals_text(finals)]) <= 0.15, finals_text(finals)
    words = [w for r in finals for w in r.alternatives[0].words]
    assert len(words) >= 18, "enable_word_time_offsets: every final lists its words"
    starts = [w.start_time for w in words]
    assert starts == sorted(starts), "word offsets count from the stream's start"
    for w in words:
        assert 0 <= w.start_time <= w.end_time <= 11_100, (w.word, w.start_time, w.end_time)
        assert 0.0 < w.confidence <= 1.0, w
    # "And" begins about 0.35 s into the recording, "country" ends about 10.6 s in: milliseconds, not s
    assert 150 <= words[0].start_time <= 1_200, words[0]
    assert 9_000 <= words[-1].end_time <= 11_100, words[-1]
    for r in finals:
        assert 0.0 < r.alternatives[0].confidence <= 1.0
        assert r.channel_tag == 1, "mono: channel 1 of 1"
        assert r.stability == 0.0, "stability is for interim results only"


def test_real_speech_call_sends_interims_before_each_final_and_audio_processed_grows(
    jfk_call: list[rasr.StreamingRecognizeResponse],
) -> None:
    rs = results(jfk_call)
    interims = [r for r in rs if not r.is_final]
    assert interims, "interim_results was asked for, and the sentences last longer than the interval"
    for r in interims:
        assert r.alternatives[0].transcript.strip()
        assert 0.0 < r.stability <= 1.0
        assert not r.alternatives[0].words, "words are for finals only"
    assert rs[-1].is_final, "the call ends with a final, never an interim"
    processed = [r.audio_processed for r in rs]
    assert processed == sorted(processed), "audio_processed only grows"
    assert 9.0 <= processed[-1] <= 11.1


def test_endpointing_config_sets_the_silence_that_ends_an_utterance(server: ServerThread) -> None:
    """A 1.2 s pause ends an utterance at the server's 0.5 s; stop_history 2500 ms x stop_threshold 1.0
    (riva.client's add_endpoint_parameters_to_config) bridges it: one final for both sentences."""
    audio, _ = make_conversation(["I would like to pay my bill.", "Thank you very much."], pause_s=1.2)
    data = to_linear16_bytes(np.concatenate([audio, silence(3.0)]))
    finals = []
    for stop_history in (0, 2500):
        config = streaming_config(encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000)
        if stop_history:
            riva.client.add_endpoint_parameters_to_config(config, 0, 0, stop_history, 0, 1.0, 0)
        with riva_asr(server.target) as asr:
            finals.append([r for r in results(stream(asr, chunks(data, 6400), config)) if r.is_final])
    assert len(finals[0]) == 2 and len(finals[1]) == 1, [finals_text(f) for f in finals]
    assert "bill" in finals_text(finals[1]).lower() and "thank" in finals_text(finals[1]).lower()


# --- two channels -------------------------------------------------------------------------------------

AGENT = ["Thank you for calling, how can I help you today?", "Let me look that up for you."]
CUSTOMER = ["I would like to check my order status.", "It was placed last week."]


@pytest.fixture(scope="module")
def two_party_audio() -> tuple[np.ndarray, str, str]:
    agent, _ = make_conversation(AGENT, pause_s=3.5, lead_s=0.3)
    customer, _ = make_conversation(CUSTOMER, pause_s=3.0, lead_s=2.8)
    return stereo(agent, customer), " ".join(AGENT), " ".join(CUSTOMER)


def test_two_channel_call_is_recognized_per_channel_with_channel_tags(
    server: ServerThread, two_party_audio: tuple[np.ndarray, str, str]
) -> None:
    audio, agent_text, customer_text = two_party_audio
    config = streaming_config(
        encoding=riva.client.AudioEncoding.MULAW,
        sample_rate_hertz=8000,
        language_code="en-US",
        audio_channel_count=2,
        enable_separate_recognition_per_channel=True,
        enable_word_time_offsets=True,
    )
    with riva_asr(server.target) as asr:
        rs = [r for r in results(stream(asr, chunks(to_mulaw_8k_bytes(audio), 1600), config)) if r.is_final]
    assert {r.channel_tag for r in rs} == {1, 2}
    agent = finals_text(r for r in rs if r.channel_tag == 1)
    customer = finals_text(r for r in rs if r.channel_tag == 2)
    assert corpus_wer([agent_text], [agent]) <= 0.3, agent
    assert corpus_wer([customer_text], [customer]) <= 0.3, customer
    customer_words = [w for r in rs if r.channel_tag == 2 for w in r.alternatives[0].words]
    assert customer_words[0].start_time >= 2_500, "the customer speaks from 2.8 s of the call"


def test_two_channels_without_separate_recognition_recognize_the_first_channel(
    server: ServerThread, two_party_audio: tuple[np.ndarray, str, str]
) -> None:
    """Riva's rule for audio_channel_count > 1 without enable_separate_recognition_per_channel: "we will
    only recognize the first channel"."""
    audio, agent_text, _ = two_party_audio
    config = streaming_config(
        encoding=riva.client.AudioEncoding.LINEAR_PCM,
        sample_rate_hertz=16000,
        language_code="en-US",
        audio_channel_count=2,
    )
    with riva_asr(server.target) as asr:
        rs = [r for r in results(stream(asr, chunks(to_linear16_bytes(audio), 6400), config)) if r.is_final]
    assert {r.channel_tag for r in rs} == {1}
    assert corpus_wer([agent_text], [finals_text(rs)]) <= 0.3, finals_text(rs)
    assert "order" not in finals_text(rs).lower(), "the customer's channel is not recognized"


# --- a WAV file streamed as riva.client's transcribe_file.py streams it ------------------------------


def test_a_streamed_wav_file_says_its_own_format(server: ServerThread, tmp_path: Path) -> None:
    """transcribe_file.py sets neither encoding nor rate and streams the file's bytes, header first
    (AudioChunkFileIterator): the header says 8 kHz, which read as Riva's default 16 kHz would garble."""
    path = tmp_path / "jfk-8k.wav"
    sf.write(path, soxr.resample(jfk_16k(), 16000, 8000), 8000, subtype="PCM_16")
    config = streaming_config(language_code="en-US", max_alternatives=1, verbatim_transcripts=True)
    with riva_asr(server.target) as asr, riva.client.AudioChunkFileIterator(str(path), 1600) as audio:
        rs = results(stream(asr, audio, config))
    assert corpus_wer([JFK_TEXT], [finals_text(rs)]) <= 0.15, finals_text(rs)


# --- recorded files: Recognize ------------------------------------------------------------------------


def test_recognize_a_wav_file_as_riva_client_sends_one(server: ServerThread, tmp_path: Path) -> None:
    """offline_recognize with the file's bytes and add_audio_file_specs_to_config (rate and channels from
    the file, no encoding): results with words in ms and audio_processed."""
    path = tmp_path / "jfk.wav"
    sf.write(path, jfk_16k(), 16000, subtype="PCM_16")
    config = riva.client.RecognitionConfig(
        language_code="en-US", max_alternatives=3, enable_word_time_offsets=True, verbatim_transcripts=True
    )
    riva.client.add_audio_file_specs_to_config(config, str(path))
    with riva_asr(server.target) as asr:
        response = asr.offline_recognize(path.read_bytes(), config)
    assert corpus_wer([JFK_TEXT], [finals_text(response.results)]) <= 0.15
    assert all(len(r.alternatives) == 1 for r in response.results), "greedy decoding: one alternative"
    assert {r.channel_tag for r in response.results} == {1}
    words = [w for r in response.results for w in r.alternatives[0].words]
    assert 150 <= words[0].start_time <= 1_200 and 9_000 <= words[-1].end_time <= 11_100
    processed = [r.audio_processed for r in response.results]
    assert processed == sorted(processed) and 9.0 <= processed[-1] <= 11.1


def test_recognize_an_ogg_opus_file(server: ServerThread) -> None:
    """OGGOPUS (what WebRTC gateways record) with Recognize; the file says its rate (48 kHz here)."""
    opus = io.BytesIO()
    sf.write(opus, soxr.resample(jfk_16k(), 16000, 48000), 48000, format="OGG", subtype="OPUS")
    config = riva.client.RecognitionConfig(encoding=riva.client.AudioEncoding.OGGOPUS, language_code="en-US")
    with riva_asr(server.target) as asr:
        response = asr.offline_recognize(opus.getvalue(), config)
    assert corpus_wer([JFK_TEXT], [finals_text(response.results)]) <= 0.15, finals_text(response.results)


def test_recognize_raw_telephone_audio_and_say_which_options_were_hints(server: ServerThread) -> None:
    """Headerless 8 kHz mu-law. A model name is accepted as a hint, and the initial metadata says so, with
    the model that answered whatever model the request named."""
    text = "I would like to speak to someone about my bill."
    audio = to_mulaw_8k_bytes(np.concatenate([silence(0.3), speak(text), silence(0.8)]))
    config = riva.client.RecognitionConfig(
        encoding=riva.client.AudioEncoding.MULAW,
        sample_rate_hertz=8000,
        model=RIVA_MODEL,
    )
    with riva_asr(server.target) as asr:
        response, call = asr.stub.Recognize.with_call(
            rasr.RecognizeRequest(config=config, audio=audio), metadata=asr.auth.get_auth_metadata()
        )
    assert corpus_wer([text], [finals_text(response.results)]) <= 0.2, finals_text(response.results)
    headers = dict(call.initial_metadata())
    assert headers["asr-model"] == server.server.recognizer.model.name
    assert "model" in headers["asr-hints"].split(",")


@pytest.mark.parametrize("verbatim", [False, True])
def test_verbatim_transcripts_false_writes_spoken_numbers_as_digits(
    server: ServerThread, verbatim: bool
) -> None:
    """Riva's inverse text normalization is on unless verbatim_transcripts: tiny.en spells this order
    number out, and the core's SMART formatting writes it as digits, its word spanning the spoken ones."""
    # the clip tests/test_client_cli.py formats too: tiny.en spells this one out at 8 kHz
    speech, _ = make_conversation(
        ["The order number is one two three four five six."], pause_s=1.0, voice="en-gb", speed=160
    )
    audio = to_mulaw_8k_bytes(speech)
    config = riva.client.RecognitionConfig(
        encoding=riva.client.AudioEncoding.MULAW,
        sample_rate_hertz=8000,
        enable_word_time_offsets=True,
        verbatim_transcripts=verbatim,
    )
    with riva_asr(server.target) as asr:
        response = asr.offline_recognize(audio, config)
    text = finals_text(response.results)
    if verbatim:
        assert "123456" not in text, text
    else:
        assert "123456" in text, text
        words = [w for r in response.results for w in r.alternatives[0].words]
        merged = next(w for w in words if "123456" in w.word)
        assert merged.end_time - merged.start_time > 1000, merged  # six spoken digits, in ms


def test_word_boosting_reaches_the_decoder(server: ServerThread) -> None:
    """speech_contexts (riva.client's add_word_boosting_to_config) are the server's keyterms: invented
    names tiny.en cannot spell come out spelled once boosted."""
    clips = [
        c
        for c in name_clips("test")
        if c.voice == "en-us" and c.term in ("Tavrenko", "Moxilar", "Brenwick", "Kestoria")
    ]
    plain, boosted = [], []
    with riva_asr(server.target) as asr:
        for clip in clips:
            audio = to_linear16_bytes(telephone_audio(clip))
            config = riva.client.RecognitionConfig(
                encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000
            )
            plain.append(finals_text(asr.offline_recognize(audio, config).results))
            riva.client.add_word_boosting_to_config(config, list(KEYTERMS), 20.0)
            boosted.append(finals_text(asr.offline_recognize(audio, config).results))
    assert not any(said(c.term or "", t) for c, t in zip(clips, plain, strict=True)), plain
    assert sum(said(c.term or "", t) for c, t in zip(clips, boosted, strict=True)) >= len(clips) // 2, boosted


def diarized_config(**diarization: int) -> rasr.RecognitionConfig:
    return riva.client.RecognitionConfig(
        encoding=riva.client.AudioEncoding.MULAW,
        sample_rate_hertz=8000,
        enable_word_time_offsets=True,
        diarization_config=rasr.SpeakerDiarizationConfig(enable_speaker_diarization=True, **diarization),
    )


def test_offline_diarization_tags_the_speakers_of_a_mono_call(server: ServerThread) -> None:
    """Two real speakers on one 8 kHz mu-law channel through offline_recognize: every word carries a
    speaker_tag from 1 (0 is proto3's unset), two speakers, right for most words."""
    call = two_speaker_call()
    with riva_asr(server.target) as asr:
        response = asr.offline_recognize(to_mulaw_8k_bytes(call.audio), diarized_config())
    words = [w for r in response.results for w in r.alternatives[0].words]
    assert len(words) >= 20 and {w.speaker_tag for w in words} == {1, 2}, words
    assert words[0].speaker_tag == 1
    timed = [(w.start_time / 1000, w.end_time / 1000, w.speaker_tag) for w in words]
    assert word_accuracy(call, timed) >= 0.85


def test_offline_without_diarization_has_no_speaker_tags(server: ServerThread) -> None:
    config = riva.client.RecognitionConfig(enable_word_time_offsets=True)
    with riva_asr(server.target) as asr:
        response = asr.offline_recognize(JFK_FLAC.read_bytes(), config)
    words = [w for r in response.results for w in r.alternatives[0].words]
    assert words and all(w.speaker_tag == 0 for w in words)


def test_offline_diarization_over_the_speaker_limit_is_refused_naming_the_field(server: ServerThread) -> None:
    with riva_asr(server.target) as asr:
        error = refusal(lambda: asr.offline_recognize(b"\xff" * 8000, diarized_config(max_speaker_count=11)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "diarization_config.max_speaker_count" in (error.details() or ""), error.details()


def streamed_words(server: ServerThread, audio: np.ndarray, diarize: bool = True) -> list[list[Any]]:
    """A live mono 8 kHz mu-law call (then a second of silence): each final's words."""
    config = rasr.StreamingRecognitionConfig(
        config=diarized_config()
        if diarize
        else riva.client.RecognitionConfig(
            encoding=riva.client.AudioEncoding.MULAW, sample_rate_hertz=8000, enable_word_time_offsets=True
        )
    )
    with riva_asr(server.target) as asr:
        responses = stream(asr, chunks(to_mulaw_8k_bytes(audio) + b"\xff" * 8000, 800), config)
    return [list(r.alternatives[0].words) for r in results(responses) if r.is_final and r.alternatives]


def test_streaming_diarization_tags_each_finals_words_consistently(server: ServerThread) -> None:
    """A live call of two LibriSpeech speakers (A B A B, a second apart): each final's words carry a
    speaker_tag from 1, A's and B's second turns their first turns' tags; one speaker stays tag 1."""
    two = two_speaker_call("1188", "1995", gap_s=1.0, overlap_s=-1.0)
    finals = streamed_words(server, two.audio)
    words = [w for f in finals for w in f]
    assert len(words) >= 20 and {w.speaker_tag for w in words} == {1, 2} and words[0].speaker_tag == 1
    assert [{w.speaker_tag for w in f} for f in finals] == [{1}, {2}, {1}, {2}]
    timed = [(w.start_time / 1000, w.end_time / 1000, w.speaker_tag) for w in words]
    assert word_accuracy(two, timed) >= 0.85
    words = [w for f in streamed_words(server, one_speaker_call("1188").audio) for w in f]
    assert len(words) >= 10 and {w.speaker_tag for w in words} == {1}


def test_streaming_without_diarization_has_no_speaker_tags(server: ServerThread) -> None:
    audio = two_speaker_call("1188", "1995", gap_s=1.0, overlap_s=-1.0).audio
    words = [w for f in streamed_words(server, audio, diarize=False) for w in f]
    assert words and all(w.speaker_tag == 0 for w in words)


# --- bad input: INVALID_ARGUMENT naming the field (and the limit) ------------------------------------


def _contexts(n: int, boost: float = 10.0) -> list[rasr.SpeechContext]:
    return [rasr.SpeechContext(phrases=[f"term{i}" for i in range(n)], boost=boost)]


BAD_STREAMS = {
    "rate": ({"sample_rate_hertz": 4000}, ["sample_rate_hertz", "8000"]),
    "channels": ({"audio_channel_count": 9}, ["audio_channel_count", "8"]),
    "opus stream": ({"encoding": riva.client.AudioEncoding.OGGOPUS}, ["encoding", "OGGOPUS", "Recognize"]),
    "flac stream": ({"encoding": riva.client.AudioEncoding.FLAC}, ["encoding", "FLAC", "Recognize"]),
    "unknown encoding": ({"encoding": 99}, ["encoding", "99"]),
    "language": ({"language_code": "de-DE"}, ["language_code", "de-DE"]),
    "diarization": (
        {
            "diarization_config": rasr.SpeakerDiarizationConfig(
                enable_speaker_diarization=True, max_speaker_count=11
            )
        },
        ["diarization_config.max_speaker_count", "max_diarization_speakers"],
    ),
    "profanity filter": ({"profanity_filter": True}, ["profanity_filter"]),
    "negative boost": ({"speech_contexts": _contexts(1, boost=-5.0)}, ["speech_contexts[0].boost"]),
    "too many phrases": ({"speech_contexts": _contexts(101)}, ["speech_contexts", "100"]),
    # counted before any is read (issue 26 #4): 100,000 copies of one phrase used to be walked, then kept as one
    "phrase flood": (
        {"speech_contexts": [rasr.SpeechContext(phrases=["Kestoria"] * 100_000, boost=5.0)]},
        ["speech_contexts", "at most 1000"],
    ),
    "phrase bytes": (
        {"speech_contexts": [rasr.SpeechContext(phrases=["k" * 100_000] * 3, boost=5.0)]},
        ["speech_contexts", "at most 262144 bytes"],
    ),
    "empty phrase": (
        {"speech_contexts": [rasr.SpeechContext(phrases=["Kestoria", " "], boost=5.0)]},
        ["speech_contexts[0].phrases[1]", "empty"],
    ),
    "max alternatives": ({"max_alternatives": -1}, ["max_alternatives"]),
    "stop history": (
        {"endpointing_config": rasr.EndpointingConfig(stop_history=60_000)},
        ["endpointing_config.stop_history", "5 s"],
    ),
    "start threshold": (
        {"endpointing_config": rasr.EndpointingConfig(start_threshold=1.5)},
        ["endpointing_config.start_threshold"],
    ),
    "eou after stop": (
        {"endpointing_config": rasr.EndpointingConfig(stop_history=500, stop_history_eou=800)},
        ["endpointing_config.stop_history_eou"],
    ),
    "custom configuration": (
        {"custom_configuration": {f"k{i}": "v" for i in range(65)}},
        ["custom_configuration", "64"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_STREAMS))
def test_a_bad_streaming_config_is_refused_naming_the_field(server: ServerThread, case: str) -> None:
    fields, words = BAD_STREAMS[case]
    config = streaming_config(
        **{
            "encoding": riva.client.AudioEncoding.LINEAR_PCM,
            "sample_rate_hertz": 16000,
            "language_code": "en-US",
            **fields,
        }
    )
    with riva_asr(server.target) as asr:
        error = refusal(lambda: stream(asr, [bytes(3200)], config))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    for word in words:
        assert word in error.details(), (word, error.details())


@pytest.mark.parametrize("channels", [1, 2], ids=["mono", "first of two channels"])
def test_an_oversized_chunk_is_refused_naming_the_limit(server: ServerThread, channels: int) -> None:
    """The limit is on what the client sent, also when only the first channel goes on."""
    config = streaming_config(
        encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000, audio_channel_count=channels
    )
    limit = server.config.max_chunk_bytes
    with riva_asr(server.target) as asr:
        error = refusal(lambda: stream(asr, [bytes(3200), bytes(limit + 4)], config))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "audio_content" in error.details() and str(limit) in error.details(), error.details()


def test_a_streamed_wav_of_float_samples_is_refused_naming_audio_content(server: ServerThread) -> None:
    wav = io.BytesIO()
    sf.write(wav, silence(1.0), 16000, subtype="FLOAT", format="WAV")
    with riva_asr(server.target) as asr:
        error = refusal(lambda: stream(asr, [wav.getvalue()], streaming_config(language_code="en-US")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "audio_content" in error.details() and "16-bit" in error.details(), error.details()


@pytest.mark.parametrize(
    "audio, config, words",
    [
        (
            b"",
            {"encoding": riva.client.AudioEncoding.LINEAR_PCM, "sample_rate_hertz": 16000},
            ["audio", "empty"],
        ),
        (b"fLaC" + bytes(100), {"encoding": riva.client.AudioEncoding.FLAC}, ["audio", "FLAC"]),
        (
            bytes(3),
            {"encoding": riva.client.AudioEncoding.LINEAR_PCM, "sample_rate_hertz": 16000},
            ["audio", "frame"],
        ),
        (
            bytes(1600),
            {"encoding": riva.client.AudioEncoding.MULAW, "sample_rate_hertz": 100},
            ["sample_rate_hertz"],
        ),
    ],
    ids=["empty", "broken flac", "partial frame", "rate"],
)
def test_a_bad_recording_is_refused_naming_the_field(
    server: ServerThread, audio: bytes, config: dict[str, int], words: list[str]
) -> None:
    with riva_asr(server.target) as asr:
        error = refusal(lambda: asr.offline_recognize(audio, riva.client.RecognitionConfig(**config)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    for word in words:
        assert word in error.details(), (word, error.details())


@pytest.mark.parametrize("encoding", ["LINEAR_PCM", "MULAW"])
def test_a_config_and_then_no_audio_ends_out_of_range_after_the_idle_timeout(
    service_engine: Engine, encoding: str
) -> None:
    """--idle-audio-timeout holds for a stream the door opens on its first audio (LINEAR_PCM, which may
    be a WAV file's header) as for one opened on its config (MULAW)."""
    s = ServerThread(ServerConfig(idle_audio_timeout=1.0), service_engine).start()
    release = threading.Event()

    def no_audio() -> Iterator[bytes]:
        release.wait(DEADLINE_S)  # until the server has answered
        yield from ()

    config = streaming_config(encoding=riva.client.AudioEncoding.Value(encoding), sample_rate_hertz=8000)
    try:
        with riva_asr(s.target, token=None) as asr:
            error = refusal(lambda: stream(asr, no_audio(), config))
    finally:
        release.set()
        s.stop()
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE, (error.code(), error.details())
    assert "idle_audio_timeout" in error.details(), error.details()


def test_a_refused_stream_leaves_another_stream_unharmed(server: ServerThread) -> None:
    """A bad config on one stream while another is under way: the other gets its finals."""
    text = "I would like to check the status of my order."
    audio = to_linear16_bytes(np.concatenate([silence(0.3), speak(text), silence(1.0)]))
    good = streaming_config(encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000)
    out: list[rasr.StreamingRecognizeResponse] = []
    with riva_asr(server.target) as asr:
        worker = threading.Thread(
            target=lambda: out.extend(stream(asr, chunks(audio, 1600, pace_s=0.02), good))
        )
        worker.start()
        bad = streaming_config(encoding=riva.client.AudioEncoding.MULAW, sample_rate_hertz=4000)
        assert refusal(lambda: stream(asr, [bytes(800)], bad)).code() == grpc.StatusCode.INVALID_ARGUMENT
        worker.join(DEADLINE_S)
    assert corpus_wer([text], [finals_text(results(out))]) <= 0.2


# --- the service's own calls, auth, reflection -------------------------------------------------------


def test_get_config_lists_the_served_model_for_streaming_and_recorded(
    server: ServerThread, service_engine: Engine
) -> None:
    """What riva.client's transcribe_file.py --list-models, pipecat and LiveKit read: `type` and
    `language_code` of each model config."""
    with riva_asr(server.target) as asr:
        reply = asr.stub.GetRivaSpeechRecognitionConfig(
            rasr.RivaSpeechRecognitionConfigRequest(), metadata=asr.auth.get_auth_metadata()
        )
        named = asr.stub.GetRivaSpeechRecognitionConfig(
            rasr.RivaSpeechRecognitionConfigRequest(model_name=RIVA_MODEL),
            metadata=asr.auth.get_auth_metadata(),
        )
    assert sorted(c.parameters["type"] for c in reply.model_config) == ["offline", "online"]
    for c in reply.model_config:
        assert c.model_name == service_engine.info.name
        assert c.parameters["language_code"] == "en-US"
    assert [c.model_name for c in named.model_config] == [c.model_name for c in reply.model_config]


def test_auth_refused_without_or_with_a_wrong_token_accepted_with_the_right_one(server: ServerThread) -> None:
    request = rasr.RivaSpeechRecognitionConfigRequest()
    config = streaming_config(encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000)
    for token in (None, "not-the-token"):
        with riva_asr(server.target, token=token) as asr:
            error = refusal(
                lambda: asr.stub.GetRivaSpeechRecognitionConfig(
                    request, metadata=asr.auth.get_auth_metadata()
                )
            )
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (
                refusal(lambda: stream(asr, [bytes(3200)], config)).code() == grpc.StatusCode.UNAUTHENTICATED
            )
            error = refusal(lambda: asr.offline_recognize(bytes(3200), config.config))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    with riva_asr(server.target) as asr:
        assert asr.stub.GetRivaSpeechRecognitionConfig(
            request, metadata=asr.auth.get_auth_metadata()
        ).model_config
        assert stream(asr, [bytes(3200)], config) == [], "silence: no result, status OK"


def _door_calls(kind: str, code: str) -> float:
    labels = {"door": "riva", "kind": kind, "code": code}
    return REGISTRY.get_sample_value("asr_door_calls_total", labels) or 0.0


def test_calls_are_counted_under_the_riva_door(server: ServerThread) -> None:
    """asr_door_calls_total{door="riva"}: a stream and a Recognize that succeed, a stream refused."""
    before = {
        k: _door_calls(*k) for k in (("stream", "OK"), ("recognize", "OK"), ("stream", "INVALID_ARGUMENT"))
    }
    config = riva.client.RecognitionConfig(
        encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=16000
    )
    with riva_asr(server.target) as asr:
        stream(asr, [bytes(3200)], riva.client.StreamingRecognitionConfig(config=config))
        asr.offline_recognize(bytes(3200), config)
        bad = riva.client.RecognitionConfig(
            encoding=riva.client.AudioEncoding.LINEAR_PCM, sample_rate_hertz=1
        )
        refusal(lambda: stream(asr, [bytes(3200)], riva.client.StreamingRecognitionConfig(config=bad)))
    after = {k: _door_calls(*k) for k in before}
    assert {k: after[k] - before[k] for k in before} == {k: 1.0 for k in before}


def test_reflection_lists_the_riva_service(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            metadata=[("authorization", f"Bearer {TOKEN}")],
            timeout=30,
        )
        names = [s.name for reply in replies for s in reply.list_services_response.service]
    assert SERVICE in names and "asr.v1.Recognizer" in names, names


# --- drain --------------------------------------------------------------------------------------------


def test_drain_sends_the_finals_of_what_was_heard_then_unavailable(service_engine: Engine) -> None:
    """A drain (what SIGTERM starts) while a Riva stream is under way: the finals of the speech already
    heard, then the stream ends UNAVAILABLE (gRPC's "go elsewhere") saying how much audio was heard; a new
    call on the same channel is refused UNAVAILABLE; the drain completes. A server of its own: this one
    drains."""
    audio, _ = make_conversation(
        ["Thank you for calling, how can I help you today?", "I would like to check my order status."],
        pause_s=1.5,
    )
    audio = np.concatenate([audio, silence(20.0)])  # the call goes on past the drain
    config = streaming_config(
        encoding=riva.client.AudioEncoding.MULAW, sample_rate_hertz=8000, language_code="en-US"
    )
    server = ServerThread(ServerConfig(drain_seconds=20), service_engine).start()
    try:
        out: list[rasr.StreamingRecognizeResponse] = []
        errors: list[grpc.RpcError] = []
        first_final = threading.Event()

        def call(asr: riva.client.ASRService) -> None:
            try:
                for response in asr.streaming_response_generator(
                    audio_chunks=chunks(to_mulaw_8k_bytes(audio), 800, pace_s=0.1), streaming_config=config
                ):
                    out.append(response)
                    if any(r.is_final for r in response.results):
                        first_final.set()
            except grpc.RpcError as e:
                errors.append(e)

        with riva_asr(server.target, token=None) as asr:
            worker = threading.Thread(target=call, args=(asr,))
            worker.start()
            assert first_final.wait(60), "the first sentence's final"
            time.sleep(3.0)  # the second sentence is spoken and heard
            drained = server.drain()
            wait_until(lambda: server.health() != "SERVING", 20, "health NOT_SERVING once draining")
            later = refusal(lambda: stream(asr, [bytes(800)], config))
            worker.join(DEADLINE_S)
            assert not worker.is_alive()
        drained.result(60)
    finally:
        server.stop()
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
    assert "drain" in errors[0].details(), errors[0].details()
    text = finals_text(results(out)).lower()
    assert "calling" in text and "order" in text, text
    assert later.code() == grpc.StatusCode.UNAVAILABLE and "drain" in later.details(), later.details()
