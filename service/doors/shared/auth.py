"""Bearer-token authentication: a grpc.aio server interceptor and the token set it checks against.

Tokens come from a file (one per line; blank lines and `#` comments ignored) and/or the environment
variable ASR_AUTH_TOKENS (comma-separated). The file is re-read whenever its mtime, size or inode
changes, so rotating a Kubernetes Secret needs no restart. Every token is compared with
`hmac.compare_digest`, and every configured token is always tried, so the time a check takes says
nothing about how much of a guess was right. Tokens never go into logs.

Health checks stay open by default (kubelet gRPC probes send no metadata); reflection is protected
like the Recognizer (it describes the API to whoever asks; grpcurl passes the token with -H).

A refused call is ended without reading any of its request (`Refusal`): an unauthenticated client can
make the server take in no more than the transport's HTTP/2 window, not a 64 MiB Recognize message.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from service.doors.shared.grpc_interceptor import HandlerInterceptor
from service.vocabulary.types import Identity

log = logging.getLogger("service.doors.shared.auth")

ENV_VAR = "ASR_AUTH_TOKENS"
# What a token may be: visible ASCII, no spaces (what gRPC metadata and an HTTP header can carry as-is;
# RFC 6750's b64token is a subset)
TOKEN_SYNTAX = re.compile(r"[\x21-\x7e]+")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
STREAM_REFUSAL_GRACE_S = 0.25
REFUSAL_LOG_INTERVAL_S = 10.0  # a client retrying with a bad token must not flood the logs


class AuthConfigError(ValueError):
    """The token file cannot be used at start-up (the server refuses to start)."""


def parse_token_file(text: str) -> list[str]:
    tokens = []
    for line in text.splitlines():
        token = line.split("#", 1)[0].strip()
        if token:
            tokens.append(token)
    return tokens


def parse_env_tokens(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def _sendable(tokens: list[str], source: str) -> list[str]:
    """The tokens a client can send (TOKEN_SYNTAX); the others are dropped, with a warning that does not
    show them."""
    kept = [t for t in tokens if TOKEN_SYNTAX.fullmatch(t)]
    if len(kept) < len(tokens):
        log.warning(
            "auth tokens ignored: not visible ASCII, so no client can send them",
            extra={"fields": {"source": source, "ignored": len(tokens) - len(kept)}},
        )
    return kept


class TokenStore:
    """The accepted tokens: the env var's (fixed for the process) plus the file's (re-read on change)."""

    def __init__(self, path: str = "", env_value: str = "") -> None:
        self.path = Path(path) if path else None
        self._env = [t.encode() for t in _sendable(parse_env_tokens(env_value), ENV_VAR)]
        self._file: list[bytes] = []
        self._stamp: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        if self.path is not None:
            try:
                self._reload(self._stat())
            except OSError as e:
                raise AuthConfigError(f"--auth-tokens-file {str(self.path)!r}: cannot read it ({e})") from e

    @property
    def enabled(self) -> bool:
        """Authentication is on when any source of tokens was configured (even if it is empty now:
        an emptied file locks everyone out rather than letting everyone in)."""
        return self.path is not None or bool(self._env)

    def _stat(self) -> tuple[int, int, int]:
        assert self.path is not None
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload(self, stamp: tuple[int, int, int]) -> None:
        assert self.path is not None
        text = self.path.read_text(encoding="utf-8")
        tokens = [t.encode() for t in _sendable(parse_token_file(text), str(self.path))]
        with self._lock:
            self._file, self._stamp = tokens, stamp
        log.info("auth tokens loaded", extra={"fields": {"file": str(self.path), "tokens": len(tokens)}})

    def _refresh(self) -> None:
        if self.path is None:
            return
        try:
            stamp = self._stat()
            if stamp != self._stamp:
                self._reload(stamp)
        except OSError as e:
            # Mid-rotation (a Secret's symlink swap) or a mistake: keep the tokens we had, say so.
            log.warning(
                "auth tokens file unreadable; keeping the previous tokens",
                extra={"fields": {"file": str(self.path), "error": str(e)}},
            )

    def tokens(self) -> list[bytes]:
        self._refresh()
        with self._lock:
            return self._env + self._file

    def check(self, token: str) -> bool:
        given = token.encode()
        ok = False
        for known in self.tokens():
            ok |= hmac.compare_digest(known, given)  # no early exit: timing says nothing
        return ok


def bearer_token(metadata: Any) -> str | None:
    """The token of the `authorization: Bearer <token>` entry; "" if the header is malformed (another
    scheme, no token, or a token that is not one run of visible ASCII: a space, a control character, a byte
    that is not UTF-8 — aiohttp hands those on as surrogates), None if there is none."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        return token if scheme.lower() == "bearer" and TOKEN_SYNTAX.fullmatch(token) else ""
    return None


def identity(token: str | None, peer: str = "") -> Identity:
    """Who presented `token`, for the core's logs: a fingerprint of it (never the token itself), or
    anonymous without one; every door names its caller this way."""
    if not token:
        return Identity(peer=peer)
    return Identity("token-" + hashlib.sha256(token.encode()).hexdigest()[:12], peer)


@dataclass(frozen=True)
class Refusal(grpc.RpcMethodHandler):
    """A handler that ends a call UNAUTHENTICATED without reading any request message.

    grpc.aio runs the interceptors first, then reads a unary request whole (up to
    grpc.max_receive_message_length: 64 MiB for Recognize) before it calls a unary handler; a
    streaming-request handler is called at once and nothing is read until it asks. So a refusal is
    always built as one (the wire is the same for every method shape: trailers only), and `method_shape`
    keeps the refused method's own (request_streaming, response_streaming) for the metrics' labels.
    The client can send no more than HTTP/2 flow control's windows before the status reaches it."""

    stream_unary: Callable[..., Awaitable[Any]]
    request_deserializer: Callable[[bytes], Any] | None
    response_serializer: Callable[[Any], bytes] | None
    method_shape: tuple[bool, bool]
    request_streaming: bool = True
    response_streaming: bool = False
    unary_unary: None = None
    unary_stream: None = None
    stream_stream: None = None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> Refusal:
    streaming_in = handler.request_streaming

    async def deny(requests: Any, context: aio.ServicerContext) -> Any:
        if streaming_in:
            # A grpc.aio client turns a status that reaches it while its write is pending into INTERNAL
            # (grpc/grpc#36066), which would hide why it was refused: let its first write complete.
            # Waiting, not reading: reading would take in the whole first message (up to 64 MiB).
            await asyncio.sleep(STREAM_REFUSAL_GRACE_S)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return Refusal(
        deny,
        handler.request_deserializer,
        handler.response_serializer,
        (handler.request_streaming, handler.response_streaming),
    )


class AuthInterceptor(HandlerInterceptor):
    """Lets a call through only with a known bearer token (health exempt when `health_open`)."""

    def __init__(self, store: TokenStore, *, health_open: bool = True) -> None:
        self.store = store
        self.health_open = health_open
        self._last_log = -REFUSAL_LOG_INTERVAL_S
        self._unlogged = 0

    def refusal(self, method: str, metadata: Any) -> str | None:
        """Why this call is refused, or None if it may go on."""
        if self.health_open and method.startswith(HEALTH_PREFIX):
            return None
        token = bearer_token(metadata)
        if token is None:
            return "missing credentials: send the metadata 'authorization: Bearer <token>'"
        if not token:
            return "malformed authorization metadata: expected 'Bearer <token>'"
        if not self.store.check(token):
            return "invalid bearer token"
        return None

    def intercept_handler(
        self, handler: grpc.RpcMethodHandler, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        reason = self.refusal(method, handler_call_details.invocation_metadata)
        if reason is None:
            return handler
        self._log_refusal(method, reason)
        return _refusal(handler, reason)

    def _log_refusal(self, method: str, reason: str) -> None:
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log < REFUSAL_LOG_INTERVAL_S:
            return
        log.warning(
            "unauthenticated calls refused",
            extra={"fields": {"method": method, "reason": reason, "refused": self._unlogged}},
        )
        self._last_log, self._unlogged = now, 0


def read_secret(path: str, env: str) -> str:
    """A credential from the file at `path` (a mounted Kubernetes Secret), else from the environment
    variable `env` (a Secret as env); "" when neither is set."""
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(env, "").strip()
