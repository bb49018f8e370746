"""The gateway serves HTTPS as configured (a real process, a real TLS handshake): with
`--ssl-ciphers`, a client offering only other ciphers fails the handshake."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from pdmesh.serve import Child, pdmesh_command
from tests.certs import make_test_certs

pytestmark = [pytest.mark.processes, pytest.mark.slow]

SERVER_CIPHERS = "ECDHE-ECDSA-AES256-GCM-SHA384"  # TLS 1.2; the test certificate is ECDSA
OTHER_CIPHERS = "ECDHE-ECDSA-AES128-GCM-SHA256"


def client_context(ca: Path, ciphers: str) -> ssl.SSLContext:
    """A TLS 1.2 client offering only `ciphers` (TLS 1.3's suites are not set by cipher
    lists, so 1.3 is left out for the refusal to show)."""
    context = ssl.create_default_context(cafile=str(ca))
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(ciphers)
    return context


def test_https_with_a_cipher_list(tmp_path: Path) -> None:
    certs = make_test_certs(tmp_path)
    gateway = Child("gateway", pdmesh_command(
        "gateway", "--router-address", "127.0.0.1:1", "--port", "0",
        "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
        "--ssl-ciphers", SERVER_CIPHERS))
    try:
        address = gateway.wait_ready(timeout_s=60)
        port = address.rpartition(":")[2]
        url = f"https://127.0.0.1:{port}/version"
        with httpx.Client(verify=client_context(certs.ca, SERVER_CIPHERS)) as http:
            assert http.get(url, timeout=10).status_code == 200
        with (httpx.Client(verify=client_context(certs.ca, OTHER_CIPHERS)) as http,
              pytest.raises(httpx.ConnectError)):
            http.get(url, timeout=10)
        with httpx.Client(verify=False) as http, pytest.raises(httpx.HTTPError):
            http.get(f"http://127.0.0.1:{port}/version", timeout=10)  # no plaintext
    finally:
        gateway.terminate(grace_s=10)
