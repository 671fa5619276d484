"""Prometheus `/metrics` text, read the way Prometheus reads it (prometheus_client's parser):
fetching it, each family's type, and a sample's value by name and labels."""

from __future__ import annotations

import urllib.request
from typing import Mapping

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(target: int | str, timeout: float = 5.0) -> str:
    """The exposition text at `target`: a port on 127.0.0.1 (its /metrics), or a whole URL."""
    url = f"http://127.0.0.1:{target}/metrics" if isinstance(target, int) else target
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def families(text: str) -> list[Metric]:
    """Every family in `text`, in order (concatenated scrapes give each scrape's own)."""
    return list(text_string_to_metric_families(text))


def types(text: str) -> dict[str, str]:
    """{family: type}. A counter's family is named without `_total` whatever the TYPE line said
    (that differs by client version); its samples keep it (`kvfleet:ticks_total`)."""
    return {f.name: f.type for f in families(text)}


def samples(text: str, name: str | None = None, labels: Mapping[str, str] | None = None) -> list[Sample]:
    """The samples named `name` (all, for None) whose labels include `labels`."""
    want = dict(labels or {}).items()
    return [
        s for f in families(text) for s in f.samples if (name is None or s.name == name) and want <= s.labels.items()
    ]


def value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The value of the one sample named `name` whose labels include `labels`; none, or more than
    one (the labels given do not say which), fails the test."""
    found = samples(text, name, labels)
    assert found, f"no sample {name}{dict(labels or {})} in the metrics"
    assert len(found) == 1, f"{name}{dict(labels or {})} names {len(found)} samples: {found}"
    return found[0].value
