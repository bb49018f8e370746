"""`pdmesh decode`: run one decode (or, with --role colocated, colocated) instance.

Prints `ready <host:port> role=decode instance_id=...` on stdout once serving. A colocated
instance serves the Prefill and Decode services from one engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.decode_svc.engine_service import serve
from pdmesh.grpc_common import parse_config
from pdmesh.logs import configure_logging


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DecodeConfig, argv, prog="pdmesh decode",
                          description="Serve the Decode service (KV import + streaming decode).")
    configure_logging(config.log_level)
    return asyncio.run(serve(config, config.role))
