"""Multi-turn, shared-prefix workload against a local 2 prefill + 2 decode mesh.

Starts the mesh with `LocalMesh` (real processes, a real redis-server), then runs the same
shape of workload through a prefix-aware router and through a round-robin router over the same
instances. Each policy gets its own conversations (distinct system prompts), so neither
profits from the caches the other warmed. Prints, per policy, the cluster prefix hit rate
(cached prompt tokens / prompt tokens, as reported in usage) and client-side TTFT p50/p99.

    .venv/bin/python bench/mesh_prefix.py --conversations 6 --turns 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from pdmesh.serve import Child, LocalMesh, MeshConfig, pdmesh_command
from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass
class Sample:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def run_conversation(
    stub: router_pb2_grpc.RouterStub, system: str, conv: int, turns: int, max_tokens: int
) -> list[Sample]:
    messages = [router_pb2.ChatMessage(role="system", content=system)]
    samples = []
    for turn in range(turns):
        question = f"Conversation {conv}, question {turn}: what should I try next, and why?"
        messages.append(router_pb2.ChatMessage(role="user", content=question))
        request = router_pb2.GenerateRequest(
            chat=router_pb2.Chat(messages=messages),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens),
            stream=True,
        )
        started = time.monotonic()
        ttft = None
        answer = []
        usage = common_pb2.Usage()
        for resp in stub.Generate(request, timeout=300):
            if resp.HasField("delta"):
                if ttft is None and resp.delta.token_ids:
                    ttft = time.monotonic() - started
                answer.append(resp.delta.text)
            else:
                usage = resp.result.usage
        messages.append(router_pb2.ChatMessage(role="assistant", content="".join(answer)))
        samples.append(Sample(ttft or 0.0, usage.prompt_tokens, usage.cached_prompt_tokens))
    return samples


def run_policy(address: str, label: str, args: argparse.Namespace) -> list[Sample]:
    # A long shared system prompt per policy: every conversation of the policy shares it.
    system = f"[{label}] You are a careful assistant for a gardening club. " + " ".join(
        f"Rule {i}: answer briefly and mention plant number {i}." for i in range(args.rules)
    )
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            futures = [
                pool.submit(run_conversation, stub, system, c, args.turns, args.max_tokens)
                for c in range(args.conversations)
            ]
            return [s for f in futures for s in f.result()]


def report(label: str, samples: list[Sample]) -> None:
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    ttfts = [s.ttft_s * 1000 for s in samples]
    print(
        f"{label:>13}: requests={len(samples)} prefix_hit_rate={cached / max(1, prompt):.1%} "
        f"({cached}/{prompt} tokens) ttft_p50={statistics.median(ttfts):.0f}ms "
        f"ttft_p99={percentile(ttfts, 99):.0f}ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rules", type=int, default=4, help="system prompt length knob")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="192MiB")
    args = parser.parse_args(argv)
    config = MeshConfig(
        num_prefill=2, num_decode=2, kv_cache_memory=args.kv_cache_memory, gateway_port=-1
    )
    with LocalMesh(config) as mesh:
        rr = Child("rr-router", pdmesh_command(
            "router", *mesh._router_argv(), "--routing-policy", "round_robin"))
        try:
            rr_address = rr.wait_ready(timeout_s=120)
            results = {
                "prefix_aware": run_policy(mesh.router_address, "prefix_aware", args),
                "round_robin": run_policy(rr_address, "round_robin", args),
            }
        finally:
            rr.terminate()
    print(f"mesh: 2 prefill + 2 decode, {args.conversations} conversations x {args.turns} "
          f"turns, concurrency {args.concurrency}")
    for label, samples in results.items():
        report(label, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
