"""Scheduler-side coverage (engine-independent): hits are capped to completed blocks."""

from omni_cache.core.coverage import RowValidity, WrittenBlocks

ALL, CAPTURED = RowValidity.ALL_KEYS, RowValidity.CAPTURED_ONLY


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


def test_per_key_validity_caps_hits_that_need_a_missing_key():
    """Blocks written under KV-sharing fast prefill are valid for the captured keys only."""
    from omni_cache.core.coverage import spans_overlap

    w = WrittenBlocks()
    w.record(1, "a")  # normal forward: every key
    w.record(2, "b", CAPTURED)
    w.record(3, "c")
    blocks = [(1, "a"), (2, "b"), (3, "c")]
    assert w.covered(blocks) == 1  # needs every key (incl. the final hidden): capped at block 2
    assert w.covered(blocks, CAPTURED) == 3
    assert w.covered(blocks, ALL) == 1
    w.record(2, "b")  # recomputed without truncation: valid for all keys again
    assert w.covered(blocks) == 3
    w.record(2, None)
    assert w.covered(blocks, CAPTURED) == 1
    assert spans_overlap([(0, 40)], 32, 64) and not spans_overlap([(0, 32)], 32, 64)


def test_pending_blocks_of_the_same_step_extend_the_covered_run():
    """Blocks that requests scheduled earlier in the same step complete count as covered
    when their hash matches; a stale record is overridden only by a matching pending hash,
    and per-key validity applies to pending blocks too."""
    w = WrittenBlocks()
    w.record(1, "a")
    w.record(2, "old")  # block 2 was evicted and is being refilled in this step
    blocks = [(1, "a"), (2, "b"), (4, "c"), (5, "d")]
    assert w.covered(blocks) == 1
    pending = {2: ("b", ALL), 4: ("c", ALL)}
    assert w.covered(blocks, pending=pending) == 3  # block 5 completed by nobody: the run ends
    assert w.covered(blocks, pending={2: ("x", ALL), 4: ("c", ALL)}) == 1  # hash differs
    assert w.covered(blocks, pending={2: ("b", CAPTURED), 4: ("c", ALL)}) == 1  # needs every key
    assert w.covered(blocks, CAPTURED, pending={2: ("b", CAPTURED), 4: ("c", ALL)}) == 3
    assert w.covered([(1, "a"), (2, None)], pending=pending) == 1  # an unhashed block never counts
