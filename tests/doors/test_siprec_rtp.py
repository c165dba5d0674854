"""The SIPREC door's RTP receiver without sockets: packets fed to one session as the receiver thread feeds
them (out of order, lost, other payload types, a silent leg), the interleaved LINEAR16 it hands over."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np

from service.doors.siprec import rtp
from service.pipeline.audio import ALAW_TABLE, MULAW_TABLE

FRAME = 160


def packet(seq: int, ts: int, payload: bytes, pt: int = 0, ssrc: int = 7) -> memoryview:
    return memoryview(struct.pack("!BBHII", 0x80, pt, seq, ts, ssrc) + payload)


def session(payload_types: list[int]) -> tuple[rtp.Session, list[bytes]]:
    out: list[bytes] = []
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in payload_types]
    for sock in socks:
        sock.close()  # never read here: the session only needs them to exist
    return rtp.Session(socks, payload_types, out.append, t0=0.0), out


def frames(out: list[bytes], channels: int) -> np.ndarray:
    return np.frombuffer(b"".join(out), dtype="<i2").reshape(-1, channels)


def test_packets_out_of_order_are_put_back_and_a_lost_one_is_silence() -> None:
    """Packets 0, 2, 1, then 4 (3 lost): the leg is 0, 1, 2, silence, 4 once the jitter buffer gives up on
    3; a telephone-event (PT 101) in between is ignored."""
    s, out = session([0])
    leg = s.legs[0]
    values = [bytes([0x80 + i]) * FRAME for i in range(5)]
    for seq, at in ((0, 0.00), (2, 0.04), (1, 0.045), (4, 0.08)):
        s.packet(leg, at, packet(seq, seq * FRAME, values[seq]))
    s.packet(leg, 0.06, packet(3, 3 * FRAME, b"\x00" * 4, pt=101))
    s.tick(0.09)
    assert out == [] or len(frames(out, 1)) == 3 * FRAME  # 4 waits for 3 until the jitter buffer gives up
    s.tick(0.2)
    got = frames(out, 1)[:, 0]
    assert len(got) == 5 * FRAME
    for i in (0, 1, 2, 4):
        assert (got[i * FRAME : (i + 1) * FRAME] == MULAW_TABLE[0x80 + i]).all(), i
    assert (got[3 * FRAME : 4 * FRAME] == 0).all()


def test_two_legs_are_interleaved_and_a_silent_leg_is_filled_with_silence() -> None:
    """Leg 0 (PCMU) sends 1 s, leg 1 (PCMA) sends nothing: its channel is silence, the call's time goes on;
    the flush at the end gives both legs the same length."""
    s, out = session([0, 8])
    for i in range(50):
        s.packet(s.legs[0], i * 0.02, packet(i, i * FRAME, b"\x10" * FRAME))
        if i == 25:  # leg 1's one packet, at 0.5 s of the call (its RTP clock starts anywhere)
            s.packet(s.legs[1], 0.5, packet(0, 123456, b"\x10" * FRAME, pt=8, ssrc=9))
        s.tick(i * 0.02 + 0.001)
    s.tick(1.2, flush=True)
    got = frames(out, 2)
    assert len(got) >= 50 * FRAME
    assert (got[: 50 * FRAME, 0] == MULAW_TABLE[0x10]).all()
    leg1 = got[:, 1]
    assert (leg1[:4000] == 0).all()  # nothing before its first packet, at 0.5 s of the call
    assert (leg1[4000 : 4000 + FRAME] == ALAW_TABLE[0x10]).all()
    assert (leg1[4000 + FRAME :] == 0).all()


async def test_rtp_from_outside_the_allowed_peers_is_dropped() -> None:
    """The RTP ports take packets from anyone who reaches them: only those from an allowed peer (the SBCs,
    --siprec-allowed-peers) reach a recording, so a stranger cannot speak into someone's call."""
    loop = asyncio.get_running_loop()
    for allowed in (False, True):
        receiver = rtp.Receiver("127.0.0.1", (41000, 41999), loop, allowed=lambda host, ok=allowed: ok)
        got: list[bytes] = []
        try:
            socks = receiver.allocate(1)
            assert socks is not None
            session = rtp.Session(
                socks, [0], lambda frames, got=got: loop.call_soon_threadsafe(got.append, frames)
            )
            receiver.add(session)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
                for seq in range(5):
                    sender.sendto(packet(seq, seq * FRAME, b"\x20" * FRAME).tobytes(), socks[0].getsockname())
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            await receiver.close(session)
        finally:
            await asyncio.to_thread(receiver.stop)
        samples = np.frombuffer(b"".join(got), dtype="<i2")
        heard = int((samples == MULAW_TABLE[0x20]).sum())
        assert heard == (5 * FRAME if allowed else 0), (allowed, heard)
