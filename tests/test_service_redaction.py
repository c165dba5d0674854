"""Redaction end to end: espeak-ng speaks card numbers (several voices and rates, digit by digit and in
pairs of digits as words, in one utterance and split across two or four; as 16 kHz PCM and as 8 kHz
mu-law telephone audio, where tiny.en mishears them) and real people read digits (pocketsphinx-testdata)
into a real server on loopback; with redact=[PCI] no response (finals, interims, segments, words; gRPC
and every HTTP format) and no log line shows the digits."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import soundfile as sf
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from engine import Engine
from service.config import ServerConfig
from service.runtime.logging import JsonFormatter
from tests.support.audio import (
    RATE,
    make_conversation,
    silence,
    speech_bounds,
    to_linear16_bytes,
    to_mulaw_8k_bytes,
)
from tests.support.calls import Outcome, audio_requests, run_stream
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow

Request = asr_pb2.StreamingRecognizeRequest
CARD_A = "4 5 3 2, 0 1 5 1, 1 2 8 3, 0 3 6 6"  # 4532 0151 1283 0366, passes Luhn
AMEX = "3 7 1 4, 4 9 6 3 5 3, 9 8 4 3 1"  # 3714 496353 98431
CARD_A_PAIRS = "forty five, thirty two, zero one, fifty one, twelve, eighty three, zero three, sixty six"
NUMBER_WORDS = re.compile(
    r"\b(zero|oh|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|\w+teen|twenty|thirty|"
    r"forty|fifty|sixty|seventy|eighty|ninety|hundred)\b",
    re.IGNORECASE,
)
# (sentences, espeak voice, words per minute): one utterance per sentence (1 s pauses between). tiny.en
# mishears some digits of some espeak voices (then the number fails Luhn and is, rightly, no card): these
# are voices and rates whose digits it gets right, checked by test_without_redact_the_digits_are_heard.
SPLIT = ["My card is 4 5 3 2, 0 1 5 1.", "1 2 8 3, 0 3 6 6, thank you."]
CALLS = {
    "digits-en-us+f3-180": ([f"My card number is {CARD_A}."], "en-us+f3", 180),
    "digits-en-us+m3-150": ([f"My card number is {CARD_A}."], "en-us+m3", 150),
    "digits-amex-en-gb-150": ([f"My card number is {AMEX}."], "en-gb", 150),
    "pairs-as-words-en-us-175": ([f"My card number is {CARD_A_PAIRS}."], "en-us", 175),
    "pairs-as-words-en-gb-130": ([f"My card number is {CARD_A_PAIRS}."], "en-gb", 130),
    "split-in-two-en-us-140": (SPLIT, "en-us", 140),
    "split-in-two-en-us+f3-180": (SPLIT, "en-us+f3", 180),
    "split-in-two-en-us+m3-150": (SPLIT, "en-us+m3", 150),
}


def leaks(text: str) -> list[str]:
    return re.findall(r"\d+", text) + NUMBER_WORDS.findall(text)


def digits_shown(text: str) -> int:
    """How many digits `text` shows, written or spoken ("45 six" shows three)."""
    return sum(len(d) for d in re.findall(r"\d+", text)) + len(NUMBER_WORDS.findall(text))


def stream_config(redact: list[int], rate: int = 16000, encoding: int = asr_pb2.LINEAR16) -> Request:
    return Request(
        streaming_config=asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(
                encoding=encoding,  # type: ignore[arg-type]
                sample_rate_hertz=rate,
                redact=redact,  # type: ignore[arg-type]
                enable_segment_time_offsets=True,
                enable_word_time_offsets=True,
            ),
            interim_results=True,
        )
    )


async def stream(target: str, audio: np.ndarray, redact: list[int]) -> Outcome:
    async with aio.insecure_channel(target) as channel:
        requests = [stream_config(redact), *audio_requests(to_linear16_bytes(audio), 3200)]
        return await run_stream(channel, requests)


def texts(outcome: Outcome) -> list[str]:
    """Every transcript, segment text and word the stream sent, interims included."""
    out = []
    for response in outcome.responses:
        for result in response.results:
            for alt in result.alternatives:
                out.append(alt.transcript)
                out.extend(s.text for s in alt.segments)
                out.extend(w.word for w in alt.words)
    return out


@pytest.mark.parametrize("name", list(CALLS))
async def test_spoken_card_numbers_never_leave_the_server(asr_server: ServerThread, name: str) -> None:
    sentences, voice, speed = CALLS[name]
    audio, _ = make_conversation(sentences, pause_s=1.0, voice=voice, speed=speed)
    outcome = await stream(asr_server.target, audio, [asr_pb2.PCI])
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    finals = [r.alternatives[0].transcript for r in outcome.finals]
    print(name, finals)
    assert len(finals) == len(sentences), finals
    assert all("[PCI]" in f for f in finals), finals
    for text in texts(outcome):
        assert not leaks(text), (text, finals)


@pytest.mark.parametrize("name", ["digits-en-us+m3-150", "split-in-two-en-us+f3-180"])
async def test_without_redact_the_digits_are_heard(asr_server: ServerThread, name: str) -> None:
    """The check above can fail: the same audio without redact carries the card's digits."""
    sentences, voice, speed = CALLS[name]
    audio, _ = make_conversation(sentences, pause_s=1.0, voice=voice, speed=speed)
    outcome = await stream(asr_server.target, audio, [])
    digits = "".join(re.findall(r"\d", " ".join(r.alternatives[0].transcript for r in outcome.finals)))
    assert "4532015112830366" in digits, outcome.text


async def test_recognize_redacts_a_card_split_across_utterances_on_telephone_audio(
    asr_server: ServerThread,
) -> None:
    audio, _ = make_conversation(SPLIT, pause_s=1.0, voice="en-us", speed=160)
    async with aio.insecure_channel(asr_server.target) as channel:
        response = await asr_pb2_grpc.RecognizerStub(channel).Recognize(
            asr_pb2.RecognizeRequest(
                config=asr_pb2.RecognitionConfig(
                    encoding=asr_pb2.MULAW, sample_rate_hertz=8000, redact=[asr_pb2.PCI, asr_pb2.NUMBERS]
                ),
                audio_content=to_mulaw_8k_bytes(audio),
            ),
            timeout=120,
        )
    finals = [r.alternatives[0].transcript for r in response.results]
    assert len(finals) == 2 and all("[PCI]" in f for f in finals), finals
    assert not any(leaks(f) for f in finals), finals


async def test_unknown_redaction_value_is_invalid_argument_naming_the_field(asr_server: ServerThread) -> None:
    async with aio.insecure_channel(asr_server.target) as channel:
        outcome = await run_stream(channel, [stream_config([7])])
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.redact" in outcome.details and "7" in outcome.details


async def test_logged_transcripts_of_a_redacting_stream_are_redacted(
    service_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sentences, voice, speed = CALLS["split-in-two-en-us+f3-180"]
    audio, _ = make_conversation(sentences, pause_s=1.0, voice=voice, speed=speed)
    server = ServerThread(ServerConfig(log_transcripts=True), service_engine).start()
    try:
        outcome = await stream(server.target, audio, [asr_pb2.PCI])
    finally:
        server.stop()
    assert outcome.code == grpc.StatusCode.OK
    lines = [JsonFormatter().format(r) for r in caplog.records if r.getMessage() == "utterance"]
    logged = [line for line in lines if '"transcript"' in line]
    assert len(logged) == 2, lines
    for line in logged:
        transcript = re.search(r'"transcript": "([^"]*)"', line)
        assert transcript is not None and "[PCI]" in transcript.group(1), line
        assert not leaks(transcript.group(1)), line


async def test_recognize_words_show_the_card_as_one_pci_word_with_its_times(asr_server: ServerThread) -> None:
    sentences, voice, speed = CALLS["digits-en-us+m3-150"]
    audio, bounds = make_conversation(sentences, pause_s=1.0, voice=voice, speed=speed)
    async with aio.insecure_channel(asr_server.target) as channel:
        response = await asr_pb2_grpc.RecognizerStub(channel).Recognize(
            asr_pb2.RecognizeRequest(
                config=asr_pb2.RecognitionConfig(
                    encoding=asr_pb2.LINEAR16,
                    sample_rate_hertz=16000,
                    redact=[asr_pb2.PCI],
                    enable_word_time_offsets=True,
                    enable_word_confidence=True,
                ),
                audio_content=to_linear16_bytes(audio),
            ),
            timeout=120,
        )
    (result,) = response.results
    words = result.alternatives[0].words
    assert [w.word for w in words][-1].startswith("[PCI]"), words
    assert " ".join(w.word for w in words) == result.alternatives[0].transcript
    assert not any(leaks(w.word) for w in words), words
    card = words[-1]
    start, end = (
        card.start_offset.ToTimedelta().total_seconds(),
        card.end_offset.ToTimedelta().total_seconds(),
    )
    speech_start, speech_end = bounds[0]
    # "My card number is" takes about a second; the card is the rest of the sentence.
    assert speech_start + 0.5 < start < end <= speech_end + 0.3, (start, end, bounds)
    assert end - start > 3.0 and 0 < card.confidence <= 1


# --- telephone audio, where tiny.en mishears the digits (issue 19) ---------------------------------------

# espeak-ng -> sox 8 kHz mu-law. On the build before issue 19 every one of these left the server with
# its digits under redact=[PCI]: tiny.en writes "481 0 0 0 0 3 3 9 0 0 5 5 9 3 8" (fails Luhn), "601, 109,
# 911, 39, 424" (14 digits), "security code in 737", or one digit repeated a hundred times.
TELEPHONE_CALLS = {
    "misheard-card": (["Yes, my card number is 4 8 1 0, 0 0 3 3, 9 0 0 5, 5 9 3 8."], "en-us", 160),
    "card-with-oh": (["The card is six oh one one, oh oh oh nine, nine oh one three, nine four two four."], "en-us", 160),
    "expiry-and-code": (["The expiry is oh four twenty seven and the security code is seven three seven."], "en-us", 160),
    "spelled-digits": (["four one one one, one one one one, one one one one, one one one one"], "en-us+f3", 170),
    "split-no-card-word": (["Okay, it's 4 1 1 1, 1 1 1 1.", "1 1 1 1, 1 1 1 2, thanks."], "en-us", 150),
    "four-groups-no-card-word": (
        ["Okay so it is 4 5 3 2.", "0 1 5 1.", "1 2 8 3.", "0 3 6 7. That is all."],
        "en-us",
        150,
    ),
}  # fmt: skip


def telephone(name: str) -> bytes:
    sentences, voice, speed = TELEPHONE_CALLS[name]
    audio, _ = make_conversation(sentences, pause_s=1.0, voice=voice, speed=speed)
    return to_mulaw_8k_bytes(audio)


async def pci_redacted_mulaw_stream(target: str, data: bytes) -> tuple[Outcome, list[str]]:
    """8 kHz mu-law `data` streamed with PCI redaction on (100 ms a request); the call ends OK."""
    async with aio.insecure_channel(target) as channel:
        requests = [
            stream_config([asr_pb2.PCI], rate=8000, encoding=asr_pb2.MULAW),
            *audio_requests(data, 1600),
        ]
        outcome = await run_stream(channel, requests)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    return outcome, [r.alternatives[0].transcript for r in outcome.finals]


@pytest.mark.parametrize("name", list(TELEPHONE_CALLS))
async def test_misheard_card_numbers_on_telephone_audio_never_leave_the_server(
    asr_server: ServerThread, name: str
) -> None:
    outcome, finals = await pci_redacted_mulaw_stream(asr_server.target, telephone(name))
    print(name, finals)
    assert any("[PCI]" in f for f in finals), finals
    assert any(w.word.startswith("[PCI]") for r in outcome.finals for w in r.alternatives[0].words), finals
    for text in texts(outcome):
        assert not leaks(text), (text, finals)


async def recognize(
    target: str, audio: bytes, config: asr_pb2.RecognitionConfig
) -> asr_pb2.RecognizeResponse:
    async with aio.insecure_channel(target) as channel:
        return await asr_pb2_grpc.RecognizerStub(channel).Recognize(
            asr_pb2.RecognizeRequest(config=config, audio_content=audio), timeout=120
        )


@pytest.mark.parametrize("name", list(TELEPHONE_CALLS))
async def test_without_redact_the_telephone_calls_carry_their_digits(
    asr_server: ServerThread, name: str
) -> None:
    """The test above can fail: unredacted, each of these calls shows digit material (digits or number
    words, what the test above counts as a leak)."""
    response = await recognize(
        asr_server.target,
        telephone(name),
        asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000),
    )
    text = " ".join(r.alternatives[0].transcript for r in response.results)
    assert digits_shown(text) >= 3, text


async def real_time(requests: list[Request], chunk_s: float) -> AsyncIterator[Request]:
    """The config at once, then one audio chunk every `chunk_s`, as a live call sends it."""
    yield requests[0]
    for r in requests[1:]:
        await asyncio.sleep(chunk_s)
        yield r


async def test_interims_of_a_card_read_in_four_groups_in_real_time_are_masked(service_engine: Engine) -> None:
    """Real-time pace, interims due every 0.3 s: each group is an interim before it is a final, and
    each interim masks its digits (an open cluster of two or more may be a card's start) though no card
    word is said; the finals mask every digit of the card."""
    server = ServerThread(ServerConfig(interim_interval_s=0.3), service_engine).start()
    try:
        async with aio.insecure_channel(server.target) as channel:
            data = telephone("four-groups-no-card-word")
            requests = [
                stream_config([asr_pb2.PCI], rate=8000, encoding=asr_pb2.MULAW),
                *audio_requests(data, 160),
            ]
            outcome = await run_stream(channel, real_time(requests, chunk_s=0.02))
    finally:
        server.stop()
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    interims = [
        r.alternatives[0].transcript for resp in outcome.responses for r in resp.results if not r.is_final
    ]
    print(interims, [r.alternatives[0].transcript for r in outcome.finals])
    assert any("[PCI]" in i for i in interims), interims
    for final in outcome.finals:
        assert not leaks(final.alternatives[0].transcript), final
    # An interim masks an open cluster from two digits (service/pipeline/redaction.py): a lone digit
    # is no part of a card anyone can rebuild (PCI DSS lets even the first six show), and masking every
    # lone digit would blank "wait 2 minutes" in every interim. tiny.en's first interim here was once
    # "okay, so it didn't 4 times".
    for text in texts(outcome):
        assert digits_shown(text) <= 1, text


# --- real people reading digits (pocketsphinx-testdata) -------------------------------------------------

POCKETSPHINX = Path("/usr/share/pocketsphinx/test/data")


def real_digits() -> np.ndarray:
    """Three utterances of real human speech, 17 digits in all: numbers.raw ("33 4 692"), the TIDIGITS
    clip dhd.2934z ("2 9 3 4 zero"), numbers.raw again; 1 s of silence between. No recording of a card
    number read aloud is packaged; these are the real read-out digit strings there are."""
    parts = [silence(0.5)]
    for name in ("numbers.raw", "tidigits/dhd.2934z.raw", "numbers.raw"):
        audio = np.frombuffer((POCKETSPHINX / name).read_bytes(), dtype="<i2").astype(np.float32) / 32768
        start, end = speech_bounds(audio)
        parts += [audio[round(start * RATE) : round(end * RATE)], silence(1.0)]
    return np.concatenate(parts)


async def test_real_read_out_digits_split_in_three_utterances_are_masked(asr_server: ServerThread) -> None:
    data = to_mulaw_8k_bytes(real_digits())
    outcome, finals = await pci_redacted_mulaw_stream(asr_server.target, data)
    assert len(finals) == 3 and all("[PCI]" in f for f in finals), finals
    for text in texts(outcome):
        assert not leaks(text), (text, finals)
    wideband = await recognize(
        asr_server.target,
        to_linear16_bytes(real_digits()),
        asr_pb2.RecognitionConfig(encoding=asr_pb2.LINEAR16, sample_rate_hertz=RATE, redact=[asr_pb2.PCI]),
    )
    assert [r.alternatives[0].transcript.rstrip(".") for r in wideband.results] == ["[PCI]"] * 3
    plain = await recognize(
        asr_server.target, data, asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000)
    )
    heard = "".join(re.findall(r"\d", " ".join(r.alternatives[0].transcript for r in plain.results)))
    assert len(heard) >= 12, plain  # unredacted, the digits are there


# --- the HTTP door: every response format -----------------------------------------------------------------


@pytest.fixture(scope="module")
def http_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(), service_engine, http=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def card_call_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A misheard card and its expiry and code, as an 8 kHz mu-law WAV (what a recorder of a phone
    line writes), made by sox."""
    sentences = TELEPHONE_CALLS["misheard-card"][0] + TELEPHONE_CALLS["expiry-and-code"][0]
    audio, _ = make_conversation(sentences, pause_s=1.0, voice="en-us", speed=160)
    folder = tmp_path_factory.mktemp("call")
    sf.write(folder / "wide.wav", audio, RATE, subtype="PCM_16")
    out = folder / "call.wav"
    subprocess.run(
        ["sox", "-D", str(folder / "wide.wav"), "-r", "8000", "-e", "mu-law", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.mark.parametrize("response_format", ["json", "text", "verbose_json", "srt", "vtt", "stream"])
def test_every_http_response_format_is_redacted(
    http_server: ServerThread, card_call_wav: Path, response_format: str
) -> None:
    client = openai.OpenAI(base_url=http_server.http_url + "/v1", api_key="none", max_retries=0, timeout=120)

    def transcribe(**extra: object) -> str:
        with open(card_call_wav, "rb") as f:
            if response_format == "stream":
                events = client.audio.transcriptions.create(model="whisper-1", file=f, stream=True, **extra)  # type: ignore[call-overload]
                return "\n".join(e.model_dump_json() for e in events)
            granularities = (
                {"timestamp_granularities": ["word", "segment"]} if response_format == "verbose_json" else {}
            )
            result = client.audio.transcriptions.create(
                model="whisper-1",
                file=f,
                response_format=response_format,
                **granularities,
                **extra,  # type: ignore[arg-type]
            )
            return result if isinstance(result, str) else result.model_dump_json()

    body = transcribe(extra_body={"redact": "pci"})
    print(response_format, body[:400])
    assert "[PCI]" in body
    if response_format == "verbose_json":
        assert '"word":"[PCI]' in body.replace(" ", "")
    text = re.sub(r"\d\d:\d\d:\d\d[,.]\d{3}", "", body)  # caption times
    text = re.sub(
        r'"(start|end|seek|id|avg_logprob|compression_ratio|temperature|duration|seconds|type)":[-0-9.e]+',
        "",
        text,
    )
    text = re.sub(r"^\d+$", "", text, flags=re.M)  # SRT cue numbers
    assert not leaks(text), text
    plain = transcribe()
    assert len(re.findall(r"\d", re.sub(r"\d\d:\d\d:\d\d[,.]\d{3}", "", plain))) > 10  # the digits are heard
