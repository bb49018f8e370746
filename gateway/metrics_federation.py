"""One scrape for the whole mesh: the gateway's /metrics with its siblings' metrics merged in.

`pdmesh serve` runs every process on this host with a /metrics port of its own (free ports,
so nothing a scrape config can name in advance). It tells the gateway where they are
(`--metrics-federate name=url,...`); on each GET /metrics the gateway then fetches every
sibling's exposition concurrently over loopback (`--metrics-federate-timeout-s` each, the
event loop never blocked: an async client, the parsing on a worker thread) and serves one
exposition:

* every series gets a `service` label naming its process (`gateway`, `router`, `prefill-0`,
  `decode-1`, ...), so two engines of one role never collide;
* each metric family has one HELP/TYPE, its series from every process beneath it;
* a sibling that does not answer in time (dead, restarting, wedged) is left out, and
  `pdmesh:metrics_scrape_up{target}` says 0 for it (1 for each that answered), beside
  `pdmesh:metrics_scrape_duration_seconds{target}`;
* with `--metrics-names vllm` each sibling's families also get vLLM's names
  (pdmesh/metrics_vllm.py), whatever the sibling serves itself.

Without `--metrics-federate` (Kubernetes: each pod is scraped) nothing of this runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import ssl
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.metrics_vllm import vllm_view

logger = logging.getLogger(__name__)

SERVICE_LABEL = "service"
GATEWAY_SERVICE = "gateway"
"""The `service` label of the gateway's own series (no target may take it)."""
ACCEPT = "text/plain;version=0.0.4"
_TARGET_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


@dataclass(frozen=True)
class MetricsTarget:
    """A sibling process's /metrics: `name` becomes its series' `service` label."""

    name: str
    url: str


def parse_targets(entries: Sequence[str]) -> tuple[MetricsTarget, ...]:
    """`name=url` entries (`url`: http(s)://host:port/path, or host:port for
    http://host:port/metrics; a bare url is named by its host:port). Raises ValueError naming
    --metrics-federate and the entry."""
    targets: list[MetricsTarget] = []
    for entry in entries:
        name, sep, where = entry.partition("=")
        if not sep:
            name, where = "", entry
        where = where.strip()
        url = where if "://" in where else f"http://{where}/metrics"
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ValueError(f"--metrics-federate: {entry!r} is not name=http[s]://host:port/"
                             "path or name=host:port")
        name = name.strip() or parts.netloc
        if not _TARGET_NAME.fullmatch(name) or name == GATEWAY_SERVICE:
            raise ValueError(f"--metrics-federate: bad target name {name!r} (letters, digits, "
                             f"'_.:-'; not {GATEWAY_SERVICE!r})")
        if any(t.name == name for t in targets):
            raise ValueError(f"--metrics-federate: target name {name!r} given twice")
        targets.append(MetricsTarget(name, url))
    return tuple(targets)


@dataclass(frozen=True)
class Scrape:
    """What one target answered: its exposition, or None and why not."""

    target: MetricsTarget
    text: str | None
    seconds: float
    error: str = ""


@functools.lru_cache(maxsize=4)
def _ssl_context(ca: str | None) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca)


async def scrape_all(targets: Sequence[MetricsTarget], *, timeout_s: float,
                     ca: str | None = None) -> list[Scrape]:
    """Every target's exposition, fetched concurrently, each within `timeout_s`. HTTPS targets
    are verified against `ca` (the mesh's --tls-ca), else the system's CAs."""
    verify: ssl.SSLContext | bool = _ssl_context(ca) if ca else True
    # trust_env off: a proxy from the environment must not carry loopback scrapes.
    async with httpx.AsyncClient(timeout=timeout_s, verify=verify, trust_env=False,
                                 headers={"Accept": ACCEPT}) as client:
        return list(await asyncio.gather(*(_scrape(client, t, timeout_s) for t in targets)))


async def _scrape(client: httpx.AsyncClient, target: MetricsTarget, timeout_s: float) -> Scrape:
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):  # also bounds a server that drips its body
            resp = await client.get(target.url)
        resp.raise_for_status()
        return Scrape(target, resp.text, time.monotonic() - start)
    except (httpx.HTTPError, TimeoutError, OSError) as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        logger.debug("metrics scrape failed target=%s url=%s error=%s", target.name,
                     target.url, why)
        return Scrape(target, None, time.monotonic() - start, why)


class _Families:
    """The merged families as prometheus_client's renderer wants them."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge(own: CollectorRegistry, scrapes: Sequence[Scrape], *, names: str = "pdmesh") -> bytes:
    """One exposition: the gateway's own families and `scrapes`' (each series labelled with its
    `service`), one HELP/TYPE per family, and the scrape-up gauges. CPU-bound: call it off the
    event loop."""
    parsed: list[tuple[str, list[Metric]]] = []
    up = GaugeMetricFamily("pdmesh:metrics_scrape_up", "1 if the gateway's last fetch of this "
                           "mesh process's /metrics succeeded, else 0 (its series are missing)",
                           labels=["target"])
    took = GaugeMetricFamily("pdmesh:metrics_scrape_duration_seconds",
                             "How long the gateway's last fetch of this process's /metrics took",
                             labels=["target"])
    for scrape in scrapes:
        families = None
        if scrape.text is not None:
            try:
                families = list(text_string_to_metric_families(scrape.text))
            except (ValueError, IndexError, TypeError) as exc:  # the parser's ways to refuse
                logger.warning("metrics of %s do not parse: %s", scrape.target.name, exc)
        up.add_metric([scrape.target.name], 0.0 if families is None else 1.0)
        took.add_metric([scrape.target.name], scrape.seconds)
        if families is not None:
            parsed.append((scrape.target.name,
                           vllm_view(families) if names == "vllm" else families))
    merged: dict[str, Metric] = {}
    _add(merged, GATEWAY_SERVICE, vllm_view(own.collect()) if names == "vllm" else own.collect())
    _add(merged, GATEWAY_SERVICE, (up, took))
    for service, families in parsed:
        _add(merged, service, families)
    return generate_latest(_Families(merged.values()))  # type: ignore[arg-type]


def _add(merged: dict[str, Metric], service: str, families: Iterable[Metric]) -> None:
    """Append `families`' series, labelled `service`, under their family in `merged`."""
    for family in families:
        samples = [s._replace(labels={**s.labels, SERVICE_LABEL: service})
                   for s in family.samples]
        have = merged.get(family.name)
        if have is None:
            have = merged[family.name] = Metric(family.name, family.documentation, family.type,
                                                family.unit)
        elif have.type != family.type:
            logger.warning("metric %s is a %s in %s but a %s elsewhere; its series there are "
                           "left out", family.name, family.type, service, have.type)
            continue
        have.samples.extend(samples)


async def federated_exposition(own: CollectorRegistry, targets: Sequence[MetricsTarget], *,
                               timeout_s: float, ca: str | None = None,
                               names: str = "pdmesh") -> bytes:
    """The gateway's /metrics body under `pdmesh serve`: fetch every target, merge off the
    event loop."""
    scrapes = await scrape_all(targets, timeout_s=timeout_s, ca=ca)
    return await asyncio.to_thread(merge, own, scrapes, names=names)
