"""The heap after a load or unload: what lives is frozen out of later collections, and what an
unloaded version left in cycles is freed."""

from __future__ import annotations

import gc
import weakref

from service.engine.loading import settle_heap


class _Node:
    other: _Node | None = None


def test_what_lives_at_a_settle_is_passed_by_until_the_next_settle_frees_it() -> None:
    gc.unfreeze()
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only a collection frees it
    kept = weakref.ref(a)
    settle_heap()
    assert gc.get_freeze_count() > 0
    del a, b
    gc.collect()
    assert kept() is not None, "frozen: a collection passes it by"
    settle_heap()  # as an unload does
    assert kept() is None, "unfrozen and collected by the next settle"
    assert gc.get_freeze_count() > 0
