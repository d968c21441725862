"""Suite-wide collection order: the costly tests first, dealt between the two halves of the run.

``pyproject.toml`` runs pytest-xdist with ``--dist worksteal``: each worker starts with one contiguous half of the
collected tests and an idle worker steals the tail of the other's queue. In file order the real multi-process tests
(minutes each) cluster in a few late files, so one worker ended the suite alone on them for minutes. Here a test's
declared ``@pytest.mark.timeout`` is its cost class: those of at least ``HEAVY_TIMEOUT_S`` seconds go first, dealt
alternately to the two halves in falling order, and the rest keep their file order (module fixtures stay shared);
what is left to steal at the end is short.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import pytest

HEAVY_TIMEOUT_S = 180.0  # a test declaring at least this much is a real run of processes (tens of seconds or more)

T = TypeVar("T")


def declared_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return 0.0
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0.0)
    return float(value)


def heavy_first(items: Sequence[T], costs: Sequence[float], threshold: float) -> list[T]:
    """``items`` reordered: the heavy ones (cost ≥ threshold) by falling cost (ties in file order) dealt alternately
    to two halves, each half topped up with the light ones in file order so that the first half is ``len // 2``
    long — the split worksteal starts two workers with."""
    heavy = sorted((i for i, c in enumerate(costs) if c >= threshold), key=lambda i: -costs[i])
    light = [i for i, c in enumerate(costs) if c < threshold]
    first, second = heavy[0::2], heavy[1::2]
    take = max(0, len(items) // 2 - len(first))
    order = first + light[:take] + second + light[take:]
    return [items[i] for i in order]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = heavy_first(items, [declared_timeout(item) for item in items], HEAVY_TIMEOUT_S)
