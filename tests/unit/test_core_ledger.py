"""Unit tests for omni_cache.core.ledger: BlockLedger's rules, and its deferred writes."""

import numpy as np
import torch

from omni_cache.core import BlockLedger, chained_block_hashes
from tests.unit.core_util import BS, KEYS, make_cache, rows


def test_ledger_reset_on_reuse_by_other_owner():
    led = BlockLedger(4, BS, KEYS)
    led.record_write(2, 111, 0, BS, KEYS, owner="A")
    assert led.covered_blocks([2], [111], KEYS) == 1
    led.record_write(2, None, 0, 2, KEYS, owner="B")  # block freed, reused by B
    assert led.block_hash[2] is None and led.filled(2, "hidden") == 2
    assert led.covered_blocks([2], [111], KEYS) == 0
    led.cache_full_block(2, 111, owner="C")  # C claims A's block_hash on B's partial block: ignored
    assert led.block_hash[2] is None and led.covered_blocks([2], [111], KEYS) == 0
    led.cache_full_block(2, 112, owner="B")  # the owner caches its half-filled block: still not served
    assert led.covered_blocks([2], [112], KEYS) == 0


def test_ledger_new_owner_never_inherits_partial_fill():
    led = BlockLedger(2, BS, KEYS)
    led.record_write(1, None, 0, 3, KEYS, owner="A")  # A's partial last block, then freed
    led.record_write(1, 9, 3, BS, KEYS, owner="B")  # B writes only the tail offsets
    assert led.owner[1] == "B" and led.filled(1, "hidden") == 0
    assert led.covered_blocks([1], [9], KEYS) == 0


def test_ledger_partial_and_gaps_not_covered():
    led = BlockLedger(4, BS, KEYS)
    led.record_write(0, None, 0, 2, KEYS, owner="A")
    led.cache_full_block(0, 5, owner="A")  # cached but only half filled
    assert led.covered_blocks([0], [5], KEYS) == 0
    led.record_write(1, None, 0, 2, ["hidden"], owner="A")
    led.record_write(1, 6, 2, BS, KEYS, owner="A")  # layer_0 has a gap at [0, 2)
    assert led.covered_blocks([1], [6], ["hidden"]) == 1
    assert led.covered_blocks([1], [6], KEYS) == 0
    assert led.uncovered_key(1, 6, KEYS) == "layer_0"


def test_ledger_rewrite_truncates_and_caching_rules():
    led = BlockLedger(2, BS, KEYS)
    led.record_write(0, None, 0, 3, KEYS, owner="A")
    led.record_write(0, None, 1, 2, ["hidden"], owner="A")  # recompute from offset 1
    assert led.filled(0, "hidden") == 2 and led.filled(0, "layer_0") == 1
    led.record_write(0, 7, 0, BS, KEYS, owner="A")
    gen = led.generation[0]
    led.cache_full_block(0, 7, owner="B")  # prefix hit restating the same block_hash: no-op
    led.cache_full_block(0, 9, owner="B")  # a non-owner cannot cache the block under another hash
    assert led.covered_blocks([0], [7], KEYS) == 1 and led.generation[0] == gen
    led.cache_full_block(0, 9, owner="A")  # the owner re-caches it under another hash: old fill no longer vouched for
    assert led.covered_blocks([0], [9], KEYS) == 0 and led.generation[0] == gen + 1
    led.record_write(0, 7, 0, BS, KEYS, owner="A")
    gen = led.generation[0]
    led.record_write(0, None, 0, 1, KEYS, owner="A")  # same owner, block reused: reset
    assert led.block_hash[0] is None and led.generation[0] == gen + 1
    led.record_write(0, 7, 0, BS, KEYS, owner="A")
    led.invalidate(0)
    assert led.covered_blocks([0, 1], [7, 8], KEYS) == 0


def test_deferred_ledger_updates_apply_in_order_before_any_lookup():
    """A big step's ledger update is deferred (defer_request_write) and applied, in call order,
    before anything reads or changes the ledger: every lookup and the ledger's state equal
    those of a cache that applies each write at once (defer off), pending writes stay bounded."""
    rng = np.random.default_rng(0)
    a, b = make_cache(64), make_cache(64)
    b.ledger.defer = False
    a.ledger.pending_max = 3
    for step in range(40):
        nblk = int(rng.integers(1, 12))
        table = rng.choice(64, nblk, replace=False).tolist()
        start = int(rng.integers(0, (nblk - 1) * BS + 1))
        n = int(rng.integers(1, nblk * BS - start + 1))
        tokens = rng.integers(0, 4, nblk * BS).tolist()
        hashes = chained_block_hashes(tokens, BS)
        bh = {j: hashes[j] for j in range(start // BS, (start + n) // BS)}
        keys = KEYS if step % 5 else KEYS[:1]
        data = {k: rows(n, seed=step) for k in keys}
        for c in (a, b):
            c.write_request_rows(f"r{step % 7}", table, start, data, bh)
        assert a.ledger.pending_writes <= 3 and b.ledger.pending_writes == 0
        if step % 3 == 0:
            nb = (start + n) // BS
            assert a.covered_prefix_tokens(table, hashes, KEYS) == b.covered_prefix_tokens(table, hashes, KEYS)
            assert a.ledger.pending_writes == 0
            if nb and b.covered_prefix_tokens(table[:nb], hashes[:nb], KEYS) == nb * BS:
                got = a.read_prefix("q", table, nb * BS, hashes, KEYS)
                want = b.read_prefix("q", table, nb * BS, hashes, KEYS)
                assert all(torch.equal(got[k], want[k]) for k in KEYS)
    assert [a.ledger.owner[i] for i in range(64)] == [b.ledger.owner[i] for i in range(64)]
    assert a.ledger.pending_writes == 0  # (a public lookup settles)
    for f in ("block_hash", "cached", "owner", "generation", "filled"):
        assert np.array_equal(getattr(a.ledger._states, f), getattr(b.ledger._states, f)), f
