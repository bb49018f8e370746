"""Process-wide log set-up for pdmesh services: key=value lines on stderr, quiet by default."""

from __future__ import annotations

import logging
import sys

FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s"


def configure_logging(level: str = "warning") -> None:
    """Configure the root logger once per process; `level` is a standard level name."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log_level: unknown level {level!r}")
    logging.basicConfig(level=numeric, stream=sys.stderr, format=FORMAT)
