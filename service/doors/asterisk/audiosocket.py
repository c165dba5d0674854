"""The Asterisk AudioSocket door: a TCP server (`--audiosocket-port`, 9092 by convention) that Asterisk's
`AudioSocket(uuid,host:port)` dialplan application (or ARI externalMedia) connects to, once per call.

The protocol (Asterisk's res_audiosocket): frames of one type byte, a 2-byte big-endian length and the
payload. 0x01 the call's UUID (16 bytes, first), 0x10 audio (signed linear 16-bit, 8 kHz, mono: what the
channel hears, the caller), 0x03 a DTMF digit, 0x00 hangup, 0xff an error code. AudioSocket carries no
credentials: the door binds `--audiosocket-host` and closes any peer outside `--audiosocket-allowed-peers`
before reading a byte.

The UUID is the call id subscribers follow (service/doors/call_transcripts.py); the one leg is labelled
"caller". A hangup frame or the connection's end finishes the stream: the last words are transcribed and
published. A frame that is not AudioSocket's, or one the server does not take, ends the call with a
hangup frame (AudioSocket has no error text towards Asterisk) and a log line naming it; a refusal by the
core (limits, draining) likewise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid

from service.config import ServerConfig, allowed_peers
from service.doors.shared.peers import peer_allowed
from service.recognizer.recognizer import Recognizer, Stream
from service.vocabulary.errors import Code, RecognitionError
from service.vocabulary.types import AudioFormat, CallInfo, Identity, RecognitionSettings, StreamSettings

log = logging.getLogger("service.doors.asterisk.audiosocket")

DOOR = "asterisk-audiosocket"
HANGUP, UUID, DTMF, AUDIO_8K, ERROR = 0x00, 0x01, 0x03, 0x10, 0xFF
RATE = 8000
HANGUP_FRAME = bytes((HANGUP, 0, 0))
FIRST_FRAME_WITHIN_S = 10.0  # Asterisk sends the UUID at once; a peer that sends nothing is let go


class ProtocolError(ValueError):
    """Bytes that are not AudioSocket's, or a frame this door does not take; the text names it."""


def stream_settings(call_id: str) -> StreamSettings:
    return StreamSettings(
        recognition=RecognitionSettings(format=AudioFormat("LINEAR16", RATE, 1)),
        call=CallInfo(call_id=call_id, platform="asterisk", channel_labels=("caller",)),
    )


class AudioSocketDoor:
    def __init__(self, config: ServerConfig, recognizer: Recognizer, *, reuse_port: bool = False) -> None:
        self.config = config
        self.recognizer = recognizer
        self.reuse_port = reuse_port
        self.allowed = allowed_peers(config.audiosocket_allowed_peers)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._calls: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(
            self._connected,
            self.config.audiosocket_host,
            self.config.audiosocket_port,
            reuse_port=self.reuse_port,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace: float) -> None:
        """No new connections; calls still open after `grace` seconds are cancelled."""
        if self._server is None:
            return
        self._server.close()
        if self._calls:
            _, pending = await asyncio.wait(set(self._calls), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _allowed(self, peer: str) -> bool:
        return peer_allowed(peer, self.allowed)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str((writer.get_extra_info("peername") or ("",))[0])
        if not self._allowed(peer):
            log.warning(
                "audiosocket: a peer outside --audiosocket-allowed-peers was closed",
                extra={"fields": {"peer": peer}},
            )
            writer.close()
            return
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            await AudioSocketCall(self, reader, writer, Identity("asterisk", peer)).run()
        finally:
            self._calls.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


class AudioSocketCall:
    def __init__(
        self,
        door: AudioSocketDoor,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        caller: Identity,
    ) -> None:
        self.door, self.reader, self.writer, self.caller = door, reader, writer, caller
        self.stream: Stream | None = None
        self._events: asyncio.Task[None] | None = None
        self._hung_up = False

    async def _frame(self, first: bool) -> tuple[int, bytes] | None:
        """The next frame; None at the connection's end."""
        try:
            async with asyncio.timeout(FIRST_FRAME_WITHIN_S if first else None):
                header = await self.reader.readexactly(3)
                payload = await self.reader.readexactly(int.from_bytes(header[1:3], "big"))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        except TimeoutError as e:
            raise ProtocolError(f"no UUID frame within {FIRST_FRAME_WITHIN_S:g} s of connecting") from e
        return header[0], payload

    async def run(self) -> None:
        try:
            try:
                await self._read()
                if self.stream is not None:
                    self.stream.finish()  # hangup: the last words are transcribed and published
            except ProtocolError as e:
                log.warning("audiosocket: %s; hanging up", e, extra={"fields": self._fields()})
                self._hang_up_on_asterisk()
                if self.stream is not None:
                    self.stream.fail(RecognitionError(Code.INVALID_ARGUMENT, str(e)))
            except RecognitionError as e:  # the core refused the call: limits, draining
                log.warning(
                    "audiosocket: refused: %s; hanging up", e.message, extra={"fields": self._fields()}
                )
                self._hang_up_on_asterisk()
            if self._events is not None:
                await self._events
        finally:
            if self._events is not None:
                self._events.cancel()
            if self.stream is not None:
                await self.stream.close()

    def _fields(self) -> dict[str, str]:
        fields = {"peer": self.caller.peer}
        if self.stream is not None:
            fields["stream_id"] = self.stream.id
        return fields

    def _hang_up_on_asterisk(self) -> None:
        if self._hung_up:
            return
        self._hung_up = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            self.writer.write(HANGUP_FRAME)

    async def _read(self) -> None:
        frame = await self._frame(first=True)
        if frame is None:
            return
        kind, payload = frame
        if kind != UUID or len(payload) != 16:
            raise ProtocolError(
                f"the first frame must be the call's UUID (type 0x01, 16 bytes), got type {kind:#04x}"
            )
        call_id = str(uuid.UUID(bytes=payload))
        self.stream = self.door.recognizer.open_stream(
            stream_settings(call_id), door=DOOR, identity=self.caller
        )
        self._events = asyncio.create_task(self._take_events(self.stream))
        while (frame := await self._frame(first=False)) is not None:
            kind, payload = frame
            if kind == AUDIO_8K:
                if len(payload) % 2:
                    raise ProtocolError(
                        f"an audio frame of {len(payload)} bytes: 16-bit samples come in pairs"
                    )
                self.stream.audio(payload)
                await self.stream.pace()
            elif kind == HANGUP:
                return
            elif kind == ERROR:
                log.info(
                    "audiosocket: Asterisk reported error %s; ending the call",
                    payload.hex() or "(none)",
                    extra={"fields": self._fields()},
                )
                return
            elif kind == DTMF:
                continue
            else:
                raise ProtocolError(
                    f"frame type {kind:#04x} is not taken here (0x10 audio at 8 kHz; set the channel to slin)"
                )
            if not self.stream.takes_audio:
                return  # the stream ended on its own (a limit, a drain): its events say why

    async def _take_events(self, stream: Stream) -> None:
        try:
            async for _ in stream.events():
                pass  # the core publishes each result to the call's subscribers
        except RecognitionError as e:
            log.warning("audiosocket: the stream ended: %s", e.message, extra={"fields": self._fields()})
        self._hang_up_on_asterisk()  # the call's transcription is over (a drain too): the dialplan goes on
