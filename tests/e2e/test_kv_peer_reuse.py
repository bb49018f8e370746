"""Cluster-wide prefix caching in a running mesh (issue: "Cluster-wide prefix caching for real").

Real processes (redis-server, engines, router), SmolLM2 weights:

- a 3-turn conversation on 1 prefill + 1 decode with P/D forced for every turn (local prefill
  off): turn N+1's prompt is turn N's prompt, its answer and a new question. The decode
  instance holds turn N's KV (it pulled the prompt and wrote the answer); the prefill instance
  pulls those blocks from it (KVPeer.LendPrefix) and computes only the new tokens, which its
  prefix-hit counters show; the decode instance then pulls only the new blocks back. Every
  turn's tokens equal the offline engine's (colocated) token for token;
- two colocated instances, the prefix holder taken out of routing (as a busy instance would
  be passed over): the other instance pulls the prefix instead of recomputing it, same tokens;
- with peer reuse off (`--no-kv-peer-reuse`) the same conversation computes every prompt
  token of turn 2 on the prefill instance (the control).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.block_hash import HashScheme, hash_token_blocks
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kvstore.prefix_index import PrefixIndex
from pdmesh.kvstore.redis_conn import RedisConnection
from pdmesh.kvstore.redis_schema import KeySpace
from pdmesh.serve import Child, LocalMesh, MeshConfig
from pdmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    kv_transfer_pb2,
    router_pb2,
    router_pb2_grpc,
)
from tests.mesh_calls import engine_load, wait_routable
from tests.polling import wait_for
from tests.router_streams import generate_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.processes, pytest.mark.weights, pytest.mark.redis]

MODEL = "smollm2"
BLOCK = 16
ANSWER_TOKENS = 64
TURNS = [
    "User: A lighthouse keeper on a remote northern island kept a logbook of every ship that "
    "passed and every storm that broke against the rocks. What might the logbooks tell a "
    "historian?\nAssistant:",
    "\nUser: Which of those records would be the most valuable, and why?\nAssistant:",
    "\nUser: Summarise that in one sentence for a museum label.\nAssistant:",
]


def scrape(child: Child, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of metric `name` of `child`, by their labels (model_name left out)."""
    assert child.metrics_url
    with urllib.request.urlopen(child.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return {frozenset((k, v) for k, v in s.labels.items() if k != "model_name"): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def peer_blocks(child: Child, direction: str) -> float:
    return sum(v for labels, v in scrape(child, "pdmesh:kv_peer_prefix_blocks_total").items()
               if ("direction", direction) in labels)


def held_by(redis_url: str, ids: list[int]) -> dict[str, int]:
    """Leading blocks of `ids` each instance holds, as the router's lookup sees them."""
    async def lookup() -> dict[str, int]:
        conn = RedisConnection.from_url(redis_url)
        try:
            hits = await PrefixIndex(conn, KeySpace(MODEL)).longest_prefix_by_medium(
                hash_token_blocks(HashScheme(block_size=BLOCK), ids))
            return {i: h.blocks for i, h in hits.items()}
        finally:
            await conn.aclose()
    return asyncio.run(lookup())


def computed(before: engine_pb2.EngineLoad, after: engine_pb2.EngineLoad) -> int:
    """Prompt tokens an instance computed between two loads (queried, less prefix hits)."""
    return ((after.prefix_query_tokens - before.prefix_query_tokens)
            - (after.prefix_hit_tokens - before.prefix_hit_tokens))


@pytest.fixture(scope="module")
def offline() -> Iterator[object]:
    from pdmesh import LLM

    yield LLM(MODEL, kv_cache_memory="64MiB")


def reference(llm: object, ids: list[int]) -> list[int]:
    out = llm.generate([{"prompt_token_ids": ids}],  # type: ignore[attr-defined]
                       SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS,
                                      ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def pd_mesh(*router_args: str) -> LocalMesh:
    config = MeshConfig(model=MODEL, num_prefill=1, num_decode=1, kv_cache_memory="64MiB",
                        local_prefill_threshold=0)
    return LocalMesh(config, router_args=["--poll-interval-s", "0.2", *router_args])


@dataclass
class Turn:
    ids: list[int]  # its prompt
    held: int  # leading blocks of it the decode instance held (the index) before it ran
    computed: int  # prompt tokens the prefill instance computed for it
    result: router_pb2.GenerateResult
    first_token: int


def converse(mesh: LocalMesh, offline: object, turns: list[str]) -> list[Turn]:
    """Each turn through the router, its tokens checked against the offline engine's."""
    assert mesh.router_address and mesh.redis_url
    prefill, decode = mesh.prefill[0], mesh.decode[0]
    decode_id = engine_load(decode, "decode").instance_id
    tokenize = offline.engine.tokenize  # type: ignore[attr-defined]
    history: list[int] = []  # the previous turns, prompts and answers
    done: list[Turn] = []
    for text in turns:
        ids = history + tokenize(text)[1]
        held = 0
        if history:  # turn N's answer reached the index before N+1 is routed
            want = (len(history) - 1) // BLOCK - 1

            def decode_holds(ids: list[int] = ids, want: int = want) -> int:
                held = held_by(mesh.redis_url, ids).get(decode_id, 0)
                return held if held >= want else 0

            held = wait_for(decode_holds, "the decode instance's blocks in the index")
        before = engine_load(prefill, "prefill")
        tokens, result = generate_greedy(mesh.router_address, ids, ANSWER_TOKENS)
        after = engine_load(prefill, "prefill")
        assert tokens == reference(offline, ids)
        assert result.served_by.prefill_instance_id != result.served_by.decode_instance_id
        done.append(Turn(ids, int(held), computed(before, after), result, tokens[0]))
        history = ids + tokens
    return done


def test_multi_turn_under_pd_computes_only_the_new_tokens(offline: object) -> None:
    with pd_mesh() as mesh:
        wait_routable(mesh.router_address, 2)
        prefill, decode = mesh.prefill[0], mesh.decode[0]
        turns = converse(mesh, offline, TURNS)
        for turn in turns[1:]:
            new_tokens = len(turn.ids) - turn.held * BLOCK
            # Only the tokens after the blocks the decode instance held were computed (a
            # partial block at the seam at most besides).
            assert turn.computed <= new_tokens + BLOCK, (turn.computed, new_tokens)
            assert turn.result.usage.cached_prompt_tokens >= turn.held * BLOCK
        assert peer_blocks(prefill, "pulled") > 0
        assert peer_blocks(decode, "lent") >= peer_blocks(prefill, "pulled")
        assert mesh.router is not None
        router = scrape(mesh.router, "pdmesh:router_peer_prefix_total")
        assert router.get(frozenset({("outcome", "pulled")}), 0) == 2
        # Every loan ended with its puller's ack: nothing stays pinned on the lender.
        wait_for(lambda: engine_load(decode, "decode").num_pinned_blocks == 0,
                 "the loans released")
        lent_prefix_that_cannot_be_pulled_is_computed(prefill, decode, turns[-1])


def lent_prefix_that_cannot_be_pulled_is_computed(prefill: Child, decode: Child,
                                                  turn: Turn) -> None:
    """A loan released before its puller starts (as a lease that ended): the Prefill call
    that carries it computes the prompt itself, with the same first token."""
    assert prefill.address and decode.address
    with grpc.insecure_channel(decode.address) as channel:
        lender = engine_pb2_grpc.KVPeerStub(channel)
        loan = lender.LendPrefix(engine_pb2.LendPrefixRequest(
            request_id="test-loan", prompt_token_ids=turn.ids, min_blocks=1), timeout=10)
        assert loan.HasField("kv") and loan.num_blocks >= turn.held
        assert lender.ReleasePrefix(engine_pb2.ReleaseKVRequest(request_id="test-loan"),
                                    timeout=10).released
    fallbacks = sum(scrape(prefill, "pdmesh:kv_peer_prefix_fallbacks_total").values())
    with grpc.insecure_channel(prefill.address) as channel:
        stub = engine_pb2_grpc.PrefillStub(channel)
        resp = stub.Prefill(engine_pb2.PrefillRequest(
            request_id="direct", prompt_token_ids=turn.ids,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2),
            peer_prefix=engine_pb2.PeerPrefix(kv=loan.kv, instance_id=loan.instance_id)),
            timeout=60)
        stub.ReleaseKV(engine_pb2.ReleaseKVRequest(request_id="direct",
                                                   transfer_id=resp.kv.transfer_id), timeout=10)
    assert resp.first[0].token_ids[0] == turn.first_token
    assert sum(scrape(prefill, "pdmesh:kv_peer_prefix_fallbacks_total").values()) == fallbacks + 1
    assert not resp.HasField("peer_prefix")  # never pulled: nothing to report
    bad_requests_are_refused(prefill, decode, turn, loan.kv)


def bad_requests_are_refused(prefill: Child, decode: Child, turn: Turn,
                             kv: kv_transfer_pb2.KVHandle) -> None:
    """INVALID_ARGUMENT naming the field, nothing held after."""
    assert prefill.address and decode.address
    short = turn.ids[: kv.layout.num_tokens]  # the loan covers the whole prompt: too long
    with grpc.insecure_channel(prefill.address) as channel:
        stub = engine_pb2_grpc.PrefillStub(channel)
        for ids, peer, field in [
            (turn.ids, engine_pb2.PeerPrefix(), "peer_prefix.kv"),
            (short, engine_pb2.PeerPrefix(kv=kv), "peer_prefix.kv: covers"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Prefill(engine_pb2.PrefillRequest(
                    request_id="bad", prompt_token_ids=ids, peer_prefix=peer,
                    sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in caught.value.details()
    with grpc.insecure_channel(decode.address) as channel:
        lender = engine_pb2_grpc.KVPeerStub(channel)
        for request, field in [
            (engine_pb2.LendPrefixRequest(prompt_token_ids=turn.ids), "request_id"),
            (engine_pb2.LendPrefixRequest(request_id="x", prompt_token_ids=[10**8]),
             "prompt_token_ids"),
            (engine_pb2.LendPrefixRequest(request_id="x"), "prompt_token_ids"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                lender.LendPrefix(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in caught.value.details()
    assert engine_load(decode, "decode").num_pinned_blocks == 0
    wait_for(lambda: engine_load(prefill, "prefill").num_pinned_blocks == 0, "nothing pinned")


def test_without_peer_reuse_the_prefill_recomputes_the_answer(offline: object) -> None:
    with pd_mesh("--no-kv-peer-reuse") as mesh:
        wait_routable(mesh.router_address, 2)
        turn = converse(mesh, offline, TURNS[:2])[1]
        assert turn.held > 0
        # The prefill instance holds turn 1's prompt only: the answer is computed again.
        assert turn.computed >= ANSWER_TOKENS
        assert peer_blocks(mesh.prefill[0], "pulled") == 0


SHARED = ("A reading group's notes on a long novel: the first chapters follow a ship's doctor "
          "who keeps a diary of the crew's illnesses, the weather and the ports they visit; "
          "later chapters switch to his daughter, who finds the diary decades afterwards and "
          "retraces the voyage port by port, comparing what she sees with what he wrote. ")


def decode_directly(child: Child, rid: str, ids: list[int], max_tokens: int) -> None:
    """A request served by `child` alone (local prefill), bypassing the router."""
    assert child.address
    with grpc.insecure_channel(child.address) as channel:
        request = engine_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True))
        replies = list(engine_pb2_grpc.DecodeStub(channel).Decode(request, timeout=120))
    assert any(r.HasField("result") for r in replies)


def test_a_busy_holder_lends_its_prefix_to_the_instance_chosen_instead(offline: object) -> None:
    config = MeshConfig(model=MODEL, colocated=True, num_decode=2, kv_cache_memory="64MiB",
                        port=-1)
    tokenize = offline.engine.tokenize  # type: ignore[attr-defined]
    with LocalMesh(config, router_args=["--poll-interval-s", "0.2"]) as mesh:
        assert mesh.router_address and mesh.redis_url
        wait_routable(mesh.router_address, 2)
        holder, other = mesh.decode
        holder_id = engine_load(holder, "decode").instance_id
        other_id = engine_load(other, "decode").instance_id
        # Both have served something (so each has a measured prefill rate), and the holder
        # has computed the shared prefix.
        decode_directly(other, "warm-other", tokenize("Warm-up: the weather today is")[1], 2)
        prefix = tokenize(SHARED * 2)[1]
        decode_directly(holder, "prefix", prefix, 1)
        ids = prefix + tokenize("Question: what does the daughter find?")[1]
        held = wait_for(lambda: held_by(mesh.redis_url, ids).get(holder_id, 0),
                        "the holder's blocks in the index")
        assert held >= 8

        # The holder gets busy with a long request the router does not know about; its
        # polled load makes the router pass it over.
        busy_ids = tokenize("Busy work: " + SHARED * 4)[1]
        with grpc.insecure_channel(holder.address) as channel:  # type: ignore[arg-type]
            busy = engine_pb2_grpc.DecodeStub(channel).Decode(engine_pb2.DecodeRequest(
                request_id="busy", prompt_token_ids=busy_ids,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=600,
                                                   ignore_eos=True)), timeout=300)
            try:
                next(iter(busy))  # its prompt is in the holder's cache: its blocks are taken

                def holder_looks_busy() -> bool:
                    with grpc.insecure_channel(mesh.router_address) as router_channel:
                        status = router_pb2_grpc.RouterStub(router_channel).GetStatus(
                            router_pb2.GetStatusRequest(), timeout=5)
                    mine = next(i for i in status.instances if i.instance_id == holder_id)
                    used = mine.load.num_total_blocks - mine.load.num_free_blocks
                    return used >= len(busy_ids) // BLOCK

                wait_for(holder_looks_busy, "the router seeing the holder's load")
                tokens, result = generate_greedy(mesh.router_address, ids, ANSWER_TOKENS)
            finally:
                busy.cancel()
        assert result.served_by.decode_instance_id == other_id
        assert tokens == reference(offline, ids)
        assert peer_blocks(other, "pulled") >= held - 1
        assert result.usage.cached_prompt_tokens >= (held - 1) * BLOCK
        assert mesh.router is not None
        router = scrape(mesh.router, "pdmesh:router_peer_prefix_total")
        assert router.get(frozenset({("outcome", "pulled")}), 0) == 1
