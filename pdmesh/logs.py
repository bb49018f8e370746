"""Process set-up for pdmesh services: key=value logs on stderr (quiet by default) and the
shared `main` body of a front-door service."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any

FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s"


def configure_logging(level: str = "warning") -> None:
    """Configure the root logger once per process; `level` is a standard level name."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log_level: unknown level {level!r}")
    logging.basicConfig(level=numeric, stream=sys.stderr, format=FORMAT)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (the default install has it), else asyncio's.

    Every streamed token crosses three event loops (engine service, router, gateway); on
    uvloop each costs less CPU, and on a machine the engine's threads fill that CPU is decode
    throughput. `PDMESH_EVENT_LOOP=asyncio` keeps the standard loop (a debugging aid)."""
    import os

    if os.environ.get("PDMESH_EVENT_LOOP", "").lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_service(
    component: str, log_level: str, serve: Callable[[], Coroutine[Any, Any, object]]
) -> int:
    """Run one asyncio service process to completion: logs, tracing, exit code.

    Every pdmesh process (router, gateway, prefill, decode) starts here. The exit code is what
    `serve()` returns when that is an int (an engine refused by the cluster), else 0. Ctrl-C is
    a clean exit (0); a start-up error the service reports as OSError/ValueError (a taken
    port, a bad OTEL_* setting) is one line on stderr and exit code 1.
    """
    from pdmesh.tracing import configure_tracing, shutdown_tracing

    configure_logging(log_level)
    code = 0
    try:
        configure_tracing(f"pdmesh-{component}")
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            result = runner.run(serve())
        if isinstance(result, int):
            code = result
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as exc:
        print(f"pdmesh {component}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    return code
