"""`pdmesh prefill` and `pdmesh decode`: the engine processes, composed from the role packages.

The one module that knows both roles: a colocated instance (`pdmesh decode --role colocated`)
serves the Prefill and the Decode service over one engine, so the composition lives above
`prefill_svc/` and `decode_svc/`, which never import each other. Each process prints
`ready <host:port> role=... instance_id=... kv_address=...` on stdout once serving.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.config import parse_config
from pdmesh.decode_svc.config import DecodeConfig
from pdmesh.decode_svc.role import DecodePart
from pdmesh.engine_svc.process import RolePartFactory, serve
from pdmesh.logs import run_service
from pdmesh.prefill_svc.config import PrefillConfig
from pdmesh.prefill_svc.role import PrefillPart


def prefill_main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PrefillConfig, argv, prog="pdmesh prefill",
                          description="Serve the Prefill service (prompt KV + first tokens).")
    return run_service("prefill", config.log_level,
                       lambda: serve(config, "prefill", [PrefillPart]))


def decode_main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DecodeConfig, argv, prog="pdmesh decode",
                          description="Serve the Decode service (KV import + streaming decode).")
    parts: list[RolePartFactory] = [DecodePart]
    if config.role == "colocated":
        parts = [PrefillPart, DecodePart]
    return run_service(config.role, config.log_level, lambda: serve(config, config.role, parts))

