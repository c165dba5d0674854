"""The SIPREC recording-server door end to end: SIPp (Debian's sip-tester) is the SRC, as an SBC records a
call, with scenarios in tests/doors/siprec/ in the shapes SBCs send; the two legs' RTP comes from a pcap
this test writes from real speech (jfk on the caller's leg, an espeak line on the agent's), replayed by
SIPp's play_pcap_audio (root). Transcripts are read as the other telephony doors' tests read them: a
subscriber of every call on `/v1/calls/transcripts`."""

from __future__ import annotations

import asyncio
import re
import secrets
import shutil
import struct
from pathlib import Path

import pytest

from clients.scoring import corpus_wer, normalize
from engine import Engine
from service.config import ServerConfig
from tests.doors.test_twilio import AGENT, follow, jfk_mulaw
from tests.support.audio import JFK_TEXT, speak, to_mulaw_8k_bytes
from tests.support.server import HOST, ServerProcess, ServerThread, free_port

pytestmark = pytest.mark.slow
SCENARIOS = Path(__file__).parent / "siprec"
CALL_DEADLINE_S = 120.0
CALLER_AOR = "sip:+15551230001@customer.example.net"
AGENT_AOR = "sip:agent42@callcenter.example.com"
# the call's timeline, as recorded_call.xml's pauses have it: the hold's re-INVITE comes where the pcap
# has no packets, the BYE right after the caller's last word
HOLD_AT_S, RESUME_AT_S, BYE_AT_S = 5.0, 7.0, 18.8
AGENT_AT_S, CALLER_AT_S = 0.5, 7.3
FRAME = 160  # 20 ms of 8 kHz G.711
PCMU_SILENCE = b"\xff" * FRAME


@pytest.fixture(scope="module")
def server(door_server: ServerThread) -> ServerThread:
    return door_server


def siprec_port(server: ServerThread | ServerProcess) -> int:
    assert isinstance(server, ServerThread) and server.server.siprec is not None
    return server.server.siprec.port


def write_pcap(path: Path, legs: list[tuple[int, list[tuple[float, bytes]]]]) -> None:
    """A pcap (Ethernet, IPv4, UDP, RTP PT 0) of each leg's (time, payload) packets towards its port, in time
    order: SIPp replays it at those times, each packet's port shifted by the answer's first port."""
    packets = []
    for index, (port, frames) in enumerate(legs):
        ssrc = 0x5150_0000 + index
        for seq, (at, payload) in enumerate(frames):
            rtp = struct.pack("!BBHII", 0x80, 0, seq & 0xFFFF, round(at * 8000) & 0xFFFFFFFF, ssrc) + payload
            udp = struct.pack("!HHHH", 30000 + 2 * index, port, 8 + len(rtp), 0) + rtp
            ip = struct.pack(
                "!BBHHHBBH4s4s",
                0x45,
                0,
                20 + len(udp),
                0,
                0x4000,
                64,
                17,
                0,
                bytes([127, 0, 0, 1]),
                bytes([127, 0, 0, 1]),
            )
            checksum = sum(struct.unpack("!10H", ip))
            checksum = (checksum & 0xFFFF) + (checksum >> 16)
            ip = ip[:10] + struct.pack("!H", ~checksum & 0xFFFF) + ip[12:]
            frame = b"\x00" * 12 + b"\x08\x00" + ip + udp
            packets.append((at, frame))
    packets.sort(key=lambda p: p[0])
    out = [struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)]
    for at, frame in packets:
        seconds, micros = int(at), round((at - int(at)) * 1e6)
        out.append(struct.pack("<IIII", seconds, micros, len(frame), len(frame)) + frame)
    path.write_bytes(b"".join(out))


def leg_frames(audio: bytes, start_s: float, end_s: float) -> list[tuple[float, bytes]]:
    """20 ms packets from 0 to end_s with `audio` from start_s (silence around it), none during the hold
    (the SRC sends nothing while the call is held; its RTP clock goes on)."""
    frames = []
    for i in range(round(end_s * 50)):
        at = i / 50
        if HOLD_AT_S <= at < RESUME_AT_S:
            continue
        offset = round((at - start_s) * 8000)
        chunk = audio[offset : offset + FRAME] if offset >= 0 else b""
        frames.append((at, chunk + PCMU_SILENCE[len(chunk) :]))
    return frames


async def run_sipp(
    scenario: str,
    port: int,
    folder: Path,
    call_id: str,
    *keys: tuple[str, str],
    timeout_s: float = 90.0,
    transport: str = "u1",
) -> tuple[int, str]:
    """SIPp as the SRC running one call of `scenario` in `folder` (its pcaps there); its exit code and the
    messages it sent and received."""
    messages = folder / f"{call_id}-messages.log"
    args = [
        shutil.which("sipp") or "sipp",
        f"{HOST}:{port}",
        *("-sf", str(SCENARIOS / scenario), "-t", transport, "-m", "1", "-i", HOST, "-p", str(free_port())),
        *("-mi", HOST, "-mp", str(free_port() & ~1), "-cid_str", f"{call_id}-%u"),
        *("-timeout", f"{timeout_s:g}s", "-timeout_error", "-nostdin"),
        *(
            "-trace_msg",
            "-message_file",
            str(messages),
            "-trace_err",
            "-error_file",
            str(folder / "errors.log"),
        ),
    ]
    for name, value in keys:
        args += ["-key", name, value]
    process = await asyncio.create_subprocess_exec(
        *args,
        cwd=folder,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    errors = folder / "errors.log"
    log = messages.read_text(errors="replace") if messages.exists() else ""
    if process.returncode != 0:
        log += output.decode(errors="replace")[-3000:] + (errors.read_text() if errors.exists() else "")
    assert process.returncode is not None
    return process.returncode, log


def responses(log: str, status: int) -> list[str]:
    """The responses of `status` SIPp received, as text."""
    return [m for m in re.split(r"\n-{5,}[^\n]*\n", log) if re.search(rf"^\s*SIP/2\.0 {status} ", m, re.M)]


def answered_ports(message: str) -> list[int]:
    return [int(p) for p in re.findall(r"^\s*m=audio (\d+) ", message, re.M)]


@pytest.mark.parametrize("transport", ["u1", "t1"])
async def test_a_recorded_call_is_transcribed_per_participant_through_hold_and_bye(
    server: ServerThread, tmp_path: Path, transport: str
) -> None:
    """An SBC records a call: the multipart INVITE is answered 200 with two recvonly ports (PCMU, as offered
    first), the caller's leg (jfk) and the agent's (an espeak line) are transcribed, each labelled by its
    participant's role from the rs-metadata, its AOR in the call's attributes; the hold's re-INVITE gets a=inactive on the same ports, the
    resume's a=recvonly; the caller's last words, right before BYE, are in a final; then call_ended. SIP
    over UDP (the 2xx sent again until the ACK) and TCP."""
    call_id = "siprec-" + secrets.token_hex(6)
    agent = to_mulaw_8k_bytes(speak(AGENT))
    caller = jfk_mulaw()
    end_s = BYE_AT_S - 0.2
    assert CALLER_AT_S + len(caller) / 8000 < end_s and AGENT_AT_S + len(agent) / 8000 < HOLD_AT_S
    write_pcap(
        tmp_path / "call.pcap",
        [(6000, leg_frames(caller, CALLER_AT_S, end_s)), (6002, leg_frames(agent, AGENT_AT_S, end_s))],
    )
    call = f"{call_id}-1"  # SIPp's Call-ID (-cid_str), which the door makes the call id
    async with asyncio.timeout(CALL_DEADLINE_S), follow(server, call) as (one, reader):
        code, log = await run_sipp(
            "recorded_call.xml",
            siprec_port(server),
            tmp_path,
            call_id,
            ("caller_aor", CALLER_AOR),
            ("agent_aor", AGENT_AOR),
            transport=transport,
        )
        assert code == 0, log
        await reader  # the subscriber's socket closes after call_ended
    mine = one.messages
    started = mine[0]
    assert started["type"] == "call_started" and started["platform"] == "siprec", mine
    # the metadata names each participant (<name>Caller</name>, <name>Agent</name>): the legs are labelled
    # by those roles, and each participant's AOR comes with the call
    assert started["channels"] == ["caller", "agent"]
    assert started["attributes"] == {
        "session_id": "c2lwcmVjLXRlc3Qtc2Vzc2lvbg==",
        "aor.caller": CALLER_AOR,
        "aor.agent": AGENT_AOR,
    }
    assert mine[-1]["type"] == "call_ended" and mine[-1]["status"] == "OK", mine[-1]

    def finals(channel: str) -> str:
        return " ".join(
            m["text"] for m in mine if m["type"] == "transcript" and m["is_final"] and m["channel"] == channel
        )

    assert corpus_wer([normalize(JFK_TEXT)], [normalize(finals("caller"))]) < 0.25, finals("caller")
    assert normalize(finals("caller")).split()[-1] == "country", finals("caller")  # the last words
    assert "thank you for calling" in normalize(finals("agent")), finals("agent")
    assert "country" not in normalize(finals("agent"))
    first_caller = next(m for m in mine if m["type"] == "transcript" and m["channel"] == "caller")
    assert first_caller["start_s"] >= CALLER_AT_S - 0.5  # the call's own time, the hold counted

    first, hold, resume = responses(log, 200)[:3]
    assert "a=recvonly" in first and "a=label:1" in first and "a=label:2" in first, first
    assert re.search(r"^\s*m=audio \d+ RTP/AVP 0\s*$", first, re.M), first
    ports = answered_ports(first)
    assert len(ports) == 2 and ports[1] == ports[0] + 2, first
    assert answered_ports(hold) == ports and hold.count("a=inactive") == 2, hold
    assert answered_ports(resume) == ports and resume.count("a=recvonly") == 2, resume


SDP_OFFER = (
    "v=0\r\no=SBC 1 1 IN IP4 127.0.0.1\r\ns=SIPREC\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 7000 RTP/AVP {formats}\r\na=label:1\r\na=sendonly\r\n"
)
METADATA = (
    '<?xml version="1.0" encoding="UTF-8"?>\r\n<recording xmlns="urn:ietf:params:xml:ns:recording:1">'
    '<datamode>complete</datamode><session session_id="s1"/>'
    '<participant participant_id="p1"><nameID aor="sip:alice@example.net"/></participant>'
    '<stream stream_id="st1" session_id="s1"><label>1</label></stream>'
    '<participantstreamassoc participant_id="p1"><send>st1</send></participantstreamassoc></recording>'
)
MULTIPART = "multipart/mixed;boundary=b1"


def multipart(sdp_text: str, metadata: str = METADATA) -> str:
    return (
        f"--b1\r\nContent-Type: application/sdp\r\n\r\n{sdp_text}\r\n"
        "--b1\r\nContent-Type: application/rs-metadata+xml\r\nContent-Disposition: recording-session\r\n\r\n"
        f"{metadata}\r\n--b1--"
    )


async def request(
    server: ServerThread | ServerProcess,
    tmp_path: Path,
    method: str,
    content_type: str = "",
    body: str = "",
    transport: str = "u1",
    port: int = 0,
    call_id: str = "",
    require: str = "siprec",
) -> str:
    """One request by SIPp (request.xml) to the server's SIPREC port (or `port`), its Call-ID `call_id`-1;
    its final response."""
    call_id = call_id or f"{method.lower()}-" + secrets.token_hex(6)
    scenario = tmp_path / f"{call_id}.xml"  # SIPp takes no keyword for the method: it is written in
    scenario.write_text((SCENARIOS / "request.xml").read_text().replace("[method]", method))
    code, log = await run_sipp(
        str(scenario),
        port or siprec_port(server),
        tmp_path,
        call_id,
        ("content_type", content_type or "application/sdp"),
        ("body", body),
        ("require", require),
        timeout_s=30,
        transport=transport,
    )
    assert code == 0, log
    finals = [m for m in re.split(r"\n-{5,}[^\n]*\n", log) if re.search(r"^\s*SIP/2\.0 [2-6]\d\d ", m, re.M)]
    assert len(finals) == 1, log
    return finals[0]


def status_of(response: str) -> int:
    match = re.search(r"^\s*SIP/2\.0 (\d{3}) ", response, re.M)
    assert match, response
    return int(match.group(1))


async def second_invite_refused_503(server: ServerThread, tmp_path: Path, offer: str, names: str) -> str:
    """The same INVITE twice: the first is answered 200 (returned), the second 503 with Retry-After, naming
    what is full (`names`: the flag or field)."""
    first = await request(server, tmp_path, "INVITE", MULTIPART, offer)
    assert status_of(first) == 200, first
    second = await request(server, tmp_path, "INVITE", MULTIPART, offer)
    assert status_of(second) == 503 and names in second, second
    assert re.search(r"^\s*Retry-After: \d+", second, re.M), second
    return first


@pytest.mark.parametrize("transport", ["u1", "t1"])
async def test_options_is_answered_200_with_what_the_door_takes(
    server: ServerThread, tmp_path: Path, transport: str
) -> None:
    """An SBC's OPTIONS ping, over UDP and TCP: 200 with Allow, Accept and Supported (siprec)."""
    response = await request(server, tmp_path, "OPTIONS", transport=transport)
    assert status_of(response) == 200, response
    assert re.search(r"^\s*Allow: .*INVITE.*BYE", response, re.M), response
    assert "application/rs-metadata+xml" in response and re.search(r"Supported: .*siprec", response), response


@pytest.mark.parametrize(
    ("content_type", "body", "status", "named"),
    [
        (
            "application/sdp",
            SDP_OFFER.format(formats="0"),
            415,
            "Content-Type: application/sdp is not SIPREC",
        ),
        (MULTIPART, multipart(SDP_OFFER.format(formats="18")), 488, "no audio m-line offers PCMU or PCMA"),
        (MULTIPART, multipart(SDP_OFFER.format(formats="0").replace("m=audio", "m=video")), 488, "SDP:"),
        (MULTIPART, multipart(SDP_OFFER.format(formats="0"), metadata="<recording"), 400, "rs-metadata: "),
        ("text/plain", "record me", 415, "Content-Type: text/plain"),
    ],
)
async def test_an_invite_that_is_no_usable_siprec_offer_gets_4xx_naming_it(
    server: ServerThread, tmp_path: Path, content_type: str, body: str, status: int, named: str
) -> None:
    """A body that is not SIPREC's (415, with Accept), an offer without PCMU/PCMA audio (488), metadata that
    is not XML (400): the status, and a Warning naming what is wrong."""
    response = await request(server, tmp_path, "INVITE", content_type, body)
    assert status_of(response) == status, response
    assert named in response, response
    if status == 415:
        assert re.search(r"^\s*Accept: .*multipart/mixed", response, re.M), response


async def test_other_methods_get_405_and_a_bye_outside_a_dialog_481(
    server: ServerThread, tmp_path: Path
) -> None:
    """MESSAGE is no method of a recording server: 405 with Allow; a BYE for no recording, and a CANCEL of
    no INVITE: 481."""
    response = await request(server, tmp_path, "MESSAGE", "text/plain", "hello")
    assert status_of(response) == 405 and re.search(r"^\s*Allow: INVITE", response, re.M), response
    assert status_of(await request(server, tmp_path, "BYE")) == 481
    assert status_of(await request(server, tmp_path, "CANCEL")) == 481


async def test_a_peer_outside_the_allowed_peers_gets_403(service_engine: Engine, tmp_path: Path) -> None:
    """SIP carries no credentials: a server whose --siprec-allowed-peers leaves out loopback answers an
    INVITE and an OPTIONS from 127.0.0.1 with 403, naming the flag, over UDP and TCP."""
    server = ServerThread(
        ServerConfig(siprec_port=free_port(), siprec_allowed_peers="10.0.0.0/8"), service_engine
    )
    server.start()
    try:
        for method, content_type, body, transport in (
            ("OPTIONS", "", "", "u1"),
            ("INVITE", MULTIPART, multipart(SDP_OFFER.format(formats="0")), "u1"),
            ("OPTIONS", "", "", "t1"),
        ):
            response = await request(server, tmp_path, method, content_type, body, transport)
            assert status_of(response) == 403 and "--siprec-allowed-peers" in response, response
    finally:
        await asyncio.to_thread(server.stop)


async def test_an_invite_past_max_streams_gets_503_with_retry_after(
    service_engine: Engine, tmp_path: Path
) -> None:
    """The door's streams count against --max-streams as every door's: with one stream allowed, a first
    recording is answered 200 and a second 503 with Retry-After, its Warning naming max_streams."""
    server = ServerThread(ServerConfig(siprec_port=free_port(), max_streams=1), service_engine)
    server.start()
    try:
        offer = multipart(SDP_OFFER.format(formats="8 0"))
        first = await second_invite_refused_503(server, tmp_path, offer, "max_streams")
        assert re.search(r"^\s*m=audio \d+ RTP/AVP 8\s*$", first, re.M), first
    finally:
        await asyncio.to_thread(server.stop)


async def test_a_drain_answers_new_sessions_503_and_ends_recordings_in_flight_with_bye(
    service_engine: Engine, tmp_path: Path
) -> None:
    """A recording in flight when the server drains: OPTIONS (an SBC's ping) and a new INVITE get 503 with
    Retry-After; the recording's stream finishes what it heard (its finals, then call_ended) and the SRC
    gets a BYE, sent again over UDP until it is answered (SIPp answers it 1.2 s late)."""
    server = ServerThread(ServerConfig(siprec_port=free_port()), service_engine, http=True).start()
    try:
        call_id = "drained-" + secrets.token_hex(6)
        caller = jfk_mulaw()
        write_pcap(
            tmp_path / "call.pcap", [(6000, leg_frames(caller, 0.3, 12.0)), (6002, leg_frames(b"", 0, 12.0))]
        )
        async with asyncio.timeout(CALL_DEADLINE_S), follow(server, f"{call_id}-1") as (one, reader):
            sipp = asyncio.create_task(
                run_sipp(
                    "ended_by_server.xml",
                    siprec_port(server),
                    tmp_path,
                    call_id,
                    ("caller_aor", CALLER_AOR),
                    ("agent_aor", AGENT_AOR),
                    timeout_s=60,
                )
            )
            await asyncio.sleep(4.5)  # past "and so my fellow Americans" (before the hold in the pcap)
            server.loop.call_soon_threadsafe(server.server.recognizer.drain)
            options = await request(server, tmp_path, "OPTIONS")
            invite = await request(
                server, tmp_path, "INVITE", MULTIPART, multipart(SDP_OFFER.format(formats="0"))
            )
            code, log = await sipp
            await reader
        assert code == 0, log  # the server's BYE came and was answered
        byes = re.findall(r"^\s*BYE sip:.*?^\s*Via: [^\n]*branch=(\S+)", log, re.M | re.S)
        assert len(byes) >= 2 and len(set(byes)) == 1, log  # unanswered for 1.2 s over UDP: sent again
        for response in (options, invite):
            assert status_of(response) == 503 and "draining" in response, response
            assert re.search(r"^\s*Retry-After: \d+", response, re.M), response
        finals = " ".join(m["text"] for m in one.messages if m["type"] == "transcript" and m["is_final"])
        assert "my fellow america" in normalize(finals), one.messages
        assert one.messages[-1]["type"] == "call_ended", one.messages
    finally:
        await asyncio.to_thread(server.stop)


async def test_a_message_past_max_message_bytes_gets_513(service_engine: Engine, tmp_path: Path) -> None:
    """--siprec-max-message-bytes bounds what one SIP message may make the door read: past it, 513 with a
    Warning naming the flag; a message within it is answered as ever."""
    server = ServerThread(
        ServerConfig(siprec_port=free_port(), siprec_max_message_bytes=2048), service_engine
    )
    server.start()
    try:
        response = await request(server, tmp_path, "OPTIONS", "text/plain", "x" * 3000)
        assert status_of(response) == 513 and "--siprec-max-message-bytes" in response, response
        assert status_of(await request(server, tmp_path, "OPTIONS", "text/plain", "x" * 1000)) == 200
    finally:
        await asyncio.to_thread(server.stop)


async def test_every_frontend_serves_the_sip_port(
    two_frontend_process: ServerProcess, two_frontend_siprec_port: int, tmp_path: Path
) -> None:
    """asr-server with two frontend processes: the supervisor reserves --siprec-port and each frontend binds
    it (UDP and TCP, SO_REUSEPORT); OPTIONS from many source ports over both transports are all answered
    200, and a recording is answered 200 with its RTP ports."""
    server, port = two_frontend_process, two_frontend_siprec_port
    for transport in ("u1", "t1", "u1", "t1"):
        assert status_of(await request(server, tmp_path, "OPTIONS", transport=transport, port=port)) == 200
    offer = multipart(SDP_OFFER.format(formats="0"))
    answer = await request(server, tmp_path, "INVITE", MULTIPART, offer, port=port)
    assert status_of(answer) == 200 and len(answered_ports(answer)) == 1, answer


async def test_a_door_bound_to_every_address_answers_with_the_media_address(
    service_engine: Engine, tmp_path: Path
) -> None:
    """Bound to 0.0.0.0 (a pod's every interface), the answer cannot say c=IN IP4 0.0.0.0 (RFC 2543's
    hold): it gives --siprec-media-address, where the SBC sends RTP, in c= and o= and the Contact."""
    server = ServerThread(
        ServerConfig(siprec_port=free_port(), siprec_host="0.0.0.0", siprec_media_address="127.0.0.1"),
        service_engine,
    )
    server.start()
    try:
        answer = await request(
            server, tmp_path, "INVITE", MULTIPART, multipart(SDP_OFFER.format(formats="0"))
        )
        assert status_of(answer) == 200, answer
        assert re.search(r"^\s*c=IN IP4 127\.0\.0\.1\s*$", answer, re.M), answer
        assert "0.0.0.0" not in answer, answer
    finally:
        await asyncio.to_thread(server.stop)


async def test_a_recording_without_rtp_past_the_rtp_timeout_ends(
    service_engine: Engine, tmp_path: Path
) -> None:
    """An SRC that answers the 200 and then sends nothing (it died without a BYE): past --siprec-rtp-timeout
    the recording ends (call_ended) and its place under --max-streams is free for the next INVITE."""
    server = ServerThread(
        ServerConfig(siprec_port=free_port(), siprec_rtp_timeout=2.0, max_streams=1),
        service_engine,
        http=True,
    ).start()
    try:
        call_id = "silent-" + secrets.token_hex(6)
        offer = multipart(SDP_OFFER.format(formats="0"))
        async with asyncio.timeout(20), follow(server, f"{call_id}-1") as (one, reader):
            answer = await request(server, tmp_path, "INVITE", MULTIPART, offer, call_id=call_id)
            assert status_of(answer) == 200, answer
            await reader  # the subscriber's socket closes after call_ended
        assert one.messages[0]["type"] == "call_started" and one.messages[-1]["type"] == "call_ended", (
            one.messages
        )
        assert status_of(await request(server, tmp_path, "INVITE", MULTIPART, offer)) == 200
    finally:
        await asyncio.to_thread(server.stop)


async def test_an_invite_when_the_rtp_ports_are_taken_gets_503_naming_the_flag(
    service_engine: Engine, tmp_path: Path
) -> None:
    """--siprec-rtp-ports 41100-41103 holds one two-leg recording (41100 and 41102): the next INVITE gets 503
    with Retry-After, its Warning naming the flag."""
    server = ServerThread(
        ServerConfig(siprec_port=free_port(), siprec_rtp_ports="41100-41103"), service_engine
    )
    server.start()
    two_legs = multipart(
        SDP_OFFER.format(formats="0") + "m=audio 7002 RTP/AVP 0\r\na=label:2\r\na=sendonly\r\n"
    )
    try:
        first = await second_invite_refused_503(server, tmp_path, two_legs, "--siprec-rtp-ports")
        assert answered_ports(first) == [41100, 41102], first
    finally:
        await asyncio.to_thread(server.stop)


async def test_an_invite_requiring_an_extension_the_door_lacks_gets_420(
    server: ServerThread, tmp_path: Path
) -> None:
    """Require: 100rel (reliable provisional responses, which the door does not send): 420 Bad Extension,
    Unsupported naming the tag (every other test's request carries Require: siprec, which is taken)."""
    offer = multipart(SDP_OFFER.format(formats="0"))
    response = await request(server, tmp_path, "INVITE", MULTIPART, offer, require="siprec, 100rel")
    assert status_of(response) == 420 and re.search(r"^\s*Unsupported: 100rel", response, re.M), response
