"""What the gRPC port's interceptors (auth, the streaming message limit, call metrics) do the same way:
look at the method's handler, and wrap or replace it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from grpc import aio


class HandlerInterceptor(aio.ServerInterceptor):
    """An interceptor that sees the handler of a known method; an unknown one (no handler) goes on as it
    is, for gRPC to answer UNIMPLEMENTED itself."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return self.intercept_handler(handler, handler_call_details)

    def intercept_handler(
        self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        """The handler the call gets instead of `handler` (or `handler` itself)."""
        raise NotImplementedError
