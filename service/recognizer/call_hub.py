"""Where a telephony call's transcripts go besides its own door: subscribers that follow it by call id.

A stream that carries a call (StreamSettings.call: the telephony doors set it) publishes `call_started`,
each result as `transcript`, and `call_ended` here (service/recognizer/recognizer.py); subscribers
(service/doors/call_transcripts.py) follow one call id, or every call with EVERY_CALL, and may subscribe
before the call starts. Publishing never waits: a subscriber whose backlog is full is ended
(SubscriberLagged) and the call goes on as if it were not there.

`CallHub` serves one process. Under asr-server a call's socket and its subscriber may land on different
frontend processes (SO_REUSEPORT), so each frontend's `ZmqCallHub` publishes through the supervisor's
ZeroMQ forwarder (`CallHubForwarder`: XSUB in, XPUB out) and hears every call its subscribers follow from
it, its own included, in the order each publisher sent them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger("service.recognizer.call_hub")

EVERY_CALL = ""  # subscribe to every call
# a platform's call id as a door takes it from its client: Twilio's CA + 32 hex, a UUID, a SIP Call-ID
CALL_ID_SYNTAX = re.compile(r"[\x21-\x7e]{1,256}")
DEFAULT_BACKLOG = 1024  # messages one subscriber may have waiting before it is ended
_PROBE = "_probe"  # a ZmqCallHub's own message: its subscription has reached the forwarder
_PROBE_EVERY_S = 0.05
_SUBSCRIBE_WITHIN_S = 5.0


class SubscriberLagged(Exception):
    """The subscriber took its messages too slowly: more than its backlog waited."""


class Subscription:
    """One subscriber's messages, in order; iterate it. Ends after `call_ended` of a followed call, when
    the hub closes, or raises SubscriberLagged."""

    def __init__(self, call_id: str, backlog: int) -> None:
        self.call_id = call_id
        self.backlog = backlog
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.lagged = False

    def deliver(self, message: dict[str, Any] | None) -> None:
        if self.lagged:
            return
        if message is not None and self._queue.qsize() >= self.backlog:
            self.lagged = True
            message = None
        self._queue.put_nowait(message)

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            message = await self._queue.get()
            if message is None:
                if self.lagged:
                    raise SubscriberLagged(f"more than {self.backlog} messages waited for this subscriber")
                return
            yield message
            if message.get("type") == "call_ended" and self.call_id != EVERY_CALL:
                return


class CallHub:
    """Subscribers of this process, by call id. Every method is called from the event loop."""

    def __init__(self, backlog: int = DEFAULT_BACKLOG) -> None:
        self.backlog = backlog
        self._subscribers: dict[str, set[Subscription]] = {}
        self.closed = False
        # called with each message this process publishes (runtime/call_webhook.py posts them)
        self._taps: list[Callable[[dict[str, Any]], None]] = []

    def tap(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener` with every message this process publishes (not those of other frontends)."""
        self._taps.append(listener)

    def _tapped(self, message: dict[str, Any]) -> None:
        for listener in self._taps:
            listener(message)

    def publish(self, call_id: str, message: dict[str, Any]) -> None:
        """Send `message` (JSON-able, its "call_id" set) to the call's subscribers; never waits."""
        self._tapped(message)
        self._deliver(call_id, message)

    def _deliver(self, call_id: str, message: dict[str, Any]) -> None:
        for key in (call_id, EVERY_CALL):
            for subscription in tuple(self._subscribers.get(key, ())):
                subscription.deliver(message)

    @contextlib.asynccontextmanager
    async def subscribe(self, call_id: str) -> AsyncIterator[Subscription]:
        """Follow `call_id` (EVERY_CALL: all) from now on: the call's messages published once this has
        entered reach the subscription."""
        subscription = Subscription(call_id, self.backlog)
        if self.closed:
            subscription.deliver(None)
        self._subscribers.setdefault(call_id, set()).add(subscription)
        try:
            await self._subscribed(call_id, first=len(self._subscribers[call_id]) == 1)
            yield subscription
        finally:
            followers = self._subscribers.get(call_id, set())
            followers.discard(subscription)
            if not followers:
                self._subscribers.pop(call_id, None)
                self._unsubscribed(call_id)

    async def _subscribed(self, call_id: str, first: bool) -> None:
        """A subscription was added (`first`: the first for this id)."""

    def _unsubscribed(self, call_id: str) -> None:
        """The last subscription for this id went."""

    async def close(self) -> None:
        """End every subscription (after what was published); later subscriptions end at once."""
        self.closed = True
        for followers in self._subscribers.values():
            for subscription in followers:
                subscription.deliver(None)


def _topic(call_id: str) -> bytes:
    # the NUL ends the id: a subscription to "CA1" must not match "CA12" (ZeroMQ matches prefixes)
    return call_id.encode() + b"\0" if call_id != EVERY_CALL else b""


@dataclass(frozen=True)
class HubAddresses:
    """The forwarder's ends: publishers connect to `publish`, subscribers to `subscribe`."""

    publish: str
    subscribe: str


class ZmqCallHub(CallHub):
    """A frontend's hub under asr-server: messages go out through the supervisor's forwarder and come
    back to whichever frontend's subscribers follow the call."""

    def __init__(self, addresses: HubAddresses, backlog: int = DEFAULT_BACKLOG) -> None:
        super().__init__(backlog)
        self._context = zmq.asyncio.Context()
        self._out = self._context.socket(zmq.PUB)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(addresses.publish)
        self._in = self._context.socket(zmq.SUB)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.connect(addresses.subscribe)
        self._probes: dict[str, asyncio.Event] = {}
        self._reader: asyncio.Task[None] | None = None

    def publish(self, call_id: str, message: dict[str, Any]) -> None:
        if message.get("type") != _PROBE:
            self._tapped(message)
        # PUB never blocks: past its high-water mark ZeroMQ drops (a forwarder that is gone or stuck)
        with contextlib.suppress(zmq.Again):
            self._out.send_multipart((_topic(call_id), json.dumps(message).encode()), zmq.NOBLOCK)

    async def _subscribed(self, call_id: str, first: bool) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="call-hub-reader")
        if first:
            self._in.setsockopt(zmq.SUBSCRIBE, _topic(call_id))
        # A subscription reaches the publishers some milliseconds later; a probe of our own that comes
        # back says it has reached the forwarder, so nothing the call says from now on is missed.
        nonce = uuid.uuid4().hex
        arrived = self._probes[nonce] = asyncio.Event()
        try:
            async with asyncio.timeout(_SUBSCRIBE_WITHIN_S):
                while not arrived.is_set():
                    self.publish(call_id, {"type": _PROBE, "nonce": nonce})
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(arrived.wait(), _PROBE_EVERY_S)
        except TimeoutError:
            log.warning("call hub: a subscription was not confirmed by the forwarder in time")
        finally:
            self._probes.pop(nonce, None)

    def _unsubscribed(self, call_id: str) -> None:
        self._in.setsockopt(zmq.UNSUBSCRIBE, _topic(call_id))

    async def _read(self) -> None:
        while True:
            topic, body = await self._in.recv_multipart()
            try:
                message = json.loads(body)
            except ValueError:
                continue
            if message.get("type") == _PROBE:
                probe = self._probes.get(message.get("nonce", ""))
                if probe is not None:
                    probe.set()
                continue
            call_id = topic.rstrip(b"\0").decode(errors="replace")
            self._deliver(call_id, message)

    async def close(self) -> None:
        if self.closed:
            return
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await super().close()
        self._out.close()
        self._in.close()
        self._context.term()


class CallHubForwarder:
    """The supervisor's ZeroMQ forwarder (XSUB -> XPUB, zmq.proxy on its own thread): every frontend's
    messages to every frontend whose subscribers follow the call, subscriptions passed back upstream."""

    def __init__(self, addresses: HubAddresses) -> None:
        self.addresses = addresses
        self._context = zmq.Context()
        self._publishers = self._context.socket(zmq.XSUB)
        self._publishers.bind(addresses.publish)
        self._subscribers = self._context.socket(zmq.XPUB)
        self._subscribers.bind(addresses.subscribe)
        self._thread = threading.Thread(target=self._run, name="call-hub-forwarder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(zmq.ContextTerminated):
            zmq.proxy(self._publishers, self._subscribers)
        self._publishers.close(linger=0)
        self._subscribers.close(linger=0)

    def close(self) -> None:
        self._context.term()
        self._thread.join(5)
