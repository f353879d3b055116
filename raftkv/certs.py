"""Throw-away certificates: a CA and the certificates it signs, for the demo and tests.

``make_ca`` writes a self-signed CA; ``issue`` writes a key and a certificate signed by
it, for a node (its HTTP and peer ports) or a client. ``cluster_certs`` does both for
every node of a local cluster. The keys are ECDSA P-256, the certificates valid for a
year; nothing here is meant for production, where an operator's own PKI issues them
(docs/security.md shows the same steps with openssl).

Uses ``cryptography`` (the ``demo`` extra), imported only when a certificate is made,
so a node that is given its certificates never needs it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey
    from cryptography.x509 import Certificate

VALID_DAYS = 365


class CertToolMissing(RuntimeError):
    """``cryptography`` is not installed."""


def _require() -> None:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise CertToolMissing("making certificates needs the cryptography package: "
                              "pip install 'raftkv[demo]' (or make them with openssl: "
                              "docs/security.md)") from None


@dataclass(frozen=True)
class CertFiles:
    cert: str
    key: str
    ca: str


def _new_key() -> EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: str, data: bytes, private: bool = False) -> None:
    # Private keys are 0600 from the start: never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _save(cert: Certificate, key: EllipticCurvePrivateKey, cert_path: str,
          key_path: str) -> None:
    from cryptography.hazmat.primitives import serialization

    _write(key_path, key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))


def make_ca(directory: str, name: str = "raftkv throw-away CA") -> CertFiles:
    """A self-signed CA in ``directory`` (``ca.pem``, ``ca-key.pem``)."""
    _require()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    os.makedirs(directory, exist_ok=True)
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    files = CertFiles(os.path.join(directory, "ca.pem"),
                      os.path.join(directory, "ca-key.pem"),
                      os.path.join(directory, "ca.pem"))
    _save(cert, key, files.cert, files.key)
    return files


def issue(ca: CertFiles, directory: str, name: str,
          hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> CertFiles:
    """``<name>.pem`` and ``<name>-key.pem`` in ``directory``, signed by ``ca``: common
    name ``name``, subject alternative names ``hosts`` (IP addresses or DNS names), for
    both server and client use (a node dials its peers with the certificate it serves)."""
    _require()
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    with open(ca.cert, "rb") as f:
        ca_cert = x509.load_pem_x509_certificate(f.read())
    with open(ca.key, "rb") as f:
        ca_key = serialization.load_pem_private_key(f.read(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{ca.key} is not an EC key (make the CA with make_ca)")
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = _new_key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = CertFiles(os.path.join(directory, f"{name}.pem"),
                      os.path.join(directory, f"{name}-key.pem"), ca.cert)
    _save(cert, key, files.cert, files.key)
    return files


def cluster_certs(directory: str, names: list[str]) -> tuple[CertFiles, dict[str, CertFiles]]:
    """A new CA in ``directory`` and a certificate for each of ``names`` (valid for
    127.0.0.1 and localhost): (the CA, {name: its files})."""
    ca = make_ca(directory)
    return ca, {n: issue(ca, directory, n) for n in names}
