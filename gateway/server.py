"""`pdmesh gateway`: serve the OpenAI-compatible REST API in front of a router.

    pdmesh gateway --router-address 127.0.0.1:50051 --host 127.0.0.1 --port 8000
    pdmesh gateway ... --ssl-certfile cert.pem --ssl-keyfile key.pem   # HTTPS

Prints `ready <host:port>` once it accepts requests (as every pdmesh service does), so that
`pdmesh serve` and tests wait for that line instead of sleeping. Connections idle between
requests (`--keep-alive-timeout-s`) and request heads that arrive too slowly
(`--header-timeout-s`, gateway/header_timeout.py) are closed. SIGINT/SIGTERM drain it: uvicorn
stops accepting connections, lets running requests (streams included) finish for up to
`--drain-timeout-s`, cancels what is left, then the router channel is closed, which cancels
those calls and so frees their KV on the engines.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Sequence

import uvicorn

from pdmesh.gateway.app import create_app
from pdmesh.gateway.config import GatewayConfig, parse_gateway_config
from pdmesh.gateway.header_timeout import header_timeout_protocol
from pdmesh.logs import run_service

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 30.0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def serve(config: GatewayConfig) -> None:
    """Run until SIGINT/SIGTERM (uvicorn's own handlers)."""
    sock = _bind(config.host, config.port)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            log_level=config.uvicorn_log_level or config.log_level,
            access_log=False,
            timeout_graceful_shutdown=config.drain_timeout_s,
            # Idle connections between requests, and slow request heads (uvicorn times out
            # only the former; gateway/header_timeout.py adds the latter).
            timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
            http=header_timeout_protocol(config.header_timeout_s),
            lifespan="on",
            root_path=config.root_path,
            # HTTPS when configured (vLLM's flags); plaintext clients then fail the handshake.
            ssl_certfile=config.ssl_certfile,
            ssl_keyfile=config.ssl_keyfile,
            ssl_ca_certs=config.ssl_ca_certs,
            ssl_cert_reqs=config.ssl_cert_reqs,
            **({"ssl_ciphers": config.ssl_ciphers} if config.ssl_ciphers else {}),
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_TIMEOUT_S
    while not server.started and not task.done() and loop.time() < deadline:
        await asyncio.sleep(0.02)  # uvicorn exposes no event for "listening"
    if not server.started:
        server.should_exit = True
        await task
        raise OSError(f"gateway did not start within {STARTUP_TIMEOUT_S:g}s")
    host = f"[{config.host}]" if ":" in config.host else config.host
    scheme = "https" if config.https else "http"
    logger.info("gateway serving address=%s://%s:%d router=%s", scheme, host, bound,
                config.router_address)
    print(f"ready {host}:{bound} scheme={scheme}", flush=True)
    await task


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_gateway_config(argv)
    return run_service("gateway", config.log_level, lambda: serve(config))


if __name__ == "__main__":
    sys.exit(main())
