"""Every field a client can make unbounded work of is bounded in the frontend: refused INVALID_ARGUMENT
(HTTP 400) naming the field and the limit, before anything reaches the engine, and a call beside it is
untouched (issue 19, scenario 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import openai
import pytest
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from engine import Engine
from engine.hooks import EngineHooks
from engine.parameters import MAX_PROMPT_CHARS
from service.config import ServerConfig
from tests.support.audio import JFK_FLAC, make_conversation, to_linear16_bytes
from tests.support.calls import Outcome, alongside_good_stream, audio_requests, config_request, run_stream
from tests.support.server import ServerProcess, ServerThread

HUGE_PROMPT = "Acme Widget-Pro " * (1 << 20)  # 16 MiB of text
TOO_MANY_TOKENS = "Zyxel Kubernetes " * 60  # ~1000 characters: under the character bound, ~240 tokens
MESSAGE_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@pytest.fixture()
def engine_prompts(engine_hooks: EngineHooks) -> Iterator[list[int]]:
    """The length of every prompt that reaches the engine while the test runs."""
    seen: list[int] = []
    with engine_hooks.installed(enqueue=lambda req: seen.append(len(req.options.prompt or ""))):
        yield seen


def speech() -> bytes:
    audio, _ = make_conversation(["Thank you for calling, how can I help you today?"], pause_s=0.8)
    return to_linear16_bytes(audio)


async def stream_with(target: str, **config: object) -> Outcome:
    async with aio.insecure_channel(target, options=MESSAGE_OPTIONS) as channel:
        return await run_stream(channel, [config_request(**config), *audio_requests(speech(), 3200)])


async def test_a_16_mb_prompt_is_refused_at_once_and_the_call_beside_it_is_untouched(
    asr_server: ServerThread, engine_prompts: list[int]
) -> None:
    outcome = await alongside_good_stream(
        asr_server.target, lambda: stream_with(asr_server.target, prompt=HUGE_PROMPT)
    )
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    # weighed before it is parsed (service/runtime/message_limit.py): the 16 MiB config is never read
    assert "over the limit of" in outcome.details and "(max_chunk_bytes" in outcome.details, outcome.details
    assert outcome.responses == []  # refused on its config, before any audio was taken
    # a prompt within the message bound but over the prompt's own is refused by the prompt's check
    long_prompt = "Acme Widget-Pro " * 4096  # 64 KiB
    outcome = await stream_with(asr_server.target, prompt=long_prompt)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert (
        f"prompt has {len(long_prompt)} characters, over the limit of {MAX_PROMPT_CHARS}" in outcome.details
    )
    assert max(engine_prompts, default=0) == 0  # nothing of either reached the engine


async def test_recognize_refuses_a_16_mb_prompt_before_the_engine(
    asr_server: ServerThread, engine_prompts: list[int]
) -> None:
    request = asr_pb2.RecognizeRequest(
        config=asr_pb2.RecognitionConfig(encoding=asr_pb2.FLAC, prompt=HUGE_PROMPT),
        audio_content=JFK_FLAC.read_bytes(),
    )
    async with aio.insecure_channel(asr_server.target, options=MESSAGE_OPTIONS) as channel:
        with pytest.raises(aio.AioRpcError) as e:
            await asr_pb2_grpc.RecognizerStub(channel).Recognize(request, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"over the limit of {MAX_PROMPT_CHARS} characters" in (e.value.details() or "")
    assert engine_prompts == []


async def test_a_prompt_over_the_token_bound_is_refused_naming_both_bounds(
    asr_server: ServerThread, engine_prompts: list[int]
) -> None:
    outcome = await stream_with(asr_server.target, prompt=TOO_MANY_TOKENS)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "over the limit of 111 tokens" in outcome.details and "--max-tokens" in outcome.details
    assert outcome.responses == []  # refused on its config, before any audio was taken
    assert engine_prompts == []
    ok = await stream_with(asr_server.target, prompt="Zyxel Kubernetes " * 10)  # within both bounds: served
    assert ok.code == grpc.StatusCode.OK and ok.finals, ok
    assert engine_prompts and min(engine_prompts) > 0


async def test_a_frontend_process_counts_prompt_tokens_with_the_engines_tokenizer(
    server_process: ServerProcess,
) -> None:
    """asr-server, its engine in another process: the frontend refuses on the config, with the tokenizer
    that came to it in ModelInfo, and serves a prompt within the bound."""
    refused = await stream_with(server_process.target, prompt=TOO_MANY_TOKENS)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert "over the limit of 111 tokens" in refused.details and refused.responses == []
    served = await stream_with(server_process.target, prompt="Zyxel Kubernetes " * 10)
    assert served.code == grpc.StatusCode.OK and served.finals, served


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"language_code": "en-" + "x" * (1 << 20)},
            "language_code has 1048579 characters, over the limit of 64",
        ),
        ({"redact": [asr_pb2.PCI] * 100_000}, "redact has 100000 values, over the limit of 8"),
    ],
    ids=["language_code", "redact"],
)
async def test_other_unbounded_fields_are_refused_naming_field_and_limit(
    asr_server: ServerThread, config: dict[str, object], expected: str
) -> None:
    outcome = await stream_with(asr_server.target, **config)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert expected in outcome.details
    assert outcome.responses == []
    assert len(outcome.details) < 500  # the refusal never echoes what was sent


@pytest.fixture(scope="module")
def http_server(service_engine: Engine) -> Iterator[ServerThread]:
    server = ServerThread(ServerConfig(), service_engine, http=True).start()
    yield server
    server.stop()


async def test_the_http_door_refuses_a_long_prompt_the_same_way(http_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{http_server.http_url}/v1", api_key="unused", max_retries=0, timeout=60)

    def upload() -> None:
        with JFK_FLAC.open("rb") as f:
            client.audio.transcriptions.create(model="whisper-1", file=f, prompt=TOO_MANY_TOKENS)

    with pytest.raises(openai.BadRequestError) as e:
        await asyncio.to_thread(upload)
    assert e.value.status_code == 400
    assert "over the limit of 111 tokens" in str(e.value)
