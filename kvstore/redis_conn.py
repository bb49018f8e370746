"""A Redis connection that fails fast, says so with one exception type, and heals by itself.

The cluster index is an optimisation: when Redis is down the router must keep routing on
load alone. So every operation here has a hard deadline, every failure surfaces as
`IndexUnavailable` (one thing for callers to catch), and after a connection failure calls
fail immediately for `retry_after_s` instead of each paying a connect timeout. The first
call after that window tries the network again, which is how the client recovers once Redis
is back — no reconnect loop, no background task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class IndexUnavailable(RuntimeError):
    """Redis could not serve the request; fall back to routing without the cluster index."""


@dataclass(frozen=True)
class RedisSettings:
    url: str
    op_timeout_s: float = 0.5  # hard deadline for one operation, round trip included
    connect_timeout_s: float = 0.25
    retry_after_s: float = 1.0  # after a connection failure, fail fast for this long


class RedisConnection:
    """One asyncio Redis client shared by the prefix index and the instance registry."""

    def __init__(self, settings: RedisSettings) -> None:
        self.settings = settings
        # One retry without backoff: a pooled socket left over from a Redis that restarted
        # fails once and is replaced at once; a Redis that is really down fails fast.
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            settings.url,
            decode_responses=True,
            socket_timeout=settings.op_timeout_s,
            socket_connect_timeout=settings.connect_timeout_s,
            retry=Retry(NoBackoff(), retries=1),
        )
        self._healthy = True
        self._last_error: str | None = None
        self._retry_at = 0.0

    @classmethod
    def from_url(cls, url: str, **settings: float) -> RedisConnection:
        return cls(RedisSettings(url=url, **settings))

    @property
    def healthy(self) -> bool:
        """Whether the last operation succeeded (True before the first one)."""
        return self._healthy

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def script(self, lua: str) -> AsyncScript:
        """A Lua script run by sha; it is reloaded transparently after a Redis restart."""
        return self._client.register_script(lua)

    async def call(self, what: str, op: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """Run `op` against Redis under the deadline; any failure becomes `IndexUnavailable`."""
        now = time.monotonic()
        if not self._healthy and now < self._retry_at:
            raise IndexUnavailable(
                f"{what}: redis at {self.settings.url} unavailable "
                f"(retrying in {self._retry_at - now:.2f}s; last error: {self._last_error})"
            )
        try:
            async with asyncio.timeout(self.settings.op_timeout_s):
                result = await op(self._client)
        except (TimeoutError, RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._mark_down(what, exc, fail_fast=True)
            raise IndexUnavailable(f"{what}: redis unreachable: {self._last_error}") from exc
        except RedisError as exc:
            # The server answered with an error (a script error, OOM, ...): not an outage,
            # so no fail-fast window, but callers still see the one exception type.
            self._mark_down(what, exc, fail_fast=False)
            raise IndexUnavailable(f"{what}: redis error: {self._last_error}") from exc
        if not self._healthy:
            logger.info("redis at %s reachable again", self.settings.url)
        self._healthy = True
        self._last_error = None
        return result

    def _mark_down(self, what: str, exc: BaseException, *, fail_fast: bool) -> None:
        if self._healthy:
            logger.warning("redis %s failed: %r", what, exc)
        self._healthy = False
        self._last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._retry_at = time.monotonic() + (self.settings.retry_after_s if fail_fast else 0.0)

    async def ping(self) -> None:
        await self.call("ping", lambda client: client.ping())

    async def aclose(self) -> None:
        await self._client.aclose()
