"""The Deepgram door's protocol side as pure functions: the query options it maps, ignores or refuses, the
messages it builds (read back by the deepgram-sdk's own types, as a client reads them), the control
messages it reads, UtteranceEnd's gap rule and the byte stream's framing. End to end through a real server
and the SDK: tests/doors/test_deepgram.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from deepgram.listen.v1.types import (
    ListenV1CloseStream,
    ListenV1Configure,
    ListenV1Finalize,
    ListenV1KeepAlive,
    ListenV1Metadata,
    ListenV1Results,
)
from deepgram.types import ListenV1Response

from service.doors.deepgram import messages
from service.doors.deepgram.common import stream_settings
from service.doors.deepgram.options import (
    MAX_ENDPOINTING_MS,
    MIN_ENDPOINTING_MS,
    ListenOptions,
    OptionError,
    parse_listen_options,
)
from service.doors.deepgram.utterance_end import UtteranceEndTracker
from service.recognizer.framing import Reframer, container_of
from service.vocabulary.redaction import Kind


def parse(live: bool = True, **query: Any) -> ListenOptions:
    items = [(k, str(x)) for k, v in query.items() for x in (v if isinstance(v, list) else [v])]
    return parse_listen_options(items, live=live, min_rate=8000, max_rate=48000, max_channels=8)


def refused(option: str, **query: Any) -> str:
    with pytest.raises(OptionError) as e:
        parse(**query)
    assert e.value.option == option
    assert option in e.value.message  # the message names what it refuses
    return e.value.message


def test_defaults_are_deepgrams_raw_linear16_at_16k_mono() -> None:
    o = parse()
    assert (o.encoding, o.sample_rate, o.channels, o.multichannel) == ("LINEAR16", 16000, 1, False)
    assert not (o.interim_results or o.vad_events or o.punctuated or o.smart or o.redact)
    assert o.endpointing and o.endpointing_ms is None and o.utterance_end_ms is None


def test_a_telephone_call_as_an_integrator_opens_it() -> None:
    o = parse(
        model="nova-3",
        encoding="mulaw",
        sample_rate=8000,
        channels=2,
        multichannel="true",
        interim_results="true",
        endpointing=300,
        utterance_end_ms=1000,
        vad_events="true",
        smart_format="true",
        redact=["pci", "ssn"],
        keyterm=["Kestoria", "customer service"],
        language="en-US",
        tag="call-42",
        extra="crm:7",
    )
    assert (o.encoding, o.sample_rate, o.channels, o.multichannel) == ("MULAW", 8000, 2, True)
    assert o.result_channels == 2
    assert o.interim_results and o.vad_events and o.punctuated and o.smart
    assert (o.endpointing_ms, o.utterance_end_ms) == (300, 1000)
    assert o.redact == {Kind.PCI, Kind.SSN}
    assert o.keyterms == ("Kestoria", "customer service")
    assert (o.language, o.model, o.tags, o.extra) == ("en-US", "nova-3", ("call-42",), {"crm": "7"})
    assert [w.parameter for w in o.warnings] == ["model"]  # nova-3 selects the model served here


def test_endpointing_false_turns_server_endpointing_off() -> None:
    assert not parse(endpointing="false").endpointing
    assert parse(endpointing="true").endpointing_ms is None


def test_turn_model_options_map_onto_the_streams_end_of_turn() -> None:
    """`endpointing` is the silence at which the turn is judged; Flux's `eot_threshold` and
    `eot_timeout_ms` and this server's `turn_model` set the stream's end-of-turn model."""
    o = parse(endpointing=300, turn_model="true", eot_threshold=0.7, eot_timeout_ms=1500)
    assert (o.endpointing_ms, o.turn_model, o.eot_threshold, o.eot_timeout_ms) == (300, True, 0.7, 1500)
    assert not o.warnings
    settings = stream_settings(o).endpointing
    assert settings is not None
    assert (settings.min_silence_s, settings.turn_model, settings.turn_threshold) == (0.3, True, 0.7)
    assert settings.turn_max_silence_s == 1.5
    assert parse(turn_model="false").turn_model is False
    assert parse().turn_model is None  # the server's --turn-model
    recorded = parse(live=False, turn_model="true")
    assert recorded.turn_model is None and [w.parameter for w in recorded.warnings] == ["turn_model"]
    assert "between 0.5 and 0.9" in refused("eot_threshold", eot_threshold=0.95)
    refused("eot_threshold", eot_threshold="high")
    assert "between 500 and 10000" in refused("eot_timeout_ms", eot_timeout_ms=100)
    refused("turn_model", turn_model="maybe")


def test_endpointing_below_what_the_vad_sees_is_raised_and_said() -> None:
    o = parse(endpointing=10)  # Deepgram's own default
    assert o.endpointing_ms == MIN_ENDPOINTING_MS
    assert [w.parameter for w in o.warnings] == ["endpointing"]
    refused("endpointing", endpointing=MAX_ENDPOINTING_MS + 1)
    refused("endpointing", endpointing="soon")


def test_redact_values() -> None:
    assert parse(redact="numbers").redact == {Kind.PCI, Kind.SSN, Kind.NUMBERS}
    assert parse(redact="true").redact == parse(redact="numbers").redact
    assert parse(redact="pci,ssn").redact == {Kind.PCI, Kind.SSN}
    assert parse(redact="false").redact == set()
    for value in ("pii", "phi", "aggressive_numbers", "name"):
        assert value in refused("redact", redact=["pci", value])


def test_keywords_boosts_become_keyterms_and_suppressions_are_dropped() -> None:
    o = parse(keyterm="Moxilar", keywords=["Kestoria:2", "Zentrix", "uh:-5", "Moxilar:1"])
    assert o.keyterms == ("Moxilar", "Kestoria", "Zentrix")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("encoding", "opus"),
        ("encoding", "flac"),
        ("encoding", "linear32"),
        ("encoding", "mp3-ish"),
        ("sample_rate", 4000),
        ("sample_rate", 96000),
        ("sample_rate", "8k"),
        ("channels", 0),
        ("channels", 9),
        ("diarize_model", "latest"),
        ("detect_entities", "true"),
        ("profanity_filter", "true"),
        ("callback", "https://example.com/hook"),
        ("search", "refund"),
        ("replace", "darn:drat"),
        ("interim_results", "maybe"),
        ("utterance_end_ms", 0),
        ("extra", "no-colon"),
        # echoed in every result: one Finalize on 8 channels returned 8 copies (issue 26 #11)
        ("extra", [f"k{i}:{'v' * 1000}" for i in range(3)]),
        ("tag", ["t" * 1000] * 3),
    ],
)
def test_refusals_name_the_option(option: str, value: object) -> None:
    query = {option: value}
    if option == "sample_rate":
        query["encoding"] = "linear16"
    refused(option, **query)


def test_diarize_is_for_recordings_with_any_of_deepgrams_diarize_models() -> None:
    assert parse(live=False, diarize="true").diarize
    assert parse(diarize="true").diarize and not parse(diarize="false").diarize  # live: diarize alone
    assert not parse(live=False).diarize and not parse(live=False, diarize="false").diarize
    o = parse(live=False, diarize_model="latest")
    assert o.diarize and [w.parameter for w in o.warnings] == ["diarize_model"]
    with pytest.raises(OptionError) as e:
        parse(live=False, diarize_model="v9")
    assert e.value.option == "diarize_model" and "v9" in e.value.message


def test_an_encoding_needs_its_sample_rate_live() -> None:
    refused("sample_rate", encoding="mulaw")
    assert parse(live=False, encoding="mulaw").sample_rate == 16000  # a recording may say it in its header


def test_hints_are_accepted_and_listed() -> None:
    o = parse(
        filler_words="true", mip_opt_out="true", numerals="false", profanity_filter="false", diarize="false",
        no_delay="true", some_future_option="x",
    )  # fmt: skip
    assert {w.parameter for w in o.warnings} == {
        "filler_words",
        "mip_opt_out",
        "no_delay",
        "some_future_option",
    }


def test_live_and_recorded_options_apart() -> None:
    recorded = parse(live=False, interim_results="true", utterances="true", vad_events="true")
    assert recorded.utterances and not recorded.interim_results and not recorded.vad_events
    assert {w.parameter for w in recorded.warnings} == {"interim_results", "vad_events"}
    assert not parse(utterances="true").utterances


def test_query_bounds() -> None:
    refused("keyterm", keyterm=["x"] * 600)
    refused("keyterm", keyterm="x" * 5000)


# --- messages, read back by the SDK's own types --------------------------------------------------------

MODEL = messages.ModelCard(name="tiny.en", version="0.1.0")
WORDS = [messages.Word(" Ask", 3.3, 3.6, 0.9), messages.Word(" not!", 3.6, 4.4, 0.8)]


def read(message: object, model: type[Any]) -> Any:
    """The frame a client receives, validated strictly by the SDK type it would parse it into."""
    text = messages.dump(message)  # type: ignore[arg-type]
    return model.model_validate(json.loads(text))


def test_results_carry_what_the_sdk_requires() -> None:
    r = read(
        messages.results(
            request_id="req", model=MODEL, channel=1, channels=2, start=3.3, duration=1.1, is_final=True,
            speech_final=True, from_finalize=False, text=" Ask not!", confidence=0.85, words=WORDS,
            punctuated=True, extra={"crm": "7"},
        ),
        ListenV1Results,
    )  # fmt: skip
    assert r.type == "Results" and r.channel_index == [1, 2] and r.is_final and r.speech_final
    assert r.from_finalize is False and (r.start, r.duration) == (3.3, 1.1)
    alt = r.channel.alternatives[0]
    assert alt.transcript == "Ask not!"
    assert [(w.word, w.punctuated_word, w.start, w.end) for w in alt.words] == [
        ("ask", "Ask", 3.3, 3.6),
        ("not", "not!", 3.6, 4.4),
    ]
    assert r.metadata.model_info.name == "tiny.en" and r.metadata.model_uuid == MODEL.uuid
    assert r.metadata.extra == {"crm": "7"}  # type: ignore[attr-defined]


def test_unpunctuated_results_read_as_deepgrams_bare_words() -> None:
    redacted = [*WORDS, messages.Word(" [PCI].", 4.4, 6.0, 0.7)]
    r = read(
        messages.results(
            request_id="req", model=MODEL, channel=0, channels=1, start=0, duration=1, is_final=False,
            speech_final=False, from_finalize=False, text="Ask not! [PCI].", confidence=0.5, words=redacted,
            punctuated=False,
        ),
        ListenV1Results,
    )  # fmt: skip
    alt = r.channel.alternatives[0]
    assert alt.transcript == "ask not [PCI]"
    assert all(w.punctuated_word is None for w in alt.words)


def test_metadata_and_events() -> None:
    m = read(
        messages.metadata(
            request_id="req", created="2026-12-01T00:00:00.000Z", duration=11.0, channels=1, sha256="ab",
            model=MODEL,
        ),
        ListenV1Metadata,
    )  # fmt: skip
    assert m.transaction_key and m.models == [MODEL.uuid] and m.model_info[MODEL.uuid]["name"] == "tiny.en"  # type: ignore[attr-defined]
    started = json.loads(messages.dump(messages.speech_started(0, 1, 1.25)))
    assert started == {"type": "SpeechStarted", "channel": [0, 1], "timestamp": 1.25}
    end = json.loads(messages.dump(messages.utterance_end(1, 2, 4.4)))
    assert end == {"type": "UtteranceEnd", "channel": [1, 2], "last_word_end": 4.4}
    err = json.loads(messages.dump(messages.error("DATA-0000", "cannot decode")))
    assert err == {"type": "Error", "variant": "DATA-0000", "description": "cannot decode"}


def test_prerecorded_response() -> None:
    utterances = [
        messages.Utterance(1, 5.0, 6.0, "Yes.", 0.9, (messages.Word(" Yes.", 5.0, 6.0, 0.9),)),
        messages.Utterance(0, 0.5, 2.0, "Hello there.", 0.8, (messages.Word(" Hello", 0.5, 1.0, 0.8),
                                                              messages.Word(" there.", 1.0, 2.0, 0.8))),
    ]  # fmt: skip
    body = read(
        messages.prerecorded(
            request_id="6f1c1b9e-2f4a-4c61-9d43-0c4f6b8f6e11", created="2026-12-01T00:00:00Z", duration=6.5,
            channels=2, sha256="ab", model=MODEL, utterances=utterances, punctuated=True, with_utterances=True,
        ),
        ListenV1Response,
    )  # fmt: skip
    assert [c.alternatives[0].transcript for c in body.results.channels] == ["Hello there.", "Yes."]
    assert [u.channel for u in body.results.utterances] == [0, 1]
    assert body.metadata.channels == 2 and body.metadata.duration == 6.5


@pytest.mark.parametrize(
    ("text", "model"),
    [
        ('{"type": "KeepAlive"}', ListenV1KeepAlive),
        ('{"type": "Finalize"}', ListenV1Finalize),
        ('{"type": "CloseStream"}', ListenV1CloseStream),
        ('{"type": "Configure", "keyterms": ["Kestoria"]}', ListenV1Configure),
    ],
)
def test_control_messages(text: str, model: type[Any]) -> None:
    assert isinstance(messages.parse_control(text), model)


@pytest.mark.parametrize(
    "text",
    ["not json", "[1]", '{"type": "Shout"}', '{"type": "Configure", "keyterms": 5}', "[" * 100_000],
)
def test_unreadable_text_is_a_schema_error(text: str) -> None:
    with pytest.raises(messages.SchemaError) as e:
        messages.parse_control(text)
    assert e.value.original == text[: messages.MAX_ECHOED_CHARS]


# --- UtteranceEnd, framing ----------------------------------------------------------------------------


def test_utterance_end_after_the_gap_past_the_last_final_word() -> None:
    t = UtteranceEndTracker(1.0)
    assert t.advance(5.0) is None  # nothing said yet
    t.on_result(2.0, is_final=False)
    assert t.advance(3.5) is None  # words not finalized
    t.on_result(2.4, is_final=True)
    assert t.advance(3.3) is None
    assert t.advance(3.4) == 2.4
    assert t.advance(9.0) is None  # once per gap


def test_utterance_end_waits_for_speech_heard_inside_the_gap() -> None:
    t = UtteranceEndTracker(1.0)
    t.on_result(2.0, is_final=True)
    t.on_speech_started(2.6)  # a short pause: no utterance end
    assert t.advance(3.5) is None
    t.on_result(4.0, is_final=True)
    assert t.advance(4.9) is None
    assert t.advance(5.0) == 4.0


def test_a_late_final_announces_a_gap_already_passed() -> None:
    t = UtteranceEndTracker(1.0)
    t.on_result(2.0, is_final=True)
    t.on_speech_started(3.5)  # after the gap: it was one
    assert t.advance(3.5) == 2.0


def test_reframer_carries_a_partial_frame() -> None:
    r = Reframer(4)  # linear16 stereo
    assert r.push(b"abcdef") == b"abcd" and r.pending == 2
    assert r.push(b"g") == b"" and r.pending == 3
    assert r.push(b"hij") == b"efgh" and r.pending == 2


def test_containers_are_recognised() -> None:
    assert container_of(b"RIFF\x24\x00\x00\x00WAVEfmt ") == "WAV"
    assert container_of(b"fLaC\x00\x00\x00\x22") == "FLAC"
    assert container_of(b"OggS\x00\x02") == "Ogg"
    assert container_of(b"\x00\x00\x00\x20ftypisom") == "MP4"
    assert container_of(b"\x00\x01\x02\x03\x04\x05\x06\x07") is None


def test_reframer_pieces_stay_within_the_limit_with_a_carried_partial_frame() -> None:
    r = Reframer(4)
    assert r.push_within(b"\x01" * 6, 6) == [b"\x01" * 4]  # 2 bytes carried
    # a message of 6 bytes (the limit) and the 2 carried: 8 bytes of whole frames, over the limit at once
    assert r.push_within(b"\x02" * 6, 6) == [b"\x01\x01\x02\x02", b"\x02" * 4]
