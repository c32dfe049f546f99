"""The per-step Prometheus series as plain numbers: what a step costs them is a few additions, not a lock each.

prometheus-client's ``Counter.inc`` and ``Histogram.observe`` take a lock and check their arguments at every call:
about 6 µs of a step for the two counters and four histograms the loop feeds (``bench/boundary.py``). Here the
loop's thread adds to Python numbers and a bucket list, and :class:`StepSeries` builds the same families (names,
help, labels, buckets, ``_created``) when Prometheus scrapes. A scrape may see one observation's sum without its
bucket (or the reverse), never a bucket list that decreases: the list is copied once, and ``_count`` is its total.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any


class Count:
    """A counter's value; the loop's thread adds to ``value``."""

    __slots__ = ("created", "doc", "name", "value")

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc, self.value, self.created = name, doc, 0.0, time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Buckets:
    """A histogram: one count per bucket (the last one +Inf), not cumulative, and the sum."""

    __slots__ = ("bounds", "counts", "created", "doc", "name", "sum")

    def __init__(self, name: str, doc: str, bounds: Sequence[float]) -> None:
        self.name, self.doc, self.bounds = name, doc, tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum, self.created = 0.0, time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus's le
        self.sum += value


class StepSeries:
    """A registry collector for :class:`Count` and :class:`Buckets` series with one label set."""

    def __init__(self, label_names: Sequence[str], label_values: Sequence[str]) -> None:
        self.label_names, self.label_values = list(label_names), list(label_values)
        self.series: list[Count | Buckets] = []

    def count(self, name: str, doc: str) -> Count:
        made = Count(name, doc)
        self.series.append(made)
        return made

    def buckets(self, name: str, doc: str, bounds: Sequence[float]) -> Buckets:
        made = Buckets(name, doc, bounds)
        self.series.append(made)
        return made

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        from prometheus_client.samples import Sample
        from prometheus_client.utils import floatToGoString

        labels = dict(zip(self.label_names, self.label_values, strict=True))
        for series in self.series:
            if isinstance(series, Count):
                counter = CounterMetricFamily(series.name, series.doc, labels=self.label_names)
                counter.add_metric(self.label_values, series.value, created=series.created)
                yield counter
                continue
            counts, total = list(series.counts), series.sum
            cumulative, running = [], 0
            for bound, count in zip([*map(floatToGoString, series.bounds), "+Inf"], counts, strict=True):
                running += count
                cumulative.append((bound, float(running)))
            histogram = HistogramMetricFamily(series.name, series.doc, labels=self.label_names)
            histogram.add_metric(self.label_values, cumulative, total)
            histogram.samples.append(Sample(f"{series.name}_created", labels, series.created))
            yield histogram
