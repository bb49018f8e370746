"""A Redis connection that fails fast, says so with one exception type, and heals by itself.

The cluster index is an optimisation: when Redis is down the router must keep routing on
load alone. So every operation here has a hard deadline, every failure surfaces as
`IndexUnavailable` (one thing for callers to catch), and after a connection failure calls
fail immediately for `retry_after_s` instead of each paying a connect timeout. The first
call after that window tries the network again, which is how the client recovers once Redis
is back — no reconnect loop, no background task.

Credentials never come from the command line (`ps` shows it): `rediss://` URLs use TLS
(CA from `--redis-ca` / `PDMESH_REDIS_CA`, else the system roots) and the ACL user and password
come from `PDMESH_REDIS_USERNAME` and `PDMESH_REDIS_PASSWORD`, or the password from a file
(`--redis-password-file` / `PDMESH_REDIS_PASSWORD_FILE`, e.g. a mounted Kubernetes Secret).
Messages and logs show the URL without its password.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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


PASSWORD_ENV = "PDMESH_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "PDMESH_REDIS_PASSWORD_FILE"
USERNAME_ENV = "PDMESH_REDIS_USERNAME"
CA_ENV = "PDMESH_REDIS_CA"


def redacted_url(url: str) -> str:
    """`url` without a password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class RedisSettings:
    url: str
    op_timeout_s: float = 0.5  # hard deadline for one operation, round trip included
    connect_timeout_s: float = 0.25
    retry_after_s: float = 1.0  # after a connection failure, fail fast for this long
    username: str | None = None  # Redis ACL user (None: the URL's, else "default")
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None  # rediss:// only: CA bundle verifying the server

    @classmethod
    def resolve(
        cls,
        url: str,
        *,
        password_file: str | None = None,
        ca_file: str | None = None,
        env: Mapping[str, str] | None = None,
        **timeouts: float,
    ) -> RedisSettings:
        """Settings for `url` with credentials from `password_file` or the environment."""
        env = os.environ if env is None else env
        password_file = password_file or env.get(PASSWORD_FILE_ENV) or None
        if password_file:
            try:
                password: str | None = Path(password_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"--redis-password-file: cannot read {password_file!r}: "
                                 f"{exc}") from None
        else:
            password = env.get(PASSWORD_ENV) or None
        ca_file = ca_file or env.get(CA_ENV) or None
        if ca_file and not url.startswith("rediss://"):
            raise ValueError(f"--redis-ca needs a rediss:// URL, got {redacted_url(url)!r}")
        if urllib.parse.urlsplit(url).password:
            logger.warning("the Redis URL holds a password, which `ps` shows; use "
                           "--redis-password-file or %s instead", PASSWORD_ENV)
        return cls(url=url, username=env.get(USERNAME_ENV) or None, password=password,
                   ca_file=ca_file, **timeouts)

    def client_options(self) -> dict[str, Any]:
        """Credential and TLS options for redis-py (the URL's own take precedence)."""
        options: dict[str, Any] = {}
        if self.username:
            options["username"] = self.username
        if self.password:
            options["password"] = self.password
        if self.ca_file:
            options["ssl_ca_certs"] = self.ca_file
        return options


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
            **settings.client_options(),
        )
        self._healthy = True
        self._last_error: str | None = None
        self._retry_at = 0.0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        password_file: str | None = None,
        ca_file: str | None = None,
        **timeouts: float,
    ) -> RedisConnection:
        """A connection to `url`; credentials from `password_file` or the environment
        (`RedisSettings.resolve`)."""
        return cls(RedisSettings.resolve(url, password_file=password_file, ca_file=ca_file,
                                         **timeouts))

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
                f"{what}: redis at {redacted_url(self.settings.url)} unavailable "
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
            logger.info("redis at %s reachable again", redacted_url(self.settings.url))
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
