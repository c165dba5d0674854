"""StreamingRecognize calls for tests that must see the server's own status, whatever the timing.

A request iterator handed to grpc.aio turns the server's status into INTERNAL "Internal error from
Core" when a write races the server ending the call (grpc/grpc#36066): a refusal would look like a
crash. Here each request is written through the call's core object, a failed write just stops the
writing, and the status comes from the call itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from asr.v1 import asr_pb2, asr_pb2_grpc
from grpc import aio

from clients.scoring import corpus_wer

T = TypeVar("T")
Request = asr_pb2.StreamingRecognizeRequest
Response = asr_pb2.StreamingRecognizeResponse
_CORE_ERROR: type[Exception] = importlib.import_module("grpc._cython.cygrpc").InternalError
# Without a deadline, how long to wait for a call's status after the last write: never forever.
STATUS_WAIT_S = 60.0


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[Response] = field(default_factory=list)
    sent_all: bool = False
    ended_at: float = 0.0  # time.monotonic() when the status arrived

    @property
    def finals(self) -> list[asr_pb2.StreamingRecognitionResult]:
        return [r for x in self.responses for r in x.results if r.is_final]

    @property
    def text(self) -> str:
        return " ".join(r.alternatives[0].transcript for r in self.finals if r.alternatives)

    def events(self, kind: int) -> int:
        return sum(1 for x in self.responses if x.speech_event_type == kind)


def config_request(
    encoding: int = asr_pb2.LINEAR16, sample_rate_hertz: int = 16000, **config: Any
) -> Request:
    return Request(
        streaming_config=asr_pb2.StreamingRecognitionConfig(
            config=asr_pb2.RecognitionConfig(
                encoding=encoding,  # type: ignore[arg-type]
                sample_rate_hertz=sample_rate_hertz,
                **config,
            )
        )
    )


def audio_requests(data: bytes, chunk_bytes: int = 640) -> list[Request]:
    return [Request(audio_content=data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]


async def paced(data: bytes, interim: bool = True, **config_fields: Any) -> AsyncIterator[Request]:
    """A live call: the config (interim results as asked, RecognitionConfig fields as given), then 100 ms
    of audio every 100 ms."""
    config = config_request(**config_fields)
    config.streaming_config.interim_results = interim
    yield config
    start = time.monotonic()
    for n, request in enumerate(audio_requests(data, 3200)):
        await asyncio.sleep(max(0.0, start + n * 0.1 - time.monotonic()))
        yield request


async def _write(call: Any, request: Request) -> bool:
    """False once the call has ended (its status then tells why)."""
    if call.done():
        return False
    core = getattr(call, "_cython_call", None)
    try:
        if core is not None and hasattr(core, "send_serialized_message"):
            await core.send_serialized_message(request.SerializeToString())
        else:
            await call.write(request)
    except (_CORE_ERROR, asyncio.InvalidStateError):
        return False
    return True


async def run_stream(
    channel: aio.Channel,
    requests: Iterable[Request] | AsyncIterable[Request],
    *,
    metadata: tuple[tuple[str, str], ...] = (),
    deadline_s: float | None = 120.0,
    half_close: bool = True,
    on_response: Callable[[Response], None] | None = None,
) -> Outcome:
    """Send `requests` (then half-close), read every response; the server's status, never an exception."""
    call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(metadata=metadata, timeout=deadline_s)
    out = Outcome(grpc.StatusCode.UNKNOWN, "")

    async def read() -> None:
        async for response in call:
            out.responses.append(response)
            if on_response is not None:
                on_response(response)

    reader = asyncio.create_task(read())
    try:
        sent_all = True
        if isinstance(requests, AsyncIterable):
            async for request in requests:
                if not await _write(call, request):
                    sent_all = False
                    break
        else:
            for request in requests:
                if not await _write(call, request):
                    sent_all = False
                    break
        out.sent_all = sent_all
        if sent_all and half_close:
            with contextlib.suppress(asyncio.InvalidStateError, _CORE_ERROR):
                await call.done_writing()
        try:
            # the deadline (gRPC's own) ends the call; a bound here only for calls without one
            await asyncio.wait_for(reader, None if deadline_s else STATUS_WAIT_S)
        except aio.AioRpcError:
            pass  # the status is read below
        except TimeoutError:
            call.cancel()  # a call that never ends shows as CANCELLED rather than a hung test
    except BaseException:
        call.cancel()
        raise
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, aio.AioRpcError):
                await reader
    out.code = await call.code()
    out.details = await call.details() or ""
    out.ended_at = time.monotonic()
    return out


# --- a well-formed stream that runs beside a misbehaving one ---

GOOD_SENTENCES = (
    "The technician will visit your home on Thursday afternoon.",
    "Thank you for calling, how can I help you today?",
)
GOOD_WER_BOUND = 0.2  # tiny.en gets both sentences word for word (measured 0.0); 4 of 19 words of slack


@functools.cache
def good_phases() -> tuple[bytes, bytes]:
    """The two sentences of the good stream as LINEAR16 16 kHz, each followed by 0.8 s of silence."""
    from tests.support.audio import make_conversation, to_linear16_bytes

    first, _ = make_conversation([GOOD_SENTENCES[0]], pause_s=0.8, lead_s=0.3)
    second, _ = make_conversation([GOOD_SENTENCES[1]], pause_s=0.8, lead_s=0.0)
    return to_linear16_bytes(first), to_linear16_bytes(second)


def good_stream_seconds() -> float:
    return sum(len(p) for p in good_phases()) / 2 / 16000


async def alongside_good_stream(target: str, bad: Callable[[], Awaitable[T]]) -> T:
    """Run `bad()` while a well-formed stream is open on its own connection, mid-call: its first sentence
    sent (and on its way through the engine), its second held back until `bad()` is over. Asserts the good
    stream was untouched (both finals, right words, OK), and returns what `bad()` returned."""
    first, second = good_phases()
    first_sent, bad_done, first_final = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def requests() -> AsyncIterator[Request]:
        yield config_request()
        for r in audio_requests(first, 3200):
            yield r
        first_sent.set()
        await bad_done.wait()
        # the first final first: then the second sentence never waits behind it (buffer limits stay clear)
        await asyncio.wait_for(first_final.wait(), 60)
        for r in audio_requests(second, 3200):
            yield r

    def seen(response: Response) -> None:
        if any(r.is_final for r in response.results):
            first_final.set()

    async with aio.insecure_channel(target) as channel:
        good = asyncio.create_task(run_stream(channel, requests(), on_response=seen))
        await asyncio.wait_for(first_sent.wait(), 30)
        try:
            result = await bad()
        finally:
            bad_done.set()
        outcome = await good
    assert outcome.code == grpc.StatusCode.OK, f"the good stream beside was harmed: {outcome}"
    assert [r.utterance_index for r in outcome.finals] == [0, 1], outcome.finals
    hypotheses = [r.alternatives[0].transcript for r in outcome.finals]
    assert corpus_wer(list(GOOD_SENTENCES), hypotheses) <= GOOD_WER_BOUND, hypotheses
    return result


class GoodStreamThread:
    """One well-formed stream kept open for a whole test module, on its own thread, loop and connection.

    Each `beside(bad)` speaks one sentence into it, runs `bad()` while that speech waits in the stream
    for its end, then sends the pause and checks that exactly the next final arrives with the right words.
    `close()` half-closes and checks the stream ends OK with one final per sentence, none twice.
    """

    SENTENCES = (
        *GOOD_SENTENCES,
        "I would like to check the status of my order.",
        "The payment will be taken on the first of next month.",
        "Great, thank you very much for your help.",
    )

    def __init__(self, target: str) -> None:
        from tests.support.audio import make_conversation, silence, to_linear16_bytes

        self.target = target
        self._speech = []
        for sentence in self.SENTENCES:
            audio, _ = make_conversation([sentence], pause_s=0.0, lead_s=0.3)
            self._speech.append(to_linear16_bytes(audio))
        self._pause = to_linear16_bytes(silence(0.8))
        self.spoken: list[str] = []
        self.finals: list[asr_pb2.StreamingRecognitionResult] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="good-stream", daemon=True)
        self._thread.start()
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._new_final: asyncio.Event | None = None
        self._run(self._open())

    def _run(self, coro: Awaitable[T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    async def _open(self) -> None:
        self._channel = aio.insecure_channel(self.target)
        self._call = asr_pb2_grpc.RecognizerStub(self._channel).StreamingRecognize(timeout=3600)
        self._new_final = asyncio.Event()

        async def read() -> None:
            async for response in self._call:
                for r in response.results:
                    if r.is_final:
                        self.finals.append(r)
                        assert self._new_final is not None
                        self._new_final.set()

        self._reader = asyncio.create_task(read())
        assert await _write(self._call, config_request())

    async def _send(self, data: bytes) -> None:
        for r in audio_requests(data, 3200):
            assert await _write(self._call, r), "the good stream ended early"

    async def _await_final(self, count: int) -> None:
        assert self._new_final is not None
        async with asyncio.timeout(60):
            while len(self.finals) < count:
                if self._reader is not None and self._reader.done():
                    self._reader.result()  # raises the stream's error
                    raise AssertionError("the good stream ended early")
                self._new_final.clear()
                await self._new_final.wait()

    async def beside(self, bad: Callable[[], Awaitable[T]]) -> T:
        """Call from any event loop (the test's)."""
        index = len(self.spoken)
        sentence = self.SENTENCES[index % len(self.SENTENCES)]
        await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._send(self._speech[index % len(self._speech)]), self.loop)
        )
        self.spoken.append(sentence)
        try:
            result = await bad()
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._send(self._pause), self.loop))
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._await_final(index + 1), self.loop)
            )
        final = self.finals[index]
        assert final.utterance_index == index, final
        hypothesis = final.alternatives[0].transcript
        print(f"good stream beside: {hypothesis!r}")
        assert corpus_wer([sentence], [hypothesis]) <= GOOD_WER_BOUND, (sentence, hypothesis)
        return result

    async def _talk(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            index = len(self.spoken)
            data = self._speech[index % len(self._speech)] + self._pause
            start = time.monotonic()
            for n, r in enumerate(audio_requests(data, 3200)):  # 100 ms per request, at the pace of speech
                await asyncio.sleep(max(0.0, start + n * 0.1 - time.monotonic()))
                assert await _write(self._call, r), "the good stream ended early"
            self.spoken.append(self.SENTENCES[index % len(self.SENTENCES)])

    def talk(self) -> Callable[[], None]:
        """Speak sentence after sentence at the pace of a live call until the returned function is called;
        that function checks every sentence got its one final, word for word."""
        stop = asyncio.Event()
        first = len(self.spoken)
        talking = asyncio.run_coroutine_threadsafe(self._talk(stop), self.loop)

        def done() -> None:
            self.loop.call_soon_threadsafe(stop.set)
            talking.result(120)
            self._run(self._await_final(len(self.spoken)))
            assert len(self.spoken) > first, "the good stream never finished a sentence"
            for sentence, final in zip(self.spoken[first:], self.finals[first:], strict=True):
                hypothesis = final.alternatives[0].transcript
                assert corpus_wer([sentence], [hypothesis]) <= GOOD_WER_BOUND, (sentence, hypothesis)

        return done

    async def _close(self) -> tuple[grpc.StatusCode, str]:
        with contextlib.suppress(asyncio.InvalidStateError, _CORE_ERROR):
            await self._call.done_writing()
        assert self._reader is not None
        with contextlib.suppress(aio.AioRpcError):
            await asyncio.wait_for(self._reader, 60)
        code, details = await self._call.code(), await self._call.details()
        await self._channel.close()
        return code, details or ""

    def close(self) -> None:
        try:
            code, details = self._run(self._close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        assert code == grpc.StatusCode.OK, (code, details)
        assert [r.utterance_index for r in self.finals] == list(range(len(self.spoken))), self.finals


class OpenStream:
    """A stream driven step by step: open, send audio when the test says, learn the server's stream id
    (its `asr-stream-id` header), then half-close and collect the outcome."""

    def __init__(
        self,
        channel: aio.Channel,
        *,
        deadline_s: float | None = 120.0,
        config: Request | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ):
        self.call = asr_pb2_grpc.RecognizerStub(channel).StreamingRecognize(
            timeout=deadline_s, metadata=metadata
        )
        self.deadline_s = deadline_s
        self.responses: list[Response] = []
        self._config = config or config_request()
        self._reader: asyncio.Task[None] | None = None

    async def open(self) -> str:
        """Send the config; returns the stream id the server gave it ("" if refused)."""

        async def read() -> None:
            async for response in self.call:
                self.responses.append(response)

        self._reader = asyncio.create_task(read())
        await _write(self.call, self._config)
        headers = await self.call.initial_metadata()
        return next((str(v) for k, v in headers or () if k == "asr-stream-id"), "")

    async def send(self, data: bytes, chunk_bytes: int = 3200) -> bool:
        for r in audio_requests(data, chunk_bytes):
            if not await _write(self.call, r):
                return False
        return True

    async def finish(self, half_close: bool = True) -> Outcome:
        if half_close:
            with contextlib.suppress(asyncio.InvalidStateError, _CORE_ERROR):
                await self.call.done_writing()
        assert self._reader is not None
        try:
            await asyncio.wait_for(self._reader, None if self.deadline_s else STATUS_WAIT_S)
        except aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # the test cancelled the call itself: its status is CANCELLED
        except TimeoutError:
            self.call.cancel()
        code, details = await self.call.code(), await self.call.details()
        return Outcome(code, details or "", self.responses, ended_at=time.monotonic())
