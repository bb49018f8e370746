"""Which engine instances are alive, what they serve, and how loaded they are.

An instance registers with a per-process id, then heartbeats; its registration is a Redis key
with a TTL, so a process that dies simply stops existing for the router and, lazily or at the
next `sweep()`, for the prefix index too. A restarted process behind the same address gets a
new id, and registering it evicts the old id and everything the index credited to it.

Registration also guards the cache contract: an instance whose hash-scheme fingerprint differs
from the live instances of the same model is refused with `SchemeMismatchError`, because it
would otherwise serve 0 % prefix hits with a 200 OK.

With a cluster token, a registration carries a signature: an HMAC, keyed with the token, over
every field that says where and what the instance is (`sign_registration`). Anybody who can
write to Redis could otherwise announce their own address and receive prompts; the router
routes only to entries that `registration_problem` accepts. Load figures and heartbeat times
are not signed (they change every heartbeat and only weigh routing among genuine instances).
Without a token, entries are unsigned and trusted, as before.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, cast, get_args

from pdmesh.auth import ClusterToken
from pdmesh.engine.block_hash import HashScheme
from pdmesh.kvstore import redis_schema
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[str, ...] = get_args(Role)
DEFAULT_TTL_S = 10.0
SIGNATURE_PURPOSE = "pdmesh/instance-registration/v1"


def new_instance_id(role: str) -> str:
    """Unique per process start, so a restart behind the same address is a new instance."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def validate_load(load: Mapping[str, float]) -> dict[str, float]:
    """Load figures are finite numbers keyed by name (running, waiting, kv_usage, ...)."""
    out: dict[str, float] = {}
    for key, value in load.items():
        if not isinstance(key, str):
            raise ValueError(f"load keys must be str, got {key!r}")
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value):
            raise ValueError(f"load[{key!r}] must be a finite number, got {value!r}")
        out[key] = value
    return out


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    role: Role
    address: str  # host:port of its gRPC service
    model: str
    scheme_fingerprint: str
    scheme_description: str
    block_size: int
    started_at: float  # wall-clock seconds, comparable across hosts
    kv_address: str | None = None  # where its KV blocks are transferred from, if elsewhere
    load: Mapping[str, float] = field(default_factory=dict)
    heartbeat_at: float | None = None
    signature: str = field(default="", repr=False)  # see sign_registration

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.instance_id or not self.address or not self.model:
            raise ValueError("instance_id, address and model must be non-empty")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        validate_load(self.load)

    @classmethod
    def create(
        cls,
        *,
        role: Role,
        address: str,
        model: str,
        scheme: HashScheme,
        kv_address: str | None = None,
    ) -> InstanceInfo:
        """A fresh registration for this process."""
        return cls(
            instance_id=new_instance_id(role),
            role=role,
            address=address,
            model=model,
            scheme_fingerprint=scheme.fingerprint(),
            scheme_description=scheme.describe(),
            block_size=scheme.block_size,
            started_at=time.time(),
            kv_address=kv_address,
        )

    def to_fields(self) -> dict[str, str]:
        """The registration hash stored in Redis (flat strings, JSON only for `load`)."""
        return {
            "role": self.role,
            "address": self.address,
            "kv_address": self.kv_address or "",
            "model": self.model,
            "fingerprint": self.scheme_fingerprint,
            "scheme": self.scheme_description,
            "block_size": str(self.block_size),
            "started_at": repr(self.started_at),
            "load": json.dumps(dict(self.load)),
            "heartbeat_at": repr(self.heartbeat_at if self.heartbeat_at is not None else 0.0),
            "sig": self.signature,
        }

    def signed_fields(self) -> tuple[str, ...]:
        """What a signature covers: identity, address and compatibility, not load."""
        return (self.instance_id, self.role, self.address, self.kv_address or "", self.model,
                self.scheme_fingerprint, self.scheme_description, str(self.block_size),
                repr(self.started_at))

    @classmethod
    def from_fields(cls, instance_id: str, fields: Mapping[str, str]) -> InstanceInfo:
        """Parse and validate a registration read back from Redis; ValueError if malformed."""
        try:
            load = json.loads(fields["load"])
            if not isinstance(load, dict):
                raise ValueError(f"load must be a JSON object, got {fields['load']!r}")
            heartbeat_at = float(fields["heartbeat_at"])
            return cls(
                instance_id=instance_id,
                role=cast(Role, fields["role"]),
                address=fields["address"],
                model=fields["model"],
                scheme_fingerprint=fields["fingerprint"],
                scheme_description=fields["scheme"],
                block_size=int(fields["block_size"]),
                started_at=float(fields["started_at"]),
                kv_address=fields["kv_address"] or None,
                load=validate_load(load),
                heartbeat_at=heartbeat_at or None,
                signature=fields.get("sig", ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed registration for {instance_id}: {exc!r}") from exc


def sign_registration(info: InstanceInfo, token: ClusterToken | None) -> InstanceInfo:
    """`info` with its signature (unchanged without a token)."""
    if token is None:
        return info
    return replace(info, signature=token.sign(SIGNATURE_PURPOSE, *info.signed_fields()))


def registration_problem(info: InstanceInfo, token: ClusterToken | None) -> str | None:
    """None if the router may route to `info`; else "unsigned" or "forged" (a metric label).

    Checked in constant time. Without a token every entry is accepted, as before.
    """
    if token is None:
        return None
    if not info.signature:
        return "unsigned"
    if not token.verify(info.signature, SIGNATURE_PURPOSE, *info.signed_fields()):
        return "forged"
    return None


def describe_scheme_diff(ours: str, theirs: str) -> str:
    """Human-readable difference of two `HashScheme.describe()` strings."""
    a, b = ours.split("/"), theirs.split("/")
    if len(a) != len(b):
        return f"{ours!r} vs {theirs!r}"
    diffs = [f"{x} vs {y}" for x, y in zip(a, b, strict=True) if x != y]
    return ", ".join(diffs) if diffs else "descriptions equal, fingerprints differ"


class SchemeMismatchError(RuntimeError):
    """Refused registration: its hashes would never match the cluster's."""

    def __init__(self, info: InstanceInfo, other_id: str, other_fp: str, other_scheme: str):
        self.info = info
        self.other_id = other_id
        self.other_fingerprint = other_fp
        self.other_scheme = other_scheme
        super().__init__(
            f"model {info.model!r}: instance {info.instance_id} uses block-hash scheme "
            f"{info.scheme_fingerprint} ({info.scheme_description}) but live instance "
            f"{other_id} uses {other_fp} ({other_scheme}); differs in: "
            f"{describe_scheme_diff(info.scheme_description, other_scheme)}. "
            "Align block size, hash algorithm and root seed across the model's instances."
        )


class Heartbeat(enum.IntEnum):
    """What a heartbeat found. An int, so `if not await registry.heartbeat(...)` still reads
    "the registration is gone"."""

    GONE = 0  # expired, or Redis lost it: register again and resend a snapshot
    ALIVE = 1
    REPUBLISH = 2  # alive, and a router asked for a fresh snapshot (its index slice drifted)


class InstanceRegistry:
    """Registration, heartbeats and membership of one model's instances."""

    def __init__(
        self, conn: RedisConnection, keys: KeySpace, *, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._conn = conn
        self._keys = keys
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._register = conn.script(redis_schema.REGISTER)
        self._heartbeat = conn.script(redis_schema.HEARTBEAT)
        self._deregister = conn.script(redis_schema.DEREGISTER)
        self._purge_dead = conn.script(redis_schema.PURGE_DEAD)
        self._live = conn.script(redis_schema.LIVE_INSTANCES)

    @property
    def keys(self) -> KeySpace:
        return self._keys

    async def register(self, info: InstanceInfo) -> list[str]:
        """Register (or re-register) `info`; returns ids it replaced at the same address.

        The instance starts with an empty slice of the prefix index: publish a full
        snapshot next. Raises `SchemeMismatchError` if live instances hash differently.
        """
        if info.model != self._keys.model:
            raise ValueError(f"registry is for model {self._keys.model!r}, got {info.model!r}")
        fields = info.to_fields() | {"ttl_ms": str(self._ttl_ms), "heartbeat_at": repr(time.time())}
        args = [
            self._keys.prefix,
            info.instance_id,
            info.scheme_fingerprint,
            info.address,
            str(self._ttl_ms),
            *(item for pair in fields.items() for item in pair),
        ]
        reply = await self._conn.call("register", lambda _: self._register(keys=[], args=args))
        if reply[0] == "mismatch":
            raise SchemeMismatchError(info, reply[1], reply[2], reply[3])
        replaced = [str(r) for r in reply[1:]]
        if replaced:
            logger.info("%s replaced %s at %s", info.instance_id, replaced, info.address)
        return replaced

    async def heartbeat(self, instance_id: str,
                        load: Mapping[str, float] | None = None) -> Heartbeat:
        """Refresh the TTL and load figures. GONE (falsy): the registration is gone (expired,
        or Redis lost it) and the instance must register again and resend a snapshot;
        REPUBLISH: a router asked for a snapshot (router/prefix_predictions.py)."""
        load_json = json.dumps(validate_load(load or {}))
        args = [self._keys.prefix, instance_id, load_json, repr(time.time())]
        refreshed = await self._conn.call(
            "heartbeat", lambda _: self._heartbeat(keys=[], args=args)
        )
        return Heartbeat(int(refreshed))

    async def deregister(self, instance_id: str) -> bool:
        """Leave the cluster now and drop its index entries; False if it was not a member."""
        args = [self._keys.prefix, instance_id]
        removed = await self._conn.call(
            "deregister", lambda _: self._deregister(keys=[], args=args)
        )
        return bool(removed)

    async def live_instances(self, role: Role | None = None) -> list[InstanceInfo]:
        """Instances whose registration has not expired, sorted by id."""
        rows = await self._conn.call(
            "live instances", lambda _: self._live(keys=[], args=[self._keys.prefix])
        )
        out: list[InstanceInfo] = []
        for instance_id, flat in rows:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            try:
                info = InstanceInfo.from_fields(instance_id, fields)
            except ValueError as exc:
                logger.warning("skipping unreadable registration: %s", exc)
                continue
            if role is None or info.role == role:
                out.append(info)
        return sorted(out, key=lambda i: i.instance_id)

    async def sweep(self) -> list[str]:
        """Remove every expired member from membership and the prefix index; returns them.

        Bounded by the member count (no SCAN); run it periodically from the router.
        """
        purged = await self._conn.call(
            "sweep", lambda _: self._purge_dead(keys=[], args=[self._keys.prefix])
        )
        if purged:
            logger.info("swept expired instances: %s", purged)
        return [str(p) for p in purged]
