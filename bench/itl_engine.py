"""The engine's own inter-token gaps: the served workload straight on an `LLMEngine`.

`bench/serving_peer.py`'s shapes (random 256-token prompts, 64 tokens out, ignore_eos,
SmolLM2's default sampling: temperature 0.2, top-p 0.9) run in one process with no serving
processes, either a closed loop of `--conc` requests or Poisson arrivals at `--rate` req/s.
Every step is timed, and each request's gaps between two new tokens are taken where the engine
produced them, so the served ITL tail can be split into what the steps make and what the path
to the client adds. Prints throughput, ITL and TTFT percentiles, decode-only and mixed step
times, and the slowest mixed steps with the target they were planned on.

    .venv/bin/python bench/itl_engine.py [--conc 16 | --rate 1] [--requests 48]
        [--itl-target-ms MS] [--stall-stream-s S]   # S: the auto target's stall budget
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.engine_request import EngineRequest
from pdmesh.engine.frontend.llm_engine import LLMEngine
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduling import step_budget

PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64


@dataclass
class Step:
    seconds: float
    tokens: int  # computed in the step
    running: int  # sequences running when it was planned
    target_s: float  # the ITL target it was planned on (0: unbounded)


@dataclass
class Run:
    steps: list[Step] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)


def request(i: int, rng: random.Random, vocab: int) -> EngineRequest:
    ids = [rng.randrange(1000, vocab - 1000) for _ in range(PROMPT_TOKENS)]
    params = SamplingParams(temperature=0.2, top_p=0.9, max_tokens=OUTPUT_TOKENS,
                            ignore_eos=True, seed=i)
    return EngineRequest(f"r{i}", ids, params)


def arrivals(n: int, rate: float) -> list[float]:
    rng, t, out = random.Random(1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def serve(engine: LLMEngine, requests: int, conc: int, rate: float,
          seed: int = 0) -> tuple[Run, float]:
    """`seed` picks the prompts (a phase with another seed shares no prefix with this one)."""
    core, rng, run = engine.core, random.Random(seed), Run()
    vocab = core.model_config.vocab_size
    started: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    sent = 0
    t0 = time.perf_counter()
    due = arrivals(requests, rate) if rate else []

    def add(i: int, at: float) -> None:
        engine.add(request(i, rng, vocab))
        started[f"r{i}"] = at

    if not rate:
        while sent < min(conc, requests):
            add(sent, time.perf_counter())
            sent += 1
    while engine.has_unfinished_requests() or (rate and sent < requests):
        if rate:
            now = time.perf_counter() - t0
            while sent < requests and due[sent] <= now:
                add(sent, t0 + due[sent])
                sent += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, due[sent] - now))  # idle until the next arrival
                continue
        tokens_before, running = core.scheduled_tokens, len(core.scheduler.running)
        begin = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        run.steps.append(Step(end - begin, core.scheduled_tokens - tokens_before, running,
                              core.scheduler.itl_target_s))
        for out in outputs:
            rid, n = out.request_id, len(out.outputs[0].token_ids)
            if n and rid not in last and rid in started:
                run.ttft.append(end - started.pop(rid))
                last[rid] = (end, n)
            elif rid in last and n > last[rid][1]:
                run.gaps.append(end - last[rid][0])
                last[rid] = (end, n)
            if out.finished:
                last.pop(rid, None)
                if not rate and sent < requests:
                    add(sent, time.perf_counter())
                    sent += 1
    return run, time.perf_counter() - t0


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--conc", type=int, default=16, help="closed loop of this many")
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson req/s instead")
    parser.add_argument("--itl-target-ms", type=float, default=None)
    parser.add_argument("--stall-stream-s", type=float, default=None,
                        help="the auto target's stall budget for this run")
    parser.add_argument("--dtype", default="auto", help="weights and KV dtype (EngineConfig)")
    parser.add_argument("--warm-rate", type=float, default=0.0,
                        help="first serve --warm-requests at this Poisson rate, unmeasured (the "
                             "served bench's 1 req/s scenario before its burst: the step-cost "
                             "model starts the measured run with that history)")
    parser.add_argument("--warm-requests", type=int, default=40)
    args = parser.parse_args()
    if args.stall_stream_s is not None:
        step_budget.AUTO_STALL_STREAM_S = args.stall_stream_s
    engine = LLMEngine(EngineConfig(model="smollm2", engine_core_process=False,
                                    itl_target_ms=args.itl_target_ms, dtype=args.dtype))
    serve(engine, 1, 1, 0.0, seed=2)  # warm-up: one request; the step-cost model starts learning
    if args.warm_rate:
        serve(engine, args.warm_requests, 0, args.warm_rate, seed=1)
    model = engine.core.scheduler.step_cost
    print(f"cost model before: {model.cost}, mixed ratio {model.mixed_ratio:.2f}")
    run, wall = serve(engine, args.requests, args.conc, args.rate)
    print(f"cost model after: {model.cost}, mixed ratio {model.mixed_ratio:.2f}")
    ms = 1e3
    print(f"wall {wall:.1f} s, out tok/s {args.requests * OUTPUT_TOKENS / wall:.1f}, "
          f"{len(run.steps)} steps")
    print(f"ITL p50 {quantile(run.gaps, .5) * ms:.0f} p90 {quantile(run.gaps, .9) * ms:.0f} "
          f"p99 {quantile(run.gaps, .99) * ms:.0f} max {max(run.gaps) * ms:.0f} ms; "
          f"TTFT p50 {quantile(run.ttft, .5) * ms:.0f} ms")
    decode = [s.seconds for s in run.steps if s.tokens <= s.running]
    mixed = [s for s in run.steps if s.tokens > s.running]
    print(f"decode-only steps {len(decode)}: p50 {quantile(decode, .5) * ms:.0f} "
          f"p99 {quantile(decode, .99) * ms:.0f} ms")
    print(f"mixed steps {len(mixed)}: p50 {quantile([s.seconds for s in mixed], .5) * ms:.0f} "
          f"p99 {quantile([s.seconds for s in mixed], .99) * ms:.0f} ms")
    for s in sorted(mixed, key=lambda s: -s.seconds)[:8]:
        print(f"  {s.seconds * ms:.0f} ms: {s.tokens} tokens, {s.running} running, "
              f"target {s.target_s * ms:.0f} ms")


if __name__ == "__main__":
    main()
