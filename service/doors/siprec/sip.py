"""SIP messages (RFC 3261) as the SIPREC door needs them, parsed and written by hand: no well-kept SIP
library fits a server in an asyncio process (PyPI's are clients, unmaintained, or bind their own loop).

A message is a start line, headers (compact forms expanded, names kept in RFC 3261's spelling) and a body.
`Framer` cuts a TCP byte stream into messages by Content-Length; over UDP one datagram is one message.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

# RFC 3261 section 7.3.3 and RFC 3841's compact forms
COMPACT = {
    "i": "Call-ID",
    "m": "Contact",
    "e": "Content-Encoding",
    "l": "Content-Length",
    "c": "Content-Type",
    "f": "From",
    "s": "Subject",
    "k": "Supported",
    "t": "To",
    "v": "Via",
    "o": "Event",
    "r": "Refer-To",
    "u": "Allow-Events",
}
CANONICAL = {
    name.lower(): name
    for name in (
        "Via",
        "From",
        "To",
        "Call-ID",
        "CSeq",
        "Contact",
        "Content-Type",
        "Content-Length",
        "Require",
        "Supported",
        "Allow",
        "Accept",
        "Retry-After",
        "Unsupported",
        "Max-Forwards",
        "Server",
        "Warning",
    )
}
REASONS = {
    100: "Trying",
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    405: "Method Not Allowed",
    415: "Unsupported Media Type",
    420: "Bad Extension",
    481: "Call/Transaction Does Not Exist",
    488: "Not Acceptable Here",
    491: "Request Pending",
    500: "Server Internal Error",
    503: "Service Unavailable",
    513: "Message Too Large",
}
_REQUEST_LINE = re.compile(r"^([A-Za-z]+) (\S+) SIP/2\.0$")
_STATUS_LINE = re.compile(r"^SIP/2\.0 (\d{3}) (.*)$")


class SipError(ValueError):
    """A message that is not SIP, or lacks what RFC 3261 requires; the text names the header."""


def canonical(name: str) -> str:
    name = name.strip()
    lower = name.lower()
    if lower in COMPACT:
        return COMPACT[lower]
    return CANONICAL.get(lower, name)


@dataclass
class Message:
    start: str  # "INVITE sip:x SIP/2.0" or "SIP/2.0 200 OK"
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    @property
    def is_request(self) -> bool:
        return not self.start.startswith("SIP/2.0 ")

    @property
    def method(self) -> str:
        match = _REQUEST_LINE.match(self.start)
        return match.group(1).upper() if match else ""

    @property
    def status(self) -> int:
        match = _STATUS_LINE.match(self.start)
        return int(match.group(1)) if match else 0

    def all(self, name: str) -> list[str]:
        """Every value of the header, comma-separated lists split for Via (each hop is its own)."""
        name = canonical(name)
        values = [v for n, v in self.headers if n == name]
        if name == "Via":
            return [part.strip() for v in values for part in _split_commas(v)]
        return values

    def get(self, name: str, default: str = "") -> str:
        values = self.all(name)
        return values[0] if values else default

    def tokens(self, name: str) -> set[str]:
        """A comma-separated option list (Require, Supported), lower-cased."""
        return {t.strip().lower() for v in self.all(name) for t in v.split(",") if t.strip()}

    @property
    def call_id(self) -> str:
        return self.get("Call-ID")

    @property
    def cseq(self) -> tuple[int, str]:
        number, _, method = self.get("CSeq").partition(" ")
        try:
            return int(number), method.strip().upper()
        except ValueError as e:
            raise SipError(f"CSeq: a number and a method (got {self.get('CSeq')!r})") from e

    @property
    def branch(self) -> str:
        return param(self.get("Via"), "branch")

    def serialize(self) -> bytes:
        lines = [self.start]
        lines += [f"{n}: {v}" for n, v in self.headers if n != "Content-Length"]
        lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


def _split_commas(value: str) -> list[str]:
    """Split at commas outside quotes and angle brackets."""
    parts: list[str] = []
    current: list[str] = []
    depth, quoted = 0, False
    for ch in value:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch == "<":
            depth += 1
        elif not quoted and ch == ">":
            depth -= 1
        if ch == "," and not quoted and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p for p in parts if p.strip()]


def param(value: str, name: str) -> str:
    """A header parameter (`;tag=...`, `;branch=...`) outside the <URI>, "" if absent."""
    outside = value.rsplit(">", 1)[-1] if ">" in value else value
    for part in outside.split(";")[1:]:
        key, _, val = part.partition("=")
        if key.strip().lower() == name:
            return val.strip()
    return ""


def parse(data: bytes) -> Message:
    """One whole message (a datagram, or a Framer's cut); SipError naming what is wrong."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        head, sep, body = data.partition(b"\n\n")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SipError("the headers are not UTF-8") from e
    lines = text.replace("\r\n", "\n").split("\n")
    start = lines[0].strip()
    if not (_REQUEST_LINE.match(start) or _STATUS_LINE.match(start)):
        raise SipError(f"not a SIP/2.0 request or response line: {start[:80]!r}")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        if line[:1] in (" ", "\t") and headers:  # a folded header continues the previous one
            name, value = headers[-1]
            headers[-1] = (name, value + " " + line.strip())
            continue
        name, colon, value = line.partition(":")
        if not colon:
            raise SipError(f"a header line without a colon: {line[:80]!r}")
        headers.append((canonical(name), value.strip()))
    message = Message(start, headers, body)
    length = message.get("Content-Length")
    if length:
        try:
            n = int(length)
        except ValueError as e:
            raise SipError(f"Content-Length: a number (got {length!r})") from e
        if n > len(body):
            raise SipError(f"Content-Length: {n} bytes, the message holds {len(body)}")
        message.body = body[:n]
    if message.is_request:
        for required in ("Via", "From", "To", "Call-ID", "CSeq"):
            if not message.get(required):
                raise SipError(f"{required}: missing (RFC 3261 section 8.1.1)")
    return message


def response(
    request: Message,
    status: int,
    *,
    to_tag: str = "",
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    reason: str = "",
) -> Message:
    """A response to `request` (RFC 3261 section 8.2.6): its Vias, From, Call-ID and CSeq copied, the To
    with our tag added (a 100 Trying keeps the To as it came)."""
    to = request.get("To")
    if to_tag and status > 100 and not param(to, "tag"):
        to = f"{to};tag={to_tag}"
    copied = [("Via", v) for v in request.all("Via")]
    copied += [("From", request.get("From")), ("To", to), ("Call-ID", request.call_id)]
    copied.append(("CSeq", request.get("CSeq")))
    return Message(
        f"SIP/2.0 {status} {reason or REASONS.get(status, 'Unknown')}", copied + (headers or []), body
    )


def new_tag() -> str:
    return secrets.token_hex(8)


class Framer:
    """A TCP byte stream -> whole messages, by Content-Length (RFC 3261 section 18.3); keep-alive CRLFs
    between messages are skipped."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()

    def push(self, data: bytes) -> list[bytes]:
        """The messages now whole; SipError when one grows past max_bytes."""
        self._buffer.extend(data)
        out: list[bytes] = []
        while True:
            while self._buffer[:2] == b"\r\n":
                del self._buffer[:2]
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > self.max_bytes:
                    raise SipError(f"a message's headers run past {self.max_bytes} bytes")
                return out
            head = bytes(self._buffer[:end]).decode("utf-8", "replace")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if canonical(name) == "Content-Length":
                    try:
                        length = int(value.strip())
                    except ValueError as e:
                        raise SipError(f"Content-Length: a number (got {value.strip()!r})") from e
            total = end + 4 + length
            if total > self.max_bytes:
                raise SipError(f"a message of {total} bytes is past {self.max_bytes}")
            if len(self._buffer) < total:
                return out
            out.append(bytes(self._buffer[:total]))
            del self._buffer[:total]
