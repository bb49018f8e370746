"""Gateway HTTPS flags (vLLM's names): validated at start-up, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdmesh.gateway.config import GatewayConfig, parse_gateway_config
from tests.certs import make_test_certs

pytestmark = pytest.mark.fast


def test_https_flags_are_validated(tmp_path: Path) -> None:
    certs = make_test_certs(tmp_path)
    config = parse_gateway_config(["--ssl-certfile", str(certs.cert), "--ssl-keyfile",
                                   str(certs.key)], env={})
    assert config.https and config.ssl_cert_reqs == 0
    assert not GatewayConfig().https
    bad = [
        ({"ssl_certfile": str(certs.cert)}, "given together"),
        ({"ssl_ca_certs": str(certs.ca)}, "need --ssl-certfile"),
        ({"ssl_certfile": str(certs.cert), "ssl_keyfile": str(certs.key), "ssl_cert_reqs": 2},
         "needs --ssl-ca-certs"),
        ({"ssl_certfile": str(certs.cert), "ssl_keyfile": str(certs.key), "ssl_cert_reqs": 5},
         "0, 1 or 2"),
        ({"ssl_certfile": str(tmp_path / "nope"), "ssl_keyfile": str(certs.key)},
         "--ssl-certfile: no such file"),
    ]
    for fields, message in bad:
        with pytest.raises(ValueError, match=message):
            GatewayConfig(**fields)  # type: ignore[arg-type]
