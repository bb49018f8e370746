"""Two in-thread engine cores handing a prompt's KV over through their connectors, as the
serving processes' control plane would arrange it: the prefill core lends its blocks, the
test builds the source the StartTransfer reply would carry, the decode core pulls.

Shared by the tests of the worker transports (tests/engine/test_kv_*_between_cores.py,
test_kv_pull_across_tp.py)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector.grant_mac import sign
from pdmesh.kvstore.connector.source import KVSource, LoadResult, encode_blocks

TRANSFER = "t" * 32
GRANT = "g" * 32


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def run(e: LLMEngine) -> list[int]:
    """Step `e` until it is idle; the last output's tokens."""
    last = None
    while e.has_unfinished_requests():
        for out in e.step():
            last = out
    assert last is not None
    return list(last.outputs[0].token_ids)


@dataclass(frozen=True)
class Lent:
    """A prefilled prompt lent by its core: its first token, the shm source of its blocks
    (what a same-host receiver is told) and the blocks' ids in the sender's cache."""

    first: int
    source: KVSource
    block_ids: list[int]


def lend(prefill: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> Lent:
    """Prefill `ids` with export_kv and lend the blocks (the id is free, the blocks pinned)."""
    prefill.add(EngineRequest(rid, ids, params, export_kv=True))
    first = run(prefill)
    lent = prefill.core.requests[rid].kv_export
    assert lent is not None
    info = prefill.core.export_kv(rid)
    facts = prefill.core.info()
    params_ = {"cache": facts.kv_cache_file, "num_blocks": str(facts.num_total_blocks),
               "blocks": encode_blocks(lent.block_ids)}
    source = KVSource("shm", params_, info.block_checksums, info.checksum_algo, len(ids),
                      facts.kv_shape, facts.kv_dtype)
    return Lent(first[0], source, list(lent.block_ids))


def granted(prefill: LLMEngine, source: KVSource, backend: str, address: str, rid: str,
            grant: str = GRANT) -> KVSource:
    """`source` as a block server's plane (tcp, ucxx) would grant it: signed for `rid`."""
    secret = prefill.core.connector.config.grant_secret
    return msgspec.structs.replace(source, backend=backend, params={
        "address": address, "request": rid, "transfer": TRANSFER, "grant": grant,
        "mac": sign(secret, rid, TRANSFER, grant)})


def decode_with(decode: LLMEngine, rid: str, ids: list[int], first: int, source: KVSource,
                params: SamplingParams) -> tuple[list[int], LoadResult]:
    """Decode `ids` with its KV pulled from `source` (the first token given); the tokens
    (the given one first) and how the pull went."""
    state = decode.add(EngineRequest(rid, ids, params, given_tokens=[[first]],
                                     kv_source=source))
    tokens = run(decode)
    assert state.kv_load is not None  # the core pulled on its connector's thread
    return tokens, state.kv_load
