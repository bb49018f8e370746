"""P/D between engines of different tensor-parallel sizes (issue 26): a prompt's KV moves
from a prefill core at TP=a to a decode core at TP=b, every destination rank's KV heads
copied straight out of the source rank(s) that hold them (kvstore/connector/rank_caches.py),
and the decode core decodes what an undisturbed one-rank run decodes.

Real weights (SmolLM2: 3 KV heads, so two ranks hold 2 + 1 of them), in-thread cores whose
other ranks are real processes (gloo); the cores are handed the source parameters the
serving processes' control plane would hand them (tests/e2e/test_kv_tp_mesh.py runs the
whole mesh).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.grant_mac import new_key
from pdmesh.kvstore.connector.source import KVSource, LoadResult, encode_blocks
from tests.core_pulls import decode_with as pulled
from tests.core_pulls import granted, lend, run
from tests.core_pulls import greedy as greedy_for

pytestmark = [pytest.mark.slow, pytest.mark.weights, pytest.mark.processes]

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith "
          "in Mainz combined movable metal type, oil-based ink and a screw press into a system "
          "that could reproduce pages quickly and cheaply. Within fifty years")
MAX_TOKENS = 12
BLOCK = 16


def engine(tp: int, shm_dir: str) -> LLMEngine:
    config = EngineConfig(model="smollm2", kv_cache_memory="48MiB", block_size=BLOCK,
                          engine_core_process=False, tensor_parallel_size=tp, cpu_threads=2)
    return LLMEngine(config, KVConnectorConfig(shm_dir=shm_dir, grant_secret=new_key()))


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("shm"))


@pytest.fixture(scope="module")
def engines(shm_dir: str) -> Iterator[dict[int, LLMEngine]]:
    built = {1: engine(1, shm_dir), 2: engine(2, shm_dir), 3: engine(2, shm_dir)}  # 3: TP=2 too
    yield built
    for e in built.values():
        e.core.close()


@pytest.fixture(scope="module")
def want() -> list[int]:
    reference = LLMEngine(EngineConfig(model="smollm2", kv_cache_memory="48MiB",
                                       engine_core_process=False))
    ids = reference.tokenize(PROMPT)[1]
    reference.add(EngineRequest("ref", ids, greedy()))
    tokens = run(reference)
    reference.core.close()
    return tokens


def greedy() -> SamplingParams:
    return greedy_for(MAX_TOKENS)


def export(prefill: LLMEngine, rid: str, ids: list[int]) -> tuple[int, KVSource, list[int]]:
    """Prefill `ids` with export_kv; its first token and the shm source a decode core pulls."""
    lent = lend(prefill, rid, ids, greedy())
    return lent.first, lent.source, lent.block_ids


def decode_with(decode: LLMEngine, rid: str, ids: list[int], first: int,
                source: KVSource) -> tuple[list[int], LoadResult]:
    return pulled(decode, rid, ids, first, source, greedy())


def test_a_tensor_parallel_core_names_one_cache_file_per_rank(engines, shm_dir) -> None:
    names = engines[2].core.info().kv_cache_file.split(",")
    assert len(names) == 2 and len(set(names)) == 2
    assert all(os.path.exists(os.path.join(shm_dir, n)) for n in names)
    assert engines[2].core.info().kv_shape == engines[1].core.info().kv_shape  # a block is a block
    assert engines[2].core.info().kv_block_server  # cross-host pulls: canonical blocks


def over_tcp(prefill: LLMEngine, rid: str, source: KVSource) -> KVSource:
    """`source` as the tcp plane's StartTransfer reply would give it (a signed grant)."""
    return granted(prefill, source, "tcp", prefill.core.connector.block_server_address, rid)


@pytest.mark.parametrize(("src", "dst"), [(2, 1), (1, 2), (2, 3)])
def test_kv_moves_between_tensor_parallel_sizes_over_tcp(engines, want, src: int,
                                                         dst: int) -> None:
    """Across hosts: the tensor-parallel sender gathers canonical blocks piece by piece, the
    tensor-parallel receiver splits them over its ranks."""
    prefill, decode = engines[src], engines[dst]
    ids = prefill.tokenize(PROMPT)[1]
    rid = f"tcp{src}to{dst}"
    assert decode.core.kv_manager.pool.reset_prefix_cache()
    first, source, _ = export(prefill, rid, ids)
    got, load = decode_with(decode, f"d{rid}", ids, first, over_tcp(prefill, rid, source))
    assert not load.error, load.error
    assert (load.reused_blocks, load.pulled_blocks) == (0, -(-len(ids) // BLOCK))
    assert load.nbytes == load.pulled_blocks * prefill.core.connector.ranks.block_nbytes
    assert got == want
    assert prefill.core.release_kv(rid)


def test_a_tensor_parallel_core_without_the_shm_transport_still_serves_tcp(
        shm_dir, want) -> None:
    config = EngineConfig(model="smollm2", kv_cache_memory="48MiB", block_size=BLOCK,
                          engine_core_process=False, tensor_parallel_size=2, cpu_threads=2)
    prefill = LLMEngine(config, KVConnectorConfig(shared_cache=False, shm_dir=shm_dir,
                                                  grant_secret=new_key()))
    decode = engine(1, shm_dir)
    try:
        assert not prefill.core.info().kv_cache_file  # peers may not map its caches
        ids = prefill.tokenize(PROMPT)[1]
        first, source, _ = export(prefill, "noshm", ids)
        got, load = decode_with(decode, "dnoshm", ids, first, over_tcp(prefill, "noshm",
                                                                        source))
        assert not load.error, load.error
        assert got == want
    finally:
        prefill.core.close()
        decode.core.close()


def test_a_tensor_parallel_decode_pulls_only_what_its_prefix_cache_lacks(engines,
                                                                         want) -> None:
    prefill, decode = engines[1], engines[2]
    ids = prefill.tokenize(PROMPT)[1]
    first, source, _ = export(prefill, "warm", ids)
    decode_with(decode, "dwarm", ids, first, source)
    assert prefill.core.release_kv("warm")
    first, source, _ = export(prefill, "again", ids)
    got, load = decode_with(decode, "dagain", ids, first, source)
    assert not load.error, load.error
    assert load.reused_blocks == (len(ids) - 1) // BLOCK and load.pulled_blocks >= 1
    assert got == want
    assert prefill.core.release_kv("again")


def test_a_corrupt_block_on_a_second_rank_fails_its_checksum_and_recomputes(engines,
                                                                            want) -> None:
    prefill, decode = engines[2], engines[1]
    ids = prefill.tokenize(PROMPT)[1]
    assert decode.core.kv_manager.pool.reset_prefix_cache()
    first, source, blocks = export(prefill, "bad", ids)
    ranks = prefill.core.connector.ranks
    ranks.caches[1][0, 0, blocks[-1]].add_(1.0)  # rank 1's slice changed under its lease
    got, load = decode_with(decode, "dbad", ids, first, source)
    assert load.reason == "checksum" and load.pulled_blocks == 0
    assert got == want  # recomputed here
    assert prefill.core.release_kv("bad")


def test_close_removes_every_ranks_cache_file(shm_dir) -> None:
    e = engine(2, shm_dir)
    names = e.core.info().kv_cache_file.split(",")
    e.core.close()
    assert not any(os.path.exists(os.path.join(shm_dir, n)) for n in names)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2)])
def test_kv_moves_between_tensor_parallel_sizes_on_gpus(tmp_path, src_tp: int,
                                                        dst_tp: int) -> None:
    """The GPU form: every rank's cache shared with rank 0 by a CUDA IPC handle, each
    destination rank's heads copied device to device; the pulled blocks' canonical checksums
    (lin64, on the device) match the sender's, so every byte landed where it belongs."""
    from tests.random_llama import write_random_llama

    model = str(write_random_llama(tmp_path / "model"))

    def gpu_engine(tp: int) -> LLMEngine:
        config = EngineConfig(model=model, device="cuda:0", dtype="float32",
                              kv_cache_memory="256MiB", max_model_len=512, block_size=BLOCK,
                              engine_core_process=False, tensor_parallel_size=tp)
        return LLMEngine(config, KVConnectorConfig(grant_secret=new_key()))

    prefill, decode = gpu_engine(src_tp), gpu_engine(dst_tp)
    try:
        assert prefill.core.info().kv_cache_ipc and decode.core.info().kv_cache_ipc
        ids = list(range(5, 5 + 3 * BLOCK + 7))
        first, _, blocks = export(prefill, "gpu", ids)
        info = prefill.core.info()
        source = KVSource("shm", {"cuda_ipc": info.kv_cache_ipc,
                                  "blocks": encode_blocks(blocks)},
                          prefill.core.connector.ranks.checksums(prefill.core.connector.algo,
                                                                 blocks),
                          str(prefill.core.connector.algo), len(ids), info.kv_shape,
                          info.kv_dtype)
        got, load = decode_with(decode, "dgpu", ids, first, source)
        assert not load.error, load.error
        assert load.pulled_blocks == len(blocks)
        assert len(got) == MAX_TOKENS
        assert prefill.core.release_kv("gpu")
    finally:
        prefill.core.close()
        decode.core.close()
