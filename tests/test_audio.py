"""service.pipeline.audio against sox (the reference G.711 codec), real speech and the shared jfk.flac."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from service.pipeline.audio import (
    ALAW_TABLE,
    MULAW_TABLE,
    AudioFormatError,
    AudioTooLong,
    StreamDecoder,
    decode_blocks,
    decode_file,
    mixdown,
    probe_recording,
    validate_stream_format,
)
from tests.support.audio import (
    JFK_FLAC,
    sox_decode_g711,
    sox_sine,
    speak,
    stereo,
    to_alaw_8k_bytes,
    to_linear16_bytes,
    to_mulaw_8k_bytes,
)

SOX_NAME = {"MULAW": "mu-law", "ALAW": "a-law"}


def decode_all(decoder: StreamDecoder, data: bytes, chunk: int | None = None) -> np.ndarray:
    chunk = chunk or len(data) or 1
    parts = [decoder.feed(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return np.concatenate([*parts, decoder.flush()], axis=1)


def test_g711_tables_hold_known_values() -> None:
    # ITU-T G.711: mu-law 0x00/0x80 are the extremes, 0xFF and 0x7F both zero;
    # A-law 0xD5/0x55 are the smallest steps (+-8), 0xAA/0x2A the extremes.
    assert MULAW_TABLE[[0x00, 0x80, 0xFF, 0x7F, 0x0F, 0x8F]].tolist() == [-32124, 32124, 0, 0, -16764, 16764]
    assert ALAW_TABLE[[0xD5, 0x55, 0xAA, 0x2A, 0x80, 0x00]].tolist() == [8, -8, 32256, -32256, 5504, -5504]
    # both are monotonic within each sign half, as a companding curve must be
    assert (np.diff(MULAW_TABLE[:128].astype(int)) > 0).all()


@pytest.mark.parametrize("encoding", ["MULAW", "ALAW"])
def test_g711_tables_equal_sox_for_every_code(encoding: str) -> None:
    table = MULAW_TABLE if encoding == "MULAW" else ALAW_TABLE
    np.testing.assert_array_equal(table, sox_decode_g711(bytes(range(256)), SOX_NAME[encoding]))


@pytest.mark.parametrize("encoding", ["MULAW", "ALAW"])
def test_sox_encoded_sine_decodes_like_sox(encoding: str) -> None:
    # 16 kHz G.711 skips the resampler, so our decode must equal sox's own, sample for sample
    data = sox_sine(440, 0.5, 16000, SOX_NAME[encoding])
    ours = decode_all(StreamDecoder(encoding, 16000, 1), data)[0]
    reference = sox_decode_g711(data, SOX_NAME[encoding], rate=16000)
    assert len(ours) == len(reference) == 8000
    assert np.abs(ours * 32768 - reference).max() <= 1.0
    assert np.abs(reference).max() > 0.6 * 32768  # the sine is really there


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampled_tone_keeps_frequency_and_amplitude(rate: int) -> None:
    t = np.arange(rate) / rate
    tone = 0.5 * np.sin(2 * np.pi * 1000 * t)
    out = decode_all(StreamDecoder("LINEAR16", rate, 1), to_linear16_bytes(tone), chunk=2 * (rate // 50))[0]
    assert abs(len(out) - 16000) <= 2
    core = out[1000:-1000]
    spectrum = np.abs(np.fft.rfft(core * np.hanning(len(core))))
    peak_hz = np.argmax(spectrum) * 16000 / len(core)
    assert abs(peak_hz - 1000) < 2
    assert np.sqrt(np.mean(core**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.01)


def test_g711_telephone_speech_decodes_to_the_original() -> None:
    speech = speak("Your call is important to us.")
    for encoding, data in (("MULAW", to_mulaw_8k_bytes(speech)), ("ALAW", to_alaw_8k_bytes(speech))):
        out = decode_all(StreamDecoder(encoding, 8000, 1), data)[0]
        n = min(len(out), len(speech))
        # 8 kHz band-limits and G.711 quantises: still the same waveform
        assert np.corrcoef(out[:n], speech[:n])[0, 1] > 0.9, encoding


@pytest.mark.parametrize(
    ("encoding", "rate", "channels", "chunk_frames"),
    [
        ("MULAW", 8000, 1, 160),
        ("ALAW", 8000, 2, 37),
        ("LINEAR16", 44100, 2, 441),
        ("LINEAR16", 16000, 1, 320),
    ],
)
def test_chunked_feed_equals_one_shot(encoding: str, rate: int, channels: int, chunk_frames: int) -> None:
    rng = np.random.default_rng(1)
    n = rate  # one second
    if encoding == "LINEAR16":
        data = to_linear16_bytes(rng.uniform(-0.5, 0.5, (channels, n)).astype(np.float32))
    else:
        data = rng.integers(0, 256, n * channels, dtype=np.uint8).tobytes()
    frame = len(data) // n
    one = decode_all(StreamDecoder(encoding, rate, channels), data)
    chunked = decode_all(StreamDecoder(encoding, rate, channels), data, chunk=chunk_frames * frame)
    assert one.shape == chunked.shape == (channels, one.shape[1])
    assert abs(one.shape[1] - 16000) <= 2
    np.testing.assert_allclose(chunked, one, atol=1e-6)


def test_samples_in_counts_input_frames() -> None:
    decoder = StreamDecoder("LINEAR16", 8000, 2)
    decoder.feed(bytes(4 * 80))
    decoder.feed(bytes(4 * 160))
    assert decoder.samples_in == 240


def test_output_is_channels_first_and_keeps_channels_apart() -> None:
    a, b = speak("Agent speaking."), np.zeros(8000, dtype=np.float32)
    out = decode_all(StreamDecoder("LINEAR16", 16000, 2), to_linear16_bytes(stereo(a, b)))
    assert out.shape == (2, len(a))
    assert np.abs(out[1]).max() == 0 and np.abs(out[0]).max() > 0.1
    np.testing.assert_allclose(mixdown(out), (out[0] + out[1]) / 2, atol=1e-7)
    assert mixdown(out[:1]).shape == (len(a),)


@pytest.mark.parametrize(
    ("encoding", "channels", "nbytes", "frame"),
    [("LINEAR16", 1, 321, 2), ("LINEAR16", 2, 6, 4), ("MULAW", 3, 7, 3)],
)
def test_partial_frame_chunk_is_rejected(encoding: str, channels: int, nbytes: int, frame: int) -> None:
    decoder = StreamDecoder(encoding, 8000, channels)
    with pytest.raises(AudioFormatError) as e:
        decoder.feed(bytes(nbytes))
    assert e.value.field == "audio_content"
    assert f"{nbytes} bytes" in str(e.value) and f"{frame}-byte frame" in str(e.value)


@pytest.mark.parametrize(
    ("rate", "channels", "field", "needle"),
    [
        (4000, 1, "sample_rate_hertz", "between 8000 and 48000, got 4000"),
        (96000, 1, "sample_rate_hertz", "between 8000 and 48000, got 96000"),
        (16000, 9, "audio_channel_count", "between 1 and 8 (0 means 1), got 9"),
        (16000, -1, "audio_channel_count", "got -1"),
    ],
)
def test_out_of_range_format_names_field_and_limit(rate: int, channels: int, field: str, needle: str) -> None:
    with pytest.raises(AudioFormatError) as e:
        validate_stream_format("LINEAR16", rate, channels)
    assert e.value.field == field and field in str(e.value) and needle in str(e.value)


def test_stream_format_normalises_channels_and_rejects_files() -> None:
    assert validate_stream_format("MULAW", 8000, 0) == (8000, 1)
    for encoding, needle in (("FLAC", "Recognize only"), ("ENCODING_UNSPECIFIED", "one of LINEAR16")):
        with pytest.raises(AudioFormatError) as e:
            validate_stream_format(encoding, 16000, 1)
        assert e.value.field == "encoding" and needle in str(e.value)


def test_jfk_flac_decodes_to_16k_stereo() -> None:
    audio, channels = decode_file(JFK_FLAC.read_bytes(), "FLAC", 0, 0)
    info = sf.info(JFK_FLAC)
    assert (info.samplerate, info.channels) == (44100, 2)
    assert channels == 2 and audio.dtype == np.float32
    assert audio.shape[0] == 2 and abs(audio.shape[1] - round(info.frames * 16000 / 44100)) <= 2
    assert 170_000 < audio.shape[1] < 180_000
    assert np.sqrt(np.mean(audio**2)) > 0.01 and np.abs(audio).max() <= 1.0


def test_wav_file_uses_its_header() -> None:
    speech = speak("Please hold.", rate=22050)
    buf = io.BytesIO()
    sf.write(buf, speech, 22050, format="WAV", subtype="PCM_16")
    audio, channels = decode_file(buf.getvalue(), "WAV", 8000, 3)  # header wins over the arguments
    assert channels == 1 and abs(audio.shape[1] - round(len(speech) * 16000 / 22050)) <= 2


def test_raw_file_decodes_like_the_stream() -> None:
    data = to_mulaw_8k_bytes(speak("One moment please."))
    audio, channels = decode_file(data, "MULAW", 8000, 1)
    np.testing.assert_array_equal(audio, decode_all(StreamDecoder("MULAW", 8000, 1), data))
    assert channels == 1


@pytest.mark.parametrize(
    ("data", "encoding", "needle"),
    [
        (b"fLaC" + bytes(range(256)) * 4, "FLAC", "not a valid FLAC file"),
        (b"", "FLAC", "not a valid FLAC file"),
        (b"RIFF\x00\x00", "WAV", "not a valid WAV file"),
    ],
)
def test_garbage_file_is_rejected(data: bytes, encoding: str, needle: str) -> None:
    with pytest.raises(AudioFormatError) as e:
        decode_file(data, encoding, 0, 0)
    assert e.value.field == "audio_content" and needle in str(e.value)


def test_file_of_another_format_is_named() -> None:
    with pytest.raises(AudioFormatError) as e:
        decode_file(JFK_FLAC.read_bytes(), "WAV", 0, 0)
    assert "not a valid WAV file (it is FLAC)" in str(e.value)


def _sox(src: Path, dst: Path, *args: str, effects: tuple[str, ...] = ()) -> bytes:
    subprocess.run(["sox", "-D", str(src), *args, str(dst), *effects], check=True, capture_output=True)
    return dst.read_bytes()


def test_wave_format_extensible_files_decode_like_their_source(tmp_path: Path) -> None:
    """WAVE_FORMAT_EXTENSIBLE (what sox writes for 24-bit or more than 2 channels, soundfile's WAVEX) is a
    WAV: the same samples as jfk.flac (24-bit), exactly."""
    reference, _ = decode_file(JFK_FLAC.read_bytes(), "FLAC", 0, 0)
    sox24 = _sox(JFK_FLAC, tmp_path / "sox24.wav", "-b", "24")
    four = _sox(JFK_FLAC, tmp_path / "four.wav", "-b", "24", effects=("remix", "1", "2", "1", "2"))
    x, rate = sf.read(JFK_FLAC, dtype="float32")
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="PCM_24")
    sf_wavex = io.BytesIO()
    sf.write(sf_wavex, x, rate, format="WAVEX", subtype="PCM_24")
    for data, channels in ((sox24, 2), (four, 4), (sf_wavex.getvalue(), 2)):
        assert data[20:22] == b"\xfe\xff"  # wFormatTag WAVE_FORMAT_EXTENSIBLE
        info = probe_recording(data, "WAV", 0, 0)
        assert (info.encoding, info.rate, info.channels) == ("WAV", 44100, channels)
        audio, n = decode_file(data, "WAV", 0, 0)
        assert n == channels
        np.testing.assert_array_equal(audio[:2], reference)
    np.testing.assert_array_equal(decode_file(buf.getvalue(), "WAV", 0, 0)[0], reference)


def test_a_wavex_file_sent_as_flac_is_told_to_set_wav(tmp_path: Path) -> None:
    data = _sox(JFK_FLAC, tmp_path / "sox24.wav", "-b", "24")
    with pytest.raises(AudioFormatError) as e:
        decode_file(data, "FLAC", 0, 0)
    assert "not a valid FLAC file (it is WAV); set encoding=WAV" in str(e.value)


def test_a_file_recognize_does_not_take_is_named_without_an_encoding_to_set(tmp_path: Path) -> None:
    data = _sox(JFK_FLAC, tmp_path / "jfk.aiff")
    with pytest.raises(AudioFormatError) as e:
        decode_file(data, "WAV", 0, 0)
    assert e.value.field == "audio_content"
    assert "not a valid WAV file (it is AIFF" in str(e.value) and "set encoding" not in str(e.value)
    assert "FLAC or WAV" in str(e.value)


def test_ogg_opus_files_decode_and_ogg_vorbis_is_named() -> None:
    """Ogg Opus (what browsers and WebRTC gateways record) is a recording's OGG_OPUS; Ogg Vorbis is not."""
    speech = speak("One moment please.")
    opus, vorbis = io.BytesIO(), io.BytesIO()
    sf.write(opus, speech, 16000, format="OGG", subtype="OPUS")
    sf.write(vorbis, speech, 16000, format="OGG", subtype="VORBIS")
    info = probe_recording(opus.getvalue(), "OGG_OPUS", 0, 0)
    assert (info.encoding, info.rate, info.channels, info.frames) == ("OGG_OPUS", 16000, 1, len(speech))
    audio, channels = decode_file(opus.getvalue(), "OGG_OPUS", 0, 0)
    assert channels == 1 and abs(audio.shape[1] - len(speech)) <= 2
    assert np.corrcoef(audio[0], speech[: audio.shape[1]])[0, 1] > 0.9, "the same speech, lossy"
    with pytest.raises(AudioFormatError) as e:
        decode_file(vorbis.getvalue(), "OGG_OPUS", 0, 0)
    assert e.value.field == "audio_content" and "it is OGG VORBIS" in str(e.value)
    with pytest.raises(AudioFormatError) as e:
        decode_file(opus.getvalue(), "FLAC", 0, 0)
    assert "set encoding=OGG_OPUS" in str(e.value)


def test_file_rate_outside_limits_is_rejected() -> None:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(4000, dtype=np.float32), 4000, format="WAV")
    with pytest.raises(AudioFormatError) as e:
        decode_file(buf.getvalue(), "WAV", 0, 0)
    assert e.value.field == "audio_content" and "between 8000 and 48000, got 4000" in str(e.value)


# --- recordings a block at a time (Recognize) ---


@pytest.mark.parametrize("block_s", [0.37, 1.0, 10.0])
def test_block_decoding_matches_decoding_the_whole_file(block_s: float) -> None:
    """jfk.flac (44.1 kHz stereo) in blocks of any size gives what soundfile + soxr give on the whole file."""
    data = JFK_FLAC.read_bytes()
    pcm, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    whole = np.clip(soxr.resample(pcm, rate, 16000, quality="HQ").T, -1.0, 1.0)
    info = probe_recording(data, "FLAC", 0, 0)
    assert (info.rate, info.channels, info.frames) == (rate, 2, len(pcm))
    blocks = np.concatenate(list(decode_blocks(data, info, block_s=block_s)), axis=1)
    assert blocks.shape == whole.shape
    np.testing.assert_allclose(blocks, whole, atol=1e-5)


def test_raw_recording_length_comes_from_its_byte_count() -> None:
    info = probe_recording(b"\xff" * 8000 * 2 * 3, "MULAW", 8000, 2)
    assert (info.channels, info.frames, info.seconds) == (2, 24000, 3.0)
    with pytest.raises(AudioFormatError) as e:
        probe_recording(b"\0" * 5, "LINEAR16", 16000, 1)
    assert e.value.field == "audio_content" and "not a multiple of the 2-byte frame" in str(e.value)


def test_block_decoding_enforces_the_limit_on_what_it_decodes() -> None:
    """A header that understates the length (here: the limit passed is below the real length) cannot
    make the decoder run past the limit."""
    data = JFK_FLAC.read_bytes()
    info = probe_recording(data, "FLAC", 0, 0)
    with pytest.raises(AudioTooLong) as e:
        for _ in decode_blocks(data, info, block_s=1.0, max_seconds=5.0):
            pass
    assert "more than 5 s" in str(e.value)


_PEAK_RSS_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    from service.pipeline.audio import probe_recording
    from service.vocabulary.endpointing import EndpointSettings
    from service.pipeline.recording import RecordingCutter

    data = open(sys.argv[1], "rb").read()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    info = probe_recording(data, "FLAC", 0, 0)
    cutter = RecordingCutter(data, info, False, EndpointSettings())
    utterances = 0
    while (found := cutter.step()) is not None:
        utterances += len(found)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew_mib": (after - before) / 1024, "seconds": cutter.samples / 16000,
                      "utterances": utterances}))
    """
)


@pytest.mark.slow
def test_long_silence_flac_is_cut_in_bounded_memory(tmp_path: Path) -> None:
    """30 min of 48 kHz silence as FLAC (~100 KB): decoding, resampling and endpointing it block by
    block grows peak RSS by a few MB. Decoding it whole would take 330 MiB for the 48 kHz float32 samples
    alone (plus 110 MiB resampled), so the bound below would fail by far."""
    path = tmp_path / "silence.flac"
    minute = np.zeros(48000 * 60, dtype=np.int16)
    with sf.SoundFile(path, "w", 48000, 1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(30):
            f.write(minute)
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_SCRIPT, str(path)], capture_output=True, text=True, check=True
    )
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"30 min silence FLAC ({path.stat().st_size} bytes): {figures}")
    assert abs(figures["seconds"] - 1800) < 0.1
    assert figures["utterances"] == 0
    assert figures["grew_mib"] < 64, figures
