"""``HiddenStateCache.write_step_rows`` (:mod:`omni_cache.core.step_write`): one step of several
requests written at once. Oracle: the same step written one request at a time with
``write_request_rows`` — pools bitwise, ledger state equal, hits served the same rows."""

from __future__ import annotations

import pytest
import torch

from omni_cache.core import chained_block_hashes
from omni_cache.core.step_write import StepRequest

from .core_util import BS, KEYS, ledger_state, make_cache, rows


def _step():
    """A step with a prefill crossing block edges (partial tail), a decode token that fills a
    block, a request hit on another's blocks restating their hashes, and a
    request with no rows."""
    a = list(range(100, 111))          # 11 tokens, blocks 0..2 (third partial)
    b = list(range(200, 208)) + [5]    # decode position 8 fills... starts block 2
    c = a[:8] + [9, 9]                 # hits a's first two blocks, computes 2 tokens
    ha, hb, hc = (chained_block_hashes(t, BS) for t in (a, b, c))
    return [
        StepRequest("A", [1, 2, 3], 0, 11, {0: ha[0], 1: ha[1]}),     # positions 0..10, block 2 partial
        StepRequest("B", [4, 5, 6], 7, 1, {1: hb[1]}),                 # position 7 completes block 1
        StepRequest("C", [1, 2, 7], 8, 2, {0: hc[0], 1: hc[1]}),       # restates a's blocks
        StepRequest("D", [0], 0, 0, {}),
    ]


def _write_both():
    step = _step()
    n = sum(r.num_tokens for r in step)
    data = {k: rows(n, 3, seed=i) for i, k in enumerate(KEYS)}
    one, per = make_cache(), make_cache()
    one.write_step_rows(step, data)
    off = 0
    for r in step:
        per.write_request_rows(r.req_id, r.block_ids, r.start, {k: t[off:off + r.num_tokens] for k, t in data.items()},
                               r.block_hashes, num_tokens=r.num_tokens)
        off += r.num_tokens
    return one, per


def test_step_write_equals_one_write_per_request():
    one, per = _write_both()
    for k in KEYS:
        assert torch.equal(one.pools[k].storage, per.pools[k].storage), k
    assert ledger_state(one) == ledger_state(per)
    m1, m2 = one.metrics.as_dict(), per.metrics.as_dict()
    for k in ("rows_written", "bytes_written"):
        assert m1[k] == m2[k], k


def test_step_write_rows_are_served_to_a_hit():
    one, _ = _write_both()
    a = list(range(100, 111))
    got = one.read_prefix("E", [1, 2], 8, chained_block_hashes(a, BS)[:2], KEYS)
    step = _step()
    n = sum(r.num_tokens for r in step)
    data = {k: rows(n, 3, seed=i) for i, k in enumerate(KEYS)}
    # A wrote positions 0..10 from batch rows 0..10: its two full blocks are rows 0..7
    for k in KEYS:
        assert torch.equal(got[k], data[k][0:8]), k


def test_step_write_checks_every_request_before_writing():
    cache = make_cache()
    step = _step()
    bad = step[:2] + [StepRequest("C", [1, 2, 99], 8, 2, {})]  # block 99 outside 8 blocks
    n = sum(r.num_tokens for r in bad)
    before = cache.pools[KEYS[0]].storage.clone()
    with pytest.raises(ValueError, match="outside"):
        cache.write_step_rows(bad, {k: rows(n) for k in KEYS})
    assert torch.equal(cache.pools[KEYS[0]].storage, before)
    with pytest.raises(ValueError, match="do not match"):
        cache.write_step_rows(step, {k: rows(n + 1) for k in KEYS})
