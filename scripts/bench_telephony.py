#!/usr/bin/env python
"""What a telephony call costs a frontend at 20 ms packets: N two-leg calls, paced in real time, through
the Twilio Media Streams door (one WebSocket per call, a JSON message with 20 ms of base64 mu-law per leg
every 20 ms: 100 messages a second) and the Asterisk AudioSocket door (one TCP connection per leg, a
320-byte slin frame every 20 ms) and the SIPREC door (an SBC's multipart INVITE over UDP, then a 172-byte
PCMU RTP packet per leg every 20 ms to the ports its answer names, then BYE), against
`asr-server --frontends 1` on the bundled model.

    python scripts/bench_telephony.py [--calls 16] [--seconds 20] [--doors twilio,audiosocket,siprec]

The legs carry line noise at -50 dBFS (what most of a call is between words: the VAD still looks at
it). Printed per door: the frontend process's CPU (user + system, read from the server's /metrics
`process_cpu_seconds_total{process="frontend-0"}` over the timed pass) in % of a core per two-leg call,
the calls one frontend process keeps up with at that rate (100 % / that), and the engine's CPU beside
it; with the machine and its load average.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
from harness.server import ServerProcess  # noqa: E402
from harness.usage import cpu_model  # noqa: E402
from service.runtime.ports import free_port  # noqa: E402

PACKET_S = 0.02
RATE = 8000


def line_noise(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(round(seconds * RATE)) * 10 ** (-50 / 20) * 32767).astype(np.int16)


def mulaw(samples: np.ndarray) -> bytes:
    x = np.clip(samples.astype(np.float64) / 32768.0, -1, 1)
    y = np.sign(x) * np.log1p(255 * np.abs(x)) / np.log1p(255)
    return (((y + 1) / 2 * 255).astype(np.uint8) ^ 0xFF).tobytes()  # close enough to G.711 for a load


def frontend_cpu_s(server: ServerProcess, process: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("process_cpu_seconds_total") and f'process="{process}"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no process_cpu_seconds_total for {process}")


async def paced(seconds: float, t0: float, send_packet: object) -> None:
    n = round(seconds / PACKET_S)
    for i in range(n):
        delay = t0 + i * PACKET_S - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await send_packet(i)  # type: ignore[operator]


async def twilio_call(url: str, seconds: float, seed: int, t0: float) -> None:
    legs = [mulaw(line_noise(seconds, seed * 2 + k)) for k in range(2)]
    sid = "CA" + uuid.uuid4().hex
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        await ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        start = {"callSid": sid, "streamSid": "MZ" + sid[2:], "tracks": ["inbound", "outbound"]}
        await ws.send_json({"event": "start", "start": start})

        async def packet(i: int) -> None:
            at = i * 160
            for track, leg in zip(("inbound", "outbound"), legs, strict=True):
                payload = base64.b64encode(leg[at : at + 160]).decode()
                media = {"track": track, "timestamp": str(i * 20), "payload": payload}
                await ws.send_str(json.dumps({"event": "media", "media": media}))

        await paced(seconds, t0, packet)
        await ws.send_json({"event": "stop"})
        async for _ in ws:
            pass


async def audiosocket_leg(port: int, seconds: float, seed: int, t0: float) -> None:
    pcm = line_noise(seconds, seed).tobytes()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(bytes((0x01, 0, 16)) + uuid.uuid4().bytes)

    async def packet(i: int) -> None:
        writer.write(bytes((0x10, 0x01, 0x40)) + pcm[i * 320 : (i + 1) * 320])
        await writer.drain()

    await paced(seconds, t0, packet)
    writer.write(bytes((0x00, 0, 0)))
    await writer.drain()
    await reader.read()
    writer.close()


SIPREC_OFFER = """v=0\r
o=SBC 1 1 IN IP4 127.0.0.1\r
s=SIPREC\r
c=IN IP4 127.0.0.1\r
t=0 0\r
m=audio 40000 RTP/AVP 0\r
a=rtpmap:0 PCMU/8000\r
a=label:1\r
a=sendonly\r
m=audio 40002 RTP/AVP 0\r
a=rtpmap:0 PCMU/8000\r
a=label:2\r
a=sendonly\r
"""
SIPREC_METADATA = """<?xml version="1.0" encoding="UTF-8"?>\r
<recording xmlns="urn:ietf:params:xml:ns:recording:1"><datamode>complete</datamode>\r
<session session_id="czE="/>\r
<participant participant_id="cDE="><nameID aor="sip:caller@example.com"/></participant>\r
<participant participant_id="cDI="><nameID aor="sip:agent@example.com"/></participant>\r
<stream stream_id="czFh" session_id="czE="><label>1</label></stream>\r
<stream stream_id="czJh" session_id="czE="><label>2</label></stream>\r
<participantstreamassoc participant_id="cDE="><send>czFh</send></participantstreamassoc>\r
<participantstreamassoc participant_id="cDI="><send>czJh</send></participantstreamassoc>\r
</recording>\r
"""


class SipUdp(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.responses: asyncio.Queue[str] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.responses.put_nowait(data.decode(errors="replace"))


async def sip_request(
    transport: asyncio.DatagramTransport,
    sip: SipUdp,
    port: int,
    method: str,
    call_id: str,
    cseq: int,
    to_tag: str,
    body: bytes = b"",
    content_type: str = "",
) -> str:
    """One request of the SRC's dialog; the final response to it (provisional ones skipped)."""
    local_port = transport.get_extra_info("sockname")[1]
    head = (
        f"{method} sip:srs@127.0.0.1:{port} SIP/2.0\r\n"
        f"Via: SIP/2.0/UDP 127.0.0.1:{local_port};branch=z9hG4bK{uuid.uuid4().hex[:12]}\r\n"
        "Max-Forwards: 70\r\n"
        f"From: <sip:sbc@127.0.0.1>;tag=src{call_id[:8]}\r\nTo: <sip:srs@127.0.0.1>{to_tag}\r\n"
        f"Call-ID: {call_id}\r\nCSeq: {cseq} {method}\r\n"
        f"Contact: <sip:sbc@127.0.0.1:{local_port}>;+sip.src\r\n"
        + ("Require: siprec\r\n" if method == "INVITE" else "")
        + (f"Content-Type: {content_type}\r\n" if content_type else "")
        + f"Content-Length: {len(body)}\r\n\r\n"
    )
    transport.sendto(head.encode() + body, ("127.0.0.1", port))
    if method == "ACK":
        return ""
    while True:
        response = await asyncio.wait_for(sip.responses.get(), 30)
        if not response.split(" ", 2)[1].startswith("1"):
            return response


async def siprec_call(port: int, seconds: float, seed: int, t0: float) -> None:
    legs = [mulaw(line_noise(seconds, seed * 2 + k)) for k in range(2)]
    loop = asyncio.get_running_loop()
    transport, sip = await loop.create_datagram_endpoint(SipUdp, local_addr=("127.0.0.1", 0))
    call_id = uuid.uuid4().hex
    body = (
        "--b\r\nContent-Type: application/sdp\r\n\r\n"
        + SIPREC_OFFER
        + "--b\r\nContent-Type: application/rs-metadata+xml\r\nContent-Disposition: recording-session\r\n\r\n"
        + SIPREC_METADATA
        + "--b--\r\n"
    ).encode()
    ok = await sip_request(transport, sip, port, "INVITE", call_id, 1, "", body, "multipart/mixed;boundary=b")
    assert ok.startswith("SIP/2.0 200"), ok
    to_tag = next(line for line in ok.split("\r\n") if line.lower().startswith("to:")).split(">", 1)[1]
    rtp_ports = [int(line.split()[1]) for line in ok.split("\r\n") if line.startswith("m=audio")]
    await sip_request(transport, sip, port, "ACK", call_id, 1, to_tag)
    rtp, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
    ssrcs = [seed * 2 + 1, seed * 2 + 2]

    async def packet(i: int) -> None:
        for leg, rtp_port, ssrc in zip(legs, rtp_ports, ssrcs, strict=True):
            header = bytes((0x80, 0)) + (i & 0xFFFF).to_bytes(2, "big") + (i * 160).to_bytes(4, "big")
            rtp.sendto(
                header + ssrc.to_bytes(4, "big") + leg[i * 160 : (i + 1) * 160], ("127.0.0.1", rtp_port)
            )

    await paced(seconds, t0, packet)
    bye = await sip_request(transport, sip, port, "BYE", call_id, 2, to_tag)
    assert bye.startswith("SIP/2.0 200"), bye
    rtp.close()
    transport.close()


async def run_door(
    server: ServerProcess, ports: dict[str, int], door: str, calls: int, seconds: float
) -> dict[str, float]:
    t0 = time.monotonic() + 1.0
    before = {p: frontend_cpu_s(server, p) for p in ("frontend-0", "engine")}
    if door == "twilio":
        url = server.http_url.replace("http://", "ws://") + "/v1/telephony/twilio"
        jobs = [twilio_call(url, seconds, i, t0) for i in range(calls)]
    elif door == "siprec":
        jobs = [siprec_call(ports["siprec"], seconds, i, t0) for i in range(calls)]
    else:
        jobs = [
            audiosocket_leg(ports["audiosocket"], seconds, i * 2 + k, t0)
            for i in range(calls)
            for k in range(2)
        ]
    started = time.monotonic()
    await asyncio.gather(*jobs)
    wall = time.monotonic() - started
    after = {p: frontend_cpu_s(server, p) for p in ("frontend-0", "engine")}
    frontend = (after["frontend-0"] - before["frontend-0"]) / wall * 100
    engine = (after["engine"] - before["engine"]) / wall * 100
    return {"frontend_pct": frontend, "engine_pct": engine, "per_call_pct": frontend / calls, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=16, help="two-leg calls at once")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each call")
    parser.add_argument(
        "--doors", default="twilio,audiosocket,siprec", help="comma-separated: twilio, audiosocket, siprec"
    )
    args = parser.parse_args()
    ports = {"audiosocket": free_port(), "siprec": free_port()}
    server = ServerProcess(
        "--frontends",
        "1",
        "--audiosocket-port",
        str(ports["audiosocket"]),
        "--siprec-port",
        str(ports["siprec"]),
        http=True,
    )
    server.wait_serving()
    try:
        print(
            f"machine: {cpu_model()}, {os.cpu_count()} CPUs; load average at start {os.getloadavg()[0]:.2f}"
        )
        print(f"{args.calls} two-leg calls of {args.seconds:g} s at 20 ms packets, one frontend process")
        print(
            "| door | frontend CPU, % of a core | per two-leg call | calls one frontend keeps up with | engine CPU |"
        )
        print("|---|---|---|---|---|")
        for door in args.doors.split(","):
            r = asyncio.run(run_door(server, ports, door, args.calls, args.seconds))
            print(
                f"| {door} | {r['frontend_pct']:.0f} % | {r['per_call_pct']:.2f} % | "
                f"{100 / r['per_call_pct']:.0f} | {r['engine_pct']:.0f} % |"
            )
        print(f"load average at end {os.getloadavg()[0]:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
