"""heap.settle: what lives at a load is kept from the collector; what an unload drops
is freed at the next settle."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from carpool.server.registry import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector can free it


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_a_settled_cycle_outlives_collections_until_the_next_settle() -> None:
    node = _Node()
    ref = weakref.ref(node)
    heap.settle()
    assert gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert ref() is not None  # frozen: full collections no longer walk it
    heap.settle()
    assert ref() is None


def test_objects_made_after_a_settle_are_collected_as_usual() -> None:
    heap.settle()
    node = _Node()
    ref = weakref.ref(node)
    del node
    gc.collect()
    assert ref() is None
