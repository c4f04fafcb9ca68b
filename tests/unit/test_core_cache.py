"""Unit tests for omni_cache.core.cache: HiddenStateCache's writes, reads, merge, metrics."""

import numpy as np
import pytest
import torch

from omni_cache.core import BLOCK_HASH_MISMATCH, HiddenStateCache, KeySpec, StaleRowsError, Tier, chained_block_hashes
from tests.unit.core_util import BS, KEYS, full_write, ledger_state, make_cache, rows
from tests.util import same_bits


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


def test_block_hash_forms_and_validation():
    cache = make_cache(num_blocks=40)
    table = list(range(3, 35))
    toks = list(range(128))
    hashes = chained_block_hashes(toks, BS)
    data = {k: rows(128, seed=i) for i, k in enumerate(KEYS)}
    cache.write_request_rows("A", table, 0, data, dict(enumerate(hashes)))
    other = make_cache(num_blocks=40)
    other.write_request_rows("A", torch.tensor(table), 0, data, (0, np.array(hashes, dtype=np.uint64)))
    assert ledger_state(cache) == ledger_state(other)
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
    state = ledger_state(cache)
    pools = {k: p.storage.clone() for k, p in cache.pools.items()}
    for table, bh in (([2, 99], {}), ([-1, 5], {}), ([2, 5], {2: 7}), ([2, 5], {-1: 7}), ([2, 5], {"0": 7})):
        with pytest.raises(ValueError):
            cache.write_request_rows("B", table, 0, {k: rows(8) for k in KEYS}, bh)
    assert ledger_state(cache) == state
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
