"""Prometheus metric families built at scrape time from the stats dicts a process keeps.

Shared by the node agent's and the metadata service's collectors; no state of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def family_by_label(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    documentation: str,
    label: str,
    counts: Mapping[str, float],
) -> CounterMetricFamily | GaugeMetricFamily:
    """A `kind` family named `name` with one sample per entry of `counts`, labelled `label`."""
    family = kind(name, documentation, labels=[label])
    for value, count in counts.items():
        family.add_metric([value], count)
    return family
