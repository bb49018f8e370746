"""Do new grammars stall the requests already decoding?

The engine core runs in its own process (as served); `--streams` plain requests decode
side by side, and once each has a few tokens, `--schemas` structured requests arrive at once,
each with a JSON schema no earlier request used, so each must be compiled. The table gives the
plain streams' inter-token gaps before that burst and while it is being admitted (from the
burst until the last structured request's first token), and what compiling those schemas
costs on its own, measured in this process against the same vocabulary.

With the compile on the core's loop every new schema adds its compile time to one step of
every running stream; with it beside the loop (engine/core/core_loop.py) the gaps during the burst
should look like the ones before it, give or take the CPU the compile thread takes.

    .venv/bin/python bench/grammar_stall.py [--streams 8] [--schemas 8] [--fields 24]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.frontend.async_engine import AsyncEngine
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.structured.grammar import GrammarCompiler, grammar_vocabulary
from pdmesh.engine.structured_output import StructuredOutput

TYPES = ({"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "boolean"},
         {"type": "array", "items": {"type": "number"}, "maxItems": 4},
         {"enum": ["red", "green", "blue", "cyan", "magenta"]})


def schema(index: int, fields: int) -> dict:
    """A schema of `fields` typed properties, nested one level, unique to `index`."""
    props = {f"s{index}_f{k}": TYPES[(index + k) % len(TYPES)] for k in range(fields)}
    props[f"s{index}_nested"] = {"type": "object", "properties": dict(list(props.items())[:4]),
                                 "required": list(props)[:2], "additionalProperties": False}
    return {"type": "object", "properties": props, "required": list(props)[: fields // 2],
            "additionalProperties": False}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def plain_stream(engine: AsyncEngine, index: int, prompt: str, max_tokens: int,
                       arrivals: list[tuple[float, int]], started: asyncio.Event,
                       warm_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    seen = 0
    async for out in engine.generate(f"plain-{index}", prompt, params):
        now = time.perf_counter()
        count = len(out.outputs[0].token_ids)
        arrivals.extend((now, index) for _ in range(count - seen))
        seen = count
        if seen >= warm_tokens:
            started.set()


async def structured(engine: AsyncEngine, index: int, spec: dict) -> float:
    params = SamplingParams(max_tokens=4, temperature=0.0,
                            structured_output=StructuredOutput(json_schema=spec))
    async for _ in engine.generate(f"json-{index}", "A record as JSON:", params):
        return time.perf_counter()  # its first token
    raise RuntimeError("no output")


def gaps(arrivals: list[tuple[float, int]], streams: int, start: float, end: float) -> list[float]:
    """Milliseconds between consecutive outputs of each stream, for outputs inside the window."""
    out = []
    for index in range(streams):
        times = sorted({t for t, i in arrivals if i == index})
        out += [(b - a) * 1e3 for a, b in itertools.pairwise(times)
                if start <= b <= end]
    return out


async def run(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, max_num_seqs=args.streams + args.schemas,
                          kv_cache_memory="256MiB", max_model_len=1024)
    engine = await AsyncEngine.spawn(config)
    try:
        # Warm-up: the vocabulary reaches the core and xgrammar is imported there, once.
        await structured(engine, -1, {"type": "object",
                                      "properties": {"warm": {"type": "integer"}}})
        compiler = GrammarCompiler(grammar_vocabulary(
            engine.tokenizer, engine.info.vocab_size, engine.eos_token_ids))
        specs = [schema(i, args.fields) for i in range(args.schemas)]
        compile_ms = []
        for i in range(args.schemas):  # other schemas than the engine's (same shape)
            t0 = time.perf_counter()
            compiler.compile(StructuredOutput(json_schema=schema(1000 + i, args.fields)))
            compile_ms.append((time.perf_counter() - t0) * 1e3)

        arrivals: list[tuple[float, int]] = []
        started = [asyncio.Event() for _ in range(args.streams)]
        prompt = "Write a long story about a lighthouse keeper. " * 8
        tasks = [asyncio.create_task(plain_stream(engine, i, prompt, args.max_tokens, arrivals,
                                                  started[i], args.warm_tokens))
                 for i in range(args.streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
        burst = time.perf_counter()
        firsts = await asyncio.gather(*(structured(engine, i, s) for i, s in enumerate(specs)))
        end = max(firsts)
        await asyncio.wait_for(asyncio.gather(*tasks), 600)
    finally:
        await engine.shutdown()

    before = gaps(arrivals, args.streams, 0.0, burst)
    during = gaps(arrivals, args.streams, burst, end)
    print(f"\n{args.streams} plain streams decoding; {args.schemas} new JSON schemas "
          f"({args.fields} fields) arrive at once; admitted in {(end - burst) * 1e3:.0f} ms")
    print(f"compile alone: {statistics.median(compile_ms):.1f} ms per schema (median), "
          f"{sum(compile_ms):.0f} ms for all\n")
    print(f"| {'plain streams, gap between tokens':<36} | {'n':>4} | {'p50 ms':>7} | "
          f"{'p99 ms':>7} | {'max ms':>7} |")
    print(f"|{'-' * 38}|{'-' * 6}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
    for name, values in (("before the burst", before), ("while the schemas are admitted", during)):
        if not values:
            print(f"| {name:<36} | {0:>4} | {'-':>7} | {'-':>7} | {'-':>7} |")
            continue
        print(f"| {name:<36} | {len(values):>4} | {statistics.median(values):>7.1f} | "
              f"{percentile(values, 0.99):>7.1f} | {max(values):>7.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--fields", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--warm-tokens", type=int, default=24)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
