"""Hidden-state pool at GPU speed: per step size and tier, GPU and host time, GB/s and the fraction
of the machine's measured limits (torch only). Three keys of the Qwen3-Omni-30B-A3B thinker width
(2048, bf16), ``--block-size`` 16, ``--num-blocks`` blocks per key.

1. Limits on the same GPU (:func:`measure_limits`): device-to-device copy, ``index_copy_`` /
   ``index_select`` of 8,192 rows, pinned H2D / D2H.
2. Per tier (``DEVICE``, ``PINNED_HOST``) and step size (1k..32k tokens): a prefill step's
   ``write_request_rows`` and a hit's ``read_prefix`` (checked bitwise), timed by
   :class:`GpuTimer` (GPU time by CUDA events behind a busy stream, host time without events,
   idle-GPU latency); GB/s = payload bytes (tokens x keys x width x 2 B) / GPU time.
3. The bars of issue 18 (:func:`bars`), printed PASS / FAIL.

What each figure means and the measured results: docs/pool-gpu.md. ``--cpu-only``: only the
host time of small steps on a ``HOST`` pool on the CPU (also part of a full run).

    python benchmarks/pool_gpu_bench.py --out benchmarks/results/pool_gpu_h100.json
    python benchmarks/pool_gpu_bench.py --cpu-only --out /tmp/pool_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script (the documented command), not as a module
    sys.path.insert(0, str(REPO))

from benchmarks import lab  # noqa: E402
from omni_cache.core import HiddenStateCache, KeySpec, Tier  # noqa: E402

KEYS = ("hidden", "layer_0", "layer_24")
STEP_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
#: per tier: the limits a write and a read are measured against (:func:`measure_limits`)
LIMITS = {Tier.DEVICE: ("index_copy_rows", "index_select_rows"), Tier.PINNED_HOST: ("pinned_d2h", "pinned_h2d")}
BARS = {"write_host_ms_8k": 0.2, "device_write_frac": 0.70, "pinned_read_frac_8k": 0.70}


class GpuTimer:
    """Times a callable's device work with CUDA events behind a sleep kernel (see module doc)."""

    def __init__(self) -> None:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(20_000_000)
        e.record()
        torch.cuda.synchronize()
        self.cycles_per_ms = 20_000_000 / s.elapsed_time(e)

    def run(self, fn, busy_ms: float, events: bool = True) -> tuple[float | None, float, object]:
        """(GPU ms, host ms, result) of one call of ``fn`` behind ``busy_ms`` of sleep; with
        ``events`` the host time includes recording the two CUDA events around the call, without
        (GPU ms None) it is the call's own (an event record costs tens of µs on a VM host)."""
        torch.cuda.synchronize()
        torch.cuda._sleep(int(busy_ms * self.cycles_per_ms))
        s, e = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if events else (None, None)
        t0 = time.perf_counter()
        if events:
            s.record()
        out = fn()
        if events:
            e.record()
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        return s.elapsed_time(e) if events else None, host, out

    def bench(self, fn, reps: int = 10) -> dict:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        busy = max(2.0, 3 * (time.perf_counter() - t0) * 1e3 + 1.0)
        torch.cuda.synchronize()
        gpu, host = zip(*(self.run(fn, busy)[:2] for _ in range(reps)))  # each call's result dropped at once
        return {"gpu_ms": float(np.median(gpu)), "host_ms": float(np.median(host)), "busy_ms": busy}


def measure_limits(timer: GpuTimer, width: int) -> dict:
    """The machine's limits (payload GB/s, GPU time): see the module docstring."""
    src = torch.randint(0, 255, (2**30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pool = torch.randn(65536, width, device="cuda").to(torch.bfloat16)
    rows = torch.randn(8192, width, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(65536, device="cuda")[:8192]
    host = torch.empty(3 * 8192 * width, dtype=torch.bfloat16, pin_memory=True)
    gpu = torch.randn(host.numel(), device="cuda").to(torch.bfloat16)
    cases = {"device_copy": (lambda: dst.copy_(src), src.nbytes),
             "index_copy_rows": (lambda: pool.index_copy_(0, slots, rows), rows.nbytes),
             "index_select_rows": (lambda: pool.index_select(0, slots), rows.nbytes),
             "pinned_h2d": (lambda: gpu.copy_(host, non_blocking=True), host.nbytes),
             "pinned_d2h": (lambda: host.copy_(gpu, non_blocking=True), host.nbytes)}
    lim = {name: {**timer.bench(fn), "bytes": nbytes} for name, (fn, nbytes) in cases.items()}
    return {name: {**v, "GBps": v["bytes"] / v["gpu_ms"] / 1e6} for name, v in lim.items()}


def bench_tier(timer: GpuTimer, tier: Tier, tokens: int, width: int, num_blocks: int, block_size: int,
               reps: int, cache: HiddenStateCache) -> dict:
    dev = torch.device("cuda")
    nb = tokens // block_size
    rows = {k: torch.randn(tokens, width, device=dev).to(torch.bfloat16) for k in KEYS}
    rng = random.Random(tokens)
    m = {k: [] for k in ("write_gpu_ms", "write_host_ms", "write_host_ms_with_events", "write_host_ms_array_forms",
                         "read_gpu_ms", "read_host_ms", "read_host_ms_with_events", "write_latency_ms",
                         "read_latency_ms", "write_settle_host_ms")}
    busy = 2.0
    # the ledger update a write deferred (applied by the next lookup anyway); older cores: none
    settle = getattr(cache, "settle", lambda: None)

    def fresh_write(req: str, arrays: bool = False):
        """A write of the step into fresh random blocks (block hashes as the ``{block index:
        hash}`` mapping the engine builds before the call, or the array forms: block table as a
        tensor, block hashes as ``(first, uint64 array)``)."""
        blocks = torch.randperm(num_blocks)[:nb]
        hashes = [rng.getrandbits(64) for _ in range(nb)]
        blocks = blocks if arrays else blocks.tolist()
        args = (blocks, 0, rows, (0, np.array(hashes, dtype=np.uint64)) if arrays else dict(enumerate(hashes)))
        return (lambda: cache.write_request_rows(req, *args)), blocks, hashes

    for rep in range(reps + 2):
        req = f"{tier.name}-{tokens}-{rep}"
        # idle-GPU latency of a write, then GPU time (events) and host time (no events) of
        # writes behind a busy stream, each into its own fresh blocks
        fn, _, _ = fresh_write(req + "-lat")
        t0 = time.perf_counter()
        fn()
        for p in cache.pools.values():
            p.wait_pending()
        torch.cuda.synchronize()
        lat_w = (time.perf_counter() - t0) * 1e3
        fn, _, _ = fresh_write(req + "-arr", arrays=True)
        h_arr = timer.run(fn, busy, events=False)[1]
        settle()
        fn, _, _ = fresh_write(req + "-host")
        h = timer.run(fn, busy, events=False)[1]
        h_settle = timer.run(settle, busy, events=False)[1]  # the write's deferred ledger update, alone
        fn, blocks, hashes = fresh_write(req)
        g, h_ev, _ = timer.run(fn, busy)
        for p in cache.pools.values():
            p.wait_pending()

        def read(req=req, blocks=blocks, hashes=hashes):
            return cache.read_prefix(req, blocks, tokens, hashes, KEYS, out_device=dev)

        t0 = time.perf_counter()
        read()
        torch.cuda.synchronize()
        lat_r = (time.perf_counter() - t0) * 1e3
        hr = timer.run(read, busy, events=False)[1]
        gr, hr_ev, out = timer.run(read, busy)
        if not all(out[k].dtype == rows[k].dtype and torch.equal(out[k].view(torch.int16), rows[k].view(torch.int16))
                   for k in KEYS):  # bitwise
            raise AssertionError(f"{tier.name} {tokens}: read rows differ from the written rows")
        busy = max(2.0, 3 * max(h_ev, hr_ev) + 1.0)
        if rep >= 2:
            for k, v in zip(m, (g, h, h_ev, h_arr, gr, hr, hr_ev, lat_w, lat_r, h_settle)):
                m[k].append(v)
    nbytes = tokens * width * 2 * len(KEYS)
    res = {"tier": tier.name, "tokens": tokens, "width": width, "keys": len(KEYS), "bytes": nbytes,
           **{k: float(np.median(v)) for k, v in m.items()},
           **{f"{k}_all": m[k] for k in ("write_host_ms", "write_host_ms_array_forms", "write_settle_host_ms",
                                         "read_host_ms")}, "fused_writes": cache._writer is not None}
    return {**res, **{f"{op}_GBps": nbytes / res[f"{op}_gpu_ms"] / 1e6 for op in ("write", "read")}}


def bench_cpu(reps: int, width: int = 2048) -> dict:
    """Host time (µs) of small steps on a HOST pool on the CPU: the CPU pipeline's path."""
    torch.manual_seed(0)
    bs, num_blocks = 16, 1024
    cache = HiddenStateCache(num_blocks, bs, [KeySpec(k, width, torch.bfloat16) for k in KEYS])
    rng = random.Random(0)
    rows = {k: torch.randn(1024, width).to(torch.bfloat16) for k in KEYS}
    cases = {}

    def timed(name, fn, n=reps):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        cases[name] = {"median_us": float(np.median(ts)), "min_us": min(ts)}

    # decode step: 32 requests x 1 token, each with a 64-block table, mid-block positions
    tables = [rng.sample(range(num_blocks), 64) for _ in range(32)]
    one = {k: v[:1] for k, v in rows.items()}
    pos = [37 + 5 * i for i in range(32)]

    def decode():
        for i, t in enumerate(tables):
            cache.write_request_rows(f"d{i}", t, pos[i], one, {})

    timed("decode_32req_x1tok_write", decode)
    for n in (16, 128, 1024):
        table = rng.sample(range(num_blocks), n // bs)
        hashes = [rng.getrandbits(64) for _ in range(n // bs)]
        part = {k: v[:n] for k, v in rows.items()}
        by_index = dict(enumerate(hashes))
        timed(f"prefill_{n}tok_write", lambda t=table, h=by_index, p=part: cache.write_request_rows("p", t, 0, p, h))
        timed(f"hit_{n}tok_read", lambda t=table, h=hashes, n=n: cache.read_prefix("q", t, n, h, KEYS))
    return cases


def plot(res: dict, path: Path) -> None:
    """Per tier and step size: GB/s (with the limits), host ms per call, fraction of the limit."""
    lim = res["limits"]
    with lab.figure(path, 1, 3, figsize=(16, 4.6), dpi=110, title_size=10,
                    title=f"omni-cache pool, 3 keys x 2048 bf16, {res['device']}") as (fig, axes):
        for tier, color in (("DEVICE", "tab:blue"), ("PINNED_HOST", "tab:orange")):
            runs = [r for r in res["runs"] if r["tier"] == tier]
            for ax, what in zip(axes, ("GBps", "host_ms", "frac")):
                for op, style in (("write", "o-"), ("read", "s--")):
                    ax.plot([r["tokens"] for r in runs], [r[f"{op}_{what}"] for r in runs], style, color=color,
                            label=f"{tier} {op}")
        for name, ls in (("index_copy_rows", ":"), ("index_select_rows", "-."), ("pinned_h2d", ":")):
            axes[0].axhline(lim[name]["GBps"], color="gray", ls=ls, lw=1)
            axes[0].annotate(name, (STEP_TOKENS[0], lim[name]["GBps"]), fontsize=7, color="gray")
        axes[1].axhline(BARS["write_host_ms_8k"], color="red", ls=":", lw=1)
        axes[2].axhline(0.7, color="red", ls=":", lw=1)
        for ax, ylabel, title in zip(axes, ("GB/s (payload, GPU time)", "host ms per call", "fraction of limit"),
                                     ("bandwidth", "host time (bar: write <= 0.2 ms at 8k)",
                                      "fraction of measured limit (bar 0.7)")):
            ax.set(xscale="log", yscale="linear" if ax is axes[2] else "log", xlabel="tokens per step",
                   ylabel=ylabel, title=title)
            ax.set_xticks(STEP_TOKENS, [f"{t // 1024}k" for t in STEP_TOKENS])
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)


def bars(res: dict) -> list[str]:
    by = {(r["tier"], r["tokens"]): r for r in res["runs"]}
    lines = []
    for tier in ("DEVICE", "PINNED_HOST"):
        if r := by.get((tier, 8192)):
            ok = r["write_host_ms"] <= BARS["write_host_ms_8k"]
            lines.append(f"{'PASS' if ok else 'FAIL'} write host time {tier} 8k: {r['write_host_ms']:.3f} ms "
                         f"(array forms {r['write_host_ms_array_forms']:.3f} ms; bar <= {BARS['write_host_ms_8k']} ms; "
                         f"its deferred ledger update, applied by the next lookup: "
                         f"{r.get('write_settle_host_ms', float('nan')):.3f} ms)")
    fr = [r["write_frac"] for r in res["runs"] if r["tier"] == "DEVICE"]
    if r8 := by.get(("DEVICE", 8192)):
        ok = r8["write_frac"] >= BARS["device_write_frac"]
        lines.append(f"{'PASS' if ok else 'FAIL'} device write 8k: {r8['write_GBps']:.0f} GB/s = "
                     f"{100 * r8['write_frac']:.0f}% of index_copy_ rows "
                     f"{res['limits']['index_copy_rows']['GBps']:.0f} "
                     f"GB/s (bar >= 70%; all sizes {min(fr) * 100:.0f}-{max(fr) * 100:.0f}%)")
    if r := by.get(("PINNED_HOST", 8192)):
        ok = r["read_frac"] >= BARS["pinned_read_frac_8k"]
        lines.append(f"{'PASS' if ok else 'FAIL'} pinned-host hit read 8k: {r['read_GBps']:.1f} GB/s = "
                     f"{100 * r['read_frac']:.0f}% of pinned H2D {res['limits']['pinned_h2d']['GBps']:.1f} GB/s "
                     f"(bar >= 70%)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cpu-repeats", type=int, default=200)
    ap.add_argument("--tokens", type=int, nargs="*", default=list(STEP_TOKENS))
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--unfused-tokens", type=int, nargs="*", default=[8192],
                    help="also run these step sizes with fused=False (per-key index_copy_), for comparison")
    ap.add_argument("--out", default="benchmarks/results/pool_gpu.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"torch": torch.__version__}
    if not a.cpu_only:
        res["device"] = torch.cuda.get_device_name(0)
        timer = GpuTimer()
        res["limits"] = measure_limits(timer, a.width)
        torch.cuda.empty_cache()  # the limits' buffers
        for name, v in res["limits"].items():
            print(f"limit {name:18s} {v['GBps']:8.1f} GB/s  ({v['gpu_ms']:.3f} ms)", flush=True)
        res.update(runs=[], runs_unfused=[])
        for fused, tier in itertools.product((True, False), (Tier.DEVICE, Tier.PINNED_HOST)):
            keys = [KeySpec(k, a.width, torch.bfloat16) for k in KEYS]
            cache = HiddenStateCache(a.num_blocks, a.block_size, keys, device="cuda", tier=tier, fused=fused)
            for tokens in (a.tokens if fused else a.unfused_tokens):
                r = bench_tier(timer, tier, tokens, a.width, a.num_blocks, a.block_size, a.repeats, cache)
                wl, rl = LIMITS[tier]
                r.update(write_limit=wl, read_limit=rl, write_frac=r["write_GBps"] / res["limits"][wl]["GBps"],
                         read_frac=r["read_GBps"] / res["limits"][rl]["GBps"])
                res["runs" if fused else "runs_unfused"].append(r)
                print(f"{tier.name:11s}{'' if fused else ' unfused'} {tokens:6d} tok  write gpu "
                      f"{r['write_gpu_ms']:7.3f} ms {r['write_GBps']:7.1f} GB/s ({100 * r['write_frac']:4.0f}% {wl})  "
                      f"host {r['write_host_ms']:.3f} ms (arrays {r['write_host_ms_array_forms']:.3f}, events "
                      f"{r['write_host_ms_with_events']:.3f}, deferred ledger update {r['write_settle_host_ms']:.3f})"
                      f"  | read gpu {r['read_gpu_ms']:7.3f} ms {r['read_GBps']:7.1f} GB/s "
                      f"({100 * r['read_frac']:4.0f}% {rl})  host {r['read_host_ms']:.3f} ms", flush=True)
            del cache
            torch.cuda.empty_cache()
    res["cpu_small_steps_us"] = bench_cpu(a.cpu_repeats)
    for name, v in res["cpu_small_steps_us"].items():
        print(f"cpu {name:28s} median {v['median_us']:9.1f} us  min {v['min_us']:9.1f} us", flush=True)
    if not a.cpu_only:
        res["bars"] = bars(res)
        print("\n".join(res["bars"]))
    lab.write_result(out.parent, res, out.name)
    if not a.cpu_only:
        try:
            plot(res, out.with_suffix(".png"))
        except ImportError:
            print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
