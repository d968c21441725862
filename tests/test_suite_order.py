"""tests/conftest.py's collection order: heavy tests first, dealt between the halves two worksteal workers start with."""

from __future__ import annotations

import pytest
from conftest import heavy_first

pytestmark = pytest.mark.timeout(30)


def test_heavy_tests_are_dealt_by_falling_cost_and_light_ones_keep_their_order() -> None:
    items = ["a", "b", "H1", "c", "H2", "d", "H3", "e", "f", "H4"]
    costs = [60, 0, 600, 30, 900, 120, 300, 0, 60, 900]
    order = heavy_first(items, costs, 180)
    # falling cost, ties in file order: H2 (900), H4 (900), H1 (600), H3 (300) -> halves H2, H1 | H4, H3
    assert order == ["H2", "H1", "a", "b", "c", "H4", "H3", "d", "e", "f"]
    assert order[: len(items) // 2].count("H2") + order[: len(items) // 2].count("H1") == 2


def test_without_heavy_tests_the_order_is_unchanged_and_more_heavy_than_half_still_keeps_every_item() -> None:
    assert heavy_first(list("abcd"), [0, 30, 60, 120], 180) == list("abcd")
    order = heavy_first(list("abcde"), [900, 800, 700, 600, 0], 180)
    assert order == ["a", "c", "b", "d", "e"] and sorted(order) == list("abcde")
