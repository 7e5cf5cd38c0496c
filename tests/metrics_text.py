"""Reading a /metrics body in tests: samples by name and labels, and sums over label sets."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items: value} of a /metrics body."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(text_or_samples, name: str, **labels) -> float:
    """The sum of a sample's values over the series whose labels include `labels`."""
    got = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    return sum(v for key, v in got.get(name, {}).items() if set(labels.items()) <= set(key))
