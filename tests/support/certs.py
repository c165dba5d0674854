"""Certificates made on the spot for TLS tests: a CA, a server certificate for 127.0.0.1/localhost, client
certificates (one from the trusted CA, one from a rogue CA), all PEM files in one folder."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA that signed the server and the good client
    server: Pem
    client: Pem
    rogue_ca: Path  # a CA nobody trusts
    rogue_client: Pem


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(
    subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    pem = Pem(folder / f"{stem}.crt", folder / f"{stem}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return pem


def _ca(folder: Path, stem: str) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (
        _builder(f"{stem} test CA", _name(f"{stem} test CA"), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key), cert, key


def _leaf(
    folder: Path,
    stem: str,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    usage: x509.ObjectIdentifier,
    server: bool,
) -> Pem:
    key = _key()
    builder = _builder(stem, ca_cert.subject, key.public_key()).add_extension(
        x509.ExtendedKeyUsage([usage]), critical=False
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return _write(folder, stem, builder.sign(ca_key, hashes.SHA256()), key)


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_cert, ca_key = _ca(folder, "ca")
    rogue, rogue_cert, rogue_key = _ca(folder, "rogue-ca")
    return Pki(
        ca=ca.cert,
        server=_leaf(folder, "server", ca_cert, ca_key, ExtendedKeyUsageOID.SERVER_AUTH, server=True),
        client=_leaf(folder, "client", ca_cert, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH, server=False),
        rogue_ca=rogue.cert,
        rogue_client=_leaf(
            folder, "rogue-client", rogue_cert, rogue_key, ExtendedKeyUsageOID.CLIENT_AUTH, server=False
        ),
    )
