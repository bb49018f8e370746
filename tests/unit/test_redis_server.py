"""The throwaway redis-server helper: starts, answers, refuses a taken port, stops."""

from __future__ import annotations

import socket

import pytest

from pdmesh.kvstore.redis_server import HOST, RedisServer, RedisServerError, server_pid

pytestmark = pytest.mark.redis


def test_starts_on_free_ports_and_stops_cleanly() -> None:
    with RedisServer() as first, RedisServer() as second:
        assert first.port != second.port
        assert first.url == f"redis://127.0.0.1:{first.port}/0"
        assert server_pid(first.port) == first.pid
        assert server_pid(second.port) == second.pid
        port = first.port
    assert not first.running and not second.running
    assert server_pid(port) is None


def test_explicit_port_that_is_taken_is_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind((HOST, 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(RedisServerError, match="did not start"):
            RedisServer(port=port, startup_timeout_s=5.0).start()


def test_missing_binary_is_a_clear_error() -> None:
    with pytest.raises(RedisServerError, match="cannot run"):
        RedisServer(binary="/nonexistent/redis-server").start()
