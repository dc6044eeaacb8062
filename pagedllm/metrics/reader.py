"""LLM.get_metrics()'s snapshot (vLLM's v1/metrics/reader.py): the engine's Prometheus metrics, those under
`pagedllm:` in its registry, as plain objects. Each series is one object with its labels (model_name, engine and
any of its own, such as finished_reason); a counter's name is its family's, without `_total`."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample

PREFIX = "pagedllm:"
_PER_POSITION = "pagedllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters: the per-position counter of accepted draft tokens, its position label
    made the index."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations by bucket: upper limit (the `le` label, "+Inf" included) -> how many were at most that; count
    (the "+Inf" bucket's) and sum of all observations."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, s.labels, s.value) for s in _samples(family, "")]
        elif family.type == "counter" and family.name == _PER_POSITION:
            collected += [Vector(family.name, dict(key), [int(by_pos[str(pos)]) for pos in range(len(by_pos))])
                          for key, by_pos in _by_labels(_samples(family, "_total"), "position").items()]
        elif family.type == "counter":
            collected += [Counter(family.name, s.labels, int(s.value)) for s in _samples(family, "_total")]
        elif family.type == "histogram":
            counts = {_key(s.labels): int(s.value) for s in _samples(family, "_count")}
            sums = {_key(s.labels): s.value for s in _samples(family, "_sum")}
            for key, buckets in _by_labels(_samples(family, "_bucket"), "le").items():
                collected.append(Histogram(family.name, dict(key), counts[key], sums[key],
                                           {le: int(count) for le, count in buckets.items()}))
        else:
            raise AssertionError(f"unexpected metric type {family.type} of {family.name}")
    return collected


def _samples(family, suffix: str) -> list[Sample]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _key(labels: dict[str, str]) -> frozenset:
    return frozenset(labels.items())


def _by_labels(samples: list[Sample], label: str) -> dict[frozenset, dict[str, float]]:
    """Each series' samples (the series: its labels but ``label``, such as a bucket's `le`) by their ``label``."""
    series: dict[frozenset, dict[str, float]] = {}
    for s in samples:
        series.setdefault(_key({k: v for k, v in s.labels.items() if k != label}), {})[s.labels[label]] = s.value
    return series
