"""vLLM's metric names as a view of pdmesh's: `--metrics-names vllm` / PDMESH_METRICS_NAMES=vllm.

A vLLM dashboard (Grafana, alerts, autoscalers) queries `vllm:*` names with `model_name` and
`engine` labels. pdmesh measures the same quantities under `pdmesh:*` names, so instead of
instrumenting twice, exposition applies one table (`ALIASES`: pdmesh family → vLLM family and
label mapping) to the families a process is about to serve and adds the renamed copies beside
the originals. Types, values and histogram buckets are pdmesh's (a histogram keeps its own
buckets; a counter keeps `_total`). Names and labels follow vLLM 0.32
(vllm/v1/metrics/loggers.py); only quantities pdmesh has an equivalent of are aliased.

Every alias gets `engine="0"` (one pdmesh engine process is one vLLM engine) unless the sample
has an `engine` label already; the sample's other labels (`role`, and `service` on a federated
scrape) are kept, so a P/D mesh can be filtered by role.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

NAMES_ENV = "PDMESH_METRICS_NAMES"
"""The switch for processes without a `--metrics-names` flag (router, engines)."""
METRICS_NAMES = ("pdmesh", "vllm")
"""pdmesh: `pdmesh:*` only; vllm: also vLLM's names for the quantities pdmesh has."""


@dataclass(frozen=True)
class Alias:
    """One vLLM family served as a renamed copy of one pdmesh family.

    `source`/`target` are family names as prometheus_client keeps them (a counter's without
    `_total`). `relabel` renames one label and maps its values: a value absent from the map
    drops the sample (e.g. a prefill's `exported` is no finished request); samples that map
    onto the same labels are summed (their `_created` timestamps: the earliest).
    """

    source: str
    target: str
    relabel: tuple[str, str, Mapping[str, str]] | None = None
    extra: Mapping[str, str] = field(default_factory=lambda: {"engine": "0"})


FINISHED_REASONS: Mapping[str, str] = {
    "stop": "stop", "length": "length", "abort": "abort", "cancelled": "abort", "error": "error",
}
"""pdmesh's `outcome` → vLLM's `finished_reason`. Left out: `exported` (a prefill handed to
decode, counted again when decode finishes it) and `finished_on_prefill` (the decode side of
a request the prefill instance finished, and counted, itself)."""

ALIASES: tuple[Alias, ...] = (
    Alias("pdmesh:num_requests_running", "vllm:num_requests_running"),
    Alias("pdmesh:num_requests_waiting", "vllm:num_requests_waiting"),
    Alias("pdmesh:kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),  # both 0..1
    Alias("pdmesh:prefix_cache_queries", "vllm:prefix_cache_queries"),
    Alias("pdmesh:prefix_cache_hits", "vllm:prefix_cache_hits"),
    Alias("pdmesh:prompt_tokens", "vllm:prompt_tokens"),
    Alias("pdmesh:generation_tokens", "vllm:generation_tokens"),
    Alias("pdmesh:requests", "vllm:request_success",
          relabel=("outcome", "finished_reason", FINISHED_REASONS)),
    Alias("pdmesh:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    Alias("pdmesh:inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
    Alias("pdmesh:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"),
    Alias("pdmesh:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    Alias("pdmesh:request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    Alias("pdmesh:request_prompt_tokens", "vllm:request_prompt_tokens"),
    Alias("pdmesh:request_generation_tokens", "vllm:request_generation_tokens"),
    Alias("pdmesh:num_preemptions", "vllm:num_preemptions"),
)
_BY_SOURCE: dict[str, list[Alias]] = {}
for _alias in ALIASES:
    _BY_SOURCE.setdefault(_alias.source, []).append(_alias)


def metrics_names(value: str | None = None) -> str:
    """The names to serve: `value`, else PDMESH_METRICS_NAMES, else "pdmesh"; raises
    ValueError naming the switch for anything else."""
    chosen = (value if value is not None else os.environ.get(NAMES_ENV, "")).strip().lower()
    chosen = chosen or "pdmesh"
    if chosen not in METRICS_NAMES:
        raise ValueError(f"--metrics-names / {NAMES_ENV} must be one of "
                         f"{', '.join(METRICS_NAMES)}, got {chosen!r}")
    return chosen


def renamed(alias: Alias, family: Metric) -> Metric:
    """`family` under the alias's name and labels."""
    out = Metric(alias.target, family.documentation, family.type, family.unit)
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
    for s in family.samples:
        labels = dict(s.labels)
        if alias.relabel is not None:
            src, dst, values = alias.relabel
            value = values.get(labels.pop(src, ""))
            if value is None:
                continue
            labels[dst] = value
        for name, value in alias.extra.items():
            labels.setdefault(name, value)
        name = alias.target + s.name[len(family.name):]
        key = (name, tuple(sorted(labels.items())))
        before = merged.get(key)
        if before is None:
            merged[key] = s._replace(name=name, labels=labels)
        else:
            total = (min(before.value, s.value) if name.endswith("_created")
                     else before.value + s.value)
            merged[key] = before._replace(value=total)
    out.samples = list(merged.values())
    return out


def vllm_view(families: Iterable[Metric]) -> list[Metric]:
    """`families` and, after them, the vLLM-named copies of those in `ALIASES` (an alias whose
    name is already among `families` is left out, so applying the view twice adds nothing)."""
    families = list(families)
    present = {f.name for f in families}
    extra = [renamed(alias, f) for f in families for alias in _BY_SOURCE.get(f.name, ())
             if alias.target not in present]
    return families + extra


class VllmNamesView:
    """A collector serving `source` with vLLM's names added (register it in a registry of its
    own: it reports no names, so nothing is checked for duplicates)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        return iter(vllm_view(self.source.collect()))


def named_registry(source: CollectorRegistry, names: str) -> CollectorRegistry:
    """The registry to serve for `names`: `source` itself, or a view of it with vLLM's names."""
    if names != "vllm":
        return source
    view = CollectorRegistry(auto_describe=False)
    view.register(VllmNamesView(source))
    return view
