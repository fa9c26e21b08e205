"""Certificates made in the test: a CA, a server certificate for localhost / 127.0.0.1 signed
by it, a client certificate signed by it (mutual TLS), and a client certificate of another,
untrusted CA."""

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
class Certs:
    ca: Path
    server: Pem
    client: Pem
    rogue_client: Pem
    """Signed by a CA the server does not trust."""


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Pem(cert_path, key_path)


def _ca(common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    common: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca[1], hashes.SHA256()), key


def make_certs(folder: Path) -> Certs:
    ca = _ca("pdserve test CA")
    ca_path = folder / "ca.pem"
    ca_path.write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    server = _leaf("localhost", ca, ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client = _leaf("pdserve test client", ca, ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = _leaf("rogue client", _ca("rogue CA"), ExtendedKeyUsageOID.CLIENT_AUTH)
    return Certs(
        ca=ca_path,
        server=_write(folder, "server", *server),
        client=_write(folder, "client", *client),
        rogue_client=_write(folder, "rogue", *rogue),
    )
