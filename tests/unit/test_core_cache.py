"""Unit tests for omni_cache.core: slots, block hashes, pool, ledger, cache."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_cache.core import (
    BlockLedger,
    HiddenPool,
    HiddenStateCache,
    KeySpec,
    BLOCK_HASH_MISMATCH,
    RowIndex,
    StaleRowsError,
    Tier,
    chained_block_hashes,
    num_full_blocks,
    slot_ids,
)

BS = 4
KEYS = ("hidden", "layer_0")


def make_cache(num_blocks=8, keys=KEYS, width=3):
    return HiddenStateCache(num_blocks, BS, [KeySpec(k, width, torch.float32) for k in keys])


def rows(n, width=3, seed=0):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def full_write(cache, req, blocks, tokens, seed=0):
    """Write rows for all keys for positions [0, len(tokens)), caching full blocks."""
    block_hashes = chained_block_hashes(tokens, BS)
    data = {k: rows(len(tokens), p.width, seed + i)
            for i, (k, p) in enumerate(cache.pools.items())}
    cache.write_request_rows(req, blocks, 0, data, dict(enumerate(block_hashes)))
    return block_hashes, data


# --- slots -----------------------------------------------------------------


def test_slot_ids_formula_and_range():
    table = torch.tensor([5, 2, 7])
    pos = torch.arange(12)
    expected = [table[p // BS].item() * BS + p % BS for p in range(12)]
    assert slot_ids(table, pos, BS).tolist() == expected
    with pytest.raises(ValueError, match="outside a block table of 3 blocks"):
        slot_ids(table, torch.tensor([12]), BS)
    with pytest.raises(ValueError, match="outside a block table"):
        slot_ids(table, torch.tensor([-1]), BS)
    assert num_full_blocks(11, BS) == 2 and num_full_blocks(12, BS) == 3


def test_chained_block_hashes_extra_keys_and_chaining():
    toks = [9, 9, 9, 9, 1, 2, 3, 4, 5, 6]
    base = chained_block_hashes(toks, BS)
    assert len(base) == 2
    img_a = chained_block_hashes(toks, BS, [(1, 6, "imgA")])
    img_a2 = chained_block_hashes(toks, BS, [(1, 6, "imgA")])
    img_b = chained_block_hashes(toks, BS, [(1, 6, "imgB")])
    assert img_a == img_a2 and img_a != img_b and img_a != base
    assert img_a[0] != img_b[0] and img_a[1] != img_b[1]  # span overlaps both blocks
    late = chained_block_hashes(toks, BS, [(5, 7, "imgA")])
    assert late[0] == base[0] and late[1] != base[1]  # only the overlapped block changes
    # a different first block changes every later block hash (chained)
    other = chained_block_hashes([8] + toks[1:], BS)
    assert other[0] != base[0] and other[1] != base[1]
    # continuing from a parent block hash equals hashing the whole prompt
    assert chained_block_hashes(toks[BS:], BS, [(1, 3, "imgA")], parent=late[0]) == late[1:]
    assert chained_block_hashes(torch.tensor(toks), BS) == base


def test_chained_block_hashes_stable_across_processes():
    args = (list(range(40)), 16, [(3, 20, "img"), (21, 22, b"x"), (0, 1, 7)])
    code = f"from omni_cache.core import chained_block_hashes as t; print(t(*{args!r}))"
    env = {**os.environ, "PYTHONHASHSEED": "4242"}  # a different str-hash salt than ours
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{chained_block_hashes(*args)}\n"


# --- pool ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_roundtrip_bitwise(dtype):
    pool = HiddenPool("hidden", 4, BS, 5, dtype, tier=Tier.HOST)  # pinned memory: CUDA tests below
    assert pool.storage.shape == (4, BS, 5) and pool.nbytes == 4 * BS * 5 * dtype.itemsize
    slots = torch.tensor([13, 0, 7, 2])
    data = rows(4, 5).to(dtype)
    pool.write(slots, data)
    assert torch.equal(pool.gather(slots).view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(pool.storage.view(-1, 5)[13], data[0])


def test_pool_casts_and_rejects_width():
    pool = HiddenPool("layer_24", 2, BS, 3, torch.bfloat16)
    pool.write(torch.tensor([1]), torch.ones(1, 3, dtype=torch.float64))
    assert pool.gather(torch.tensor([1])).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="layer_24"):
        pool.write(torch.tensor([1]), torch.ones(1, 4))


# --- ledger ----------------------------------------------------------------


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


def test_ledger_rewrite_truncates_and_seal_rules():
    led = BlockLedger(2, BS, KEYS)
    led.record_write(0, None, 0, 3, KEYS, owner="A")
    led.record_write(0, None, 1, 2, ["hidden"], owner="A")  # recompute from offset 1
    assert led.filled(0, "hidden") == 2 and led.filled(0, "layer_0") == 1
    led.record_write(0, 7, 0, BS, KEYS, owner="A")
    gen = led.generation[0]
    led.cache_full_block(0, 7, owner="B")  # prefix hit restating the same block_hash: no-op
    led.cache_full_block(0, 9, owner="B")  # a non-owner cannot re-block_hash the block
    assert led.covered_blocks([0], [7], KEYS) == 1 and led.generation[0] == gen
    led.cache_full_block(0, 9, owner="A")  # the owner re-block_hashes: old fill no longer vouched for
    assert led.covered_blocks([0], [9], KEYS) == 0 and led.generation[0] == gen + 1
    led.record_write(0, 7, 0, BS, KEYS, owner="A")
    gen = led.generation[0]
    led.record_write(0, None, 0, 1, KEYS, owner="A")  # same owner, block reused: reset
    assert led.block_hash[0] is None and led.generation[0] == gen + 1
    led.record_write(0, 7, 0, BS, KEYS, owner="A")
    led.invalidate(0)
    assert led.covered_blocks([0, 1], [7, 8], KEYS) == 0


# --- cache -----------------------------------------------------------------


def test_missing_key_not_covered():
    cache = make_cache()
    toks = list(range(8))
    block_hashes = chained_block_hashes(toks, BS)
    cache.write_request_rows("A", [3, 1], 0, {"hidden": rows(4), "layer_0": rows(4)}, {0: block_hashes[0]})
    cache.write_request_rows("A", [3, 1], 4, {"layer_0": rows(4)}, {0: block_hashes[0], 1: block_hashes[1]})
    assert cache.covered_prefix_tokens([3, 1], block_hashes, ["layer_0"]) == 8
    assert cache.covered_prefix_tokens([3, 1], block_hashes, KEYS) == 4
    with pytest.raises(StaleRowsError, match="hidden"):
        cache.read_prefix("B", [3, 1], 8, block_hashes, KEYS)
    assert cache.read_prefix("B", [3, 1], 4, block_hashes, KEYS)["hidden"].shape == (4, 3)


def test_read_prefix_stale_after_overwrite():
    cache = make_cache()
    block_hashes, data = full_write(cache, "A", [2, 5], list(range(8)))
    got = cache.read_prefix("B", [2, 5], 8, block_hashes, KEYS)
    assert all(torch.equal(got[k], data[k]) for k in KEYS)
    # A finishes, block 5 is evicted and reused by C for other tokens
    cache.write_request_rows("C", [5], 0, {k: rows(2, seed=9) for k in KEYS}, {})
    with pytest.raises(StaleRowsError) as err:
        cache.read_prefix("D", [2, 5], 8, block_hashes, KEYS)
    assert err.value.req_id == "D" and err.value.block_index == 1 and err.value.key == BLOCK_HASH_MISMATCH
    assert cache.metrics.hits_refused == 1
    with pytest.raises(ValueError, match="not whole blocks"):
        cache.read_prefix("D", [2, 5], 6, block_hashes, KEYS)


def test_write_validation():
    cache = make_cache()
    with pytest.raises(ValueError, match="unknown"):
        cache.write_request_rows("A", [0], 0, {"nope": rows(2)}, {})
    with pytest.raises(ValueError, match="row counts"):
        cache.write_request_rows("A", [0], 0, {"hidden": rows(2), "layer_0": rows(3)}, {})
    with pytest.raises(ValueError, match="hashed"):
        cache.write_request_rows("A", [0], 0, {"hidden": rows(2)}, {0: 1})
    with pytest.raises(ValueError, match="outside a block table"):
        cache.write_request_rows("A", [0], 2, {"hidden": rows(4)}, {})


def test_merge_order_and_keys():
    prefix = {"hidden": torch.zeros(4, 2), "layer_0": torch.zeros(4, 1)}
    fresh = {"hidden": torch.ones(3, 2), "layer_0": torch.ones(3, 1)}
    out = HiddenStateCache.merge(prefix, fresh)
    assert out["hidden"].shape == (7, 2)
    assert out["hidden"][:4].eq(0).all() and out["hidden"][4:].eq(1).all()
    with pytest.raises(ValueError, match="prefix keys"):
        HiddenStateCache.merge({"hidden": prefix["hidden"]}, fresh)


def test_metrics_and_describe():
    cache = make_cache(keys=("hidden",), width=8)
    cache.begin_step()
    block_hashes, _ = full_write(cache, "A", [0, 1, 2], list(range(10)))
    cache.read_prefix("B", [0, 1], 8, block_hashes, ["hidden"])
    m = cache.metrics.as_dict()
    assert m["steps"] == 1 and m["rows_written"] == 10 and m["bytes_written"] == 10 * 8 * 4
    assert m["rows_read"] == 8 and m["bytes_read"] == 8 * 8 * 4
    assert m["hit_tokens"] == 8 and m["hits_served"] == 1 and m["hits_refused"] == 0
    assert m["seconds_write"] > 0 and m["seconds_read"] > 0
    text = cache.describe()
    assert "MiB" in text and "hidden" in text and "total" in text
    assert cache.nbytes == 8 * BS * 8 * 4


CUDA_TIERS = [(Tier.DEVICE, None), (Tier.PINNED_HOST, True), (Tier.PINNED_HOST, False), (Tier.HOST, None)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier,zero_copy", CUDA_TIERS)
@pytest.mark.parametrize("width,dtype", [(2048, torch.bfloat16), (3, torch.bfloat16), (5, torch.float32)])
def test_cuda_rows_every_tier(tier, zero_copy, width, dtype):
    """Rows computed on the GPU survive write -> read -> merge bitwise on every tier, through
    int64 words (width 2048 bf16) and without (rows of 6 / 20 bytes)."""
    cache = HiddenStateCache(80, 16, [KeySpec("hidden", width, dtype)], "cuda", tier, zero_copy=zero_copy)
    pool = cache.pools["hidden"]
    assert pool.storage.is_pinned() == (tier is Tier.PINNED_HOST)
    assert pool.zero_copy == (zero_copy is True)
    table = torch.randperm(80)[:64]
    block_hashes = chained_block_hashes(list(range(1000)), 16)
    data = torch.randn(1000, width, device="cuda")
    expected = data.to(dtype).clone()
    cache.write_request_rows("A", table, 0, {"hidden": data}, dict(enumerate(block_hashes)))
    data.zero_()  # the source is reused right away, as the model runner's buffers are
    got = cache.read_prefix("B", table, 992, block_hashes, ["hidden"], out_device="cuda")["hidden"]
    assert got.device.type == "cuda" and same_bits(got, expected[:992])
    assert same_bits(cache.read_prefix("C", table, 992, block_hashes, ["hidden"])["hidden"].cuda(), expected[:992])
    merged = cache.merge({"hidden": got.cpu()}, {"hidden": expected[992:]})["hidden"]
    assert merged.device.type == "cuda" and same_bits(merged, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("zero_copy", [True, False])
def test_cuda_pinned_host_writes_are_asynchronous_and_reads_wait_only_on_conflict(zero_copy):
    """A pinned-host pool fed from the GPU returns from a write before the rows land (no host
    sync), a CPU read of other blocks does not wait, a GPU read does not wait, and a CPU read
    of the written blocks sees the rows (it waits for the device)."""
    cache = HiddenStateCache(64, 16, [KeySpec("hidden", 1024, torch.bfloat16)], "cuda", Tier.PINNED_HOST,
                             zero_copy=zero_copy)
    pool = cache.pools["hidden"]
    stream = torch.cuda.current_stream()
    old = torch.randn(16 * 8, 1024, device="cuda")
    hashes_old = chained_block_hashes(list(range(128)), 16)
    cache.write_request_rows("A", list(range(8)), 0, {"hidden": old}, dict(enumerate(hashes_old)))
    # the first use of a kernel loads it (CUDA lazy loading), which waits for the device: not here
    cache.read_prefix("W", list(range(8)), 128, hashes_old, ["hidden"], out_device="cuda")
    new = torch.randn(16 * 8, 1024, device="cuda")
    hashes_new = chained_block_hashes(list(range(1000, 1128)), 16)
    expected_old, expected_new = old.to(torch.bfloat16).cpu(), new.to(torch.bfloat16)  # (.cpu() waits)
    pool.wait_pending()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keep the stream busy (~0.1 s): the next write cannot land yet
    cache.write_request_rows("B", list(range(8, 16)), 0, {"hidden": new}, dict(enumerate(hashes_new)))
    assert not stream.query(), "the write waited for the device"
    if not zero_copy:
        assert pool._committer._inflight
    got_old = cache.read_prefix("C", list(range(8)), 128, hashes_old, ["hidden"])["hidden"]
    assert not stream.query(), "a CPU read of other blocks waited for the device"
    got_new = cache.read_prefix("D", list(range(8, 16)), 128, hashes_new, ["hidden"], out_device="cuda")["hidden"]
    if zero_copy:
        assert not stream.query(), "a GPU read waited"
    assert same_bits(got_old, expected_old)
    assert same_bits(got_new, expected_new)
    got_new_cpu = cache.read_prefix("E", list(range(8, 16)), 128, hashes_new, ["hidden"])["hidden"]
    assert same_bits(got_new_cpu, expected_new.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("zero_copy", [True, False])
def test_cuda_pinned_host_cpu_write_waits_for_a_pending_gpu_read(zero_copy):
    """Rows written from the CPU into blocks a queued GPU read still has to copy do not reach
    that read (the CPU write waits for it)."""
    pool = HiddenPool("hidden", 8, 4, 256, torch.float32, "cuda", Tier.PINNED_HOST, zero_copy=zero_copy)
    first = torch.randn(8, 256)
    pool.write(torch.arange(8) + 4, first)  # blocks 1, 2
    pool.gather_blocks([3], out_device="cuda")  # loads the kernels (lazy loading waits for the device)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    got = pool.gather_blocks([1, 2], out_device="cuda")  # queued behind the sleep
    assert not torch.cuda.current_stream().query(), "the read did not stay queued"
    pool.write(torch.arange(8) + 4, torch.randn(8, 256))
    assert torch.equal(got.cpu(), first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uva_view_aliases_pinned_memory_bitwise():
    from omni_cache.core.pool import uva_view

    host = torch.empty(64, 512, dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.int16).copy_(torch.randint(-2**15, 2**15, host.shape, dtype=torch.int16))  # NaNs too
    view = uva_view(host, torch.device("cuda", torch.cuda.current_device()))
    assert view is not None and view.device.type == "cuda" and view.shape == host.shape
    idx = torch.randperm(64, device="cuda")[:20]
    assert same_bits(view.index_select(0, idx).cpu(), host[idx.cpu()])
    rows = torch.randn(20, 512, device="cuda").to(torch.bfloat16)
    view.index_copy_(0, idx, rows)
    torch.cuda.synchronize()
    assert same_bits(host[idx.cpu()], rows.cpu())
    assert uva_view(torch.empty(4), torch.device("cuda", 0)) is None  # not pinned


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --- vectorised bookkeeping, index and block hash forms --------------------------------------


def _ledger_state(cache):
    led = cache.ledger
    return [(led.block_hash[b], led.owner[b], led.generation[b], [led.filled(b, k) for k in led.keys])
            for b in range(led.num_blocks)]


def test_block_hash_forms_and_validation():
    cache = make_cache(num_blocks=40)
    table = list(range(3, 35))
    toks = list(range(128))
    hashes = chained_block_hashes(toks, BS)
    data = {k: rows(128, seed=i) for i, k in enumerate(KEYS)}
    cache.write_request_rows("A", table, 0, data, dict(enumerate(hashes)))
    other = make_cache(num_blocks=40)
    other.write_request_rows("A", torch.tensor(table), 0, data, (0, np.array(hashes, dtype=np.uint64)))
    assert _ledger_state(cache) == _ledger_state(other)
    as_int64 = torch.tensor(np.array(hashes, dtype=np.uint64).view(np.int64))  # reinterpreted
    assert any(h >= 2**63 for h in hashes) and cache.covered_prefix_tokens(table, as_int64, KEYS) == 128
    got = cache.read_prefix("B", np.array(table), 128, as_int64, KEYS)
    assert all(torch.equal(got[k], data[k]) for k in KEYS)
    for bad in ("12", -1, 1.5, 2**64, None):
        with pytest.raises(ValueError):
            cache.write_request_rows("C", [0], 0, {k: rows(4) for k in KEYS}, {0: bad})
        with pytest.raises(StaleRowsError):  # a lookup with it matches nothing
            cache.read_prefix("D", table, 4, [bad], KEYS)
        assert cache.covered_prefix_tokens(table, [bad], KEYS) == 0


def test_write_rejects_bad_block_ids_before_touching_anything():
    cache = make_cache()
    hashes, data = full_write(cache, "A", [2, 5], list(range(8)))
    state = _ledger_state(cache)
    pools = {k: p.storage.clone() for k, p in cache.pools.items()}
    for table, bh in (([2, 99], {}), ([-1, 5], {}), ([2, 5], {2: 7}), ([2, 5], {-1: 7}), ([2, 5], {"0": 7})):
        with pytest.raises(ValueError):
            cache.write_request_rows("B", table, 0, {k: rows(8) for k in KEYS}, bh)
    assert _ledger_state(cache) == state
    assert all(torch.equal(p.storage, pools[k]) for k, p in cache.pools.items())
    assert cache.covered_prefix_tokens([2, 5], hashes, KEYS) == 8


def test_failed_pool_write_leaves_touched_blocks_unserved(monkeypatch):
    cache = make_cache()
    hashes, _ = full_write(cache, "A", [2, 5], list(range(8)))

    def boom(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(cache.pools["layer_0"], "write_blocks", boom)
    with pytest.raises(RuntimeError):  # B reuses block 5: its hidden rows land, layer_0's do not
        cache.write_request_rows("B", [5], 0, {k: rows(4, seed=3) for k in KEYS}, {})
    assert cache.covered_prefix_tokens([2, 5], hashes, KEYS) == 4
    assert cache.ledger.owner[5] is None


def test_row_index_shares_one_copy_and_checks_bounds():
    ix = RowIndex(np.array([4, 5, 6, 9, 1], dtype=np.int64))
    head, tail = ix.split([3, 2])
    cpu = torch.device("cpu")
    assert head.on(cpu).tolist() == [4, 5, 6] and tail.on(cpu).tolist() == [9, 1]
    assert head.on(cpu).data_ptr() == ix.on(cpu).data_ptr()  # a view of the parent's copy
    ix.check(10, "block ids")
    with pytest.raises(IndexError):
        ix.check(9, "block ids")
    pool = HiddenPool("hidden", 4, BS, 4, torch.bfloat16)
    for bad in ([-1], [16]):
        with pytest.raises(IndexError):
            pool.write(bad, torch.zeros(1, 4))
        with pytest.raises(IndexError):
            pool.gather(bad)


@pytest.mark.parametrize("width,dtype", [(4, torch.bfloat16), (3, torch.bfloat16), (2, torch.float32),
                                         (3, torch.float64)])
def test_pool_cpu_paths_bitwise_with_nan_payloads(width, dtype):
    """CPU writes go through numpy int64 words where rows allow (8-byte multiples) and
    index_copy_ otherwise; both keep every bit, NaN payloads included."""
    pool = HiddenPool("hidden", 6, BS, width, dtype)
    bits = torch.randint(0, 256, (2 * BS * width * dtype.itemsize,), dtype=torch.uint8)
    data = bits.view(dtype).view(2 * BS, width)
    pool.write_blocks([4, 1], data)
    assert same_bits(pool.gather_blocks([4, 1]), data)
    pool.write([3, 22], data[:2])
    assert same_bits(pool.gather([3, 22]), data[:2])
    assert same_bits(pool.storage[1], data[BS:])


def test_chained_block_hashes_continue_from_parent_with_span_across_the_split():
    """The runner hashes only newly filled blocks (parent = last block hash); that must equal
    hashing the whole prompt, also when a multimodal span crosses the split."""
    import random

    from omni_cache.core import chained_block_hashes

    rng = random.Random(0)
    toks = [rng.randrange(1000) for _ in range(32 * 7)]
    spans = [(40, 130, "img-A")]
    whole = chained_block_hashes(toks, 32, spans)
    for split in (1, 2, 3, 5):
        lo = split * 32
        head = chained_block_hashes(toks[:lo], 32, [s for s in spans if s[0] < lo])
        tail = chained_block_hashes(toks[lo:], 32, [(a - lo, b - lo, i) for a, b, i in spans if b > lo],
                                parent=head[-1])
        assert head + tail == whole


def test_added_key_is_uncovered_until_written_on_both_ledger_paths():
    for scalar_max in (0, 4):
        cache = make_cache(num_blocks=12)
        cache.ledger.scalar_max = cache.ledger.scalar_max_read = scalar_max
        table = [7, 2, 9]
        hashes, data = full_write(cache, "A", table, list(range(12)))
        cache.add_keys([KeySpec("late", 3, torch.float32)])
        with pytest.raises(ValueError):
            cache.add_keys([KeySpec("late", 3, torch.float32)])
        assert cache.covered_prefix_tokens(table, hashes, KEYS) == 12
        assert cache.covered_prefix_tokens(table, hashes, ["late"]) == 0
        with pytest.raises(StaleRowsError, match="late"):
            cache.read_prefix("B", table, 12, hashes, [*KEYS, "late"])
        late = rows(8, seed=5)
        cache.write_request_rows("C", [4, 5], 0, {**{k: rows(8) for k in KEYS}, "late": late},
                                 dict(enumerate(chained_block_hashes(list(range(50, 58)), BS))))
        got = cache.read_prefix("D", [4, 5], 8, chained_block_hashes(list(range(50, 58)), BS), ["late"])
        assert torch.equal(got["late"], late)


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
    for f in ("_hash", "_cached", "_owner", "_generation", "_filled"):
        assert np.array_equal(getattr(a.ledger, f), getattr(b.ledger, f)), f
    assert a.ledger.pending_writes == 0
    assert [a.ledger.owner[i] for i in range(64)] == [b.ledger.owner[i] for i in range(64)]
