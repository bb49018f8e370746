"""`pdmesh prefill`: run one prefill instance until SIGINT/SIGTERM.

Prints `ready <host:port> role=prefill instance_id=... kv_address=...` on stdout once serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdmesh.decode_svc.engine_service import serve
from pdmesh.grpc_common import parse_config
from pdmesh.logs import configure_logging
from pdmesh.prefill_svc.config import PrefillConfig


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PrefillConfig, argv, prog="pdmesh prefill",
                          description="Serve the Prefill service (prompt KV + first tokens).")
    configure_logging(config.log_level)
    return asyncio.run(serve(config, "prefill"))
