"""The HTTP port (--http-port): one aiohttp application in the gRPC server's event loop, which every HTTP
and WebSocket door registers its routes on (service/doors/openai_http.py `register`).

What is the port's and not a door's lives here: binding (every interface, IPv4 too; SO_REUSEPORT across
asr-server's frontends), TLS with the gRPC port's certificate (and mutual TLS), the request counter
(asr_http_requests_total{code}), a JSON answer for a path or method no door serves, the bound on open
connections (--http-max-connections), and the stop with a grace for requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from service import metrics
from service.config import ServerConfig
from service.doors.shared.http_body import BODY_OVERHEAD_BYTES

log = logging.getLogger("service.runtime.http_server")


def _over_cap_response(cap: int) -> bytes:
    """The whole HTTP answer to a connection past --http-max-connections, in OpenAI's error shape."""
    body = json.dumps(
        {
            "error": {
                "message": f"this server process holds its limit of {cap} HTTP connections "
                "(http_max_connections); retry, or reuse a connection",
                "type": "server_error",
                "param": None,
                "code": "http_max_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpServer:
    """The aiohttp application and its site, bound to `config.host:config.http_port`."""

    def __init__(self, config: ServerConfig, *, reuse_port: bool = False) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.port = 0
        self._runner: web.AppRunner | None = None
        self.app = web.Application(
            middlewares=[self._count, self._unrouted],
            client_max_size=config.max_recognize_bytes + BODY_OVERHEAD_BYTES,
        )

    async def start(self) -> int:
        # handler_cancellation: a client that hangs up cancels its recognition (the engine frees its slots)
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            # aiohttp's keep-alive timer also runs while a request head is incomplete: the header timeout
            keepalive_timeout=self.config.http_idle_timeout,
        )
        await self._runner.setup()
        self._cap_connections(self._runner.server)
        host: str | None = self.config.host.strip("[]")
        if host in ("", "::", "0.0.0.0"):
            # Every interface, IPv4 too: asyncio binds "::" IPv6-only (IPV6_V6ONLY), so a pod's IPv4
            # address would never reach the doors; None makes one socket per address family.
            host = None
        # asr-server's frontend processes share the port (SO_REUSEPORT), as they share the gRPC port;
        # the supervisor checked it was free first (service/runtime/supervisor.py reserve_port).
        site = web.TCPSite(
            self._runner, host, self.config.http_port, ssl_context=self._ssl(), reuse_port=self.reuse_port
        )
        await site.start()
        self.port = self.config.http_port  # never 0 here: 0 turns the port off
        paths = sorted({r.resource.canonical for r in self.app.router.routes() if r.resource is not None})
        log.info(
            "HTTP listening",
            extra={"fields": {"port": self.port, "paths": paths, "tls": site.name.startswith("https")}},
        )
        return self.port

    def _cap_connections(self, server: web.Server | None) -> None:
        """--http-max-connections: aiohttp has no bound of its own, so its server's hook for each new
        connection answers one past the cap 503 and closes it, before anything of it is read."""
        cap = self.config.http_max_connections
        if server is None or cap <= 0:
            return
        admit = server.connection_made

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            admit(handler, transport)
            if len(server.connections) > cap:
                # counted before the answer leaves: a client that reads it may look at the count at once
                metrics.HTTP_REQUESTS.labels("503").inc()
                transport.write(_over_cap_response(cap))
                transport.close()

        server.connection_made = connection_made  # type: ignore[method-assign]

    def _ssl(self) -> ssl.SSLContext | None:
        """HTTPS with the gRPC port's certificate (and client CA: mutual TLS) when TLS is configured."""
        c = self.config
        if not c.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(c.tls_cert, c.tls_key)
        if c.tls_client_ca:
            context.load_verify_locations(c.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    async def stop(self, grace: float) -> None:
        """Stop listening; requests still running after `grace` seconds are cancelled."""
        if self._runner is not None:
            # aiohttp reads it at cleanup; it takes 0 as "no limit", so a grace of 0 becomes 1 ms
            self._runner._shutdown_timeout = max(grace, 0.001)
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            metrics.HTTP_REQUESTS.labels(str(status)).inc()

    @web.middleware
    async def _unrouted(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A path no door serves (404) or a method it does not take (405), as JSON: the error shape of
        OpenAI's API, which most HTTP clients of speech services read."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            body = {
                "error": {
                    "message": f"{request.method} {request.path}: {e.reason}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
            return web.json_response(body, status=e.status)
