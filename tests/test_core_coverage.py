"""Scheduler-side coverage (engine-independent): hits are capped to completed blocks."""

from omni_cache.core.coverage import WrittenBlocks


def test_covered_stops_at_first_unrecorded_or_changed_block():
    w = WrittenBlocks()
    for bid, h in [(3, "a"), (7, "b"), (9, "c")]:
        w.record(bid, h)
    assert w.covered([(3, "a"), (7, "b"), (9, "c")]) == 3
    assert w.covered([(3, "a"), (8, "b"), (9, "c")]) == 1  # block 8 never completed
    assert w.covered([(3, "a"), (7, "B"), (9, "c")]) == 1  # block 7 evicted + refilled
    assert w.covered([(3, None)]) == 0  # an unhashed (partial) block is never covered
    w.record(7, "B")  # completed again for the new content
    assert w.covered([(3, "a"), (7, "B"), (9, "c")]) == 3
    w.forget(3)
    assert w.covered([(3, "a"), (7, "B")]) == 0
    w.record(9, None)
    assert len(w) == 1
