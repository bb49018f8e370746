"""InstancePool.servability: can the router route a request now? (issue 12, item 5)

The router's health for pdmesh.v1.Router and the gateway's /health follow this, so it must say
"no" exactly when the orchestrator would refuse every request (no live decode-capable
instance), and "yes" whenever one can serve, prefilling on decode when no prefill instance is
live (issue 10).
"""

from __future__ import annotations

import pytest

from pdmesh.router.instances import InstancePool, PoolSettings
from pdmesh.v1 import engine_pb2

pytestmark = [pytest.mark.anyio, pytest.mark.fast]
MAX_LEN = 2048


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"


async def pool_of(*instances: tuple[str, bool]) -> InstancePool:
    """A pool of static instances, each (role, live), as if their last poll told so."""
    pool = InstancePool(
        PoolSettings(model="m"),
        static=[(role, f"127.0.0.1:{10000 + n}") for n, (role, _) in enumerate(instances)],
    )
    for n, (_role, live) in enumerate(instances):
        instance = next(i for i in pool.instances() if i.address.endswith(str(10000 + n)))
        instance.info = engine_pb2.EngineInfo(instance_id=f"id-{n}", max_model_len=MAX_LEN)
        instance.healthy = live
        instance.detail = "" if live else "polls failing: UNAVAILABLE"
    return pool


async def test_needs_a_live_decode_instance() -> None:
    pool = await pool_of(("prefill", True), ("decode", False))
    servable = pool.servability()
    assert not servable.serving
    assert "no live decode instance" in servable.detail
    assert "polls failing" in servable.detail  # says which instance and why
    await pool.stop()


async def test_without_a_live_prefill_instance_decode_prefills_and_serves() -> None:
    """Degraded, not down: the orchestrator plans every request with local prefill."""
    pool = await pool_of(("prefill", False), ("decode", True))
    servable = pool.servability()
    assert servable.serving
    assert "no live prefill instance" in servable.detail
    assert "prefilled on decode" in servable.detail
    assert "polls failing" in servable.detail
    await pool.stop()


async def test_live_pair_or_colocated_instance_serves() -> None:
    pair = await pool_of(("prefill", True), ("decode", True))
    assert pair.servability().serving
    assert pair.servability().detail == ""
    await pair.stop()
    # A colocated instance prefills for any decode instance and decodes itself.
    mixed = await pool_of(("decode", True), ("colocated", True), ("prefill", False))
    assert mixed.servability().serving
    assert mixed.servability().detail == ""
    await mixed.stop()
    nothing = await pool_of()
    assert not nothing.servability().serving
    await nothing.stop()
