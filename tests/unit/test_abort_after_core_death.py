"""Abort on an engine service whose core died answers "not found" instead of failing with an
unhandled EngineError (the router still sends Aborts for the streams it loses with it); and
the core's socket directory, named after its serving process, is removed by `shutdown()`."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from prometheus_client import CollectorRegistry

from pdmesh.decode_svc.servicer import DecodeServicer
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.frontend.async_engine import AsyncEngine, EngineError
from pdmesh.engine.frontend.core_client import core_dir_prefix
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine_svc.config import EngineServiceConfig
from pdmesh.engine_svc.service import EngineService
from pdmesh.kvstore.transfer.receiver import KVReceiver
from pdmesh.metrics import engine_metrics
from pdmesh.prefill_svc.servicer import PrefillServicer
from pdmesh.v1 import engine_pb2

pytestmark = [pytest.mark.weights, pytest.mark.processes]

CONFIG = EngineConfig(model="smollm2", kv_cache_memory="64MiB", max_model_len=512)


@pytest.mark.slow
@pytest.mark.anyio
async def test_abort_after_the_core_died_is_not_found() -> None:
    engine = await AsyncEngine.spawn(CONFIG)
    core_dir = engine.calls.link._dir  # type: ignore[attr-defined]
    try:
        assert os.path.basename(core_dir).startswith(core_dir_prefix())
        stream = engine.generate("r", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        assert engine.core_pid is not None
        os.kill(engine.core_pid, signal.SIGKILL)
        await asyncio.wait_for(engine.dead_event.wait(), 10.0)
        with pytest.raises(EngineError):  # what the servicers used to let through
            await engine.abort("r")
        config = EngineServiceConfig()
        request = engine_pb2.AbortRequest(request_id="r")
        decode = DecodeServicer(EngineService(config, "decode", engine), KVReceiver(),
                                metrics=engine_metrics("decode", CollectorRegistry()))
        prefill = PrefillServicer(EngineService(config, "prefill", engine),
                                  metrics=engine_metrics("prefill", CollectorRegistry()))
        for servicer in (decode, prefill):
            response = await servicer.Abort(request, None)  # type: ignore[arg-type]
            assert response == engine_pb2.AbortResponse(found=False)
        await stream.aclose()
    finally:
        await engine.shutdown()
    assert not os.path.exists(core_dir)


@pytest.fixture(name="anyio_backend")
def anyio_backend_fixture() -> str:
    return "asyncio"
