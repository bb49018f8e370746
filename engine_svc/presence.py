"""Cluster presence of one engine instance: registration, heartbeats and KV events in Redis.

`ClusterPresence` registers the instance in Redis, heartbeats its load and publishes its KV
events to the prefix index. Redis being down is logged, reported (`registered`, health name
`PRESENCE_HEALTH_NAME`) and retried with a jittered back-off (`Backoff`), never fatal: serving
traffic matters more than being indexed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from pdmesh.engine.kv_events import KVEvent, KVEventBatch
from pdmesh.kvstore.instance_registry import (
    Heartbeat,
    InstanceInfo,
    InstanceRegistry,
    SchemeMismatchError,
)
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import IndexUnavailable, RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace

logger = logging.getLogger(__name__)

LoadFn = Callable[[], Mapping[str, float]]
EventsFn = Callable[[], Awaitable[list[KVEvent]]]
SnapshotFn = Callable[[], Awaitable[list[KVEvent]]]
PresenceChangeFn = Callable[[bool, str], Awaitable[None]]
"""Called with (registered, detail) whenever `ClusterPresence.registered` flips."""

PRESENCE_HEALTH_NAME = "pdmesh.engine.ClusterIndex"
"""Health-service name an engine reports SERVING while it is registered and publishing to the
Redis index, NOT_SERVING while it is not. Only informational: the engine's own services stay
SERVING, because a request routed to it is served just the same without the index."""


@dataclass
class Backoff:
    """Retry delays while Redis is unreachable: `initial_s` doubling up to `max_s`, each drawn
    from [delay/2, delay] so engines that lost Redis together do not retry in lockstep."""

    initial_s: float = 0.5
    max_s: float = 5.0
    rng: random.Random = dataclasses.field(default_factory=random.Random, repr=False)
    _attempt: int = dataclasses.field(default=0, init=False, repr=False)

    def next_delay(self) -> float:
        nominal = min(self.max_s, self.initial_s * 2.0 ** self._attempt)
        self._attempt = min(self._attempt + 1, 32)  # 2**32 * initial is past any sane max
        return nominal / 2 + self.rng.uniform(0.0, nominal / 2)

    def reset(self) -> None:
        self._attempt = 0


class ClusterPresence:
    """Keeps one instance registered, heartbeating and indexed in Redis.

    `load()` gives the heartbeat's load figures. `take_events()` drains new KV events;
    `snapshot()` drains them too and returns a batch describing *everything* cached (sent after
    (re-)registration and after a lost batch). `events_ready` wakes the loop early so events
    reach the index within `publish_interval_s` instead of a heartbeat later.

    A hash-scheme mismatch is fatal and surfaces via `fatal`. Every other Redis failure is an
    outage: `registered` turns False (`on_change` is told), events are dropped (the snapshot
    sent on return covers them) and Redis is retried with `backoff`, never in a tight loop.
    When Redis answers again the instance heartbeats — or registers anew if Redis lost it, e.g.
    after a restart with an empty dataset — and republishes a full snapshot.

    A router that finds this instance's index slice drifting from what it reports using asks
    for a snapshot too (router/prefix_predictions.py): the heartbeat says so (`REPUBLISH`) and
    the snapshot, once applied, clears the ask. `republish_asks` counts them.
    """

    def __init__(
        self,
        conn: RedisConnection,
        info: InstanceInfo,
        *,
        load: LoadFn,
        take_events: EventsFn,
        snapshot: SnapshotFn,
        events_ready: asyncio.Event | None = None,
        ttl_s: float = 10.0,
        publish_interval_s: float = 0.05,
        backoff: Backoff | None = None,
        on_change: PresenceChangeFn | None = None,
    ) -> None:
        self.info = info
        self._conn = conn
        keys = KeySpace(model=info.model)
        self._registry = InstanceRegistry(conn, keys, ttl_s=ttl_s)
        self._index = PrefixIndex(conn, keys)
        self._load = load
        self._take_events = take_events
        self._snapshot = snapshot
        self._events_ready = events_ready or asyncio.Event()
        self._heartbeat_s = ttl_s / 3
        self._publish_s = publish_interval_s
        self._backoff = backoff or Backoff()
        self._on_change = on_change
        self._seq = 0
        self._registered = False  # Redis holds our registration, as far as we know
        self._reachable = False  # the last Redis operation succeeded
        self._detail = "not registered yet"
        self._reported: bool | None = None  # `registered` as last told to on_change
        self._need_snapshot = True
        self._next_heartbeat = 0.0
        self.republish_asks = 0  # snapshots sent because a router asked for one
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.fatal: BaseException | None = None
        self.fatal_event = asyncio.Event()

    @property
    def registered(self) -> bool:
        """Registered and publishing now: False before the first registration and while Redis
        is unreachable (this is the engine's `pdmesh:index_up`)."""
        return self._registered and self._reachable

    @property
    def detail(self) -> str:
        """Why `registered` is False; empty while it is True."""
        return "" if self.registered else self._detail

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"presence-{self.info.instance_id}")

    async def try_register(self) -> bool:
        """One registration attempt before serving, so a scheme mismatch fails start-up.

        False (logged) when Redis is unreachable; the loop started by `start()` retries.
        Raises `SchemeMismatchError` when the cluster refuses this instance.
        """
        try:
            await self._register()
        except IndexUnavailable as exc:
            logger.warning("redis unavailable at start-up, serving unregistered: %s", exc)
            self._lost(exc)
            await self._report()
            return False
        self._next_heartbeat = asyncio.get_running_loop().time() + self._heartbeat_s
        await self._report()
        return True

    async def stop(self) -> None:
        """Stop the loop and deregister (best effort: Redis may be gone)."""
        self._stopping.set()
        if self._task is not None:
            await self._task
        if self._registered:
            try:
                await self._registry.deregister(self.info.instance_id)
            except IndexUnavailable as exc:
                logger.info("deregister skipped: %s", exc)
            self._registered = False

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                wait = await self._sync()
            except SchemeMismatchError as exc:
                logger.error("refused by the cluster: %s", exc)
                self.fatal = exc
                self.fatal_event.set()
                return
            except IndexUnavailable as exc:
                self._lost(exc)
                await self._report()
                # Nothing can be published until Redis is back, and the snapshot sent then
                # supersedes these events: drop them rather than let them pile up.
                await self._take_events()
                self._events_ready.clear()
                await self._sleep(self._backoff.next_delay())
                continue
            self._backoff.reset()
            await self._report()
            await self._wait(wait)

    async def _sync(self) -> float:
        """Register or heartbeat when due, then publish; returns seconds to the next heartbeat.

        Raises IndexUnavailable when Redis cannot be reached."""
        now = asyncio.get_running_loop().time()
        if not self._registered:
            await self._register()
            self._next_heartbeat = now + self._heartbeat_s
        elif now >= self._next_heartbeat:
            beat = await self._registry.heartbeat(self.info.instance_id, self._load())
            self._next_heartbeat = now + self._heartbeat_s
            self._reachable = True
            if beat is Heartbeat.GONE:  # expired, or Redis lost it (restarted empty): anew
                logger.info("registration lost instance_id=%s; registering again",
                            self.info.instance_id)
                await self._register()
            elif beat is Heartbeat.REPUBLISH:  # the index drifted from our cache
                logger.info("router asked for a snapshot instance_id=%s", self.info.instance_id)
                self.republish_asks += 1
                self._need_snapshot = True
        await self._publish()
        if not self._registered:  # the index did not know us (see ApplyResult.needs_register)
            await self._register()
            await self._publish()
        return max(0.0, min(self._heartbeat_s,
                            self._next_heartbeat - asyncio.get_running_loop().time()))

    def _lost(self, exc: IndexUnavailable) -> None:
        if self._reachable:
            logger.warning("cluster index unreachable instance_id=%s, serving unindexed and "
                           "retrying with back-off: %s", self.info.instance_id, exc)
        self._reachable = False
        self._detail = f"redis unavailable: {exc}"
        self._need_snapshot = True  # whatever was in flight is lost; resend everything
        self._next_heartbeat = 0.0  # prove the registration survived as soon as Redis answers

    async def _report(self) -> None:
        """Tell `on_change` when `registered` flipped (a failing callback is only logged)."""
        now = self.registered
        if now == self._reported:
            return
        if now and self._reported is False:
            logger.info("cluster index reachable again instance_id=%s", self.info.instance_id)
        self._reported = now
        if self._on_change is not None:
            try:
                await self._on_change(now, self.detail)
            except Exception:
                logger.exception("presence change callback failed")

    async def _sleep(self, timeout_s: float) -> None:
        """Until stop or `timeout_s`; new events do not cut a back-off short."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout_s)

    async def _wait(self, timeout_s: float) -> None:
        """Until stop, new events (then a short batching pause) or `timeout_s`."""
        stop = asyncio.ensure_future(self._stopping.wait())
        ready = asyncio.ensure_future(self._events_ready.wait())
        try:
            await asyncio.wait({stop, ready}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            ready.cancel()
        if self._events_ready.is_set() and not self._stopping.is_set():
            self._events_ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._publish_s)

    async def _register(self) -> None:
        info = dataclasses.replace(self.info, load=dict(self._load()))
        replaced = await self._registry.register(info)
        self._registered = True
        self._reachable = True
        self._detail = ""
        self._need_snapshot = True
        logger.info("registered instance_id=%s role=%s address=%s replaced=%s",
                    info.instance_id, info.role, info.address, replaced)

    async def _publish(self) -> None:
        if self._need_snapshot:
            events = await self._snapshot()
        else:
            events = await self._take_events()
            if not events:
                return
        self._seq += 1
        batch = KVEventBatch(self.info.instance_id, self._seq, events)
        try:
            result = await self._index.apply(batch)
        except IndexUnavailable:
            self._need_snapshot = True  # the batch is lost; resend everything later
            raise
        self._need_snapshot = result.needs_snapshot
        if result.needs_register:
            self._registered = False
