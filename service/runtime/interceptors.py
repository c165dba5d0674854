"""A grpc.aio server interceptor for the standard grpc_server_* metrics.

py-grpc-prometheus only knows the threaded server, so this wraps each aio handler instead: it counts
the call when it starts, every message each way, the handling time, and the final status code
(from `context.abort`, `context.set_code`, a client cancel, or an uncaught exception -> UNKNOWN).

Messages are counted in the call's own integers and added to the Prometheus counters every
FLUSH_MESSAGES messages and when the call ends: in multiprocess mode every counter write is a lock and
an mmap write, which per 20 ms audio chunk was a measurable share of a frontend's CPU.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio

from service import metrics
from service.doors.shared.auth import Refusal
from service.doors.shared.grpc_interceptor import HandlerInterceptor

# Messages a call counts before it adds them to grpc_server_msg_{received,sent}_total: about a second of
# 20 ms audio chunks, so a long stream's counters still move while it runs.
FLUSH_MESSAGES = 64

_TYPES = {
    (False, False): "unary",
    (False, True): "server_stream",
    (True, False): "client_stream",
    (True, True): "bidi_stream",
}


def _split(full_method: str) -> tuple[str, str]:
    # "/asr.v1.Recognizer/StreamingRecognize" -> ("asr.v1.Recognizer", "StreamingRecognize")
    _, service, method = full_method.split("/", 2)
    return service, method


def _code_name(context: aio.ServicerContext, default: grpc.StatusCode) -> str:
    code = context.code()
    if code is None:
        return default.name
    if isinstance(code, grpc.StatusCode):
        return code.name
    # the Cython context may hand back the raw integer
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return default.name


class CallMetrics:
    """Bookkeeping for one RPC: labels, start time, message counts (flushed in batches)."""

    def __init__(self, grpc_type: str, service: str, method: str) -> None:
        self.labels = (grpc_type, service, method)
        self.start = time.perf_counter()
        self._received = metrics.GRPC_MSG_RECEIVED.labels(*self.labels)
        self._sent = metrics.GRPC_MSG_SENT.labels(*self.labels)
        self.received = 0  # messages not yet added to the counters
        self.sent = 0
        metrics.GRPC_STARTED.labels(*self.labels).inc()

    @classmethod
    def begin(
        cls, labels: tuple[str, str, str], request_streaming: bool, request_or_iterator: Any
    ) -> tuple[CallMetrics, Any]:
        """A call's bookkeeping, begun: a streaming call's requests counted as they are read (the
        iterator returned stands for the one given), a unary call's one request at once."""
        call = cls(*labels)
        if request_streaming:
            return call, call.count_requests(request_or_iterator)
        call.count_received()
        return call, request_or_iterator

    def count_received(self) -> None:
        self.received += 1
        if self.received >= FLUSH_MESSAGES:
            self.flush()

    def count_sent(self) -> None:
        self.sent += 1
        if self.sent >= FLUSH_MESSAGES:
            self.flush()

    def flush(self) -> None:
        if self.received:
            self._received.inc(self.received)
            self.received = 0
        if self.sent:
            self._sent.inc(self.sent)
            self.sent = 0

    def finish(self, code: str) -> None:
        self.flush()
        metrics.GRPC_HANDLED.labels(*self.labels, code).inc()
        metrics.GRPC_HANDLING_SECONDS.labels(*self.labels).observe(time.perf_counter() - self.start)

    def finish_from(self, context: aio.ServicerContext, exc: BaseException | None) -> None:
        if exc is None:
            self.finish(_code_name(context, grpc.StatusCode.OK))
        elif isinstance(exc, aio.AbortError):
            self.finish(_code_name(context, grpc.StatusCode.UNKNOWN))
        elif isinstance(exc, asyncio.CancelledError):
            self.finish(grpc.StatusCode.CANCELLED.name)
        elif isinstance(exc, GeneratorExit):
            # gRPC ended the RPC (client cancel, deadline) while the handler was parked at `yield`, and
            # the generator was closed later: the client's doing, not a server error.
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            self.finish((grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED).name)
        else:
            self.finish(grpc.StatusCode.UNKNOWN.name)

    async def count_requests(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            self.count_received()
            yield request


class _CountingContext:
    """The handler's context, with `write` counted (health's Watch sends that way). The Cython
    context's attributes are read-only, hence a proxy rather than a patch."""

    def __init__(self, context: aio.ServicerContext, call: CallMetrics) -> None:
        self._context = context
        self._call = call

    async def write(self, message: Any) -> None:
        await self._context.write(message)
        self._call.count_sent()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _wrap(
    behavior: Callable[..., Any] | None,
    shape: tuple[bool, bool],
    grpc_type: str,
    service: str,
    method: str,
) -> Callable[..., Any]:
    """`behavior` counted; `shape` is the handler's (request_streaming, response_streaming), `grpc_type`
    the method's label (they differ for an auth refusal, which reads no request whatever the method)."""
    assert behavior is not None, "the handler lacks the behavior its streaming flags promise"
    request_streaming, response_streaming = shape
    labels = (grpc_type, service, method)

    if response_streaming:

        async def streaming(request_or_iterator: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            call, request_or_iterator = CallMetrics.begin(labels, request_streaming, request_or_iterator)
            exc: BaseException | None = None
            try:
                result = behavior(request_or_iterator, _CountingContext(context, call))
                if inspect.isasyncgen(result):
                    async for response in result:
                        yield response
                        call.count_sent()
                elif inspect.isawaitable(result):
                    await result  # the handler writes with context.write
            except BaseException as e:
                exc = e
                raise
            finally:
                call.finish_from(context, exc)

        return streaming

    async def unary(request_or_iterator: Any, context: aio.ServicerContext) -> Any:
        call, request_or_iterator = CallMetrics.begin(labels, request_streaming, request_or_iterator)
        exc: BaseException | None = None
        try:
            result = behavior(request_or_iterator, context)
            response = await result if inspect.isawaitable(result) else result
            if response is not None:
                call.count_sent()
            return response
        except BaseException as e:
            exc = e
            raise
        finally:
            call.finish_from(context, exc)

    return unary


class MetricsInterceptor(HandlerInterceptor):
    def intercept_handler(
        self, handler: grpc.RpcMethodHandler, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        service, method = _split(handler_call_details.method)
        shape = (handler.request_streaming, handler.response_streaming)
        grpc_type = _TYPES[handler.method_shape if isinstance(handler, Refusal) else shape]
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        labels = (grpc_type, service, method)
        if shape == (False, False):
            return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, shape, *labels), **kwargs)
        if shape == (False, True):
            return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream, shape, *labels), **kwargs)
        if shape == (True, False):
            return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary, shape, *labels), **kwargs)
        return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream, shape, *labels), **kwargs)
