"""RTP reception off the event loop: one thread per door reads every leg's socket (`selectors`, batches
of `recv_into`), puts each leg's packets back in order in a small jitter buffer, decodes G.711 with the
tables the pipeline uses, fills losses and silences with silence, and hands the loop one interleaved
LINEAR16 chunk per session about every 100 ms (`loop.call_soon_threadsafe`). A Python callback per 20 ms
packet per leg on the loop every stream shares would be the per-message path the issue rules out.

Each leg's samples are placed by RTP timestamp, anchored to the wall clock at its first packet (a leg that
starts late starts with silence, so both legs keep the call's time); a timestamp jump the wall clock does
not bear out (a new SSRC, an SRC that restarted its clock after a hold) is anchored again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from service.recognizer.recognizer import ALAW_TABLE, MULAW_TABLE

log = logging.getLogger("service.doors.siprec.rtp")

RATE = 8000
JITTER_S = 0.06  # a packet missing this long is taken as lost (silence), its successors go on
BATCH_S = 0.1  # how often a session's audio is handed to the loop
SILENT_LEG_S = 0.3  # a leg with no packets this long (on hold, never sent) is silence up to now - this
REANCHOR_SAMPLES = RATE  # a timestamp more than 1 s off the wall clock is anchored again
MAX_PACKET = 2048
MAX_READS_PER_WAKE = 64  # packets read from one socket per select, so one busy leg cannot starve others
TABLES = {0: MULAW_TABLE, 8: ALAW_TABLE}
MAX_SOURCES = 4096  # source addresses whose verdict is remembered
MAX_JITTER_PACKETS = 50  # 1 s of 20 ms packets waiting per leg; more (a flood, a bogus sequence) are dropped


def decode(payload_type: int, payload: bytes) -> np.ndarray:
    return TABLES[payload_type][np.frombuffer(payload, dtype=np.uint8)]


@dataclass
class Leg:
    sock: socket.socket
    payload_type: int  # from the SDP answer; packets of other types (RFC 4733 events) are ignored
    ssrc: int | None = None
    next_seq: int | None = None
    jitter: dict[int, tuple[float, int, bytes]] = field(default_factory=dict)  # seq -> arrival, ts, payload
    anchor: int | None = None  # RTP timestamp of sample position 0
    end: int = 0  # samples placed so far (silence included)
    last_arrival: float = 0.0
    chunks: list[np.ndarray] = field(default_factory=list)
    pending: int = 0  # samples in chunks


class Session:
    """One SIPREC session's legs; `deliver` gets interleaved LINEAR16 frames (channel i = leg i), called
    on the receiver's thread (the door passes one that hands them to the loop)."""

    def __init__(
        self,
        socks: list[socket.socket],
        payload_types: list[int],
        deliver: Callable[[bytes], None],
        t0: float | None = None,
    ) -> None:
        self.legs = [Leg(s, pt) for s, pt in zip(socks, payload_types, strict=True)]
        self.deliver = deliver
        self.t0 = time.monotonic() if t0 is None else t0  # the call's time 0: the 200 OK
        self.last_batch = self.t0
        self.packets = 0
        self.last_packet = self.t0
        # `on_timeout` (on this thread) once no packet came on any leg for `timeout_s` (0: never)
        self.timeout_s = 0.0
        self.on_timeout: Callable[[], None] | None = None

    def set_payload_types(self, payload_types: list[int]) -> None:
        for leg, pt in zip(self.legs, payload_types, strict=True):
            leg.payload_type = pt  # one attribute: atomic for the receiver thread

    def _place(self, leg: Leg, arrival: float, ts: int, payload: bytes) -> None:
        wall = int((arrival - self.t0) * RATE)
        if leg.anchor is None or abs(((ts - leg.anchor) & 0xFFFFFFFF) - wall) > REANCHOR_SAMPLES:
            leg.anchor = (ts - max(leg.end, wall)) & 0xFFFFFFFF
        at = (ts - leg.anchor) & 0xFFFFFFFF
        samples = decode(leg.payload_type, payload)
        if at < leg.end:  # overlaps what was placed (a late duplicate, or silence put in its place)
            samples = samples[leg.end - at :]
            at = leg.end
        if at > leg.end:
            self._append(leg, np.zeros(at - leg.end, dtype=np.int16))
        if len(samples):
            self._append(leg, samples)

    @staticmethod
    def _append(leg: Leg, samples: np.ndarray) -> None:
        leg.chunks.append(samples)
        leg.pending += len(samples)
        leg.end += len(samples)

    def packet(self, leg: Leg, arrival: float, data: memoryview) -> None:
        if len(data) < 12 or data[0] >> 6 != 2:
            return
        payload_type = data[1] & 0x7F
        if payload_type != leg.payload_type:
            return
        seq = int.from_bytes(data[2:4], "big")
        ts = int.from_bytes(data[4:8], "big")
        ssrc = int.from_bytes(data[8:12], "big")
        start = 12 + 4 * (data[0] & 0x0F)
        if data[0] & 0x10 and len(data) >= start + 4:  # a header extension
            start += 4 + 4 * int.from_bytes(data[start + 2 : start + 4], "big")
        end = len(data) - (data[-1] if data[0] & 0x20 else 0)
        if start >= end:
            return
        if ssrc != leg.ssrc:  # a new source: what was buffered of the old one goes first
            self._release(leg, arrival, flush=True)
            leg.ssrc, leg.next_seq = ssrc, seq
        assert leg.next_seq is not None
        if (seq - leg.next_seq) & 0xFFFF >= 0x8000:
            return  # older than what was already played out: too late
        if len(leg.jitter) >= MAX_JITTER_PACKETS:
            return
        leg.jitter[seq] = (arrival, ts, bytes(data[start:end]))
        leg.last_arrival = self.last_packet = arrival
        self.packets += 1

    def _release(self, leg: Leg, now: float, *, flush: bool = False) -> None:
        while leg.jitter:
            assert leg.next_seq is not None
            if leg.next_seq not in leg.jitter:
                oldest = min(a for a, _, _ in leg.jitter.values())
                if not flush and now - oldest < JITTER_S:
                    return
                # the missing packet is lost: go on from the next one there is (its gap is silence)
                leg.next_seq = min(leg.jitter, key=lambda s: (s - leg.next_seq) & 0xFFFF)  # type: ignore[operator]
            arrival, ts, payload = leg.jitter.pop(leg.next_seq)
            self._place(leg, arrival, ts, payload)
            leg.next_seq = (leg.next_seq + 1) & 0xFFFF

    def tick(self, now: float, *, flush: bool = False) -> None:
        if self.timeout_s and self.on_timeout is not None and now - self.last_packet > self.timeout_s:
            timed_out, self.on_timeout = self.on_timeout, None  # once
            timed_out()
        for leg in self.legs:
            self._release(leg, now, flush=flush)
            if not leg.jitter and now - leg.last_arrival > SILENT_LEG_S:
                due = int((now - self.t0 - SILENT_LEG_S) * RATE)
                if due > leg.end:
                    self._append(leg, np.zeros(due - leg.end, dtype=np.int16))
        if flush:
            longest = max(leg.end for leg in self.legs)
            for leg in self.legs:
                if leg.end < longest:
                    self._append(leg, np.zeros(longest - leg.end, dtype=np.int16))
        elif now - self.last_batch < BATCH_S:
            return
        self.last_batch = now
        n = min(leg.pending for leg in self.legs)
        if n == 0:
            return
        columns = []
        for leg in self.legs:
            joined = np.concatenate(leg.chunks)
            columns.append(joined[:n])
            rest = joined[n:]
            leg.chunks = [rest] if len(rest) else []
            leg.pending = len(rest)
        frames = columns[0] if len(columns) == 1 else np.stack(columns, axis=1)
        self.deliver(frames.astype("<i2").tobytes())


class Receiver:
    """The door's RTP thread and its port range; sessions are added and closed from the loop."""

    def __init__(
        self,
        host: str,
        ports: tuple[int, int],
        loop: asyncio.AbstractEventLoop,
        allowed: Callable[[str], bool] | None = None,
    ) -> None:
        self.host = host
        self.allowed = allowed  # None: any source; the door passes --siprec-allowed-peers
        self._sources: dict[str, bool] = {}
        self.first, self.last = ports
        self.first += self.first % 2  # RTP on even ports (RFC 3550 section 11), RTCP's odd one beside
        self.loop = loop
        self._cursor = self.first
        self._commands: queue.SimpleQueue[tuple[str, Session, concurrent.futures.Future[None] | None]] = (
            queue.SimpleQueue()
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._sessions: list[Session] = []
        self._running = True
        self._thread = threading.Thread(target=self._run, name="siprec-rtp", daemon=True)
        self._thread.start()

    def allocate(self, n: int) -> list[socket.socket] | None:
        """n UDP sockets on even ports base, base+2, ... (SIPp and many SRCs send a session's streams so),
        or None when the range has no room."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        span = self.last - self.first + 1
        for _ in range(max(1, span // 2)):
            base = self._cursor
            self._cursor += 2 * n
            if self._cursor + 2 * n - 1 > self.last:
                self._cursor = self.first
            if base + 2 * (n - 1) > self.last:
                continue
            socks: list[socket.socket] = []
            try:
                for i in range(n):
                    sock = socket.socket(family, socket.SOCK_DGRAM)
                    socks.append(sock)
                    sock.bind((self.host, base + 2 * i))
                    sock.setblocking(False)
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                return socks
            except OSError:
                for sock in socks:
                    sock.close()
        return None

    def add(self, session: Session) -> None:
        self._command("add", session, None)

    async def close(self, session: Session) -> None:
        """The session's last audio delivered (its jitter buffers flushed), its sockets closed."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._command("close", session, done)
        await asyncio.wrap_future(done)

    def stop(self) -> None:
        self._running = False
        self._wake_w.send(b"x")
        self._thread.join(5)
        for session in self._sessions:
            for leg in session.legs:
                leg.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def _command(self, kind: str, session: Session, done: concurrent.futures.Future[None] | None) -> None:
        self._commands.put((kind, session, done))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        buffer = bytearray(MAX_PACKET)
        view = memoryview(buffer)
        while self._running:
            try:
                events = self._selector.select(timeout=0.02)
                now = time.monotonic()
                for key, _ in events:
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                        self._take_commands(now)
                        continue
                    session, leg = key.data
                    for _ in range(MAX_READS_PER_WAKE):
                        try:
                            n, source = leg.sock.recvfrom_into(buffer)
                        except OSError:  # BlockingIOError: read them all
                            break
                        if self._from_allowed(source[0]):
                            session.packet(leg, now, view[:n])
                for session in self._sessions:
                    session.tick(now)
            except Exception:  # one session's bad packet must not end every session's reception
                log.exception("siprec: the RTP receiver failed on a packet; going on")

    def _from_allowed(self, host: str) -> bool:
        """Whether a packet's source may speak into a recording (the SBCs only); remembered per address,
        so that the check is not made per packet."""
        if self.allowed is None:
            return True
        known = self._sources.get(host)
        if known is None:
            if len(self._sources) >= MAX_SOURCES:  # a scan from many addresses: start over
                self._sources.clear()
            known = self._sources[host] = self.allowed(host)
        return known

    def _take_commands(self, now: float) -> None:
        while True:
            try:
                kind, session, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._sessions.append(session)
                for leg in session.legs:
                    self._selector.register(leg.sock, selectors.EVENT_READ, (session, leg))
            elif kind == "close":
                try:
                    if session in self._sessions:
                        self._sessions.remove(session)
                        session.tick(now, flush=True)
                        for leg in session.legs:
                            self._selector.unregister(leg.sock)
                    for leg in session.legs:
                        leg.sock.close()
                finally:
                    assert done is not None
                    done.set_result(None)
