"""WAVE_FORMAT_EXTENSIBLE recordings (24-bit, multichannel; what sox and most recorders write) through a
real server: gRPC Recognize and the HTTP door take them as WAV. The bulk client's side is in
tests/test_client_bulk.py."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from asr.v1 import asr_pb2
from grpc import aio

from clients.client import RecognizerClient
from clients.scoring import normalize
from engine import Engine
from service.config import ServerConfig
from tests.support.audio import JFK_FLAC
from tests.support.server import ServerThread

pytestmark = pytest.mark.slow
ASK_NOT = "ask not what your country can do for you"


def wavex(tmp_path: Path, name: str, *args: str, effects: tuple[str, ...] = ()) -> Path:
    """jfk.flac rewritten by sox; 24-bit or more than two channels makes sox write WAVE_FORMAT_EXTENSIBLE."""
    out = tmp_path / name
    subprocess.run(["sox", "-D", str(JFK_FLAC), *args, str(out), *effects], check=True, capture_output=True)
    assert out.read_bytes()[20:22] == b"\xfe\xff", "wFormatTag is WAVE_FORMAT_EXTENSIBLE"
    return out


@pytest.fixture(scope="module")
def http_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(), service_engine, http=True).start()
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("name", "args", "effects", "channels"),
    [
        ("stereo24.wav", ("-b", "24"), (), 2),
        ("quad16.wav", ("-b", "16"), ("remix", "1", "2", "1", "2"), 4),
    ],
)
async def test_recognize_takes_wavex_as_wav(
    asr_server: ServerThread,
    tmp_path: Path,
    name: str,
    args: tuple[str, ...],
    effects: tuple[str, ...],
    channels: int,
) -> None:
    path = wavex(tmp_path, name, *args, effects=effects)
    async with RecognizerClient(asr_server.target) as client:
        response = await client.recognize_file(path, separate_channels=True, deadline_s=120)
    assert {r.channel_tag for r in response.results} == set(range(1, channels + 1))
    for tag in range(1, channels + 1):
        text = " ".join(r.alternatives[0].transcript for r in response.results if r.channel_tag == tag)
        assert ASK_NOT in normalize(text), (tag, text)
    assert abs(response.total_audio_duration.ToTimedelta().total_seconds() - 11.0) < 0.05


async def test_recognize_names_wav_for_a_wavex_file_sent_as_flac(
    asr_server: ServerThread, tmp_path: Path
) -> None:
    data = wavex(tmp_path, "stereo24.wav", "-b", "24").read_bytes()
    async with RecognizerClient(asr_server.target) as client:
        with pytest.raises(aio.AioRpcError) as e:
            await client.recognize(data, asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC), deadline_s=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "(it is WAV); set encoding=WAV" in (e.value.details() or "")


def test_the_http_door_takes_wavex(http_server: ServerThread, tmp_path: Path) -> None:
    path = wavex(tmp_path, "stereo24.wav", "-b", "24")
    client = openai.OpenAI(base_url=http_server.http_url + "/v1", api_key="none", max_retries=0, timeout=120)
    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text")
    assert ASK_NOT in normalize(str(text))
