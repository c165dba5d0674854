"""SDP (RFC 4566) offer/answer (RFC 3264) for a recording server: each audio m-line of the SRC's offer is
one recorded leg, sendonly towards us; the answer takes it recvonly on a port of ours, with the first of
PCMU/PCMA the offer lists. Other m-lines (video, other codecs, past the legs we take) are refused with
port 0, as RFC 3264 section 6 says, and the session goes on with the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

# the static payload types of G.711 (RFC 3551): what the receiver decodes
CODECS = {0: "PCMU", 8: "PCMA"}
DIRECTIONS = ("sendonly", "sendrecv", "recvonly", "inactive")
# what a recorder answers to each offered direction (it only ever receives)
ANSWER_DIRECTION = {
    "sendonly": "recvonly",
    "sendrecv": "recvonly",
    "recvonly": "inactive",
    "inactive": "inactive",
}


class SdpError(ValueError):
    """An offer without usable audio or that is not SDP; the text says what (SIP answers 488)."""


@dataclass
class MediaLine:
    media: str
    port: int
    proto: str
    formats: list[str]
    label: str = ""
    direction: str = "sendrecv"
    rtpmap: dict[int, str] = field(default_factory=dict)  # payload type -> "PCMU/8000"
    address: str = ""  # the m-line's c= or the session's

    def codec(self) -> int | None:
        """The first offered G.711 payload type, None if none (static numbers or rtpmap names)."""
        for fmt in self.formats:
            if not fmt.isdigit():
                continue
            pt = int(fmt)
            name = self.rtpmap.get(pt, CODECS.get(pt, "")).split("/")[0].upper()
            if name in CODECS.values() and self.rtpmap.get(pt, "/8000").endswith("/8000"):
                return pt
        return None

    @property
    def usable(self) -> bool:
        return (
            self.media == "audio" and self.port > 0 and "RTP/AVP" in self.proto and self.codec() is not None
        )


@dataclass
class Offer:
    version: int
    origin: str
    lines: list[MediaLine]


def parse_offer(text: str) -> Offer:
    origin, session_address = "", ""
    session_direction = "sendrecv"
    lines: list[MediaLine] = []
    if not text.lstrip().startswith("v=0"):
        raise SdpError("the SDP does not start with v=0")
    for raw in text.replace("\r\n", "\n").split("\n"):
        kind, eq, value = raw.strip().partition("=")
        if not eq:
            continue
        current = lines[-1] if lines else None
        if kind == "o":
            origin = value
        elif kind == "c":
            address = value.split()[-1] if value.split() else ""
            if current is None:
                session_address = address
            else:
                current.address = address
        elif kind == "m":
            parts = value.split()
            if len(parts) < 4:
                raise SdpError(f"m={value}: media, port, proto and formats")
            try:
                port = int(parts[1].split("/")[0])
            except ValueError as e:
                raise SdpError(f"m={value}: the port is not a number") from e
            lines.append(MediaLine(parts[0], port, parts[2], parts[3:], direction=session_direction))
        elif kind == "a":
            name, _, attr = value.partition(":")
            if name in DIRECTIONS:
                if current is None:
                    session_direction = name
                else:
                    current.direction = name
            elif current is None:
                continue
            elif name == "label":
                current.label = attr.strip()
            elif name == "rtpmap":
                pt, _, encoding = attr.partition(" ")
                if pt.isdigit():
                    current.rtpmap[int(pt)] = encoding.strip()
    for line in lines:
        line.address = line.address or session_address
    if not any(line.usable for line in lines):
        raise SdpError("no audio m-line offers PCMU or PCMA over RTP/AVP at 8000 Hz")
    return Offer(0, origin, lines)


def answer(offer: Offer, ports: list[int | None], host: str, session_id: int, version: int) -> str:
    """The answer: line i on ports[i] (None: refused, port 0), recvonly with the chosen codec and the
    offer's label; `version` goes up with each new answer in the dialog (RFC 3264 section 8)."""
    out = [
        "v=0",
        f"o=asr-server {session_id} {version} IN {'IP6' if ':' in host else 'IP4'} {host}",
        "s=asr-server SIPREC",
        f"c=IN {'IP6' if ':' in host else 'IP4'} {host}",
        "t=0 0",
    ]
    for line, port in zip(offer.lines, ports, strict=True):
        pt = line.codec()
        if port is None or pt is None:
            out.append(f"m={line.media} 0 {line.proto} {' '.join(line.formats)}")
            continue
        out.append(f"m=audio {port} RTP/AVP {pt}")
        out.append(f"a=rtpmap:{pt} {CODECS[pt]}/8000")
        if line.label:
            out.append(f"a=label:{line.label}")
        out.append(f"a={ANSWER_DIRECTION[line.direction]}")
    return "\r\n".join(out) + "\r\n"
