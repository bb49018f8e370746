"""Test certificates made on the fly: a CA, a service certificate (server and client use, SAN
localhost/127.0.0.1) and a rogue client certificate from a CA nobody trusts."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdmesh.grpc_common import TLSConfig


@dataclass(frozen=True)
class CertSet:
    ca: Path
    cert: Path  # the service certificate, for servers and clients alike
    key: Path
    rogue_cert: Path
    rogue_key: Path

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(str(self.cert), str(self.key), str(self.ca))

    @property
    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key),
                "--tls-ca", str(self.ca)]


Issued = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def _issue(name: str, issuer: Issued | None) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=6))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ), False,
        ).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                   ExtendedKeyUsageOID.CLIENT_AUTH]), False,
        )
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256()), key


def _write(directory: Path, name: str, issued: Issued) -> tuple[Path, Path]:
    cert, key = issued
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def make_test_certs(directory: Path) -> CertSet:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _issue("pdmesh test CA", None)
    ca_path, _ = _write(directory, "ca", ca)
    rogue_ca = _issue("rogue CA", None)
    return CertSet(ca_path, *_write(directory, "service", _issue("pdmesh service", ca)),
                     *_write(directory, "rogue", _issue("rogue client", rogue_ca)))
