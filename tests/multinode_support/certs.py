"""Test certificates made with ``cryptography``: a CA, a server certificate for
127.0.0.1, a client certificate, and a second CA with its own client (the wrong ones)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["make_certs"]

_DAY = datetime.timedelta(days=1)


def _write(base: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    base.with_name(base.name + "-key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    base.with_name(base.name + ".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + 2 * _DAY)
    )


def _ca(name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], name: str, server: bool
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = _builder(subject, ca[1].subject, key).add_extension(
        x509.ExtendedKeyUsage(usage), critical=False
    )
    if server:
        names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca[0], hashes.SHA256())


def make_certs(folder: Path) -> dict[str, Path]:
    """Write the files; returns their paths by name (ca, server, client, other-ca, other-client
    and the ``-key`` of each)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = _ca("relaunch test CA"), _ca("another CA")
    _write(folder / "ca", *ca)
    _write(folder / "other-ca", *other)
    _write(folder / "server", *_leaf(ca, "etcd", server=True))
    _write(folder / "client", *_leaf(ca, "relaunch", server=False))
    _write(folder / "other-client", *_leaf(other, "relaunch", server=False))
    return {p.name.removesuffix(".pem"): p for p in folder.glob("*.pem")}
