"""The `pdmesh serve [MODEL]` command: parse `MeshConfig`, start a `LocalMesh`, supervise it
until Ctrl-C / SIGTERM, then stop it.

A busy fixed port is refused before anything starts, naming its flag. When a child fails to
start, its fatal error (its last stderr lines) is the last thing printed, after the other
children's shutdown. `pdmesh serve` generates a cluster token per run (unless
PDMESH_CLUSTER_TOKEN[_FILE] is set) and hands it to the children through their environment.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from pdmesh import __version__
from pdmesh.auth import TOKEN_ENV, TOKEN_FILE_ENV, ClusterToken
from pdmesh.config import parse_config
from pdmesh.kvstore.redis_server import RedisServerError
from pdmesh.logs import configure_logging
from pdmesh.serve.child import Child, ChildFailed
from pdmesh.serve.config import MeshConfig
from pdmesh.serve.mesh import LocalMesh
from pdmesh.serve.supervisor import Supervisor
from pdmesh.serve.vllm_flags import vllm_command_line


def children_env(config: MeshConfig, env: dict[str, str]) -> dict[str, str]:
    """`env` with what `config`'s vLLM flags set in the environment (`--otlp-traces-endpoint`,
    `--hf-token`) and a cluster token (`with_cluster_token`)."""
    if config.otlp_traces_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = config.otlp_traces_endpoint
    if config.hf_token:
        env["HF_TOKEN"] = config.hf_token
    return with_cluster_token(env)


def with_cluster_token(env: dict[str, str]) -> dict[str, str]:
    """`env` with a fresh cluster token unless one is configured: `pdmesh serve` makes one per
    run, so its engines only answer the router (docs/SECURITY.md). It travels in the
    children's environment, never on a command line."""
    if not (env.get(TOKEN_ENV) or env.get(TOKEN_FILE_ENV)):
        env[TOKEN_ENV] = ClusterToken.generate().value
    return env


def _positional_model(argv: Sequence[str]) -> list[str]:
    """`pdmesh serve MODEL [flags]` as vLLM spells it -> `--model MODEL [flags]`."""
    args = list(argv)
    if args and not args[0].startswith("-"):
        return ["--model", args[0], *args[1:]]
    return args


def check_ports(config: MeshConfig) -> None:
    """Refuse a fixed port that something already listens on, before anything starts (else
    the mesh would load every engine first and then fail), naming the flag that sets it."""
    for flag, port in (("--port", config.http_port), ("--grpc-port", config.grpc_port)):
        if port <= 0:
            continue
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                sock.bind((config.host, port))
            except OSError as exc:
                raise OSError(f"cannot listen on {config.host}:{port} ({exc.strerror or exc}); "
                              f"choose another port with {flag} (0 picks a free one)") from None


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(
        MeshConfig, _positional_model(sys.argv[1:] if argv is None else argv),
        prog="pdmesh serve [MODEL]",
        description=f"pdmesh {__version__}: start redis, prefill and decode engines, the "
                    "router and the OpenAI HTTP API as local processes, and restart any of "
                    "them that dies. MODEL (or --model) is an alias, an HF-format directory or "
                    "a Hub id; --port is the HTTP port, as in `vllm serve`, and --grpc-port the "
                    "router's.",
        foreign=vllm_command_line,
    )
    configure_logging(config.log_level)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mesh = LocalMesh(config, env=children_env(config, dict(os.environ)))
    try:
        check_ports(config)
        address = mesh.start()
    except (ChildFailed, OSError, RedisServerError) as exc:
        # Last, after the other children's shutdown: what went wrong, in the child's words.
        print(f"pdmesh serve: error: {exc}", file=sys.stderr)
        for line in getattr(exc, "last_words", ()):
            print(f"  {line}", file=sys.stderr)
        return 1
    mesh.supervise()
    engines = (
        f"{config.num_decode} colocated" if config.colocated
        else f"{config.num_prefill} prefill, {config.num_decode} decode"
    )
    print(f"router listening on {address} (redis {mesh.redis_url}, {engines})", flush=True)
    if mesh.gateway_url:
        print(f"OpenAI API on {mesh.gateway_url}", flush=True)
    for name, url in mesh.metrics_urls().items():
        print(f"metrics {name} {url}", flush=True)
    gateway = f" gateway={mesh.gateway_url}" if mesh.gateway_url else ""
    print(f"ready {address}{gateway}", flush=True)
    try:
        while not stop.wait(timeout=1.0):
            pass  # the supervisor's threads restart what dies
    finally:
        mesh.stop()
        report_deaths(mesh.supervisor)
    return 0


def report_deaths(supervisor: Supervisor | None) -> None:
    """Last, after every child's shutdown logs: which children died while serving, and the
    fatal error of those that exited with one."""
    for state in supervisor.states() if supervisor is not None else ():
        if not state.exits:
            continue
        print(f"pdmesh serve: {state.spec.name} ended {state.exits} time(s) while serving, "
              f"last: {state.last_exit}", file=sys.stderr)
        if isinstance(state.ended, Child) and (state.ended.poll() or 0) > 0:
            for line in state.ended.last_words():
                print(f"  {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
