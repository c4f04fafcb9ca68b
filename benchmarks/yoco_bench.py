"""Thinker prefill time of a KV-shared (YOCO) thinker: {fast prefill off/on} x {cache off/on}.

The embedded bench-size Gemma-3n-style thinker (hidden 512, 16 layers, 8 of them KV-shared
= 50 %, 3 sliding : 1 full attention, window 512) runs as stage 0 of the real pipeline
(``stage_configs/gemma3n_yoco_cpu.yaml``, talker + code2wav of the bench Qwen3-Omni) in four
variants, one pipeline process at a time (memory): fast prefill off/on x prefix caching with
omni-cache off/on. Workload: ``--prefix-tokens`` (default ~3,000) of shared system prompt,
then per request a distinct question; thinker ``max_tokens=2`` (the Qwen3-Omni talker needs
at least two thinker tokens) so prefill dominates. In each
variant a warm-up request with another prefix runs first (not measured), then the first
shared-prefix request (a miss everywhere: ``miss``), then ``--requests`` more (``hit`` rows;
hits only where the cache is on). Measured per request: vLLM's own thinker prefill time
(``vllm:request_prefill_time_seconds`` of stage 0, scheduled → first token, engine-core
clock) via :class:`benchmarks.prefill.worker.VariantWorker`.

Ratios (medians): ``speedup_fast`` = off/off ÷ on/off, ``speedup_cache`` = off/off ÷ off/on
(hit rows), ``speedup_both`` = off/off ÷ on/on (hit rows); ``both_vs_product`` =
speedup_both ÷ (speedup_fast × speedup_cache) — ≥ 0.9 means the two compose.

    /work/tools/with-slot --all .venv/bin/python -m benchmarks.yoco_bench --requests 6 --repeats 2

Writes ``benchmarks/results/yoco-<stamp>/result.json`` (+ the stage configs and logs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "stage_configs" / "gemma3n_yoco_cpu.yaml"
VARIANTS = [(f, c) for f in ("off", "on") for c in ("off", "on")]
WORDS = ("river bridge harbour lantern meadow copper violet engine quiet signal orchard "
         "granite pepper saddle thunder marble willow canvas").split()


def _text(n_chars: int, seed: int) -> str:
    out, i = [], seed
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(WORDS[(i * 7 + len(out) * 3) % len(WORDS)])
        i += 1
    return " ".join(out) + "."


def _stage_config(out_dir: Path, fast: str, cache: str) -> Path:
    from omni_cache.driver.variants import derive_stage_config

    return derive_stage_config(
        CONFIG, out_dir / f"stage_config_fast-{fast}_cache-{cache}.yaml",
        stages={0: {"kv_sharing_fast_prefill": fast == "on", "enable_prefix_caching": cache == "on"}},
        sampling={0: {"max_tokens": 2},  # the talker needs >= 2 thinker tokens
                  1: {"max_tokens": 4}})


def _specs(args) -> list[dict]:
    prefix = _text(args.prefix_tokens, 1)  # the byte-level tokenizer: ~1 token per character
    other = _text(args.prefix_tokens, 5)
    specs = [{"workload": "warmup", "index": 0, "system": other, "text": "Warm up.", "max_tokens": 2,
              "measure": False}]
    for i in range(args.requests + 1):
        specs.append({"workload": "miss" if i == 0 else "hit", "index": i, "system": prefix,
                      "text": f"Question {i}: {_text(args.suffix_tokens, 100 + i)}", "max_tokens": 2})
    return specs


def _run_variant(args) -> int:
    """Child process: start one pipeline, run the workload ``--repeats`` times, print JSON."""
    from benchmarks.prefill.worker import VariantWorker

    w = VariantWorker(args.model, args.stage_config, stream_thinker=False)
    rows = []
    try:
        for rep in range(args.repeats):
            for spec in _specs(args):
                spec = dict(spec, round=rep)
                if rep > 0:  # a fresh shared prefix per repeat, so its first request misses again
                    spec["system"] = _text(args.prefix_tokens, 1 + 17 * rep) if spec["workload"] != "warmup" \
                        else _text(args.prefix_tokens, 5 + 17 * rep)
                rows.append(w.run_one(spec))
    finally:
        w.close()
    print("@@ROWS " + json.dumps({"start_s": w.start_s, "rows": rows}), flush=True)
    return 0


def _median(rows, workload):
    v = [r["prefill_ms"] for r in rows if r["workload"] == workload and r.get("prefill_ms") is not None]
    return statistics.median(v) if v else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6, help="hit requests per repeat (after the miss)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=3000)
    ap.add_argument("--suffix-tokens", type=int, default=100)
    ap.add_argument("--size", default="bench", choices=("tiny", "bench"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--order", default="forward", choices=("forward", "reverse"),
                    help="variant order (check run-order drift)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--stage-config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _run_variant(args)

    from omni_cache.models_gemma import build_gemma_omni, default_gemma_dir

    model = build_gemma_omni(default_gemma_dir(args.size), args.size)
    out = Path(args.out) / time.strftime("yoco-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("child", "model", "stage_config")},
              "model": str(model), "variants": {}}
    order = VARIANTS if args.order == "forward" else VARIANTS[::-1]
    for fast, cache in order:
        name = f"fast-{fast}_cache-{cache}"
        cfg = _stage_config(out, fast, cache)
        cmd = [sys.executable, "-m", "benchmarks.yoco_bench", "--child", "--model", str(model),
               "--stage-config", str(cfg), "--requests", str(args.requests), "--repeats", str(args.repeats),
               "--prefix-tokens", str(args.prefix_tokens), "--suffix-tokens", str(args.suffix_tokens)]
        print(f"== {name}", flush=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        (out / f"log_{name}.txt").write_text(proc.stdout + proc.stderr)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@ROWS ")), None)
        if proc.returncode or line is None:
            print(f"{name} failed (rc {proc.returncode}); see {out / f'log_{name}.txt'}", file=sys.stderr)
            return 1
        data = json.loads(line[len("@@ROWS "):])
        rows = [r for r in data["rows"] if r.get("measure", True)]
        errs = [r["error"] for r in rows if r.get("error")]
        if errs:
            print(f"{name}: request errors {errs[:2]}", file=sys.stderr)
            return 1
        v = {"start_s": data["start_s"], "rows": rows,
             "miss_prefill_ms": _median(rows, "miss"), "hit_prefill_ms": _median(rows, "hit"),
             "all_prefill_ms": statistics.median([r["prefill_ms"] for r in rows if r.get("prefill_ms") is not None]),
             "hit_ratio": statistics.median([r["hit_ratio"] for r in rows if r["workload"] == "hit"])}
        result["variants"][name] = v
        print(f"   miss {v['miss_prefill_ms']:.1f} ms, hit-row {v['hit_prefill_ms']:.1f} ms, "
              f"hit ratio {v['hit_ratio']:.3f}", flush=True)
    V = result["variants"]
    slow = V["fast-off_cache-off"]["all_prefill_ms"]
    fast = V["fast-on_cache-off"]["all_prefill_ms"]
    cache = V["fast-off_cache-on"]["hit_prefill_ms"]
    both = V["fast-on_cache-on"]["hit_prefill_ms"]
    sf, sc, sb = slow / fast, slow / cache, slow / both
    result["summary"] = {
        "slow_ms": slow, "fast_ms": fast, "cache_hit_ms": cache, "both_hit_ms": both,
        "speedup_fast": sf, "speedup_cache": sc, "speedup_both": sb,
        "product": sf * sc, "both_vs_product": sb / (sf * sc), "composes": sb >= 0.9 * sf * sc,
        "ideal_cache_speedup": 1 / (1 - V["fast-off_cache-on"]["hit_ratio"]),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
