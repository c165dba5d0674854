"""RFC 7865 recording metadata (application/rs-metadata+xml) -> who speaks on which stream label.

A participant (`<participant participant_id>` with `<nameID aor>` and maybe `<name>`) sends streams
(`<participantstreamassoc participant_id><send>stream_id</send>`), and a stream (`<stream stream_id>`)
carries the SDP's `a=label` (`<label>`). The XML comes from an allowed peer but is parsed with the stdlib:
a DOCTYPE (the door to entity expansion) is refused before parsing.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

NS = "urn:ietf:params:xml:ns:recording:1"
# roles some SRCs put in a participant's name or an extension element; the leg is labelled by it
ROLES = ("customer", "agent", "caller", "callee")


class MetadataError(ValueError):
    """Metadata that is not RFC 7865's; the text names the element."""


@dataclass
class Participant:
    participant_id: str
    aor: str = ""
    name: str = ""
    role: str = ""  # customer/agent where the metadata says so

    @property
    def label(self) -> str:
        """The leg's channel label: its role where the metadata gives one, else its AOR."""
        return self.role or self.aor or self.name or self.participant_id


@dataclass
class Metadata:
    session_id: str = ""
    by_label: dict[str, Participant] = field(default_factory=dict)  # SDP a=label -> who sends it
    participants: list[Participant] = field(default_factory=list)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def parse(body: bytes) -> Metadata:
    if b"<!DOCTYPE" in body or b"<!ENTITY" in body:
        raise MetadataError("recording: a DOCTYPE or ENTITY is not taken in metadata")
    try:
        root = ET.fromstring(body)
    except ET.ParseError as e:
        raise MetadataError(f"recording: not XML ({e})") from e
    if _local(root.tag) != "recording":
        raise MetadataError(f"the root element is <{_local(root.tag)}>, not <recording> ({NS})")
    meta = Metadata()
    participants: dict[str, Participant] = {}
    sends: dict[str, str] = {}  # stream_id -> participant_id
    labels: dict[str, str] = {}  # stream_id -> label
    for element in root:
        kind = _local(element.tag)
        if kind == "session" and not meta.session_id:
            meta.session_id = element.get("session_id", "")
        elif kind == "participant":
            pid = element.get("participant_id", "")
            participant = participants.setdefault(pid, Participant(pid))
            for child in element.iter():
                child_kind = _local(child.tag)
                if child_kind == "nameID":
                    participant.aor = child.get("aor") or participant.aor
                elif child_kind == "name" and (child.text or "").strip():
                    participant.name = (child.text or "").strip()
                elif child_kind == "role" and (child.text or "").strip().lower() in ROLES:
                    participant.role = (child.text or "").strip().lower()
            if not participant.role and participant.name.lower() in ROLES:
                participant.role = participant.name.lower()
        elif kind == "participantstreamassoc":
            pid = element.get("participant_id", "")
            for child in element:
                if _local(child.tag) == "send" and (child.text or "").strip():
                    sends[(child.text or "").strip()] = pid
        elif kind == "stream":
            for child in element:
                if _local(child.tag) == "label" and (child.text or "").strip():
                    labels[element.get("stream_id", "")] = (child.text or "").strip()
    meta.participants = list(participants.values())
    for stream_id, label in labels.items():
        sender = sends.get(stream_id)
        if sender is not None and sender in participants:
            meta.by_label[label] = participants[sender]
    return meta
