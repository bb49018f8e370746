"""Slow and idle HTTP clients are cut off by a real `pdmesh gateway` process: a connection
that sends nothing, a request head sent a byte at a time (slowloris), and a kept-alive
connection idle after its response. No router is needed: /version answers on its own."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import pytest

from pdmesh.serve import Child, pdmesh_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.processes]

TIMEOUT_S = 1.0
SLACK_S = 3.0  # a loaded 2-core machine answers a timer late, never early
HEAD = b"GET /version HTTP/1.1\r\nHost: test\r\nUser-Agent: slowloris\r\n\r\n"


@pytest.fixture(scope="module")
def address() -> Iterator[tuple[str, int]]:
    gateway = Child("gateway", pdmesh_command(
        "gateway", "--router-address", "127.0.0.1:1", "--port", "0",
        "--header-timeout-s", str(TIMEOUT_S), "--keep-alive-timeout-s", str(TIMEOUT_S)))
    try:
        host, port = gateway.wait_ready(timeout_s=60).rsplit(":", 1)
        yield host, int(port)
    finally:
        gateway.terminate()


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (it sends nothing first)."""
    started = time.monotonic()
    sock.settimeout(TIMEOUT_S + SLACK_S)
    assert sock.recv(1) == b"", "the server answered instead of closing"
    return time.monotonic() - started


def cut_off(sock: socket.socket) -> bool:
    """The server closed `sock`: an orderly end, or a reset when a byte the client sent
    crossed the server's close (its kernel answers such a byte with RST)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head and its Content-Length body), nothing after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return data


def test_silent_slow_and_idle_connections_are_closed(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as silent:
        assert TIMEOUT_S - 0.1 <= closed_after(silent) < TIMEOUT_S + SLACK_S

    with socket.create_connection(address) as slow:
        started, sent = time.monotonic(), 0
        while sent < len(HEAD):  # one byte per 0.2 s: the head would take 12 s
            slow.sendall(HEAD[sent:sent + 1])
            sent += 1
            readable, _, _ = select.select([slow], [], [], 0.2)
            if readable:
                break
        assert cut_off(slow) and sent < len(HEAD)
        assert time.monotonic() - started < TIMEOUT_S + SLACK_S

    with socket.create_connection(address) as kept_alive:
        kept_alive.sendall(HEAD)
        assert read_response(kept_alive).startswith(b"HTTP/1.1 200")
        assert TIMEOUT_S - 0.1 <= closed_after(kept_alive) < TIMEOUT_S + SLACK_S
