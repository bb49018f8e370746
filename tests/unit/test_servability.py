"""InstancePool.servability: can the router route a request now? (issue 12, item 5)

The router's health for pdmesh.v1.Router and the gateway's /health follow this, so it must say
"no" exactly when the orchestrator would refuse every request needing a missing role, and "yes"
whenever one live instance combination can serve.
"""

from __future__ import annotations

import pytest

from pdmesh.router.instances import InstancePool, PoolSettings
from pdmesh.v1 import engine_pb2

pytestmark = pytest.mark.anyio
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
    servable = pool.servability(local_prefill_threshold=256)
    assert not servable.serving
    assert "no live decode instance" in servable.detail
    assert "polls failing" in servable.detail  # says which instance and why
    await pool.stop()


async def test_needs_a_live_prefill_instance_unless_decode_prefills_everything() -> None:
    pool = await pool_of(("prefill", False), ("decode", True))
    off = pool.servability(local_prefill_threshold=0)
    assert not off.serving and "no live prefill instance" in off.detail
    assert "local prefill is off" in off.detail
    # Short prompts are still prefilled on decode, long ones are refused: not serving.
    some = pool.servability(local_prefill_threshold=256)
    assert not some.serving and "fewer than 256 uncached tokens" in some.detail
    # Every prompt is shorter than the model length: decode prefills all of them.
    assert pool.servability(local_prefill_threshold=MAX_LEN).serving
    await pool.stop()


async def test_live_pair_or_colocated_instance_serves() -> None:
    pair = await pool_of(("prefill", True), ("decode", True))
    assert pair.servability(local_prefill_threshold=0).serving
    assert pair.servability(local_prefill_threshold=0).detail == ""
    await pair.stop()
    # A colocated instance prefills for any decode instance and decodes itself.
    mixed = await pool_of(("decode", True), ("colocated", True), ("prefill", False))
    assert mixed.servability(local_prefill_threshold=0).serving
    await mixed.stop()
    nothing = await pool_of()
    assert not nothing.servability(local_prefill_threshold=0).serving
    await nothing.stop()
