"""A prompt's KV streamed chunk by chunk between two engine cores on one host (issue 23).

The prefill core lends each block as soon as its chunk has filled it (`stream_kv`, reported in
`CoreOutput.kv_stream`); the decode core pulls each batch of ready blocks while the prefill
computes the next chunk and decodes once the export is sealed, every block has landed and
the first token came. Here the test relays the progress the serving processes relay in
production, and steps the two cores in turn, so that the overlap is deterministic.

Real weights (SmolLM2), in-thread cores, `max_num_batched_tokens=32`: two blocks per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import wait

import msgspec
import pytest

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.core.core_loop import CoreLoop
from pdmesh.engine.core.engine_core import EngineCore
from pdmesh.engine.core_protocol import Batch, Reply
from pdmesh.engine.core_types import CoreOutput
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.connector.config import KVConnectorConfig
from pdmesh.kvstore.connector.export_info import ExportProgress
from pdmesh.kvstore.connector.grant_mac import new_key, sign
from pdmesh.kvstore.connector.source import KVSource, LoadResult

pytestmark = [pytest.mark.slow, pytest.mark.weights]

PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith "
          "in Mainz combined movable metal type, oil-based ink and a screw press into a system "
          "that could reproduce pages quickly and cheaply. Within fifty years the new craft had "
          "spread to more than two hundred towns across Europe, and printers in Venice, Paris "
          "and London competed to publish grammars, calendars, sermons and the classics of "
          "Greek and Roman authors in editions that scholars could afford. As books became "
          "cheaper, literacy spread beyond the clergy and the universities, and")
MAX_TOKENS = 10
CHUNK = 32
BLOCK = 16


def engine(chunk: int) -> LLMEngine:
    config = EngineConfig(model="smollm2", kv_cache_memory="24MiB", block_size=BLOCK,
                          max_num_batched_tokens=chunk, scheduling_policy="priority",
                          engine_core_process=False)
    return LLMEngine(config, KVConnectorConfig(tcp=True, grant_secret=new_key()))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    prefill, decode = engine(CHUNK), engine(2048)
    yield prefill, decode
    prefill.core.close()
    decode.core.close()


@pytest.fixture(scope="module")
def colocated(pair) -> list[int]:
    """What an undisturbed greedy run of PROMPT decodes."""
    prefill, _ = pair
    ids = prefill.tokenize(PROMPT)[1]
    reference = LLMEngine(EngineConfig(model="smollm2", kv_cache_memory="24MiB",
                                       engine_core_process=False))
    reference.add(EngineRequest("ref", ids, greedy()))
    tokens: list[int] = []
    while reference.has_unfinished_requests():
        for out in reference.step():
            tokens = list(out.outputs[0].token_ids)
    reference.core.close()
    return tokens


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def shm_source(core: EngineCore, num_tokens: int) -> KVSource:
    """What the decode service hands its core for a growing export on this host: the cache
    file, no block yet (they come with the progress)."""
    facts = core.info()
    assert core.connector is not None
    params = {"cache": facts.kv_cache_file, "num_blocks": str(facts.num_total_blocks),
              "blocks": ""}
    return KVSource("shm", params, [], str(core.connector.algo), num_tokens, facts.kv_shape,
                    facts.kv_dtype, streamed=True)


def tcp_source(core: EngineCore, rid: str, num_tokens: int) -> KVSource:
    assert core.connector is not None
    grant, transfer = "g" * 32, "t" * 32
    return msgspec.structs.replace(shm_source(core, num_tokens), backend="tcp", params={
        "address": core.connector.block_server_address, "request": rid, "transfer": transfer,
        "grant": grant, "mac": sign(core.connector.config.grant_secret, rid, transfer, grant)})


def land_pulls(decode: EngineCore) -> None:
    """Let the decode core start pulls for what it was told, and wait for them to finish (the
    next step lands them)."""
    decode.step()
    wait(decode.loads_in_flight())


def stream_prefill(prefill: EngineCore, decode: EngineCore, prid: str, drid: str,
                   before_each_step: Callable[[int], None] = lambda steps: None,
                   ) -> tuple[int | None, int]:
    """Step the prefill core until its request's export is sealed or failed, relaying each
    progress to the decode core and letting it pull before the next chunk computes. Its
    first token (None if the stream failed) and the prefill steps it took."""
    steps, first = 0, None
    while True:
        before_each_step(steps)
        outputs = prefill.step()
        steps += 1
        progress: ExportProgress | None = None
        for out in outputs:
            if out.request_id != prid:
                continue
            if out.samples and out.samples[0].new_token_ids:
                first = out.samples[0].new_token_ids[0]
            progress = out.kv_stream or progress
        if progress is not None:
            assert decode.kv_stream(drid, progress)
            land_pulls(decode)
            if progress.sealed:
                return first, steps
            if progress.failed:
                return None, steps


def decode_rest(decode: EngineCore, rid: str) -> tuple[list[int], LoadResult]:
    """Step the decode core until `rid` finishes: its output tokens and how its KV came."""
    tokens: list[int] = []
    load = None
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.request_id != rid:
                continue
            load = out.kv_load or load
            for delta in out.samples:
                tokens += delta.new_token_ids
    assert load is not None
    return tokens, load


def first_batch_pulled(prefill: LLMEngine, decode: LLMEngine, sentence: str,
                       tag: str) -> tuple[int, int]:
    """Requests `p-<tag>` (streaming its export) and `d-<tag>` (pulling it) on the two
    cores, the prefill's first chunk computed and pulled; the free blocks before."""
    ids = prefill.tokenize(sentence * 6)[1]
    free = (prefill.num_free_blocks, decode.num_free_blocks)
    prefill.core.add(EngineRequest(f"p-{tag}", ids, greedy(), cache_salt=f"p-{tag}",
                                   export_kv=True, stream_kv=True))
    decode.core.add(EngineRequest(f"d-{tag}", ids, greedy(), cache_salt=f"d-{tag}",
                                  kv_source=shm_source(prefill.core, len(ids))))
    out = [o for o in prefill.core.step() if o.kv_stream is not None]
    assert decode.core.kv_stream(f"d-{tag}", out[0].kv_stream)
    land_pulls(decode.core)
    return free


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_streamed_pull_overlaps_the_prefill_and_equals_colocated(pair, colocated,
                                                                 transport) -> None:
    prefill, decode = pair
    ids = prefill.tokenize(PROMPT)[1]
    n_blocks = -(-len(ids) // BLOCK)
    assert len(ids) > 3 * CHUNK  # several chunks
    free = (prefill.num_free_blocks, decode.num_free_blocks)
    prid, drid = f"p-{transport}", f"d-{transport}"
    prefill.core.add(EngineRequest(prid, ids, greedy(), cache_salt=prid, export_kv=True,
                                   stream_kv=True))
    source = (shm_source(prefill.core, len(ids)) if transport == "shm"
              else tcp_source(prefill.core, prid, len(ids)))
    decode.core.add(EngineRequest(drid, ids, greedy(), cache_salt=drid, kv_source=source))

    first, steps = stream_prefill(prefill.core, decode.core, prid, drid)
    assert first is not None and steps >= 3
    assert decode.core.kv_stream_first_tokens(drid, [[first]])
    tokens, load = decode_rest(decode.core, drid)

    assert not load.error, load.error
    assert load.streamed and (load.reused_blocks, load.pulled_blocks) == (0, n_blocks)
    # Every chunk's blocks were pulled while the next chunk computed; only the last chunk's
    # (and the partial last block) after the seal.
    assert load.pulled_before_seal >= n_blocks - CHUNK // BLOCK - 1 > 0
    assert [first, *tokens] == colocated
    # The sealed export is lent like any other: its lease ends with a release.
    assert prefill.core.export_kv(prid).block_checksums  # the serving process's ExportKV
    assert prefill.core.release_kv(prid)
    assert prefill.num_free_blocks == free[0]
    assert not decode.core.admission.loads.loading and drid not in decode.core.requests
    assert decode.num_free_blocks == free[1]  # the prompt stays cached, in free blocks


def test_a_streamed_export_is_announced_before_its_first_chunk_runs(pair, colocated) -> None:
    """Before the step that starts a streamed prompt runs, the core sends an empty report
    (the serving process publishes the export on it, so the decode side's transfer starts
    while the first chunk computes); a prompt still queued is announced only when a step
    starts it. The decode core takes the empty report as nothing to pull yet."""
    prefill, decode = pair
    core = prefill.core
    assert core.connector is not None
    ids = prefill.tokenize(PROMPT)[1]
    early: list[tuple[int, CoreOutput]] = []  # (steps run before it was sent, the output)
    core.send_early = lambda outs: early.extend((core.num_steps, o) for o in outs)
    free = (prefill.num_free_blocks, decode.num_free_blocks)
    try:
        for rid in ("p-early", "p-queued"):  # the first's chunk takes the whole step budget
            core.add(EngineRequest(rid, ids, greedy(), cache_salt=rid, export_kv=True,
                                   stream_kv=True))
        decode.core.add(EngineRequest("d-early", ids, greedy(), cache_salt="d-early",
                                      kv_source=shm_source(core, len(ids))))
        steps = core.num_steps
        outputs = core.step()
        assert [(n, o.request_id) for n, o in early] == [(steps, "p-early")]
        announced = early[0][1]
        assert announced == CoreOutput("p-early", kv_stream=ExportProgress(
            0, checksum_algo=str(core.connector.algo)))
        grown = next(o.kv_stream for o in outputs if o.request_id == "p-early" and o.kv_stream)
        assert grown.first_index == 0 and len(grown.block_ids) == CHUNK // BLOCK

        assert decode.core.kv_stream("d-early", announced.kv_stream)  # nothing to pull yet
        assert not decode.core.loads_in_flight()
        assert decode.core.kv_stream("d-early", grown)
        land_pulls(decode.core)
        first, _ = stream_prefill(core, decode.core, "p-early", "d-early")
        assert first is not None and decode.core.kv_stream_first_tokens("d-early", [[first]])
        tokens, load = decode_rest(decode.core, "d-early")
        assert not load.error, load.error
        assert [first, *tokens] == colocated

        while not any(o.request_id == "p-queued" for _, o in early):
            assert core.num_steps < steps + 64, "the queued prompt was never announced"
            core.step()
        assert [o.request_id for _, o in early].count("p-queued") == 1
    finally:
        core.send_early = None
    assert core.export_kv("p-early").block_checksums
    assert core.release_kv("p-early")
    assert core.abort_request("p-queued")
    assert prefill.num_free_blocks == free[0]
    assert decode.num_free_blocks == free[1]


def test_a_prefill_aborted_mid_stream_falls_back_to_recompute(pair, colocated) -> None:
    prefill, decode = pair
    ids = prefill.tokenize(PROMPT)[1]
    free = (prefill.num_free_blocks, decode.num_free_blocks)
    prefill.core.add(EngineRequest("p-abort", ids, greedy(), cache_salt="p-abort",
                                   export_kv=True, stream_kv=True))
    decode.core.add(EngineRequest("d-abort", ids, greedy(), cache_salt="d-abort",
                                  kv_source=shm_source(prefill.core, len(ids))))
    for _ in range(2):  # two chunks computed, streamed and pulled
        out = [o for o in prefill.core.step() if o.kv_stream is not None]
        assert out and not out[0].kv_stream.sealed
        assert decode.core.kv_stream("d-abort", out[0].kv_stream)
        land_pulls(decode.core)
    assert prefill.core.abort_request("p-abort")  # the prefill dies between two chunks
    assert prefill.num_free_blocks == free[0]  # nothing more is served, nothing pinned
    assert prefill.core.connector.exports.get("p-abort") is None
    # The decode service learns it from the broken stream; the router re-plans and hands the
    # first token computed elsewhere (here: the colocated run's).
    assert decode.core.kv_stream("d-abort", ExportProgress(4, failed="aborted"))
    decode.core.step()
    assert decode.core.kv_stream_first_tokens("d-abort", [[colocated[0]]])
    tokens, load = decode_rest(decode.core, "d-abort")
    assert load.reason == "export_failed" and load.streamed
    assert [colocated[0], *tokens] == colocated  # recomputed here: the same tokens
    assert decode.num_free_blocks == free[1] and not decode.core.admission.loads.loading


def test_a_prefill_preempted_mid_stream_fails_its_export_and_the_pull_recomputes(
        pair, colocated) -> None:
    prefill, decode = pair
    ids = prefill.tokenize(PROMPT)[1]
    free = (prefill.num_free_blocks, decode.num_free_blocks)
    prefill.core.add(EngineRequest("p-pre", ids, greedy(), cache_salt="p-pre",
                                   export_kv=True, stream_kv=True))
    decode.core.add(EngineRequest("d-pre", ids, greedy(), cache_salt="d-pre",
                                  kv_source=shm_source(prefill.core, len(ids))))

    def preempt_after_two_chunks(steps: int) -> None:
        if steps == 2:  # a more important prompt that needs every free block and one more
            urgent = list(range(1000, 1000 + prefill.num_free_blocks * BLOCK + 1))
            prefill.core.add(EngineRequest("urgent", urgent, SamplingParams(
                temperature=0.0, max_tokens=1), priority=-1))

    first, _ = stream_prefill(prefill.core, decode.core, "p-pre", "d-pre",
                              preempt_after_two_chunks)
    assert first is None  # the stream failed: its blocks went to the urgent prompt
    assert prefill.core.scheduler.num_preemptions >= 1
    assert decode.core.kv_stream_first_tokens("d-pre", [[colocated[0]]])
    tokens, load = decode_rest(decode.core, "d-pre")
    assert load.reason == "export_failed" and "preempted" in load.error
    assert [colocated[0], *tokens] == colocated
    # The prefill goes on as a plain export (its serving process releases it).
    while prefill.has_unfinished_requests():
        prefill.core.step()
    assert prefill.core.release_kv("p-pre")
    assert prefill.num_free_blocks == free[0]
    assert decode.num_free_blocks == free[1] and not decode.core.admission.loads.loading


def test_a_decode_aborted_while_waiting_for_blocks_frees_them(pair) -> None:
    prefill, decode = pair
    free = first_batch_pulled(prefill, decode, "Rivers carve valleys over thousands of years; ",
                              "gone")
    assert decode.num_free_blocks < free[1]
    assert decode.core.abort_request("d-gone")  # the router cancelled: no first token ever
    while decode.has_unfinished_requests():
        decode.core.step()
    assert decode.num_free_blocks == free[1]
    assert not decode.core.kv_stream("d-gone", ExportProgress(2, sealed=True))
    assert prefill.core.abort_request("p-gone")
    assert prefill.num_free_blocks == free[0]


class _Replies:
    """The core loop's replies, as its serving side would receive them."""

    def __init__(self) -> None:
        self.sent: list[Reply] = []

    def receive(self, block: bool) -> list:
        return []

    def send(self, reply: Reply, tensor: object = None) -> None:
        self.sent.append(reply)


def test_a_pull_dropped_without_a_step_still_reports_its_blocks_free(pair) -> None:
    """Regression: an aborted request's streamed pull is dropped by the landing before a step;
    with nothing else to run no step follows, and the loop sent no load, so the serving side
    (and the router) saw its blocks taken and the request waiting until the next command."""
    prefill, decode = pair
    free = first_batch_pulled(prefill, decode, "Glaciers grind mountains into gravel, slowly; ",
                              "quiet")
    decode.core.step()  # the batch landed; the stream waits for more blocks
    assert decode.num_free_blocks < free[1] and decode.core.load().num_waiting == 1

    replies = _Replies()
    loop = CoreLoop(decode.core, replies)
    assert decode.core.abort_request("d-quiet")  # abandoned: dropped at the next landing
    loop._step()
    loads = [r.load for r in replies.sent if isinstance(r, Batch)]
    assert loads, "the loop reported nothing"
    assert loads[-1].num_free_blocks == free[1] and loads[-1].num_waiting == 0
    assert prefill.core.abort_request("p-quiet")
    assert prefill.num_free_blocks == free[0]
