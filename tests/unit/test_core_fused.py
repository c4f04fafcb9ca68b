"""The one-launch step write (omni_cache.core.fused): bit-exact against the pools' own path.

The CUDA tests run where CUDA and Triton are (the lent GPU machine); the kernel's address
arithmetic is also checked on the CPU under Triton's interpreter where Triton is installed.
"""

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_cache.core import HiddenStateCache, KeySpec, Tier, chained_block_hashes
from tests.util import same_bits

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda_triton = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON),
                                       reason="needs CUDA and Triton (the GPU machine)")

INTERPRETED = r'''
import random, sys, torch
from omni_cache.core import fused
bs, nblk = 4, 12
rng = random.Random(int(sys.argv[1]))
widths = [8, 3, 16]  # int64 words per row, one per key
pools = [torch.randint(-2**62, 2**62, (nblk * bs, w)) for w in widths]
for case in range(12):
    u = rng.randint(1, 5)
    first_off = rng.randrange(bs)
    last_end = rng.randint(first_off + 1 if u == 1 else 1, bs)
    n = u * bs - first_off - (bs - last_end)
    ids = torch.tensor(rng.sample(range(nblk), u))
    rows = [torch.randint(-2**62, 2**62, (n, w)) for w in widths]
    expect = [p.clone() for p in pools]
    slots = torch.cat([ids[j] * bs + torch.arange(first_off if j == 0 else 0, last_end if j == u - 1 else bs)
                       for j in range(u)])
    for e, r in zip(expect, rows):
        e[slots] = r
    tab = torch.tensor([v for r, p, w in zip(rows, pools, widths) for v in (r.data_ptr(), p.data_ptr(), w)])
    fused.launch(tab.data_ptr(), ids.data_ptr(), u, first_off, last_end, bs, len(widths))
    assert all(torch.equal(p, e) for p, e in zip(pools, expect)), case
for case in range(12):  # the scatter kernel: rows to distinct slots in any order (a decode step's)
    n = rng.randint(1, 9)
    slots = torch.tensor(rng.sample(range(nblk * bs), n))
    rows = [torch.randint(-2**62, 2**62, (n, w)) for w in widths]
    expect = [p.clone() for p in pools]
    for e, r in zip(expect, rows):
        e[slots] = r
    tab = torch.tensor([v for r, p, w in zip(rows, pools, widths) for v in (r.data_ptr(), p.data_ptr(), w)])
    fused.launch_slots(tab.data_ptr(), slots.data_ptr(), n, len(widths))
    assert all(torch.equal(p, e) for p, e in zip(pools, expect)), ("slots", case)
print("ok")
'''


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                    reason="needs Triton, and no CUDA (where CUDA is, the tests below run the compiled kernel)")
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_kernel_interpreted_on_cpu(seed):
    """The kernel under TRITON_INTERPRET=1 on CPU memory: every (first offset, last end,
    block count) case lands each key's rows exactly at its slots, nothing else changes."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", INTERPRETED, str(seed)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


WRITER = r'''
import types, torch
from omni_cache.core import fused
from omni_cache.core.pool import HiddenPool, Tier
torch._C._cuda_getCurrentRawStream = lambda index: 0  # (no CUDA here: the interpreter ignores the stream)


class Ring:  # the staging ring's interface over CPU memory (the interpreter reads CPU addresses)
    def __init__(self):
        self.buf = torch.zeros(4096, dtype=torch.int64)
        self.host, self.half, self.pos = self.buf.numpy(), 2048, 0

    def reserve(self, n):
        self.pos += n
        return self.pos - n

    def device_address(self, offset):
        return self.buf.data_ptr() + 8 * offset


bs = 4
pools = [HiddenPool(k, 8, bs, w, torch.float32, "cpu", Tier.DEVICE) for k, w in (("a", 6), ("b", 2))]
writer = fused.StepWriter.__new__(fused.StepWriter)  # by hand: its __init__ asks for a CUDA ring
writer.device, writer.block_size, writer.ring = types.SimpleNamespace(index=-1), bs, Ring()
writer.launches, writer.pinned = 0, False
writer.destinations = {p.key: fused._Destination(p.dtype, p.storage.data_ptr(), p.row_bytes // 8, None) for p in pools}
expect = {p.key: p.storage.clone().view(-1, p.width) for p in pools}
gen = torch.Generator().manual_seed(0)
# write: blocks 3 then 1, from offset 2 of block 3 to offset 3 of block 1 (5 rows) (rows to
# convert make a temporary that only CUDA's stream-ordered allocator keeps for the kernel: the
# CUDA tests cover them)
rows = {"a": torch.randn(5, 6, generator=gen), "b": torch.randn(5, 2, generator=gen)}
assert writer.write(torch.tensor([3, 1]).numpy(), 2, 3, rows)
for k, r in rows.items():
    expect[k][[14, 15, 4, 5, 6]] = r
# write_slots: a decode step's rows to slots in any order
rows = {"a": torch.randn(3, 6, generator=gen), "b": torch.randn(3, 2, generator=gen)}
assert writer.write_slots(torch.tensor([30, 0, 9]).numpy(), rows)
for k, r in rows.items():
    expect[k][[30, 0, 9]] = r
assert writer.launches == 2
assert all(torch.equal(p.storage.view(-1, p.width), expect[p.key]) for p in pools)
print("ok")
'''


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                    reason="needs Triton, and no CUDA (where CUDA is, the CUDA tests below cover the writer)")
def test_step_writer_interpreted_on_cpu():
    """StepWriter.write (a run of blocks) and write_slots (rows to slots in any order) under
    TRITON_INTERPRET=1 on CPU pools, with a stand-in for the staging ring: the argument table
    and index land where the kernels read them, every row is at its slot (oracle: torch
    indexing of the same slots), one launch each."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", WRITER], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


WARM_UP = r'''
import sys
from omni_cache.core import fused
if sys.argv[1] == "broken":  # a kernel that writes nothing: the check must catch it
    fused.kernel()
    fused.launch = lambda *a, **k: None
if sys.argv[1] == "broken_slots":  # the scatter kernel writes nothing: caught too, both turned off
    fused.slots_kernel()
    fused.launch_slots = lambda *a, **k: None
print("warm_up", fused.warm_up("cpu", 16), fused.warm_up("cpu", 16), "kernel", fused.kernel() is not None)
'''


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                    reason="needs Triton, and no CUDA (the CUDA test below compiles it)")
@pytest.mark.parametrize("case", ["exact", "broken", "broken_slots"])
def test_warm_up_checks_the_kernel_before_any_request(case):
    """fused.warm_up (run at start-up by the runner) writes known patterns through both kernels
    and compares them with torch indexing of the same slots (oracle). A kernel that gets it
    wrong (planted: a launch of either that writes nothing) turns the fused path off for the
    process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", WARM_UP, case], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    expect = "warm_up True True kernel True" if case == "exact" else "warm_up False False kernel False"
    assert expect in out.stdout, (out.stdout, out.stderr[-2000:])


@needs_cuda_triton
def test_cuda_warm_up_compiles_so_the_first_write_does_not():
    """After fused.warm_up on the GPU the kernel is compiled and its launcher goes direct: the
    first real step write does not enter Triton's JIT (the cost it moves to start-up)."""
    from omni_cache.core import fused

    assert fused.warm_up("cuda", 16)
    launcher = fused._Launcher.get(fused.kernel())
    assert launcher.compiled is not None
    full, _ = _pair(Tier.DEVICE)
    compiled = launcher.compiled
    rows = {k.name: torch.randn(40, k.width, device="cuda").to(k.dtype) for k in KEYS}
    full.write_request_rows("A", [3, 4, 5], 0, rows, {})
    torch.cuda.synchronize()
    assert launcher.compiled is compiled and full._writer is not None and full._writer.launches == 1


KEYS = [KeySpec("hidden", 2048, torch.bfloat16), KeySpec("layer_0", 64, torch.float32),
        KeySpec("odd", 12, torch.float16)]  # 24-byte rows: int64 words, not 16-byte ones


def _pair(tier, keys=KEYS, num_blocks=96, bs=16):
    kw = {"zero_copy": True} if tier is Tier.PINNED_HOST else {}
    return (HiddenStateCache(num_blocks, bs, keys, "cuda", tier, fused=True, **kw),
            HiddenStateCache(num_blocks, bs, keys, "cuda", tier, fused=False, **kw))


@needs_cuda_triton
@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.PINNED_HOST])
def test_cuda_fused_step_writes_match_index_copy(tier):
    """Random steps (prefills, chunks starting and ending mid-block, single tokens, a key
    missing, rows of another dtype or not contiguous) leave the fused cache's pools and
    ledger bitwise equal to the per-key index_copy_ path's, and its hits read the same rows."""
    a, b = _pair(tier)
    rng = random.Random(int(tier is Tier.DEVICE))
    bs, nb = 16, 96
    for step in range(40):
        table = rng.sample(range(nb), 8)
        start = rng.randrange(0, 100)
        n = rng.choice([1, 3, 16, 17, 31, 128 - start if start < 128 else 1])
        n = max(1, min(n, 128 - start))
        keys = [k for k in KEYS if step % 7 != 3 or k.name != "layer_0"]
        rows = {k.name: torch.randn(n, k.width, device="cuda").to(k.dtype) for k in keys}
        if step % 5 == 1:
            rows["hidden"] = torch.randn(n, 2048, device="cuda")  # float32 into a bf16 pool
        if step % 5 == 2:
            rows["hidden"] = torch.randn(2048, n, device="cuda").to(torch.bfloat16).t()  # not contiguous
        full = (start + n) // bs
        hashes = chained_block_hashes([rng.randrange(50) for _ in range(full * bs)], bs)
        bh = {j: hashes[j] for j in range(start // bs, full)}
        for c in (a, b):
            c.write_request_rows(f"r{step}", table, start, rows, bh)
    torch.cuda.synchronize()
    assert a._writer is not None and a._writer.launches > 0 and b._writer is None
    for k in KEYS:
        assert same_bits(a.pools[k.name].storage.cpu(), b.pools[k.name].storage.cpu()), k.name
    # the ledgers' public state, block by block: block hash (None while partial), owner,
    # generation and every key's filled rows
    for blk in range(nb):
        for f in ("block_hash", "owner", "generation"):
            assert getattr(a.ledger, f)[blk] == getattr(b.ledger, f)[blk], (f, blk)
        for k in KEYS:
            assert a.ledger.filled(blk, k.name) == b.ledger.filled(blk, k.name), (k.name, blk)
    assert any(a.ledger.block_hash[blk] is not None for blk in range(nb)), "no block was cached: vacuous"


@needs_cuda_triton
@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.PINNED_HOST])
def test_cuda_fused_step_rows_match_index_copy(tier):
    """Whole engine steps (write_step_rows: prefills of several requests, then decode steps of
    8 requests, rows completing and caching blocks on the way, float32 rows into the bf16 key)
    through the scatter kernel leave pools and ledger bitwise equal to the per-key index_copy_
    path's; one launch per step."""
    from omni_cache.core.step_write import StepRequest

    a, b = _pair(tier)
    bs, rng = 16, random.Random(7)
    tables = {f"r{i}": list(range(8 * i, 8 * i + 8)) for i in range(8)}
    prompt = {r: rng.randrange(20, 60) for r in tables}
    tokens = {r: [rng.randrange(50) for _ in range(128)] for r in tables}

    def step(reqs):
        n = sum(r.num_tokens for r in reqs)
        rows = {k.name: torch.randn(n, k.width, device="cuda").to(k.dtype) for k in KEYS}
        rows["hidden"] = torch.randn(n, 2048, device="cuda")  # float32 rows into the bf16 pool
        for c in (a, b):
            c.write_step_rows(reqs, rows)

    def hashes(r, upto):
        full = chained_block_hashes(tokens[r][:upto // bs * bs], bs)
        return dict(enumerate(full))

    step([StepRequest(r, t, 0, prompt[r], {j: h for j, h in hashes(r, prompt[r]).items()})
          for r, t in tables.items()])
    launches = a._writer.launches
    for s in range(40):
        reqs = []
        for r, t in tables.items():
            pos = prompt[r] + s
            done = (pos + 1) // bs
            reqs.append(StepRequest(r, t, pos, 1, {done - 1: hashes(r, pos + 1)[done - 1]}
                                    if (pos + 1) % bs == 0 else {}))
        step(reqs)
    torch.cuda.synchronize()
    assert a._writer.launches == launches + 40 and b._writer is None
    for k in KEYS:
        assert same_bits(a.pools[k.name].storage.cpu(), b.pools[k.name].storage.cpu()), k.name
    for blk in range(64):
        for f in ("block_hash", "owner", "generation"):
            assert getattr(a.ledger, f)[blk] == getattr(b.ledger, f)[blk], (f, blk)
        for k in KEYS:
            assert a.ledger.filled(blk, k.name) == b.ledger.filled(blk, k.name), (k.name, blk)
    assert sum(a.ledger.block_hash[blk] is not None for blk in range(64)) > 8, "too few blocks cached: vacuous"


@needs_cuda_triton
@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.PINNED_HOST])
def test_cuda_fused_prefill_round_trip_without_waiting(tier):
    """A prefill of 8,192 tokens x 3 keys written behind a busy stream: the write returns at
    once (no host wait), uses one launch, the source buffers are reused right away, and the
    hit reads back every row bitwise."""
    keys = [KeySpec(k, 2048, torch.bfloat16) for k in ("hidden", "layer_0", "layer_24")]
    cache = HiddenStateCache(1024, 16, keys, "cuda", tier)
    table = torch.randperm(1024)[:512].tolist()
    hashes = chained_block_hashes(list(range(8192)), 16)
    warm = {k.name: torch.randn(16, 2048, device="cuda").to(torch.bfloat16) for k in keys}
    cache.write_request_rows("warm", table[:1], 0, warm, {0: hashes[0]})  # compiles / loads the kernel
    rows = {k.name: torch.randn(8192, 2048, device="cuda").to(torch.bfloat16) for k in keys}
    expected = {k: v.clone() for k, v in rows.items()}
    launches = cache._writer.launches
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    cache.write_request_rows("A", table, 0, rows, dict(enumerate(hashes)))
    assert not torch.cuda.current_stream().query(), "the write waited for the device"
    assert cache._writer.launches == launches + 1
    for v in rows.values():
        v.zero_()  # the model runner reuses its buffers
    got = cache.read_prefix("B", table, 8192, hashes, [k.name for k in keys], out_device="cuda")
    assert all(same_bits(got[k], expected[k]) for k in expected)


@needs_cuda_triton
def test_cuda_fused_declines_what_it_does_not_cover():
    """Pools of rows that are not whole int64 words, and CPU rows, take the pools' path."""
    odd = HiddenStateCache(8, 4, [KeySpec("h", 3, torch.bfloat16)], "cuda", Tier.DEVICE)
    odd.write_request_rows("A", [0, 1], 0, {"h": torch.randn(8, 3, device="cuda")}, {})
    assert odd._writer is None and not odd._fused_maybe
    dev = HiddenStateCache(8, 4, [KeySpec("h", 4, torch.bfloat16)], "cuda", Tier.DEVICE)
    rows = torch.randn(8, 4).to(torch.bfloat16)
    dev.write_request_rows("A", [0, 1], 0, {"h": rows}, {0: 1, 1: 2})
    assert dev._writer is not None and dev._writer.launches == 0
    assert same_bits(dev.read_prefix("B", [0, 1], 8, [1, 2], ["h"])["h"].cpu(), rows)
