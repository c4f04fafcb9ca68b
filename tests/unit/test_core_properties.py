"""Property tests: HiddenStateCache driven by a reference model of vLLM's block lifecycle.

The reference model (``KvBlockPool`` + ``Sim``) mimics vLLM v1 prefix caching: a block pool
with an LRU free queue, a block_hash -> block map for cached full blocks, prefix hits of whole
blocks (at most ``num_tokens - 1``), blocks cached at schedule time (so a request can hit
blocks another request computes in the same step), chunked prefill, decode, free/abort
and preempt+resume. The "model" output at a position is a hash of everything the position
depends on (token prefix and the multimodal items started so far), so the correct row of
every slot is known and the test keeps a shadow of what each pool slot really holds.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_cache.core import BlockLedger, HiddenStateCache, KeySpec, StaleRowsError, chained_block_hashes
from omni_cache.core.ledger_state import BlockWrite
from tests.util import same_bits

BS = 4
NUM_BLOCKS = 12
ALPHABET = (1, 2)
SPECS = (
    KeySpec("hidden", 4, torch.float32),
    KeySpec("layer_0", 3, torch.bfloat16),
    KeySpec("mm_out", 2, torch.float16),
)
KEYS = tuple(s.name for s in SPECS)
SCHEDULED = st.sampled_from((True, True, True, False))  # is a request in this step's batch
SHARE = st.sampled_from((True, True, False))  # does a new prompt reuse an earlier one's prefix
SPEC = {s.name: s for s in SPECS}


@functools.cache
def model_row(content: tuple, key: str) -> torch.Tensor:
    """The model's deterministic output row for one position's content id."""
    width = SPEC[key].width
    digest = hashlib.blake2b(repr((key, content)).encode(), digest_size=4 * width).digest()
    vals = np.frombuffer(digest, dtype="<u4").astype(np.float32) / np.float32(2**32) - 0.5
    return torch.from_numpy(vals).to(SPEC[key].dtype)


@dataclass
class Req:
    rid: str
    tokens: list[int]
    spans: tuple[tuple[int, int, str], ...] = ()  # multimodal placeholders (start, end, image)
    table: list[int] = field(default_factory=list)
    computed: int = 0  # num_computed_tokens
    admitted: bool = False

    def content(self, p: int) -> tuple:
        return tuple(self.tokens[: p + 1]), tuple(s for s in self.spans if s[0] <= p)

    def rows(self, lo: int, hi: int, key: str) -> torch.Tensor:
        return torch.stack([model_row(self.content(p), key) for p in range(lo, hi)])

    def block_hashes(self, num_blocks: int) -> list[int]:
        return chained_block_hashes(self.tokens[: num_blocks * BS], BS, self.spans)


class KvBlockPool:
    """vLLM's BlockPool: ref counts, LRU free queue, block_hash -> cached full block."""

    def __init__(self) -> None:
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.block_hash: list[int | None] = [None] * NUM_BLOCKS
        self.cached: dict[int, int] = {}

    def longest_hit(self, block_hashes: list[int]) -> list[int]:
        hit = []
        for t in block_hashes:
            if t not in self.cached:
                break
            hit.append(self.cached[t])
        return hit

    def touch(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def allocate(self) -> int:
        b, _ = self.free.popitem(last=False)  # evicts the LRU block and its cached block_hash
        if self.block_hash[b] is not None:
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
        self.ref[b] = 1
        return b

    def release(self, table: list[int]) -> None:
        for b in reversed(table):  # tail blocks are evicted first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache_block(self, b: int, block_hash: int) -> None:
        if self.block_hash[b] is None and block_hash not in self.cached:
            self.block_hash[b] = block_hash
            self.cached[block_hash] = b


class Sim:
    def __init__(self, data, drops: bool, vectorised: bool = False) -> None:
        self.data, self.drops = data, drops
        self.cache = HiddenStateCache(NUM_BLOCKS, BS, SPECS)
        if vectorised:  # every ledger call through the array path, however few its blocks
            self.cache.ledger.scalar_max = self.cache.ledger.scalar_max_read = 0
        self.kv = KvBlockPool()
        self.reqs: list[Req] = []
        self.next_id = 0
        self.shadow: dict[tuple[int, int, str], tuple] = {}  # (block, offset, key) -> content
        self.block_hash_content: dict[int, list[tuple]] = {}  # block_hash -> content of its block's slots
        self.cached: dict[int, set[int]] = {b: set() for b in range(NUM_BLOCKS)}
        self.dropped: dict[int, set[str]] = {}  # block -> keys skipped during its current fill
        self.prompts: list[tuple[list[int], tuple]] = []

    def draw(self, strategy):
        return self.data.draw(strategy)

    # -- operations -------------------------------------------------------
    def add(self) -> None:
        tokens = self.draw(st.lists(st.sampled_from(ALPHABET), min_size=3, max_size=14))
        spans = ()
        if self.prompts and self.draw(SHARE):  # share a prefix (system prompt, image)
            base, base_spans = self.draw(st.sampled_from(self.prompts))
            cut = self.draw(st.integers(1, len(base)))
            tokens = base[:cut] + tokens[: self.draw(st.integers(1, 6))]
            other = {"imgA": "imgB", "imgB": "imgA"}
            flip = self.draw(st.booleans())  # same placeholder tokens, other image
            spans = tuple((s, e, other[i] if flip else i) for s, e, i in base_spans if e <= cut)
        elif self.draw(st.booleans()):
            s = self.draw(st.integers(0, len(tokens) - 1))
            e = min(s + self.draw(st.integers(1, 3)), len(tokens))
            tokens[s:e] = [0] * (e - s)  # image placeholder tokens
            spans = ((s, e, self.draw(st.sampled_from(("imgA", "imgB")))),)
        self.prompts.append((list(tokens), spans))
        self.reqs.append(Req(f"r{self.next_id}", tokens, spans))
        self.next_id += 1

    def finish(self, preempt: bool) -> None:
        if not self.reqs:
            return
        req = self.draw(st.sampled_from(self.reqs))
        self.kv.release(req.table)
        req.table, req.computed, req.admitted = [], 0, False
        if not preempt:
            self.reqs.remove(req)

    def schedule(self, req: Req):
        hit: list[int] = []
        if not req.admitted:  # prefix hit: whole blocks, at most num_tokens - 1
            hit = self.kv.longest_hit(req.block_hashes((len(req.tokens) - 1) // BS))
        computed = req.computed if req.admitted else len(hit) * BS
        n = min(self.draw(st.integers(1, 6)), len(req.tokens) - computed)
        need = -(-(computed + n) // BS) - (len(req.table) if req.admitted else len(hit))
        if need > len(self.kv.free) - sum(self.kv.ref[b] == 0 for b in hit):
            return None
        if not req.admitted:
            for b in hit:
                self.kv.touch(b)
            req.table, req.computed, req.admitted = list(hit), computed, True
        for _ in range(need):
            b = self.kv.allocate()
            self.dropped.pop(b, None)
            req.table.append(b)
        full_hashes = req.block_hashes((computed + n) // BS)
        for b, t in zip(req.table, full_hashes):
            self.kv.cache_block(b, t)  # cached at schedule time, hittable this step
        return req, computed, n, full_hashes, len(hit)

    def step(self) -> None:
        self.cache.begin_step()
        batch = [s for r in list(self.reqs) if self.draw(SCHEDULED) and (s := self.schedule(r))]
        self.write_all(self.draw(st.permutations(batch)))  # batch order != schedule order
        for req, start, n, _, hit_blocks in batch:
            if hit_blocks:
                self.check_hit(req, start, n, hit_blocks)
            req.computed = start + n
            if req.computed == len(req.tokens):
                req.tokens.append(self.draw(st.sampled_from(ALPHABET)))  # sampled token
        self.check_ledger()

    # -- forward: all writes of the step precede its reads ----------------
    def write_all(self, batch) -> None:
        for req, start, n, full_hashes, _ in batch:
            drop = self.draw(st.sets(st.sampled_from(KEYS))) if self.drops and self.draw(
                st.integers(0, 3)) == 0 else set()
            keep = [k for k in KEYS if k not in drop]
            self.cache.write_request_rows(
                req.rid, req.table, start, {k: req.rows(start, start + n, k) for k in keep},
                dict(enumerate(full_hashes)), num_tokens=n,
            )
            for i, t in enumerate(full_hashes):
                b = req.table[i]
                self.cached[b].add(t)
                self.block_hash_content[t] = [req.content(p) for p in range(i * BS, (i + 1) * BS)]
            for p in range(start, start + n):
                b, o = req.table[p // BS], p % BS
                for k in keep:
                    self.shadow[b, o, k] = req.content(p)
                if drop:
                    self.dropped.setdefault(b, set()).update(drop)

    # -- properties -------------------------------------------------------
    def check_hit(self, req: Req, start: int, n: int, hit_blocks: int) -> None:
        block_hashes = req.block_hashes(hit_blocks)
        table = req.table[:hit_blocks]
        covered = self.cache.covered_prefix_tokens(table, block_hashes, KEYS)
        assert covered <= start
        if not self.drops:
            assert covered == start, "ledger refused a valid hit"
        if covered < start:
            with pytest.raises(StaleRowsError):
                self.cache.read_prefix(req.rid, table, start, block_hashes, KEYS)
        got = self.cache.read_prefix(req.rid, table, covered, block_hashes, KEYS)
        assert all(got[k].shape == (covered, SPEC[k].width) for k in KEYS)
        if covered:  # served rows are bitwise the model's rows
            assert all(same_bits(got[k], req.rows(0, covered, k)) for k in KEYS)
        if covered == start:
            merged = self.cache.merge(got, {k: req.rows(start, start + n, k) for k in KEYS})
            assert all(same_bits(merged[k], req.rows(0, start + n, k)) for k in KEYS)

    def check_ledger(self) -> None:
        """Covered (block, block_hash, key) => every slot truly holds that block_hash's rows."""
        ledger = self.cache.ledger
        for b, block_hashes in self.cached.items():
            for t in block_hashes:
                stale = True
                for k in KEYS:
                    if ledger.covered_blocks([b], [t], [k]):
                        stale = False
                        assert all(
                            self.shadow.get((b, o, k)) == self.block_hash_content[t][o] for o in range(BS)
                        ), f"block {b} served stale rows for key {k}"
                if stale:
                    with pytest.raises(StaleRowsError):
                        self.cache.read_prefix("probe", [b], BS, [t], KEYS)
        for b, keys in self.dropped.items():  # a dropped key never becomes covered
            for t in self.cached[b]:
                for k in keys:
                    assert ledger.covered_blocks([b], [t], [k]) == 0


OPS = ("add",) * 3 + ("step",) * 6 + ("free", "preempt")  # enough load to evict and reuse blocks


@pytest.mark.parametrize("vectorised", [False, True])
@settings(max_examples=150, deadline=None)
@given(st.data(), st.booleans())
def test_lifecycle_never_serves_wrong_rows(vectorised, data, drops):
    sim = Sim(data, drops, vectorised)
    ops = data.draw(st.lists(st.sampled_from(OPS), min_size=20, max_size=60))
    for op in ops:
        if op == "add":
            sim.add()
        elif op == "step":
            sim.step()
        else:
            sim.finish(preempt=op == "preempt")


def test_same_step_hit_gets_writers_rows():
    """B hits blocks A computes in the same step; B's write (restating the hit blocks' block_hashes)
    comes first in batch order, yet after the step's writes B reads A's rows."""
    cache = HiddenStateCache(NUM_BLOCKS, BS, SPECS)
    a = Req("A", [1, 2, 1, 2, 2, 2, 1, 1, 2], table=[3, 7, 5])
    b = Req("B", a.tokens[:8] + [1, 1, 2], table=[3, 7, 9])
    block_hashes = a.block_hashes(2)
    assert b.block_hashes(2) == block_hashes
    cache.begin_step()
    cache.write_request_rows("B", b.table, 8, {k: b.rows(8, 11, k) for k in KEYS},
                             dict(enumerate(block_hashes)))
    cache.write_request_rows("A", a.table, 0, {k: a.rows(0, 9, k) for k in KEYS},
                             dict(enumerate(block_hashes)))
    got = cache.read_prefix("B", b.table, 8, block_hashes, KEYS)
    assert all(same_bits(got[k], a.rows(0, 8, k)) for k in KEYS)
    merged = cache.merge(got, {k: b.rows(8, 11, k) for k in KEYS})
    assert all(same_bits(merged[k], b.rows(0, 11, k)) for k in KEYS)


def test_dropped_key_step_is_never_served():
    cache = HiddenStateCache(NUM_BLOCKS, BS, SPECS)
    r = Req("A", [1, 2, 1, 2, 2, 1, 1, 1], table=[0, 1])
    block_hashes = r.block_hashes(2)
    cache.write_request_rows("A", r.table, 0, {k: r.rows(0, 6, k) for k in KEYS}, {0: block_hashes[0]})
    cache.write_request_rows("A", r.table, 6, {k: r.rows(6, 8, k) for k in ("hidden",)},
                             dict(enumerate(block_hashes)))
    assert cache.covered_prefix_tokens(r.table, block_hashes, ["hidden"]) == 8
    assert cache.covered_prefix_tokens(r.table, block_hashes, KEYS) == 4
    with pytest.raises(StaleRowsError, match="layer_0"):
        cache.read_prefix("B", r.table, 8, block_hashes, KEYS)


# --- the vectorised ledger against a per-block reference ----------------------------------


class RefLedger:
    """The per-block ledger as it was before vectorisation (lists, one Python step per block):
    the reference the numpy ledger must match exactly, block by block."""

    def __init__(self, num_blocks, block_size, keys):
        self.block_size, self.keys = block_size, tuple(keys)
        self.block_hash = [None] * num_blocks
        self.owner = [None] * num_blocks
        self.generation = [0] * num_blocks
        self.filled = [[0] * len(keys) for _ in range(num_blocks)]

    def _reset(self, b, owner):
        self.block_hash[b], self.owner[b] = None, owner
        self.filled[b] = [0] * len(self.keys)
        self.generation[b] += 1

    def record_write(self, b, block_hash, start, end, keys, owner):
        if owner != self.owner[b] or (self.block_hash[b] is not None and self.block_hash[b] != block_hash):
            self._reset(b, owner)
        f = self.filled[b]
        for i in range(len(f)):
            f[i] = min(f[i], start)
        for i, k in enumerate(self.keys):
            if k in keys and f[i] == start:
                f[i] = end
        if block_hash is not None:
            self.block_hash[b] = block_hash

    def cache_full_block(self, b, block_hash, owner):
        if owner != self.owner[b] or self.block_hash[b] == block_hash:
            return
        if self.block_hash[b] is not None:
            self._reset(b, owner)
        self.block_hash[b] = block_hash

    def uncovered_key(self, b, block_hash, keys):
        if self.block_hash[b] is None or self.block_hash[b] != block_hash:
            return "<block hash>"
        for i, k in enumerate(self.keys):
            if k in keys and self.filled[b][i] != self.block_size:
                return k
        return None

    def covered_blocks(self, ids, hashes, keys):
        n = 0
        for b, h in zip(ids, hashes):
            if self.uncovered_key(b, h, keys) is not None:
                break
            n += 1
        return n


LBS, LNB = 4, 10
HASHES = (1, 2, 3, 2**64 - 1, 2**63)
ODD_HASHES = ("x", -1, 1.0, None, np.int64(-1), 2**64)  # lookups only: never stored


def _assert_same(led, ref):
    for b in range(LNB):
        assert led.block_hash[b] == ref.block_hash[b], b
        assert led.owner[b] == ref.owner[b], b
        assert led.generation[b] == ref.generation[b], b
        assert [led.filled(b, k) for k in KEYS] == ref.filled[b], b


def test_request_write_of_one_partial_block_on_the_array_path():
    """A one-block write [0, 1) on the array path fills to 1, not to block_size (a case the
    random test below found on one run of the GPU machine's seeds)."""
    for scalar_max in (0, 4):
        led = BlockLedger(LNB, LBS, KEYS)
        led.scalar_max = scalar_max
        led.record_request_write(BlockWrite(np.array([3]), 0, 1, np.array([0], np.uint64), np.array([False]),
                                            led.key_mask(["hidden"]), owner="A"))
        assert [led.filled(3, k) for k in KEYS] == [1, 0, 0]
        led.record_request_write(BlockWrite(np.array([3, 5]), 1, 2, np.array([9, 0], np.uint64),
                                            np.array([True, False]), led.key_mask(KEYS), owner="A"))
        assert [led.filled(3, k) for k in KEYS] == [LBS, 0, 0] and led.block_hash[3] == 9
        assert [led.filled(5, k) for k in KEYS] == [2, 2, 2] and led.block_hash[5] is None


@pytest.mark.parametrize("scalar_max", [0, 4, 1000])
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_vectorised_ledger_matches_per_block_reference(scalar_max, data):
    """Random batches (repeated blocks, any offsets, hashes, keys, owners) give the same state
    and the same answers as the per-block reference, on the block-by-block path (small
    calls), the vectorised path (``scalar_max=0``) and a mix; interned owners are pruned
    often, so a pruned owner coming back must still be told apart."""
    led, ref = BlockLedger(LNB, LBS, KEYS, owner_floor=3), RefLedger(LNB, LBS, KEYS)
    led.scalar_max = led.scalar_max_read = scalar_max
    owners = st.sampled_from([f"r{i}" for i in range(8)])
    maybe_hash = st.one_of(st.none(), st.sampled_from(HASHES))
    keys = st.sets(st.sampled_from(KEYS))
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(("writes", "request", "cache", "one", "invalidate", "query")))
        owner = data.draw(owners)
        if op == "writes":  # arbitrary blocks (repeats allowed), offsets and hashes
            n = data.draw(st.integers(1, 8))
            ids = data.draw(st.lists(st.integers(0, LNB - 1), min_size=n, max_size=n))
            ranges = [sorted(data.draw(st.sets(st.integers(0, LBS), min_size=2, max_size=2))) for _ in ids]
            hs = [data.draw(maybe_hash) for _ in ids]
            ks = data.draw(keys)
            led.record_writes(np.array(ids), np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges]),
                              np.array([h or 0 for h in hs], dtype=np.uint64), np.array([h is not None for h in hs]),
                              led.key_mask(ks), owner=owner)
            for b, (s, e), h in zip(ids, ranges, hs):
                ref.record_write(b, h, s, e, ks, owner)
        elif op == "request":  # a request's step: distinct consecutive table entries
            n = data.draw(st.integers(1, 8))
            ids = data.draw(st.permutations(range(LNB)))[:n]
            first = data.draw(st.integers(0, LBS - 1))
            last = data.draw(st.integers(first + 1 if n == 1 else 1, LBS))
            hs = [data.draw(maybe_hash) for _ in ids]
            ks = data.draw(keys)
            as_list = data.draw(st.booleans())
            led.record_request_write(BlockWrite(
                ids if as_list else np.array(ids), first, last,
                [h or 0 for h in hs] if as_list else np.array([h or 0 for h in hs], np.uint64),
                [h is not None for h in hs] if as_list else np.array([h is not None for h in hs]),
                led.key_mask(ks), owner=owner))
            for j, (b, h) in enumerate(zip(ids, hs)):
                ref.record_write(b, h, first if j == 0 else 0, last if j == n - 1 else LBS, ks, owner)
        elif op == "cache":
            n = data.draw(st.integers(1, 8))
            ids = data.draw(st.lists(st.integers(0, LNB - 1), min_size=n, max_size=n))
            hs = [data.draw(st.sampled_from(HASHES)) for _ in ids]
            as_list = data.draw(st.booleans())
            led.cache_full_blocks(ids if as_list else np.array(ids), hs if as_list else np.array(hs, np.uint64),
                                  owner=owner)
            for b, h in zip(ids, hs):
                ref.cache_full_block(b, h, owner)
        elif op == "one":
            b, h = data.draw(st.integers(0, LNB - 1)), data.draw(maybe_hash)
            if data.draw(st.booleans()):
                s, e = sorted(data.draw(st.sets(st.integers(0, LBS), min_size=2, max_size=2)))
                ks = data.draw(keys)
                led.record_write(b, h, s, e, ks, owner=owner)
                ref.record_write(b, h, s, e, ks, owner)
            elif h is not None:
                led.cache_full_block(b, h, owner=owner)
                ref.cache_full_block(b, h, owner)
        elif op == "invalidate":
            b = data.draw(st.integers(0, LNB - 1))
            led.invalidate(b)
            ref._reset(b, None)
        n = data.draw(st.integers(0, 20))
        ids = data.draw(st.lists(st.integers(0, LNB - 1), min_size=n, max_size=n))
        hs = data.draw(st.lists(st.sampled_from(HASHES + ODD_HASHES), min_size=n, max_size=n))
        ks = data.draw(keys)
        assert led.covered_blocks(ids, hs, ks) == ref.covered_blocks(ids, hs, ks)
        if all(isinstance(h, int) and 0 <= h < 2**64 for h in hs):  # the array forms too
            assert led.covered_blocks(np.array(ids), np.array(hs, np.uint64), ks) == ref.covered_blocks(ids, hs, ks)
            assert led.covered_blocks(torch.tensor(ids, dtype=torch.int64), torch.tensor(
                np.array(hs, np.uint64).view(np.int64)), ks) == ref.covered_blocks(ids, hs, ks)
        for b, h in zip(ids, hs):
            assert led.uncovered_key(b, h, ks) == ref.uncovered_key(b, h, ks)
        _assert_same(led, ref)
