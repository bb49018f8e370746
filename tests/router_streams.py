"""Streams through the router's gRPC API, as the fault tests drive them: a fixed mix of
requests, and what one client saw of each (tokens, logprobs, text, finishes, when each message
came), so a disturbed run can be compared with an undisturbed one."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPTS = [
    "The three primary colors are red, yellow and blue. Mixing two of them gives",
    "Paris is the capital of France, and its most famous monument is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
]


def mixed_sampling(i: int, max_tokens: int) -> common_pb2.SamplingParams:
    """Request i: greedy (0, 1, 4, 5) or seeded (2, 3, 6, 7), so that round robin puts both
    kinds on each decode instance; request 7 samples n = 2 seeded sequences. Every request
    returns its sampled tokens' logprobs: the near-tie check reads them."""
    if i == 7:
        return common_pb2.SamplingParams(temperature=0.8, seed=7, n=2, logprobs=0,
                                         max_tokens=max_tokens, ignore_eos=True)
    if i % 4 >= 2:
        return common_pb2.SamplingParams(temperature=0.8, seed=100 + i, frequency_penalty=0.3,
                                         logprobs=0, max_tokens=max_tokens, ignore_eos=True)
    return common_pb2.SamplingParams(temperature=0.0, logprobs=0, max_tokens=max_tokens,
                                     ignore_eos=True)


def mixed_requests(max_tokens: int) -> list[tuple[str, common_pb2.SamplingParams]]:
    return [(PROMPTS[i % len(PROMPTS)], mixed_sampling(i, max_tokens)) for i in range(8)]


@dataclass
class Stream:
    """What one client saw of one streamed request, and when."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, common_pb2.Finish] = field(default_factory=dict)
    result: router_pb2.GenerateResult | None = None
    errors: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic, one per message
    started: threading.Event = field(default_factory=threading.Event)

    def longest_pause_s(self) -> float:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return max(gaps, default=0.0)


def run_stream(address: str, prompt: list[int], params: common_pb2.SamplingParams,
               stream: Stream, *, started_after: int, timeout_s: float) -> Stream:
    """Stream one request into `stream`; `stream.started` is set once every sequence has
    `started_after` tokens (or the stream ended)."""
    n = params.n or 1
    with grpc.insecure_channel(address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), stream=True,
                                       sampling=params), timeout=timeout_s)
        for resp in call:
            stream.arrivals.append(time.monotonic())
            if resp.HasField("result"):
                stream.result = resp.result
                continue
            delta = resp.delta
            if delta.index in stream.finishes:
                stream.errors.append(f"delta after the finish of sequence {delta.index}")
            stream.tokens.setdefault(delta.index, []).extend(delta.token_ids)
            stream.logprobs.setdefault(delta.index, []).extend(
                lp.logprob for lp in delta.logprobs)
            stream.text[delta.index] = stream.text.get(delta.index, "") + delta.text
            if delta.HasField("finish"):
                stream.finishes[delta.index] = delta.finish
                if delta.finish.reason == common_pb2.FINISH_REASON_ERROR:
                    stream.errors.append(f"error event: {delta.finish.message}")
            if all(len(stream.tokens.get(i, [])) >= started_after for i in range(n)):
                stream.started.set()
    stream.started.set()
    return stream


def generate_greedy(address: str, ids: list[int], max_tokens: int
                    ) -> tuple[list[int], router_pb2.GenerateResult]:
    """One greedy request of `max_tokens` (EOS ignored), unary: its tokens and its result."""
    with grpc.insecure_channel(address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True))
        replies = list(router.Generate(request, timeout=300))
    tokens = [t for r in replies if r.HasField("delta") for t in r.delta.token_ids]
    return tokens, next(r.result for r in replies if r.HasField("result"))
