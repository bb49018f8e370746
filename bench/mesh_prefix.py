"""Cluster-wide prefix caching on a 2 prefill + 2 decode mesh: multi-turn conversations with and
without peer reuse and the host offload tier, in one run.

Each mode starts its own mesh (`LocalMesh`: real processes, a real redis-server) and runs the
same workload: `--conversations` chats of `--turns` turns sharing a system prompt, each turn's
prompt the whole conversation so far (the chat template over system, questions and answers);
the conversations take turns (every conversation's first turn, then every second turn, ...,
`--concurrency` requests at a time), as many users chatting at once do, so their KV competes
for the engines' caches. P/D is forced (`--local-prefill-threshold 0`): every
turn is prefilled on a prefill instance, while the conversation's KV (the previous turn's
prompt and answer) lives on the decode instance that wrote it, which is what peer reuse is for
(with conditional disaggregation the holder prefills short follow-ups itself instead). The KV
budget per engine (`--kv-cache-memory`) is small, so conversations evict each other's blocks:

- `baseline`: the router's prefix-aware routing alone (`--no-kv-peer-reuse`, no offload tier);
- `reuse+tier`: peer reuse on (the router's default) and every engine with a host offload tier
  of `--kv-offload-host-bytes`;
- `reuse`, `tier`: each alone (`--modes baseline,reuse,tier,reuse+tier` for the ablation).

Prints, per mode, the prompt tokens the engines computed (their prefix-cache query tokens less
hits, summed over the four engines: what was not reused from any cache), client-side TTFT
p50/p99, and the router's peer-reuse counters; then the reduction.

    .venv/bin/python bench/mesh_prefix.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.engine.config import EngineConfig
from pdmesh.serve import Child, LocalMesh, MeshConfig
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass
class Sample:
    ttft_s: float
    prompt_tokens: int
    turn: int


@dataclass
class ModeResult:
    label: str
    samples: list[Sample]
    computed_tokens: int
    prompt_tokens: int
    peer: dict[str, float]
    wall_s: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def ask(stub: router_pb2_grpc.RouterStub, messages: list[router_pb2.ChatMessage], conv: int,
        turn: int, max_tokens: int) -> Sample:
    """Turn `turn` of conversation `conv`: its question and the answer appended to
    `messages`."""
    question = (f"Conversation {conv}, question {turn}: which plant should the club try "
                f"next in bed {conv * 10 + turn}, and why?")
    messages.append(router_pb2.ChatMessage(role="user", content=question))
    request = router_pb2.GenerateRequest(
        chat=router_pb2.Chat(messages=messages),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True),
        stream=True,
    )
    started = time.monotonic()
    ttft = None
    answer = []
    usage = common_pb2.Usage()
    for resp in stub.Generate(request, timeout=600):
        if resp.HasField("delta"):
            if ttft is None and resp.delta.token_ids:
                ttft = time.monotonic() - started
            answer.append(resp.delta.text)
        else:
            usage = resp.result.usage
    messages.append(router_pb2.ChatMessage(role="assistant", content="".join(answer)))
    return Sample(ttft or 0.0, usage.prompt_tokens, turn)


def scrape(child: Child) -> dict[str, float]:
    """`child`'s metrics, each summed over its labels."""
    assert child.metrics_url
    with urllib.request.urlopen(child.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def computed_tokens(mesh: LocalMesh) -> int:
    """Prompt tokens the mesh's engines computed since start (queried less prefix hits)."""
    engines = [scrape(c) for c in (*mesh.prefill, *mesh.decode)]
    return int(sum(m.get("pdmesh:prefix_cache_queries_total", 0.0)
                   - m.get("pdmesh:prefix_cache_hits_total", 0.0) for m in engines))


def router_peer_counters(mesh: LocalMesh) -> dict[str, float]:
    assert mesh.router is not None and mesh.router.metrics_url
    with urllib.request.urlopen(mesh.router.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdmesh:router_peer_prefix_total":
                out[sample.labels["outcome"]] = sample.value
            elif sample.name == "pdmesh:router_peer_prefix_tokens_total":
                out["tokens"] = sample.value
    return out


def run_mode(label: str, config: MeshConfig, router_args: list[str],
             args: argparse.Namespace) -> ModeResult:
    system = "You are a careful assistant for a gardening club. " + " ".join(
        f"Rule {i}: answer briefly and mention plant number {i}." for i in range(args.rules))
    with LocalMesh(config, router_args=["--poll-interval-s", "0.2", *router_args]) as mesh:
        before = computed_tokens(mesh)
        started = time.monotonic()
        chats = [[router_pb2.ChatMessage(role="system", content=system)]
                 for _ in range(args.conversations)]
        samples: list[Sample] = []
        with grpc.insecure_channel(mesh.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                for turn in range(args.turns):  # every conversation's turn, then the next
                    samples += pool.map(
                        lambda c, t=turn: ask(stub, chats[c], c, t, args.max_tokens),
                        range(args.conversations))
        wall_s = time.monotonic() - started
        computed = computed_tokens(mesh) - before
        peer = router_peer_counters(mesh)
    return ModeResult(label, samples, computed, sum(s.prompt_tokens for s in samples), peer,
                      wall_s)


def report(results: list[ModeResult], args: argparse.Namespace) -> None:
    print(f"mesh: 2 prefill + 2 decode (P/D forced), {args.conversations} conversations x "
          f"{args.turns} turns, {args.max_tokens}-token answers, concurrency "
          f"{args.concurrency}, kv cache {args.kv_cache_memory} per engine")
    print("| mode | requests | prompt tokens | computed | computed % | TTFT p50 ms | "
          "TTFT p99 ms | later turns TTFT p50 ms | peer pulls | peer tokens | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ttfts = [s.ttft_s * 1e3 for s in r.samples]
        later = [s.ttft_s * 1e3 for s in r.samples if s.turn > 0] or [0.0]
        print(f"| {r.label} | {len(r.samples)} | {r.prompt_tokens} | {r.computed_tokens} | "
              f"{r.computed_tokens / max(1, r.prompt_tokens):.1%} | "
              f"{statistics.median(ttfts):.0f} | {percentile(ttfts, 99):.0f} | "
              f"{statistics.median(later):.0f} | {r.peer.get('pulled', 0):.0f} | "
              f"{r.peer.get('tokens', 0):.0f} | {r.wall_s:.0f} |")
        print("  router peer counters:", r.peer)
    base = results[0]
    base_p50 = statistics.median([s.ttft_s for s in base.samples])
    for new in results[1:]:
        fewer = 1 - new.computed_tokens / max(1, base.computed_tokens)
        p50 = statistics.median([s.ttft_s for s in new.samples])
        print(f"{new.label}: {fewer:.1%} fewer prompt tokens computed than {base.label}; "
              f"TTFT p50 {p50 * 1e3:.0f} ms vs {base_p50 * 1e3:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rules", type=int, default=6, help="system prompt length knob")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="48MiB")
    parser.add_argument("--kv-offload-host-bytes", default="256MiB")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--modes", type=lambda v: v.split(","), default=["baseline", "reuse+tier"],
                        help="comma-separated, in order: baseline, reuse, tier, reuse+tier")
    args = parser.parse_args(argv)

    def config(engine: EngineConfig) -> MeshConfig:
        return MeshConfig(model=args.model, num_prefill=2, num_decode=2,
                          kv_cache_memory=args.kv_cache_memory, local_prefill_threshold=0,
                          port=-1, engine=engine)

    tier = EngineConfig(kv_offload_host_bytes=args.kv_offload_host_bytes)
    modes = {  # label: (engines, router flags)
        "baseline": (EngineConfig(), ["--no-kv-peer-reuse"]),
        "reuse": (EngineConfig(), []),
        "tier": (tier, ["--no-kv-peer-reuse"]),
        "reuse+tier": (tier, []),
    }
    unknown = [m for m in args.modes if m not in modes]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {list(modes)}")
    results = [run_mode(m, config(modes[m][0]), modes[m][1], args) for m in args.modes]
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
