"""Batched VAD across streams (service/pipeline/vad_batch.py, SileroVad.score) and telephone endpointing, on the real
silero-vad model with real speech (jfk.flac, pocketsphinx's librivox) and espeak-ng speech turned into
telephone audio by sox; and through a real server with several calls at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from asr.v1 import asr_pb2
from prometheus_client import REGISTRY

from clients.client import RecognizerClient
from service.pipeline.audio import StreamDecoder
from service.pipeline.endpointing import Endpointer, Utterance
from service.pipeline.vad import RATE, WINDOW, SileroVad, load_vad
from service.pipeline.vad_batch import VadBatcher
from tests.support.audio import JFK_FLAC, make_conversation, to_mulaw_8k_bytes, white_noise
from tests.support.server import ServerThread

CALL = [
    "Thank you for calling the support line, my name is Alex.",
    "I can see that your order was shipped on Monday morning.",
    "Is there anything else I can help you with today?",
]
POCKETSPHINX = "/usr/share/pocketsphinx/test/data"
WINDOW_S = 0.032
# Telephone audio is not the wideband recording: a boundary of its cuts lies up to 7 windows from the
# wideband one (a librivox end). Measured in windows off the wideband cuts summed over each set: jfk 1,
# librivox 14, cards 23, espeak 2.
BOUNDARY_SLACK_S = 8 * WINDOW_S + 1e-6


def jfk_16k() -> np.ndarray:
    audio, rate = sf.read(JFK_FLAC, dtype="float32", always_2d=True)
    return soxr.resample(audio.mean(axis=1), rate, RATE).astype(np.float32)


def pocketsphinx_16k(folder: str) -> np.ndarray:
    """Every clip of a pocketsphinx test set, one after the other with a second of silence between them."""
    parts = []
    for path in sorted(Path(POCKETSPHINX, folder).glob("*.wav")):
        audio, rate = sf.read(path, dtype="float32")
        assert rate == RATE
        parts += [audio, np.zeros(RATE, dtype=np.float32)]
    assert len(parts) == 10, folder
    return np.concatenate(parts)


def telephone(audio16: np.ndarray) -> np.ndarray:
    """sox's 8 kHz mu-law of the audio, decoded and resampled to 16 kHz float32 as a stream would be."""
    data = to_mulaw_8k_bytes(audio16)
    decoder = StreamDecoder("MULAW", 8000, 1)
    resampled = [decoder.feed(data[i : i + 160])[0] for i in range(0, len(data), 160)]  # 20 ms frames
    resampled.append(decoder.flush()[0])
    return np.concatenate(resampled)


def windows_of(audio: np.ndarray) -> np.ndarray:
    n = len(audio) // WINDOW
    return audio[: n * WINDOW].reshape(n, WINDOW)


def test_batched_probabilities_equal_one_stream_at_a_time() -> None:
    """Streams of different lengths (wideband and telephone), fed in ticks of different sizes: each
    channel's probabilities are the same whether it is scored alone or in a batch with the others."""
    vad = load_vad()
    conversation, _ = make_conversation(CALL[:2], pause_s=0.5)
    jfk = jfk_16k()
    phone_jfk, phone_call = telephone(jfk), telephone(conversation)
    streams = [  # (windows, windows per tick)
        (windows_of(jfk), 3),
        (windows_of(conversation), 1),
        (windows_of(phone_jfk), 3),
        (windows_of(phone_call), 1),
        (windows_of(white_noise(4.0, dbfs=-30)), 5),
        (windows_of(phone_call[: RATE * 2]), 2),
    ]
    alone = []
    for windows, per_tick in streams:
        state = vad.new_state()
        alone.append(
            np.concatenate([vad(state, windows[i : i + per_tick]) for i in range(0, len(windows), per_tick)])
        )
    states = [vad.new_state() for _ in streams]
    batched: list[list[np.ndarray]] = [[] for _ in streams]
    ticks = max(-(-len(w) // k) for w, k in streams)
    sizes = []
    for t in range(ticks):
        chunks = [w[t * k : (t + 1) * k] for w, k in streams]
        sizes.append(sum(1 for c in chunks if len(c)))
        for out, probs in zip(batched, vad.score(states, chunks), strict=True):
            out.append(probs)
    assert max(sizes) == len(streams) and min(sizes) < len(streams)  # streams of different lengths
    noise = 4
    for k, ((windows, _), a, b) in enumerate(zip(streams, alone, batched, strict=True)):
        b_all = np.concatenate(b)
        assert len(a) == len(b_all) == len(windows)
        np.testing.assert_allclose(b_all, a, atol=1e-5, err_msg=f"stream {k}")
        assert a.max() < 0.5 if k == noise else a.max() > 0.9  # speech was heard in speech, none in noise


def test_one_stream_alone_keeps_its_fast_path_and_state_across_paths() -> None:
    """A channel can be scored alone (the 16 kHz sequence model) one tick and in a batch the next: the
    state carries over and the probabilities match a channel scored alone throughout."""
    vad = SileroVad()
    windows = windows_of(jfk_16k())
    ref_state = vad.new_state()
    reference = vad(ref_state, windows)
    state, other = vad.new_state(), vad.new_state()
    noise = windows_of(white_noise(len(windows) * 0.032, dbfs=-30))
    mixed = []
    for i in range(0, len(windows), 4):
        if i // 4 % 2:
            mixed.append(vad.score([state, other], [windows[i : i + 4], noise[i : i + 4]])[0])
        else:
            mixed.append(vad.score([state], [windows[i : i + 4]])[0])
    np.testing.assert_allclose(np.concatenate(mixed), reference, atol=1e-5)


def cut(audio16: np.ndarray, chunk_s: float = 0.02) -> list[Utterance]:
    ep = Endpointer()
    events = []
    step16 = round(chunk_s * RATE)
    for i in range(0, max(len(audio16), 1), step16):
        events += ep.feed(audio16[i : i + step16])
    events += ep.catch_up() + ep.flush()
    return [e for e in events if isinstance(e, Utterance)]


@pytest.mark.parametrize("source", ["jfk", "librivox", "cards", "espeak"])
def test_telephone_speech_is_cut_as_the_wideband_recording(source: str) -> None:
    """Telephone audio (8 kHz mu-law, resampled to 16 kHz as a stream's is) is cut into the utterances of
    the original wideband recording, each boundary within a few windows of the wideband one."""
    if source == "jfk":
        audio = jfk_16k()
    elif source == "espeak":
        audio = make_conversation(CALL, pause_s=1.0)[0]
    else:
        audio = pocketsphinx_16k(source)
    wideband, phone = cut(audio), cut(telephone(audio))
    assert len(phone) >= 2, phone
    assert [u.index for u in phone] == [u.index for u in wideband]
    for u, w in zip(phone, wideband, strict=True):
        assert (
            abs(u.start_s - w.start_s) <= BOUNDARY_SLACK_S and abs(u.end_s - w.end_s) <= BOUNDARY_SLACK_S
        ), (
            phone,
            wideband,
        )
    assert [u.forced_cut for u in phone] == [u.forced_cut for u in wideband]


def test_batcher_pass_gives_the_events_of_one_endpointer_fed_alone() -> None:
    """Three telephone calls and one wideband call through one VadBatcher tick after tick: each gets the
    events it would have got fed on its own."""
    conversation, _ = make_conversation(CALL[:2], pause_s=0.8)
    resampled = telephone(conversation)
    jfk = jfk_16k()

    async def main() -> list[list[Utterance]]:
        batcher = VadBatcher()
        eps = [Endpointer() for _ in range(4)]
        got: list[list[Utterance]] = [[] for _ in eps]

        def on_scored(probs: list[np.ndarray] | Exception) -> None:
            assert not isinstance(probs, Exception)
            for i, (ep, p) in enumerate(zip(eps, probs, strict=True)):
                got[i] += [e for e in ep.advance(p) if isinstance(e, Utterance)]

        step = 320  # 20 ms at 16 kHz
        lags = [0, 4 * step, 8 * step]  # the calls start 0, 80 and 160 ms apart
        for i in range(0, max(len(resampled) + lags[-1], len(jfk)), step):
            for ep, lag in zip(eps, lags, strict=False):
                j = i - lag
                if 0 <= j < len(resampled):
                    ep.push(resampled[j : j + step])
            eps[3].push(jfk[i : i + step])
            batcher.request("calls", eps, on_scored)
            await asyncio.sleep(0)  # the tick
        for i, (ep, p) in enumerate(zip(eps, batcher.score_now(eps), strict=True)):
            got[i] += [e for e in ep.advance(p) + ep.flush() if isinstance(e, Utterance)]
        return got

    got = asyncio.run(main())
    alone = [cut(resampled)] * 3 + [cut(jfk)]
    for g, a in zip(got, alone, strict=True):
        assert [(u.start_s, u.end_s, u.index) for u in g] == [(u.start_s, u.end_s, u.index) for u in a]
        assert len(g) >= 2


def histogram(name: str) -> dict[str, float]:
    return {
        s.labels["le"]: s.value
        for family in REGISTRY.collect()
        if family.name == name
        for s in family.samples
        if s.name == f"{name}_bucket"
    }


@pytest.mark.slow
async def test_concurrent_telephone_calls_share_vad_passes(asr_server: ServerThread) -> None:
    """Six 8 kHz mu-law calls at once through the real server: the VAD pass scores more than one call
    at a time, and every call still gets its finals."""
    audio, _ = make_conversation(CALL[:2], pause_s=0.8)
    data = to_mulaw_8k_bytes(audio)
    before = histogram("asr_vad_batch_channels")

    chunks = [data[i : i + 160] for i in range(0, len(data), 160)]  # 20 ms of 8 kHz G.711
    config = asr_pb2.StreamingRecognitionConfig(
        config=asr_pb2.RecognitionConfig(encoding=asr_pb2.MULAW, sample_rate_hertz=8000)
    )

    async def one() -> list[str]:
        finals = []
        async with RecognizerClient(asr_server.target) as client:
            async for response in client.stream(config, chunks):
                finals += [r.alternatives[0].transcript for r in response.results if r.is_final]
        return finals

    results = await asyncio.gather(*(one() for _ in range(6)))
    for finals in results:
        assert len(finals) == 2 and "order" in finals[1].lower(), finals
    after = histogram("asr_vad_batch_channels")
    passes = after["+Inf"] - before.get("+Inf", 0.0)
    single = after["1.0"] - before.get("1.0", 0.0)
    assert passes > 0 and passes - single > 0, (before, after)  # some pass held more than one call
