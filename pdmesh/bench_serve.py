"""`pdmesh bench serve`: an online serving benchmark against an OpenAI-compatible endpoint.

In the spirit of `vllm bench serve`: requests arrive open-loop (a Poisson process at
`request_rate`, or all at once for inf), optionally capped at `max_concurrency` in flight,
bounded by a number of requests and a time limit. Every request streams, so the client sees
time to first token (TTFT) and the gaps between streamed chunks (ITL); the report gives
request and token throughput, TTFT, TPOT = (latency − TTFT) / (output tokens − 1), ITL and
end-to-end latency (mean, median, p90, p99) and goodput: requests per second that met every
SLO given.

Workloads are *sessions* of one or more turns. Single-shot datasets (random, shared-prefix)
are one-turn sessions; a multi-turn session sends turn k only after turn k−1 answered, with
the conversation so far (including the real answers) as its prompt, so each turn extends a
prefix the serving side may have cached. Arrivals schedule session starts.

The pieces are separate for testing: dataset generators and the metric math are pure
functions of their inputs (and a seeded `random.Random`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pdmesh import slo

WORDS = (
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
    "child", "eye", "woman", "place", "work", "week", "case", "point", "company", "number",
    "group", "problem", "fact", "river", "mountain", "cloud", "music", "garden", "window",
    "light", "stone", "paper", "question", "answer", "story", "letter", "table", "market",
    "ocean", "forest", "bridge", "engine",
)


# -- prompts -----------------------------------------------------------------------------------
class PromptSource:
    """Makes prompt pieces of an exact token length (with a tokenizer: random vocabulary ids,
    sent as token ids to /v1/completions) or of n random words (no tokenizer needed)."""

    def __init__(self, rng: random.Random, tokenizer: Any | None = None) -> None:
        self.rng = rng
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        if tokenizer is not None:
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            self._ids = [i for i in range(len(tokenizer)) if i not in special]

    def piece(self, length: int) -> Piece:
        if self.tokenizer is None:
            return Piece(" ".join(self.rng.choice(WORDS) for _ in range(length)), None, length)
        ids = [self.rng.choice(self._ids) for _ in range(length)]
        return Piece(self.tokenizer.decode(ids), ids, length)


@dataclass
class Piece:
    text: str
    token_ids: list[int] | None
    length: int  # tokens (or words, without a tokenizer)

    def __add__(self, other: Piece) -> Piece:
        ids = None
        if self.token_ids is not None and other.token_ids is not None:
            ids = self.token_ids + other.token_ids
        return Piece(self.text + other.text, ids, self.length + other.length)


@dataclass
class Turn:
    prompt: Piece
    output_len: int


@dataclass
class Session:
    turns: list[Turn]
    group: int = 0  # shared-prefix group, for reports


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean·(1−r), mean·(1+r)], at least 1 (vLLM's random dataset)."""
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    source: PromptSource, num: int, input_len: int, output_len: int, range_ratio: float = 0.0
) -> list[Session]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = source.rng
    return [
        Session([Turn(source.piece(_lengths(rng, input_len, range_ratio)),
                      _lengths(rng, output_len, range_ratio))])
        for _ in range(num)
    ]


def shared_prefix_dataset(
    source: PromptSource, num: int, num_groups: int, prefix_len: int, suffix_len: int,
    output_len: int,
) -> list[Session]:
    """`num_groups` long prefixes; request i uses prefix i mod groups plus its own suffix."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    prefixes = [source.piece(prefix_len) for _ in range(num_groups)]
    return [
        Session([Turn(prefixes[i % num_groups] + source.piece(suffix_len), output_len)],
                group=i % num_groups)
        for i in range(num)
    ]


def multi_turn_dataset(
    source: PromptSource, num: int, turns: int, turn_len: int, output_len: int
) -> list[Session]:
    """Conversations of `turns` user turns each, `num` turns in all (the last may be short)."""
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    sessions: list[Session] = []
    remaining = num
    while remaining > 0:
        k = min(turns, remaining)
        sessions.append(Session([Turn(source.piece(turn_len), output_len) for _ in range(k)],
                                group=len(sessions)))
        remaining -= k
    return sessions


# -- one request -----------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # since the benchmark started
    text: str = ""
    error: str = ""


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one `data:` line; None for blank lines, comments and `[DONE]`."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            text += (choice.get("delta") or {}).get("content") or ""
    return text


def _body(endpoint: str, model: str, history: list[dict[str, str]], turn: Turn,
          temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": turn.output_len, "temperature": temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    if endpoint.endswith("/chat/completions"):
        body["messages"] = [*history, {"role": "user", "content": turn.prompt.text}]
    elif history:
        body["prompt"] = "".join(m["content"] for m in history) + turn.prompt.text
    else:
        body["prompt"] = turn.prompt.token_ids or turn.prompt.text
    return body


async def send_request(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str], t0: float
) -> RequestResult:
    """POST one streaming request (httpx.AsyncClient) and time its chunks."""
    start = time.perf_counter()
    result = RequestResult(ok=False, start_s=start - t0)
    last: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter()
                if chunk_text(chunk):
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.text += chunk_text(chunk)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_len = int(usage.get("prompt_tokens", 0))
                    result.output_len = int(usage.get("completion_tokens", 0))
        result.latency_s = time.perf_counter() - start
        result.ok = last is not None or result.output_len > 0
        if not result.ok:
            result.error = "no output"
    except Exception as exc:  # network errors are results, not crashes of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# -- metrics ---------------------------------------------------------------------------------
@dataclass
class Stats:
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> Stats:
        if len(values_ms) == 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        a = np.asarray(values_ms, dtype=np.float64)
        return cls(float(a.mean()), float(np.median(a)), float(np.percentile(a, 90)),
                   float(np.percentile(a, 99)))


def latency_of(r: RequestResult) -> slo.RequestLatency:
    return slo.RequestLatency(r.ttft_s, r.latency_s, r.output_len, max(r.itl_s, default=0.0))


def tpot_s(r: RequestResult) -> float | None:
    """Time per output token after the first; None with fewer than two output tokens."""
    return latency_of(r).tpot_s if r.output_len >= 2 else None


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    return slo.meets_slos(latency_of(r), slos)


@dataclass
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    goodput: float | None = None


def compute_metrics(
    results: Sequence[RequestResult], duration_s: float, slos: dict[str, float] | None = None
) -> BenchMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t * 1000 for r in ok if (t := tpot_s(r)) is not None]
    goodput = None
    if slos:
        goodput = sum(meets_slos(r, slos) for r in ok) / duration_s
    return BenchMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=Stats.of([r.ttft_s * 1000 for r in ok]),
        tpot_ms=Stats.of(tpots),
        itl_ms=Stats.of([x * 1000 for r in ok for x in r.itl_s]),
        e2el_ms=Stats.of([r.latency_s * 1000 for r in ok]),
        goodput=goodput,
    )


def format_report(m: BenchMetrics, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{f' {title} ':=^60}"]

    def row(label: str, value: float | int | str) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.goodput is not None:
        row("Request goodput (req/s):", m.goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name, label in (("ttft_ms", "Time to First Token"), ("tpot_ms",
                        "Time per Output Token (excl. 1st token)"),
                        ("itl_ms", "Inter-token Latency"), ("e2el_ms", "E2E Latency")):
        stats: Stats = getattr(m, name)
        short = name.split("_")[0].upper()
        lines.append(f"{f' {label} ':-^60}")
        row(f"Mean {short} (ms):", stats.mean)
        row(f"Median {short} (ms):", stats.median)
        row(f"P90 {short} (ms):", stats.p90)
        row(f"P99 {short} (ms):", stats.p99)
    lines.append("=" * 60)
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------
@dataclass
class RunSettings:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    max_duration_s: float | None = None
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True


def arrival_delays(rng: random.Random, count: int, rate: float) -> list[float]:
    """Gaps between session starts: exponential (Poisson arrivals) at `rate`/s; 0 for inf."""
    if rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {rate}")
    if rate == float("inf"):
        return [0.0] * count
    return [rng.expovariate(rate) for _ in range(count)]


async def run_benchmark(
    settings: RunSettings, sessions: list[Session],
    on_result: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every session's turns; returns (results, wall duration in seconds).

    New turns stop being sent at `max_duration_s`; requests still running then are cancelled
    and left out of the results (they would only measure the cut-off).
    """
    import httpx

    url = settings.base_url.rstrip("/") + settings.endpoint
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limit = asyncio.Semaphore(settings.max_concurrency or 1_000_000)
    delays = arrival_delays(random.Random(settings.seed), len(sessions), settings.request_rate)
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    deadline = None if settings.max_duration_s is None else t0 + settings.max_duration_s

    def expired() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    async def run_session(client: Any, session: Session) -> None:
        history: list[dict[str, str]] = []
        for turn in session.turns:
            if expired():
                return
            body = _body(settings.endpoint, settings.model, history, turn, settings.temperature)
            async with limit:
                if expired():
                    return
                result = await send_request(client, url, body, headers, t0)
            results.append(result)
            if on_result is not None:
                on_result(result)
            if not result.ok:
                return  # a conversation does not go on past a failed turn
            history += [{"role": "user", "content": turn.prompt.text},
                        {"role": "assistant", "content": result.text}]

    timeout = httpx.Timeout(settings.request_timeout_s, connect=30.0)
    pool = httpx.Limits(max_connections=settings.max_concurrency or 1000,
                        max_keepalive_connections=settings.max_concurrency or 1000)
    async with httpx.AsyncClient(timeout=timeout, limits=pool) as client:
        tasks: list[asyncio.Task[None]] = []
        for session, delay in zip(sessions, delays, strict=True):
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process itself, not synchronization
            if expired():
                break
            tasks.append(asyncio.create_task(run_session(client, session)))
        remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return results, time.perf_counter() - t0


def result_json(
    settings: RunSettings, dataset: dict[str, Any], metrics: BenchMetrics,
    results: Sequence[RequestResult], slos: dict[str, float],
) -> dict[str, Any]:
    settings_dict = asdict(settings)
    settings_dict.pop("api_key", None)
    if settings_dict["request_rate"] == float("inf"):
        settings_dict["request_rate"] = "inf"
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": settings_dict,
        "dataset": dataset,
        "goodput_slos_ms": slos,
        "metrics": asdict(metrics),
        "requests": [
            {k: v for k, v in asdict(r).items() if k != "text"} for r in results
        ],
    }
