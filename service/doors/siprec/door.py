"""SIPREC dialogs -> recognition streams: the Session Recording Server side of RFC 7866 on
`--siprec-port` (SIP over UDP and TCP).

An SRC (an SBC, a PBX) records a call by sending an INVITE whose multipart/mixed body holds an SDP offer
(one sendonly audio m-line per leg, each with `a=label`) and rs-metadata naming the participants and the
label each sends. The door answers 100 Trying, then 200 OK with a recvonly answer (one even RTP port per
leg from `--siprec-rtp-ports`, PCMU or PCMA as offered), and opens one stream of one channel per leg,
labelled by the participant (its role where the metadata gives one, else its AOR). A re-INVITE or UPDATE
(hold, resume, new metadata) gets a fresh answer on the same ports; BYE ends the stream once the RTP
receiver has handed over what it held, so the last words are transcribed and published.

The call id subscribers follow is the SIPREC dialog's Call-ID: every SRC has one from the first message,
whereas metadata may come later or not at all; the metadata's session_id is kept in the call's attributes.

SIP carries no credentials: a peer outside `--siprec-allowed-peers` gets 403. Refusals answer in SIP's
terms: 415 (a body that is not SIPREC's), 488 (no usable audio), 420 (an extension required that the
door lacks), 481 (no such dialog), 405 (a method it does not take), 503 with Retry-After (draining, the
core's limits such as --max-streams, no free RTP ports); the Warning header names the field or the flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import email.parser
import email.policy
import functools
import logging
import secrets
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

from service.config import ServerConfig, allowed_peers, rtp_port_range
from service.doors.shared.peers import peer_allowed
from service.doors.siprec import metadata as md
from service.doors.siprec import rtp, sdp, sip
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import AudioFormat, CallInfo, Identity, RecognitionSettings, StreamSettings

log = logging.getLogger("service.doors.siprec")

DOOR = "siprec"
MAX_LEGS = 2  # the two legs of a recorded call; further m-lines are refused with port 0
ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS, UPDATE, INFO"
ACCEPT = "application/sdp, application/rs-metadata+xml, multipart/mixed"
SUPPORTED = "siprec"  # no session timers (RFC 4028): a dead SRC is found by --siprec-rtp-timeout
RETRY_AFTER_S = 5
ENDING = "siprec-ending"  # the name of a task that ends a recording (stop waits for those)
T1, T2 = 0.5, 4.0  # RFC 3261's timers: the 2xx to an INVITE is sent again over UDP until the ACK
TRANSACTION_S = 32.0  # how long a response is kept for a retransmitted request (64*T1)
Reply = Callable[[bytes], None]


class Refusal(Exception):
    """A request answered with an error status; `warning` names the field or the flag."""

    def __init__(self, status: int, warning: str, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(warning)
        self.status, self.warning, self.headers = status, warning, headers or []


@dataclass
class Body:
    sdp: str = ""
    metadata: bytes = b""


def split_body(message: sip.Message) -> Body:
    """The SDP and the rs-metadata of a request's body; Refusal 415 for anything else."""
    content_type = message.get("Content-Type").lower()
    kind = content_type.split(";")[0].strip()
    if kind == "application/sdp":
        return Body(sdp=message.body.decode("utf-8", "replace"))
    if kind in ("application/rs-metadata+xml", "application/rs-metadata"):
        return Body(metadata=message.body)
    if kind != "multipart/mixed":
        raise Refusal(
            415, f"Content-Type: {kind or 'none'} is not SIPREC's (multipart/mixed)", [("Accept", ACCEPT)]
        )
    parsed = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(
        f"Content-Type: {message.get('Content-Type')}\r\n\r\n".encode() + message.body
    )
    body = Body()
    parts = parsed.get_payload() if parsed.is_multipart() else []
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, email.message.Message):
            continue
        part_type = part.get_content_type()
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes):
            continue
        if part_type == "application/sdp":
            body.sdp = payload.decode("utf-8", "replace")
        elif part_type in ("application/rs-metadata+xml", "application/rs-metadata"):
            body.metadata = payload
    if not body.sdp:
        raise Refusal(415, "multipart/mixed: no application/sdp part", [("Accept", ACCEPT)])
    return body


def stream_settings(
    call_id: str, labels: list[str], meta: md.Metadata, offer_labels: list[str]
) -> StreamSettings:
    attributes = [("session_id", meta.session_id)] if meta.session_id else []
    for label, leg in zip(offer_labels, labels, strict=True):
        participant = meta.by_label.get(label)
        if participant is not None and participant.aor:
            attributes.append((f"aor.{leg}", participant.aor))
    return StreamSettings(
        recognition=RecognitionSettings(
            format=AudioFormat("LINEAR16", rtp.RATE, len(labels)), separate_channels=len(labels) > 1
        ),
        call=CallInfo(
            call_id=call_id, platform=DOOR, channel_labels=tuple(labels), attributes=tuple(attributes)
        ),
    )


def leg_labels(offer_labels: list[str], meta: md.Metadata) -> list[str]:
    """Each leg's channel label: its participant's role or AOR, else the SDP label; never twice the same."""
    labels: list[str] = []
    for i, label in enumerate(offer_labels):
        participant = meta.by_label.get(label)
        name = (
            participant.label if participant is not None else (f"label:{label}" if label else f"leg{i + 1}")
        )
        labels.append(name if name not in labels else f"{name}#{i + 1}")
    return labels


def media_address(config: ServerConfig) -> str:
    """What the answers say to send RTP to: a wildcard bind address is no address to send to (0.0.0.0 in
    c= is RFC 2543's hold)."""
    if config.siprec_media_address:
        return config.siprec_media_address
    host = config.siprec_host.strip("[]")
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass
class Recording:
    """One SIPREC dialog and its stream."""

    call_id: str
    to_tag: str
    invite: sip.Message
    reply: Reply
    peer: tuple[str, int]
    lines: list[int]  # indexes of the offer's m-lines taken as legs
    socks_ports: list[int]
    session: rtp.Session
    stream: Stream
    sdp_session_id: int = field(default_factory=lambda: secrets.randbelow(1 << 31))
    sdp_version: int = 1
    remote_cseq: int = 0
    local_cseq: int = 0
    acked: asyncio.Event = field(default_factory=asyncio.Event)
    events: asyncio.Task[None] | None = None
    ended: bool = False


class SiprecDoor:
    def __init__(self, config: ServerConfig, recognizer: Recognizer, *, reuse_port: bool = False) -> None:
        self.config = config
        self.recognizer = recognizer
        self.reuse_port = reuse_port
        self.allowed = allowed_peers(config.siprec_allowed_peers)
        self.port = 0
        self.media_address = media_address(config)
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._receiver: rtp.Receiver | None = None
        self._dialogs: dict[str, Recording] = {}
        self._answered: dict[tuple[str, str, str], tuple[float, bytes]] = {}  # a retransmission's answer
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()  # set when the last recording ends
        self._byes: dict[str, asyncio.Event] = {}  # our BYEs' branches, until answered

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        c = self.config
        self._udp, _ = await loop.create_datagram_endpoint(
            lambda: _Udp(self), local_addr=(c.siprec_host, c.siprec_port), reuse_port=self.reuse_port or None
        )
        self.port = self._udp.get_extra_info("sockname")[1]
        self._tcp = await asyncio.start_server(
            self._connected, c.siprec_host, self.port, reuse_port=self.reuse_port
        )
        # RTP from anyone but the allowed peers would be words spoken into someone's recording
        self._receiver = rtp.Receiver(
            c.siprec_host, rtp_port_range(c.siprec_rtp_ports), loop, allowed=self._allowed
        )
        return self.port

    async def stop(self, grace: float) -> None:
        """No new requests; recordings still open after `grace` seconds end (their last words transcribed)
        and the SRC is sent a BYE."""
        if self._tcp is not None:
            self._tcp.close()
        if self._dialogs and grace > 0:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._idle.wait()
        for recording in list(self._dialogs.values()):
            await self._end(recording, send_bye=True)
        endings = {t for t in self._tasks if t.get_name() == ENDING}
        if endings:  # recordings a BYE ended just before: their last words are being transcribed
            await asyncio.wait(endings, timeout=max(grace, 1.0))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._udp is not None:
            self._udp.close()
        if self._receiver is not None:
            await asyncio.to_thread(self._receiver.stop)

    def _allowed(self, peer: str) -> bool:
        return peer_allowed(peer, self.allowed)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str = "siprec") -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        framer = sip.Framer(self.config.siprec_max_message_bytes)

        def write(data: bytes) -> None:
            if not writer.is_closing():
                writer.write(data)

        reply = _TcpReply(write)

        try:
            while data := await reader.read(65536):
                try:
                    messages = framer.push(data)
                except sip.SipError as e:
                    log.warning(
                        "siprec: %s; closing the TCP connection", e, extra={"fields": {"peer": peer[0]}}
                    )
                    reply(b"SIP/2.0 513 Message Too Large\r\nContent-Length: 0\r\n\r\n")
                    break
                for message in messages:
                    self.received(message, (str(peer[0]), int(peer[1])), reply)
                if messages and not self._allowed(str(peer[0])):
                    break  # answered 403: a stranger keeps no connection open here
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def received(self, data: bytes, peer: tuple[str, int], reply: Reply) -> None:
        """One SIP message from `peer`; what is sent back goes through `reply`."""
        try:
            message = sip.parse(data)
        except sip.SipError as e:
            log.info("siprec: not a SIP message: %s", e, extra={"fields": {"peer": peer[0]}})
            return  # RFC 3261 section 16.3: a malformed message is dropped (no Via to answer to)
        if not message.is_request:  # a response to our BYE: it need not be sent again
            answered = self._byes.pop(message.branch, None)
            if answered is not None:
                answered.set()
            return
        method = message.method
        if method != "ACK":
            key = (message.call_id, message.branch, method)
            previous = self._answered.get(key)
            if previous is not None:  # a retransmission: the same answer again
                reply(previous[1])
                return
        if not self._allowed(peer[0]):
            log.warning(
                "siprec: a peer outside --siprec-allowed-peers was refused",
                extra={"fields": {"peer": peer[0], "method": method}},
            )
            # answered, not kept for retransmissions: a stranger's requests hold no memory here
            forbidden = sip.response(
                message,
                403,
                to_tag=sip.new_tag(),
                headers=[("Warning", '399 asr-server "this peer is not in --siprec-allowed-peers"')],
            )
            reply(forbidden.serialize())
            return
        if len(data) > self.config.siprec_max_message_bytes:
            self._respond(
                message,
                reply,
                sip.response(
                    message,
                    513,
                    to_tag=sip.new_tag(),
                    headers=[
                        (
                            "Warning",
                            f'399 asr-server "a message past {self.config.siprec_max_message_bytes} bytes (--siprec-max-message-bytes)"',
                        )
                    ],
                ),
            )
            return
        try:
            self._request(message, peer, reply)
        except Refusal as e:
            to_tag = sip.param(message.get("To"), "tag") or sip.new_tag()
            warning = e.warning.replace('"', "'")
            headers = [*e.headers, ("Warning", f'399 asr-server "{warning}"')]
            log.info(
                "siprec: %s answered %d: %s", method, e.status, e.warning, extra={"fields": {"peer": peer[0]}}
            )
            self._respond(message, reply, sip.response(message, e.status, to_tag=to_tag, headers=headers))
        except sip.SipError as e:
            self._respond(
                message,
                reply,
                sip.response(
                    message,
                    400,
                    to_tag=sip.new_tag(),
                    reason="Bad Request",
                    headers=[("Warning", f'399 asr-server "{str(e).replace(chr(34), chr(39))}"')],
                ),
            )

    def _respond(self, request: sip.Message, reply: Reply, response: sip.Message) -> bytes:
        data = response.serialize()
        loop = asyncio.get_running_loop()
        now = loop.time()
        if response.status >= 200:
            self._answered[(request.call_id, request.branch, request.method)] = (now, data)
            for key in [k for k, (at, _) in self._answered.items() if now - at > TRANSACTION_S]:
                del self._answered[key]
        reply(data)
        return data

    def _request(self, message: sip.Message, peer: tuple[str, int], reply: Reply) -> None:
        method = message.method
        to_tag = sip.param(message.get("To"), "tag")
        recording = self._dialogs.get(message.call_id)
        if recording is not None and to_tag and to_tag != recording.to_tag:
            recording = None
        if method == "OPTIONS":
            if self.recognizer.draining:  # an SBC's OPTIONS ping takes a draining server out of its rotation
                raise Refusal(503, "the server is draining", [("Retry-After", str(RETRY_AFTER_S))])
            self._respond(
                message,
                reply,
                sip.response(
                    message,
                    200,
                    to_tag=to_tag or sip.new_tag(),
                    headers=[("Allow", ALLOW), ("Accept", ACCEPT), ("Supported", SUPPORTED)],
                ),
            )
        elif method == "INVITE" and not to_tag:
            self._invite(message, peer, reply)
        elif method in ("INVITE", "UPDATE"):
            if recording is None:
                raise Refusal(481, f"{method}: no SIPREC dialog with this Call-ID and tags")
            self._reinvite(recording, message, reply)
        elif method == "ACK":
            if recording is not None:
                recording.acked.set()
        elif method == "BYE":
            if recording is None:
                raise Refusal(481, "BYE: no SIPREC dialog with this Call-ID and tags")
            self._respond(message, reply, sip.response(message, 200))
            self._spawn(self._end(recording, send_bye=False), ENDING)
        elif method == "CANCEL":
            # the door answers an INVITE at once, so a CANCEL finds its transaction complete (RFC 3261
            # section 9.2: 200 to the CANCEL, no effect) or no transaction at all
            if recording is not None and recording.invite.branch == message.branch:
                self._respond(message, reply, sip.response(message, 200, to_tag=recording.to_tag))
            else:
                raise Refusal(481, "CANCEL: no INVITE transaction to cancel")
        elif method == "INFO":
            if recording is None:
                raise Refusal(481, "INFO: no SIPREC dialog with this Call-ID and tags")
            self._respond(message, reply, sip.response(message, 200))
        else:
            raise Refusal(405, f"{method}: a SIPREC recording server takes {ALLOW}", [("Allow", ALLOW)])

    def _check_require(self, message: sip.Message) -> None:
        unsupported = message.tokens("Require") - {"siprec"}
        if unsupported:
            names = ", ".join(sorted(unsupported))
            raise Refusal(420, f"Require: {names} is not supported", [("Unsupported", names)])

    def _invite(self, message: sip.Message, peer: tuple[str, int], reply: Reply) -> None:
        if message.call_id in self._dialogs:
            raise Refusal(
                491, "INVITE: this Call-ID has a recording already (a re-INVITE carries the To tag)"
            )
        self._check_require(message)
        if self.recognizer.draining:
            raise Refusal(
                503, "the server is draining; retry on another replica", [("Retry-After", str(RETRY_AFTER_S))]
            )
        reply(sip.response(message, 100).serialize())
        kind = message.get("Content-Type").split(";")[0].strip().lower()
        if kind != "multipart/mixed":  # an INVITE of SDP alone is a call, not a recording session
            raise Refusal(
                415,
                f"Content-Type: {kind or 'none'} is not SIPREC's (multipart/mixed: application/sdp and "
                "application/rs-metadata+xml)",
                [("Accept", ACCEPT)],
            )
        body = split_body(message)
        if not body.metadata:
            raise Refusal(
                415,
                "multipart/mixed: no application/rs-metadata+xml part (not a SIPREC INVITE)",
                [("Accept", ACCEPT)],
            )
        try:
            meta = md.parse(body.metadata)
        except md.MetadataError as e:
            raise Refusal(400, f"rs-metadata: {e}") from e
        try:
            offer = sdp.parse_offer(body.sdp)
        except sdp.SdpError as e:
            raise Refusal(488, f"SDP: {e}") from e
        lines = [i for i, line in enumerate(offer.lines) if line.usable][:MAX_LEGS]
        assert self._receiver is not None
        socks = self._receiver.allocate(len(lines))
        if socks is None:
            raise Refusal(
                503,
                f"no free RTP ports in --siprec-rtp-ports {self.config.siprec_rtp_ports}",
                [("Retry-After", str(RETRY_AFTER_S))],
            )
        offer_labels = [offer.lines[i].label for i in lines]
        labels = leg_labels(offer_labels, meta)
        to_tag = sip.new_tag()
        try:
            stream = self.recognizer.open_stream(
                stream_settings(message.call_id, labels, meta, offer_labels),
                door=DOOR,
                identity=Identity(DOOR, peer[0]),
            )
        except RecognitionError as e:
            for sock in socks:
                sock.close()
            if e.code in (Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE):
                raise Refusal(488, e.message) from e
            raise Refusal(503, e.message, [("Retry-After", str(RETRY_AFTER_S))]) from e
        payload_types = [offer.lines[i].codec() or 0 for i in lines]
        loop = asyncio.get_running_loop()
        recording: Recording

        def deliver(frames: bytes) -> None:  # on the RTP thread
            loop.call_soon_threadsafe(self._audio, recording, frames)

        def timed_out() -> None:  # on the RTP thread
            loop.call_soon_threadsafe(self._rtp_timed_out, recording)

        session = rtp.Session(socks, payload_types, deliver)
        session.timeout_s, session.on_timeout = self.config.siprec_rtp_timeout, timed_out
        recording = Recording(
            call_id=message.call_id,
            to_tag=to_tag,
            invite=message,
            reply=reply,
            peer=peer,
            lines=lines,
            socks_ports=[s.getsockname()[1] for s in socks],
            session=session,
            stream=stream,
            remote_cseq=message.cseq[0],
        )
        self._dialogs[message.call_id] = recording
        self._receiver.add(session)
        recording.events = asyncio.create_task(self._take_events(recording))
        log.info(
            "siprec: recording",
            extra={
                "fields": {
                    "peer": peer[0],
                    "call_id": message.call_id,
                    "stream_id": stream.id,
                    "legs": labels,
                }
            },
        )
        data = self._respond(message, reply, self._ok(recording, message, offer))
        if not isinstance(reply, _TcpReply):
            self._spawn(self._retransmit(recording, data))

    def _ok(self, recording: Recording, request: sip.Message, offer: sdp.Offer) -> sip.Message:
        ports: list[int | None] = [None] * len(offer.lines)
        for index, port in zip(recording.lines, recording.socks_ports, strict=True):
            ports[index] = port
        answer = sdp.answer(offer, ports, self.media_address, recording.sdp_session_id, recording.sdp_version)
        recording.sdp_version += 1
        host = self.media_address
        contact_host = f"[{host}]" if ":" in host else host
        return sip.response(
            request,
            200,
            to_tag=recording.to_tag,
            headers=[
                ("Contact", f"<sip:asr-server@{contact_host}:{self.port}>;+sip.srs"),
                ("Allow", ALLOW),
                ("Supported", SUPPORTED),
                ("Content-Type", "application/sdp"),
            ],
            body=answer.encode(),
        )

    async def _retransmit(self, recording: Recording, data: bytes) -> None:
        """The 2xx again until the ACK (RFC 3261 section 13.3.1.4), over UDP."""
        interval = T1
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(64 * T1):
                while not recording.acked.is_set() and not recording.ended:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(interval):
                            await recording.acked.wait()
                    if not recording.acked.is_set():
                        recording.reply(data)
                    interval = min(2 * interval, T2)

    def _reinvite(self, recording: Recording, message: sip.Message, reply: Reply) -> None:
        """Hold, resume, new metadata: a fresh answer on the same ports. The stream's labels were set when
        it opened, so new participants are logged, not relabelled."""
        self._check_require(message)
        number, _ = message.cseq
        if number <= recording.remote_cseq and message.method == "INVITE":
            raise Refusal(500, "CSeq: not above the dialog's last one", [("Retry-After", "1")])
        recording.remote_cseq = max(recording.remote_cseq, number)
        if message.method == "INVITE":
            reply(sip.response(message, 100).serialize())
        if not message.body:
            if message.method == "INVITE":
                raise Refusal(488, "a re-INVITE without an SDP offer is not taken here")
            self._respond(message, reply, sip.response(message, 200, to_tag=recording.to_tag))
            return
        body = split_body(message)
        if body.metadata:
            with contextlib.suppress(md.MetadataError):
                meta = md.parse(body.metadata)
                log.info(
                    "siprec: metadata updated",
                    extra={
                        "fields": {
                            "call_id": recording.call_id,
                            "participants": [p.aor for p in meta.participants],
                        }
                    },
                )
        if not body.sdp:
            self._respond(message, reply, sip.response(message, 200, to_tag=recording.to_tag))
            return
        try:
            offer = sdp.parse_offer(body.sdp)
        except sdp.SdpError as e:
            raise Refusal(488, f"SDP: {e}") from e
        if max(recording.lines) >= len(offer.lines):
            raise Refusal(488, "SDP: a re-offer keeps every m-line of the first offer (RFC 3264 section 8)")
        payload_types = [offer.lines[i].codec() for i in recording.lines]
        if any(pt is None for pt in payload_types):
            raise Refusal(488, "SDP: a recorded leg's m-line no longer offers PCMU or PCMA")
        recording.session.set_payload_types([pt or 0 for pt in payload_types])
        recording.acked.clear()
        data = self._respond(message, reply, self._ok(recording, message, offer))
        if message.method == "INVITE" and not isinstance(reply, _TcpReply):
            self._spawn(self._retransmit(recording, data))

    def _audio(self, recording: Recording, frames: bytes) -> None:
        if recording.ended and not recording.stream.takes_audio:
            return
        step = self.config.max_chunk_bytes - self.config.max_chunk_bytes % 4
        for i in range(0, len(frames), step):
            recording.stream.audio(frames[i : i + step])

    def _rtp_timed_out(self, recording: Recording) -> None:
        if recording.ended:
            return
        log.warning(
            "siprec: no RTP for --siprec-rtp-timeout %g s; ending the recording",
            self.config.siprec_rtp_timeout,
            extra={"fields": {"call_id": recording.call_id, "stream_id": recording.stream.id}},
        )
        self._spawn(self._end(recording, send_bye=True), ENDING)

    async def _take_events(self, recording: Recording) -> None:
        try:
            async for _ in recording.stream.events():
                pass  # the core publishes each result to the call's subscribers
        except RecognitionError as e:
            log.warning(
                "siprec: the stream ended: %s", e.message, extra={"fields": {"call_id": recording.call_id}}
            )
        if not recording.ended:  # the stream ended on its own (a limit, a drain): the SRC stops sending
            self._spawn(self._end(recording, send_bye=True), ENDING)

    async def _end(self, recording: Recording, *, send_bye: bool) -> None:
        """The recording is over: the RTP receiver hands over what it held, the stream finishes (its last
        words are transcribed and published), and the SRC is told with a BYE when it did not say so."""
        if recording.ended:
            return
        recording.ended = True
        self._dialogs.pop(recording.call_id, None)
        if not self._dialogs:
            self._idle.set()
        try:
            assert self._receiver is not None
            await self._receiver.close(recording.session)
            recording.stream.finish()
            if send_bye:
                self._send_bye(recording)
            if recording.events is not None and recording.events is not asyncio.current_task():
                await recording.events
        finally:
            await recording.stream.close()

    def _send_bye(self, recording: Recording) -> None:
        invite = recording.invite
        recording.local_cseq += 1
        contact = invite.get("Contact")
        target = (
            contact[contact.find("<") + 1 : contact.find(">")] if "<" in contact else contact.split(";")[0]
        )
        transport = "TCP" if isinstance(recording.reply, _TcpReply) else "UDP"
        host = self.media_address
        bye = sip.Message(
            f"BYE {target or invite.start.split()[1]} SIP/2.0",
            [
                ("Via", f"SIP/2.0/{transport} {host}:{self.port};branch=z9hG4bK{secrets.token_hex(8)}"),
                ("Max-Forwards", "70"),
                ("From", f"{invite.get('To')};tag={recording.to_tag}"),
                ("To", invite.get("From")),
                ("Call-ID", recording.call_id),
                ("CSeq", f"{recording.local_cseq} BYE"),
            ],
        )
        data = bye.serialize()
        with contextlib.suppress(ConnectionError, RuntimeError):
            recording.reply(data)
        if not isinstance(recording.reply, _TcpReply):
            answered = self._byes[bye.branch] = asyncio.Event()
            self._spawn(self._bye_again(recording.reply, data, bye.branch, answered))

    async def _bye_again(self, reply: Reply, data: bytes, branch: str, answered: asyncio.Event) -> None:
        """A BYE over UDP again until a response comes (RFC 3261 section 17.1.2.2: Timer E up to T2,
        given up at 64*T1)."""
        interval = T1
        try:
            async with asyncio.timeout(64 * T1):
                while not answered.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(interval):
                            await answered.wait()
                    if not answered.is_set():
                        reply(data)
                    interval = min(2 * interval, T2)
        except TimeoutError:
            log.info("siprec: the SRC never answered the BYE", extra={"fields": {"branch": branch}})
        finally:
            self._byes.pop(branch, None)


class _TcpReply:
    """A TCP connection's writer as a Reply (no 2xx retransmission over a reliable transport)."""

    def __init__(self, write: Reply) -> None:
        self.write = write

    def __call__(self, data: bytes) -> None:
        self.write(data)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, door: SiprecDoor) -> None:
        self.door = door
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        # RFC 3581: the answer goes where the request came from
        self.door.received(
            data, (str(addr[0]), int(addr[1])), functools.partial(self.transport.sendto, addr=addr)
        )
