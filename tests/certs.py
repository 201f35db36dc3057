"""Certificates and SuperNode keys for the deployment tests, made with the ``cryptography`` package.

* :func:`make_ca`: a self-signed CA (P-256), written as ``<name>.pem`` (certificate) and ``<name>.key``;
* :func:`make_server_cert`: a server certificate signed by a CA, with SANs for ``localhost``, ``127.0.0.1``
  and ``::1`` (what the SuperLink presents to SuperNodes and to ``flwr run`` on loopback);
* :func:`make_node_key`: a SuperNode's authentication key pair in the format Flower 1.41 wants: an ECDSA key
  on a NIST curve (P-384), the private key in OpenSSH format (``flower-supernode
  --auth-supernode-private-key``), the public key as one OpenSSH line (``flwr supernode register``).

The same files come out of ``openssl`` / ``ssh-keygen -t ecdsa -b 384`` (fedhead/flower/DEPLOY.md).
"""

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
class CA:
    cert: Path  # PEM certificate (what --root-certificates / --ssl-ca-certfile take)
    key: Path  # PEM private key
    _cert: x509.Certificate
    _key: ec.EllipticCurvePrivateKey


def _write_key(path: Path, key) -> Path:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)
    return path


def _validity(builder: x509.CertificateBuilder, expired: bool = False) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    if expired:  # valid for a day, ending a day ago
        return builder.not_valid_before(now - datetime.timedelta(days=2)).not_valid_after(
            now - datetime.timedelta(days=1)
        )
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=2)
    )


def make_ca(folder: Path, name: str = "ca") -> CA:
    """A self-signed certificate authority: ``<folder>/<name>.pem`` and ``<folder>/<name>.key``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fedhead test {name}")])
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_path = folder / f"{name}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return CA(cert_path, _write_key(folder / f"{name}.key", key), cert, key)


def make_server_cert(
    ca: CA,
    folder: Path,
    name: str = "server",
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1"),
    expired: bool = False,
) -> tuple[Path, Path]:
    """A server certificate signed by ``ca`` for ``hosts`` (DNS names or IP addresses in the SAN):
    ``(<folder>/<name>.pem, <folder>/<name>.key)``; ``expired``: its validity ended yesterday."""
    key = ec.generate_private_key(ec.SECP256R1())
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        _validity(x509.CertificateBuilder(), expired)
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca._cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca._key.public_key()), critical=False)
        .sign(ca._key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_path = folder / f"{name}.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, _write_key(folder / f"{name}.key", key)


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's key pair as ``ssh-keygen -t ecdsa -b 384 -N "" -f <folder>/<name>`` writes it:
    ``(<folder>/<name>, <folder>/<name>.pub)`` (OpenSSH private key, one-line OpenSSH public key)."""
    key = ec.generate_private_key(ec.SECP384R1())
    folder.mkdir(parents=True, exist_ok=True)
    priv = folder / name
    priv.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    priv.chmod(0o600)
    pub = folder / f"{name}.pub"
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        + f" {name}\n".encode()
    )
    return priv, pub
