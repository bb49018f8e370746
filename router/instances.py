"""The router's view of the engine instances: who is there, alive, compatible and how busy.

Membership comes from two sources: static addresses given on the command line, and the Redis
instance registry (heartbeats with a TTL) when one is configured. Every `poll_interval_s` the
pool reads the registry, then asks every known instance for GetInfo (once per process: the
instance id changes when a process restarts behind the same address) and GetLoad.

An instance leaves routing when it

* fails `failure_threshold` polls in a row, or a request on it fails (`mark_failed`); a poll
  refused as UNAVAILABLE (process gone or stopping) counts as the whole threshold at once;
* reports NOT_SERVING on its health service ("" = the whole server: it is shutting down);
* drops out of the registry (its heartbeats stopped, or it began draining) — static instances
  stay, but still have to answer polls. Its channel stays open for the calls still running on
  it (`RETIRED_CHANNEL_GRACE_S`): a draining instance finishes them, and closing the channel
  at once would cut them on this side instead;
* serves another model or hashes blocks with another scheme than the rest of the cluster
  (their prefix hits would silently be 0 %);
* reports its engine core stalled (`core_stalled`: its own watchdog, engine_svc/watchdog.py),
  or silent with work in flight for longer than the router's stall bound (`core_silent_s`).

Progress: every answered poll whose engine core is not stalled is evidence that the instance
was making progress `core_silent_s` before it was sent (an idle core owes nothing: 0), and so
is every delta a call receives from it (`note_progress`). `Instance.progress_at` is the latest
such evidence; the router's progress watchdog (router/watchdog.py) reads it, and asks the
instance itself (`confirm_progress`) before it judges an instance whose last evidence is old.

With a cluster token, registry entries not signed with it are never contacted at all (a
warning and `pdmesh:registry_rejected_entries_total`); see docs/SECURITY.md.

It comes back as soon as a poll succeeds again. When Redis is unreachable the last known
membership is kept and routing falls back to load only; `index_available` says so. When Redis
comes back (possibly empty, after a restart), instances missing from it keep their place for
`rejoin_grace_s`: they re-register on their own once their back-off lets them retry.

`servability()` says whether a request can be routed at all right now; the router's health
service reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.auth import ClusterToken, auth_metrics
from pdmesh.engine.block_hash import HashScheme
from pdmesh.engine.frontend.stall import StallBound
from pdmesh.grpc_common import TLSConfig, open_channel
from pdmesh.kvstore.instance_registry import (
    InstanceInfo,
    InstanceRegistry,
    registration_problem,
)
from pdmesh.kvstore.redis_conn import IndexUnavailable
from pdmesh.router.instance import Instance
from pdmesh.v1 import engine_pb2

logger = logging.getLogger(__name__)

RETIRED_CHANNEL_GRACE_S = 3660.0
"""How long the channel of an instance that left the registry waits for the calls still running
on it before it cancels them. An instance leaves when it starts draining, and it lets its
running calls end for up to its `--drain-timeout-s` (at most 3600 s) before it cuts them
itself; the router must not cut them first (a cut stream is a failed or migrated request)."""

ROLE_NAMES = {
    engine_pb2.ROLE_PREFILL: "prefill",
    engine_pb2.ROLE_DECODE: "decode",
    engine_pb2.ROLE_COLOCATED: "colocated",
}
_SCHEME = re.compile(
    r"pdmesh-block-hash/v(?P<version>\d+)/(?P<algorithm>[a-z0-9]+)"
    r"/bs=(?P<block_size>\d+)/root=(?P<root>.*)"
)


def scheme_from_description(description: str) -> HashScheme:
    """Rebuild a HashScheme from `HashScheme.describe()` (as stored in the registry)."""
    match = _SCHEME.fullmatch(description)
    if match is None:
        raise ValueError(f"unrecognised hash scheme description {description!r}")
    return HashScheme(
        block_size=int(match["block_size"]),
        algorithm=match["algorithm"],
        root_seed=match["root"],
        version=int(match["version"]),
    )


@dataclass
class PoolSettings:
    model: str
    poll_interval_s: float = 0.5
    failure_threshold: int = 2
    rpc_timeout_s: float = 2.0
    tls: TLSConfig = field(default_factory=TLSConfig)
    max_message_bytes: int = 64 * 2**20
    # The cluster token: sent on every call to instances, and registry entries must be signed
    # with it (unsigned or forged ones are never contacted). None = trust the registry.
    token: ClusterToken | None = None
    # After a registry outage, how long instances missing from the registry stay: engines
    # retry Redis with a back-off of up to ~5 s, then heartbeat, before they re-register.
    rejoin_grace_s: float = 15.0
    # How long an instance may show no progress with work in flight (router/watchdog.py).
    stall: StallBound = field(default_factory=StallBound)


@dataclass(frozen=True)
class Servability:
    """Whether the router can route a request now, and why not."""

    serving: bool
    detail: str = ""


class InstancePool:
    """Membership, health and load of the instances; polled by one background task."""

    def __init__(
        self,
        settings: PoolSettings,
        *,
        static: Iterable[tuple[str, str]] = (),
        registry: InstanceRegistry | None = None,
    ) -> None:
        self.settings = settings
        self._registry = registry
        self._instances: dict[str, Instance] = {}  # by address
        self._fingerprint: str | None = None
        self._block_size: int | None = None
        self.scheme: HashScheme | None = None
        self.index_detail = "no --redis-url: routing on load only" if registry is None else ""
        self._rejoin_until = 0.0  # monotonic; see PoolSettings.rejoin_grace_s
        self._rejected: set[str] = set()  # registry entry ids already reported as forged
        self._task: asyncio.Task[None] | None = None
        # Channels of departed instances, closing once their calls end (see _retire).
        self._retiring: set[asyncio.Task[None]] = set()
        self.polled = asyncio.Event()  # set after every completed poll round
        for role, address in static:
            self._add(address, role, static=True)

    # -- views -------------------------------------------------------------------------------
    @property
    def index_available(self) -> bool:
        return self._registry is not None and not self.index_detail

    @property
    def block_size(self) -> int | None:
        return self._block_size

    def instances(self) -> list[Instance]:
        return sorted(self._instances.values(), key=lambda i: (i.role, i.address))

    def routable(self, role: str) -> list[Instance]:
        return [i for i in self._instances.values() if i.healthy and i.serves(role)]

    def by_id(self, instance_id: str) -> Instance | None:
        return next((i for i in self._instances.values() if i.instance_id == instance_id), None)

    def max_model_len(self) -> int | None:
        lens = [i.info.max_model_len for i in self._instances.values() if i.healthy and i.info]
        return min(lens) if lens else None

    def kv_capacity_tokens(self) -> int | None:
        """The smallest KV pool among live decode instances (as `max_model_len`, the least)."""
        caps = [i.info.kv_capacity_tokens for i in self.routable("decode")
                if i.info and i.info.kv_capacity_tokens]
        return min(caps) if caps else None

    def servability(self) -> Servability:
        """Can a request be routed now? It needs a live decode-capable instance: without a
        live prefill-capable one the decode instance prefills every prompt itself (degraded,
        still serving; `detail` says so). This is what the planner refuses on (`no live
        decode instance to route to`), checked ahead."""
        decode = [i for i in self.routable("decode") if i.instance_id]
        if not decode:
            return Servability(False, "no live decode instance" + self._why_not("decode"))
        if any(i.instance_id for i in self.routable("prefill")):
            return Servability(True)
        return Servability(True, f"no live prefill instance{self._why_not('prefill')}: "
                                 "prompts are prefilled on decode instances")

    def _why_not(self, role: str) -> str:
        down = [f"{i.address}: {i.detail}" for i in self._instances.values()
                if i.serves(role) and not i.healthy]
        return f" ({'; '.join(sorted(down))})" if down else " (none known)"

    # -- changes -----------------------------------------------------------------------------
    def _add(self, address: str, role: str, *, static: bool) -> Instance:
        instance = self._instances.get(address)
        if instance is None:
            channel = open_channel(address, self.settings.tls, self.settings.max_message_bytes,
                                   self.settings.token)
            instance = Instance(address=address, role=role, channel=channel, static=static)
            self._instances[address] = instance
            logger.info("instance added address=%s role=%s static=%s", address, role, static)
        instance.static = instance.static or static
        return instance

    def mark_failed(self, instance: Instance, reason: str) -> None:
        """A request failed on `instance`: take it out of routing until a poll succeeds."""
        if instance.healthy:
            logger.warning("instance unhealthy address=%s id=%s reason=%s",
                           instance.address, instance.instance_id, reason)
        instance.healthy = False
        instance.detail = reason
        instance.failures = max(instance.failures, self.settings.failure_threshold)

    # -- polling -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="instance-pool")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Departed instances' channels: stop waiting for their calls. The router drained its
        # own calls before this, and a router call cancelled by that drain cancels its call.
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        for instance in self._instances.values():
            await instance.channel.close()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # a bug here must not stop membership updates for good
                logger.exception("instance poll failed")
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.settings.poll_interval_s - elapsed))

    async def poll_once(self) -> None:
        await self._sync_registry()
        await asyncio.gather(*(self._poll(i) for i in list(self._instances.values())))
        self.polled.set()
        self.polled = asyncio.Event()

    async def wait_polled(self) -> None:
        """Wait for the next completed poll round."""
        await self.polled.wait()

    async def _sync_registry(self) -> None:
        if self._registry is None:
            return
        try:
            live = await self._registry.live_instances()
        except IndexUnavailable as exc:
            if not self.index_detail:
                logger.warning("cluster index unavailable, routing on load only: %s", exc)
            self.index_detail = f"redis unavailable: {exc}"
            return
        if self.index_detail:
            logger.info("cluster index available again")
            self._rejoin_until = time.monotonic() + self.settings.rejoin_grace_s
        self.index_detail = ""
        self._merge_registry(live)

    def _authentic(self, reg: InstanceInfo) -> bool:
        """Whether `reg` is signed with the cluster token. Checked before its address is ever
        dialled: anybody who can write to Redis could otherwise receive prompts."""
        problem = registration_problem(reg, self.settings.token)
        if problem is None:
            return True
        if reg.instance_id not in self._rejected:
            self._rejected.add(reg.instance_id)
            auth_metrics().registry_rejected.labels(problem).inc()
            logger.warning("ignoring %s registry entry id=%s address=%s: not signed with the "
                           "cluster token", problem, reg.instance_id, reg.address)
        return False

    def _merge_registry(self, live: list[InstanceInfo]) -> None:
        seen = set()
        for reg in live:
            if reg.model != self.settings.model or not self._authentic(reg):
                continue
            seen.add(reg.address)
            instance = self._add(reg.address, reg.role, static=False)
            instance.registered = True
            if self.scheme is None or self.scheme.fingerprint() != reg.scheme_fingerprint:
                with contextlib.suppress(ValueError):
                    scheme = scheme_from_description(reg.scheme_description)
                    if scheme.fingerprint() == reg.scheme_fingerprint and (
                        self._fingerprint in (None, reg.scheme_fingerprint)
                    ):
                        self.scheme = scheme
        if time.monotonic() < self._rejoin_until:
            return  # Redis just came back (maybe empty): give instances time to re-register
        for address, instance in list(self._instances.items()):
            if instance.registered and address not in seen:
                instance.registered = False
                if not instance.static:
                    logger.warning("instance left the registry address=%s id=%s",
                                   address, instance.instance_id)
                    del self._instances[address]
                    self._retire(instance)

    def _retire(self, instance: Instance) -> None:
        """Close a departed instance's channel once the calls running on it have ended: it
        is still finishing them (draining), and closing now would cancel them here."""
        task = asyncio.get_running_loop().create_task(
            instance.channel.close(grace=RETIRED_CHANNEL_GRACE_S),
            name=f"retire-channel {instance.address}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _poll(self, instance: Instance) -> None:
        timeout = self.settings.rpc_timeout_s
        sent_at = time.monotonic()
        try:
            stub = instance.prefill_stub() if instance.role == "prefill" else instance.decode_stub()
            load = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout)
            if instance.info is None or load.instance_id != instance.info.instance_id:
                info = await stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=timeout)
                if instance.info is not None:
                    logger.info("instance restarted address=%s old=%s new=%s",
                                instance.address, instance.instance_id, info.instance_id)
                instance.info = info
                # A statically listed decode address may be a colocated engine: its own
                # account of its role decides whether it can prefill (never needs a P).
                reported = ROLE_NAMES.get(info.role)
                if reported == "colocated" and instance.role != reported:
                    logger.info("instance is colocated address=%s", instance.address)
                    instance.role = reported
            serving = await _health_serving(instance, timeout)
        except grpc.aio.AioRpcError as exc:
            # Refused or unreachable: the process is gone or stopping, and requests sent there
            # would fail too. A slow answer (DEADLINE_EXCEEDED) may just be a busy instance.
            refused = exc.code() == grpc.StatusCode.UNAVAILABLE
            instance.failures += 1
            if refused or instance.failures >= self.settings.failure_threshold:
                self.mark_failed(instance, f"polls failing: {exc.code().name} {exc.details()}")
            return
        instance.apply_poll(load, sent_at)
        instance.failures = 0
        stalled = self._take_progress(instance, load, sent_at)
        if stalled:
            if instance.healthy:  # its detail changes every poll: log the change of state
                logger.warning("instance hung address=%s id=%s: %s", instance.address,
                               instance.instance_id, stalled)
            instance.healthy, instance.detail = False, stalled
            return
        if not serving:
            if instance.healthy:
                logger.warning("instance NOT_SERVING (shutting down) address=%s id=%s",
                               instance.address, instance.instance_id)
            instance.healthy, instance.detail = False, "health NOT_SERVING (shutting down)"
            return
        problem = self._incompatibility(instance.info)
        if problem:
            if instance.healthy or instance.detail != problem:
                logger.error("excluding instance address=%s: %s", instance.address, problem)
            instance.healthy, instance.detail = False, problem
            return
        if not instance.healthy:
            logger.info("instance routable address=%s id=%s", instance.address,
                        instance.instance_id)
        instance.healthy, instance.detail = True, ""

    def _take_progress(self, instance: Instance, load: engine_pb2.EngineLoad,
                       sent_at: float) -> str:
        """Record what a GetLoad answer says about progress; why the instance counts as hung
        ('' if it does not)."""
        if load.core_stalled:
            return f"engine core stalled ({load.core_silent_s:.1f}s without an answer)"
        instance.note_progress(sent_at - load.core_silent_s)
        bound = instance.stall_bound_s(self.settings.stall)
        if load.core_silent_s >= bound:
            return (f"engine core silent for {load.core_silent_s:.1f}s with work in flight "
                    f"(stall bound {bound:.1f}s)")
        return ""

    async def confirm_progress(self, instance: Instance) -> None:
        """Ask `instance` how its core is doing now (one GetLoad, shared by every caller
        meanwhile) and record the evidence; a call that fails or times out records none."""
        task = instance.progress_check
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(
                self._ask_progress(instance), name=f"confirm-progress {instance.address}")
            instance.progress_check = task
        await asyncio.shield(task)

    async def _ask_progress(self, instance: Instance) -> None:
        sent_at = time.monotonic()
        stub = instance.prefill_stub() if instance.role == "prefill" else instance.decode_stub()
        try:
            load = await stub.GetLoad(engine_pb2.GetLoadRequest(),
                                      timeout=self.settings.rpc_timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            return
        self._take_progress(instance, load, sent_at)

    def _incompatibility(self, info: engine_pb2.EngineInfo) -> str:
        """Why `info` cannot join this cluster, or '' if it can. The first compatible
        instance fixes the cluster's hashing scheme."""
        if info.model != self.settings.model:
            return f"serves model {info.model!r}, router serves {self.settings.model!r}"
        if self._fingerprint is None:
            self._fingerprint = info.hash_scheme_fingerprint
            self._block_size = info.block_size
        if info.hash_scheme_fingerprint != self._fingerprint:
            return (
                f"hash scheme {info.hash_scheme_fingerprint} (block size {info.block_size}) "
                f"differs from the cluster's {self._fingerprint} (block size "
                f"{self._block_size}): its prefix hits would never match"
            )
        return ""


async def _health_serving(instance: Instance, timeout_s: float) -> bool:
    """The instance's whole-server health ("") is SERVING. An engine turns it NOT_SERVING
    first thing on SIGTERM, before it deregisters and stops accepting calls. A server without
    the health service is judged by its GetLoad answers alone."""
    try:
        response = await health_pb2_grpc.HealthStub(instance.channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
            return True
        raise
    return response.status == health_pb2.HealthCheckResponse.SERVING
