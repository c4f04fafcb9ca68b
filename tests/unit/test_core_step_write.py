"""``HiddenStateCache.write_step_rows`` (:mod:`omni_cache.core.step_write`): one step of several
requests written at once. Oracle: the same step written one request at a time with
``write_request_rows`` — pools bitwise, ledger state equal, hits served the same rows."""

from __future__ import annotations

import pytest
import torch

from omni_cache.core import chained_block_hashes
from omni_cache.core.step_write import StepRequest

from .core_util import BS, KEYS, full_write, ledger_state, make_cache, rows


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


def _decode_steps(seed: int):
    """Seeded decode-shaped steps over 6 blocks of 4: each request writes one row at its next
    position; some steps restart a block under another owner, hand a cached block to a new
    owner, or (fallbacks) repeat a block, bring an owner never seen, or complete a block."""
    import random

    rng = random.Random(seed)
    tables = {f"R{i}": [i] for i in range(6)}
    pos = {r: rng.randrange(0, BS) for r in tables}
    steps = []
    for _ in range(12):
        reqs = rng.sample(sorted(tables), rng.randint(1, 6))  # 1-4: block by block, 5-6: vectorised
        step = []
        for r in reqs:
            p = pos[r] % BS
            pos[r] += 1
            step.append(StepRequest(r, tables[r], p, 1, {}))
        kind = rng.random()
        if kind < 0.15:   # a repeated block: two requests writing the same block (fallback)
            step.append(StepRequest(step[0].req_id + "x", step[0].block_ids, (step[0].start + 1) % BS, 1, {}))
        elif kind < 0.3:  # an owner the ledger has never seen (fallback)
            step[-1] = StepRequest(f"new{rng.randrange(10**6)}", step[-1].block_ids, step[-1].start, 1, {})
        elif kind < 0.4:  # a decode row that completes and caches its block
            r = step[0]
            step[0] = StepRequest(r.req_id, r.block_ids, BS - 1, 1, {0: 1000 + rng.randrange(10**6)})
        elif kind < 0.55:  # owners swap tables: each block's next write is by another owner
            names = sorted(tables)
            rng.shuffle(names)
            tables = dict(zip(names, tables.values(), strict=True))
        steps.append(step)
    return steps


@pytest.mark.parametrize("seed", range(12))
def test_decode_steps_equal_one_write_per_request(seed):
    """The decode fast path (one row per request, no block cached: the ledger updated for all
    requests at once) and its fallbacks against the oracle, one ``write_request_rows`` per
    request: pools bitwise, ledger state equal, after every step."""
    from omni_cache.core import step_write

    one, per = make_cache(), make_cache()
    for k in range(6):  # every block first filled and cached by its own request
        full_write(one, f"R{k}", [k], list(range(10 * k, 10 * k + BS)), seed=k)
        full_write(per, f"R{k}", [k], list(range(10 * k, 10 * k + BS)), seed=k)
    fast = 0
    for i, step in enumerate(_decode_steps(seed)):
        data = {k: rows(len(step), 3, seed=100 * i + j) for j, k in enumerate(KEYS)}
        fast += step_write._decode_slots(step, BS, one.num_blocks) is not None
        one.write_step_rows(step, data)
        for j, r in enumerate(step):
            per.write_request_rows(r.req_id, r.block_ids, r.start, {k: t[j:j + 1] for k, t in data.items()},
                                   r.block_hashes, num_tokens=1)
        for k in KEYS:
            assert torch.equal(one.pools[k].storage, per.pools[k].storage), (i, k)
        assert ledger_state(one) == ledger_state(per), i
    assert fast >= 6  # most steps took the fast path


def test_step_writes_go_to_the_one_launch_writer_and_fall_back_when_it_declines():
    """Where the fused path is on (a CUDA cache), every step write — a prefill, a decode of one
    request, a decode of three — hands its slots to the one-launch writer
    (``StepWriter.write_slots``, here a stand-in that declines) and, declined, writes through
    the pools' own path: the rows land all the same (oracle: the rows given)."""
    cache = make_cache()
    calls = []

    class Declines:
        launches = 0

        def write_slots(self, slots, rows):
            calls.append(slots.tolist())
            return False

    cache._fused_maybe, cache._writer = True, Declines()
    data = [rows(5, 3, seed=1), rows(1, 3, seed=2), rows(3, 3, seed=3)]
    cache.write_step_rows([StepRequest("a", [1, 2], 0, 5, {})], {k: data[0] for k in KEYS})
    cache.write_step_rows([StepRequest("a", [1, 2], 5, 1, {})], {k: data[1] for k in KEYS})
    cache.write_step_rows([StepRequest("a", [1, 2], 6, 1, {}), StepRequest("b", [3], 0, 1, {}),
                           StepRequest("c", [4], 0, 1, {})], {k: data[2] for k in KEYS})
    assert calls == [[4, 5, 6, 7, 8], [9], [10, 12, 16]]
    flat = cache.pools[KEYS[0]].storage.view(-1, 3)
    assert torch.equal(flat[[4, 5, 6, 7, 8]], data[0]) and torch.equal(flat[[9]], data[1])
    assert torch.equal(flat[[10, 12, 16]], data[2])
