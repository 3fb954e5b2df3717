"""The tiers' markers (tests/conftest.py, tests/tiers.py): ``pytest -m "not slow"`` (the fast
tier) replaces pyproject.toml's ``-m`` (which keeps the extended, bridge and vLLM tiers out of the
README's suite), so every test of those tiers is also marked ``slow``; a test listed in
:data:`tests.tiers.SLOW` or :data:`tests.tiers.EXTENDED` gets its marker at collection."""

from __future__ import annotations

import pytest

from tests import conftest
from tests.tiers import EXTENDED, SLOW


class Item:
    """What ``pytest_collection_modifyitems`` reads of a collected test."""

    def __init__(self, nodeid: str, *markers: str):
        self.nodeid, self.markers = nodeid, set(markers)

    def add_marker(self, mark) -> None:
        self.markers.add(mark.name)

    def get_closest_marker(self, name: str):
        return pytest.mark.__getattr__(name) if name in self.markers else None


def marked(*items: Item) -> list[set[str]]:
    conftest.pytest_collection_modifyitems(None, list(items))
    return [item.markers for item in items]


def test_the_tiers_out_of_the_suite_are_out_of_the_fast_tier():
    got = marked(Item("tests/engines/test_x.py::test_a", "vllm"),
                 Item("tests/bridge/test_x.py::test_b", "bridge"),
                 Item("tests/e2e/test_x.py::test_c", "extended"),
                 Item(f"{EXTENDED[0]}::test_listed" if "::" not in EXTENDED[0] else EXTENDED[0]),
                 Item(SLOW[0]),
                 Item("tests/unit/test_x.py::test_fast"))
    assert all("slow" in m for m in got[:5]), got
    assert "extended" in got[3]
    assert got[5] == set()  # an ordinary unit test stays in the fast tier
