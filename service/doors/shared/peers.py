"""Who may reach a door that carries no credentials (Asterisk's AudioSocket, SIPREC's SIP and RTP): peers
checked by address against the networks of a `--*-allowed-peers` flag (service/config.py `allowed_peers`)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable


def peer_allowed(peer: str, networks: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    """Whether `peer` (an address as a socket reports it: maybe with an IPv6 zone, maybe IPv4-mapped) is in
    one of `networks`; anything that is not an address is not allowed."""
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return any(address in network for network in networks)
