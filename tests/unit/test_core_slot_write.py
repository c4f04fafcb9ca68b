"""``omni_cache::write_rows_at_slots`` (:mod:`omni_cache.core.slot_write`): rows to the slot
mapping's slots, padded entries to the scratch row. Oracle everywhere: a per-row Python
reference (``pool[slot] = row`` for each unpadded entry), compared bit for bit, and every other
slot unchanged. The CUDA test (bare GPU hosts: ``scripts/gpu_bare_check.sh``) captures the op in
a CUDA graph and replays it with new rows and slots, as a decode step's graph would."""

from __future__ import annotations

import pytest
import torch

from omni_cache.core.slot_write import PAD_SLOT_ID, write_rows_at_slots

NUM_SLOTS, WIDTH = 64, 24


def _reference(pool: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    out = pool.clone()
    for i in range(rows.shape[0]):
        s = int(slot_mapping[i])
        if s != PAD_SLOT_ID:
            out[s] = rows[i].to(pool.dtype)
    return out


def _case(gen: torch.Generator, n: int, padded: int, device="cpu", dtype=torch.bfloat16):
    """A pool (scratch row included), ``n`` rows and a slot mapping of ``padded`` entries:
    distinct slots in random order, some of the first ``n`` padded, the tail padded."""
    pool = torch.randn(NUM_SLOTS + 1, WIDTH, generator=gen).to(dtype).to(device)
    rows = torch.randn(n, WIDTH, generator=gen).to(device)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:padded]
    slots[n:] = PAD_SLOT_ID
    slots[torch.randperm(n, generator=gen)[: n // 4]] = PAD_SLOT_ID
    return pool, rows, slots.to(device)


def _same_but_scratch(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a[:NUM_SLOTS].view(torch.int16), b[:NUM_SLOTS].view(torch.int16))


@pytest.mark.parametrize("n,padded", [(1, 1), (7, 16), (16, 16), (33, 48)])
def test_rows_land_on_their_slots_and_pads_on_the_scratch_row(n, padded):
    gen = torch.Generator().manual_seed(n * 100 + padded)
    pool, rows, slots = _case(gen, n, padded)
    expect = _reference(pool, rows, slots)
    write_rows_at_slots(pool, rows, slots)
    assert _same_but_scratch(pool, expect)


def test_int32_slot_mapping_and_a_float32_pool():
    gen = torch.Generator().manual_seed(7)
    pool, rows, slots = _case(gen, 12, 16, dtype=torch.float32)
    expect = _reference(pool, rows, slots)
    write_rows_at_slots(pool, rows, slots.to(torch.int32))
    assert torch.equal(pool[:NUM_SLOTS], expect[:NUM_SLOTS])


def test_torch_compile_keeps_the_write_in_the_graph():
    """Traced whole (``fullgraph=True``) and run from the compiled graph: the pool is written
    (an op with no output that the compiler dropped would leave it unchanged)."""
    torch._dynamo.reset()

    def forward(pool, hidden, slots):
        out = hidden * 2.0
        torch.ops.omni_cache.write_rows_at_slots(pool, out, slots)
        return out + 1.0

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(11)
    pool, rows, slots = _case(gen, 9, 16)
    expect = _reference(pool, rows * 2.0, slots)
    out = compiled(pool, rows, slots)
    assert torch.equal(out, rows * 2.0 + 1.0)
    assert _same_but_scratch(pool, expect)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_the_write_with_new_rows_and_slots():
    """Captured once with static buffers (rows, a padded slot mapping, the pool), replayed six
    times after copying new rows and slots into the buffers — each replay equal to the
    reference on the pool as it was before that replay."""
    gen = torch.Generator().manual_seed(3)
    n, padded = 8, 16
    pool, rows, slots = _case(gen, n, padded, device="cuda")
    static_rows, static_slots = rows.clone(), slots.clone()
    write_rows_at_slots(pool, static_rows, static_slots)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_rows_at_slots(pool, static_rows, static_slots)
    for k in range(6):
        _, new_rows, new_slots = _case(gen, n, padded, device="cuda")
        expect = _reference(pool.cpu(), new_rows.cpu(), new_slots.cpu())
        static_rows.copy_(new_rows)
        static_slots.copy_(new_slots)
        graph.replay()
        torch.cuda.synchronize()
        assert _same_but_scratch(pool.cpu(), expect), f"replay {k}"
