"""TLS and mutual TLS for the gRPC port, from PEM files named by --tls-cert, --tls-key, --tls-client-ca.

With a client CA the server requires a client certificate signed by it (mutual TLS); without one any
client that trusts the server's certificate may connect (and bearer tokens, if on, identify it).
"""

from __future__ import annotations

from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """A TLS file is missing or unreadable; the message names the flag."""


def _read(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"{flag} {path!r}: cannot read it ({e})") from e
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"{flag} {path!r}: not a PEM file")
    return data


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials | None:
    """None when TLS is off (no certificate given); else credentials for `add_secure_port`."""
    if not cert and not key:
        if client_ca:
            raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if not (cert and key):
        raise TlsConfigError("--tls-cert and --tls-key go together")
    pair = (_read("--tls-key", key), _read("--tls-cert", cert))
    ca = _read("--tls-client-ca", client_ca) if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
