"""The size bound of one streaming request, checked on its serialized bytes before it is parsed.

gRPC's receive limit is one number for every method, and a Recognize request carries a whole recording
(--max-recognize-bytes, 64 MiB), so a streaming request could be that large too and was parsed (a copy,
and seconds of CPU for a 48 MiB phrase list) before any door checked its chunk (--max-chunk-bytes). Here
each request-streaming method's deserializer first looks at the length: one past the bound is not parsed,
and the door's request iterator raises RecognitionError INVALID_ARGUMENT in its place, which every door
answers in its own protocol's terms as it answers an oversized chunk.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from service import metrics
from service.doors.shared.grpc_interceptor import HandlerInterceptor
from service.vocabulary.errors import Code, RecognitionError

# Beside the audio, what one streaming request may carry: the first request's config (phrase hints
# included: at most MAX_PHRASES_READ of them) or a keyterm update.
CONFIG_SLACK_BYTES = 256 << 10


@dataclass(frozen=True)
class _Oversized:
    size: int


class StreamMessageLimit(HandlerInterceptor):
    """Refuses, unparsed, a streaming request longer than `max_chunk_bytes` + CONFIG_SLACK_BYTES."""

    def __init__(self, max_chunk_bytes: int) -> None:
        self.limit = max_chunk_bytes + CONFIG_SLACK_BYTES

    def intercept_handler(
        self, handler: grpc.RpcMethodHandler, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if not handler.request_streaming:
            return handler
        parse = handler.request_deserializer
        limit = self.limit

        def deserialize(raw: bytes) -> Any:
            if len(raw) > limit:
                return _Oversized(len(raw))
            return parse(raw) if parse is not None else raw

        kwargs = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            assert handler.stream_stream is not None
            return grpc.stream_stream_rpc_method_handler(self._streaming(handler.stream_stream), **kwargs)
        assert handler.stream_unary is not None
        return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary), **kwargs)

    def _checked(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        limit = self.limit

        async def checked() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, _Oversized):
                    metrics.refused("max_chunk_bytes")
                    raise RecognitionError(
                        Code.INVALID_ARGUMENT,
                        f"audio_content: a streaming request of {request.size} bytes is over the limit of "
                        f"{limit} bytes (max_chunk_bytes and 256 KiB for the config); send smaller chunks",
                        "audio_content",
                    )
                yield request

        return checked()

    def _streaming(self, behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        async def streaming(requests: AsyncIterator[Any], context: aio.ServicerContext) -> AsyncIterator[Any]:
            result = behavior(self._checked(requests), context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            elif inspect.isawaitable(result):
                await result  # the handler writes with context.write

        return streaming

    def _unary(self, behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def unary(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
            result = behavior(self._checked(requests), context)
            return await result if inspect.isawaitable(result) else result

        return unary
