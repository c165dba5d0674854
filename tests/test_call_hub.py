"""The call hub: a call's messages reach its subscribers on any frontend (two ZmqCallHubs through a real
ZeroMQ forwarder, as asr-server's frontends use it), subscribed before the call starts, in order, and a
subscriber that does not keep up is ended without the publisher ever waiting."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from service.recognizer.call_hub import (
    EVERY_CALL,
    CallHub,
    CallHubForwarder,
    HubAddresses,
    SubscriberLagged,
    ZmqCallHub,
)


def message(call_id: str, kind: str, n: int = 0) -> dict[str, object]:
    return {"type": kind, "call_id": call_id, "n": n}


async def test_a_call_on_one_frontend_reaches_subscribers_on_another(tmp_path: Path) -> None:
    addresses = HubAddresses(f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock")
    forwarder = CallHubForwarder(addresses)
    caller_side, subscriber_side = ZmqCallHub(addresses), ZmqCallHub(addresses)
    try:
        async with (
            subscriber_side.subscribe("CA1") as one,
            subscriber_side.subscribe(EVERY_CALL) as every,
            caller_side.subscribe("CA1") as local,
        ):
            for n in range(100):
                caller_side.publish(
                    "CA12", message("CA12", "transcript", n)
                )  # another call: "CA1" is a prefix
                caller_side.publish("CA1", message("CA1", "transcript", n))
            caller_side.publish("CA1", message("CA1", "call_ended"))
            async with asyncio.timeout(10):
                got = [m async for m in one]
                got_local = [m async for m in local]
                got_every: list[dict[str, object]] = []
                async for m in every:
                    got_every.append(m)
                    if m["type"] == "call_ended":
                        break
        expected = [message("CA1", "transcript", n) for n in range(100)] + [message("CA1", "call_ended")]
        assert got == expected
        assert got_local == expected  # the publisher's own frontend hears it through the forwarder too
        assert [m for m in got_every if m["call_id"] == "CA1"] == expected
        assert [m["n"] for m in got_every if m["call_id"] == "CA12"] == list(range(100))
    finally:
        await caller_side.close()
        await subscriber_side.close()
        forwarder.close()


async def test_a_subscriber_that_does_not_keep_up_is_ended_and_the_call_goes_on() -> None:
    hub = CallHub(backlog=10)
    async with hub.subscribe("CA1") as slow, hub.subscribe("CA1") as keeping_up:
        for n in range(11):
            hub.publish(
                "CA1", message("CA1", "transcript", n)
            )  # never waits, past the slow one's backlog too
            assert (await anext(aiter(keeping_up)))["n"] == n
        with pytest.raises(SubscriberLagged):
            async for _ in slow:
                pass
        hub.publish("CA1", message("CA1", "call_ended"))
        assert [m["type"] async for m in keeping_up] == ["call_ended"]


async def test_closing_the_hub_ends_every_subscription_after_what_was_published() -> None:
    hub = CallHub()
    async with hub.subscribe(EVERY_CALL) as every:
        hub.publish("CA1", message("CA1", "transcript"))
        await hub.close()
        assert [m["type"] async for m in every] == ["transcript"]
    async with hub.subscribe("CA2") as late:  # after the close: ends at once
        assert [m async for m in late] == []
