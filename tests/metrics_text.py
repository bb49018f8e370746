"""Reading a Prometheus exposition in tests, whatever labels a scrape adds (the one scrape of
`pdmesh serve` labels every series with its `service`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def counter(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when absent)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
