"""Goodput: requests that met every latency SLO given. One rule for the benchmark client
(`pdmesh bench serve --goodput`) and the router (`--goodput`, `pdmesh:router_goodput_requests`),
so both count the same requests.

SLOs are given as vLLM's benchmark client takes them, `name:ms`: `ttft` (time to first token),
`tpot` (mean time per output token after the first), `e2el` (end to end), and `itl` (the
longest gap between two consecutive arrivals of output: what a reader sees as a freeze; vLLM's
client has no such SLO, its ITL percentiles are over all gaps of all requests).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GOODPUT_METRICS = ("ttft", "tpot", "e2el", "itl")


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.strip().partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO must be one of {', '.join(GOODPUT_METRICS)} as "
                             f"name:ms, got {spec!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number") from None
        if not 0 < slos[name] < float("inf"):
            raise ValueError(f"goodput SLO {spec!r} must be > 0")
    return slos


@dataclass(frozen=True)
class RequestLatency:
    """What a request's SLOs are judged on (seconds)."""

    ttft_s: float
    e2e_s: float
    output_tokens: int
    max_itl_s: float = 0.0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first; 0 with fewer than two."""
        if self.output_tokens < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def meets_slos(latency: RequestLatency, slos: dict[str, float]) -> bool:
    measured_ms = {"ttft": latency.ttft_s * 1000, "e2el": latency.e2e_s * 1000,
                   "tpot": latency.tpot_s * 1000, "itl": latency.max_itl_s * 1000}
    return all(measured_ms[name] <= limit for name, limit in slos.items())
