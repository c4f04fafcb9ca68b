"""Hidden-state pool on an accelerator: cost of one step's write and one hit's read, per tier.

torch-only (runs where vLLM is not installed, e.g. the lent GPU machine). For each tier
(``DEVICE``: pool in GPU memory; ``PINNED_HOST``: pool in pinned host memory) it times
``HiddenStateCache.write_request_rows`` for one prefill step of ``--tokens`` tokens at random
free slots and ``read_prefix`` of a ``--tokens``-token hit, for the Qwen3-Omni-30B-A3B thinker
width (2048, bf16) and three keys (final hidden, layer 0, accept_hidden_layer), with CUDA
events (median of ``--repeats``), and reports GB/s, the host time of the write (no host synchronisation on the forward path:
a pinned-host write only enqueues a device->host copy) and, for pinned host, the committer's
scatter time after the copy landed (off the forward path, in a background thread).

    python benchmarks/pool_gpu_bench.py --out benchmarks/results/pool_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from omni_cache.core import HiddenStateCache, KeySpec, Tier


def bench(tier: Tier, tokens: int, width: int, num_blocks: int, block_size: int, repeats: int) -> dict:
    dev = torch.device("cuda")
    keys = [KeySpec(k, width, torch.bfloat16) for k in ("hidden", "layer_0", "layer_24")]
    cache = HiddenStateCache(num_blocks, block_size, keys, device=dev if tier is Tier.DEVICE else "cpu", tier=tier)
    nb = tokens // block_size
    rows = {k.name: torch.randn(tokens, width, device=dev, dtype=torch.bfloat16) for k in keys}
    write_ms, read_ms, host_ms, commit_ms = [], [], [], []
    for r in range(repeats + 2):
        blocks = torch.randperm(num_blocks)[:nb].tolist()
        block_hashes = list(range(r * nb + 1, (r + 1) * nb + 1))
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        cache.write_request_rows(f"r{r}", blocks, 0, rows, dict(enumerate(block_hashes)))
        e.record()
        host = (time.perf_counter() - t0) * 1e3  # host time to enqueue (no sync if async)
        torch.cuda.synchronize()
        w = s.elapsed_time(e)
        t1 = time.perf_counter()
        for pool in cache.pools.values():
            pool.wait_pending()  # pinned host: the committer's scatter after the copy landed
        commit = (time.perf_counter() - t1) * 1e3
        s2, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s2.record()
        out = cache.read_prefix(f"r{r}", blocks, tokens, block_hashes, [k.name for k in keys], out_device=dev)
        e2.record()
        torch.cuda.synchronize()
        assert torch.equal(out["hidden"], rows["hidden"])
        if r >= 2:
            write_ms.append(w)
            read_ms.append(s2.elapsed_time(e2))
            host_ms.append(host)
            commit_ms.append(commit)
    nbytes = 3 * tokens * width * 2
    wm, rm = statistics.median(write_ms), statistics.median(read_ms)
    return {"tier": tier.name, "tokens": tokens, "width": width, "keys": 3, "bytes_per_step": nbytes,
            "pool_bytes": cache.nbytes, "write_ms_median": wm, "read_ms_median": rm,
            "write_GBps": nbytes / wm / 1e6, "read_GBps": nbytes / rm / 1e6,
            "host_enqueue_ms_median": statistics.median(host_ms),
            "commit_after_device_ms_median": statistics.median(commit_ms)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/pool_gpu.json")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "runs": [bench(t, a.tokens, a.width, a.num_blocks, a.block_size, a.repeats)
                    for t in (Tier.DEVICE, Tier.PINNED_HOST)]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    for r in res["runs"]:
        print(f"{r['tier']:12} write {r['write_ms_median']:.3f} ms ({r['write_GBps']:.0f} GB/s)  "
              f"read {r['read_ms_median']:.3f} ms ({r['read_GBps']:.0f} GB/s)  host enqueue {r['host_enqueue_ms_median']:.3f} ms  "
              f"commit after device {r['commit_after_device_ms_median']:.3f} ms")


if __name__ == "__main__":
    main()
