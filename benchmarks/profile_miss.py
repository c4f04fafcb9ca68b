"""Where a thinker miss spends its time: py-spy on the thinker of one bench pipeline.

Starts one pipeline of ``--variant`` (the benchmark's stage config: ``uni`` executor, so the
model runner runs inside the thinker's engine-core process), sends two untimed misses, then
records that process with py-spy (``--rate`` Hz, raw collapsed stacks) while it serves
``--requests`` misses of the benchmark's ``miss`` workload (~3k tokens each), and splits the
samples taken inside ``execute_model`` / ``sample_tokens``: omni-cache's cache work (frames of
``omni_cache/core`` or the runner's cache methods), the model forward, ``compute_logits``.

    .venv/bin/python -m benchmarks.profile_miss --variant omni_cache --requests 8

Writes ``<out>/profile-miss-<variant>.json`` (shares, sample counts, request times) and the
raw stacks ``<out>/profile-miss-<variant>.txt``. Needs ``py-spy`` (installed by the setup).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: the runner's cache methods (omni_cache/engine/runner.py); omni_cache/core counts whole
CACHE_METHODS = {"new_step_starts", "save_outputs", "materialize", "_tags", "_ensure_cache",
                 "_restart_resumed_payloads", "_publish_metrics", "discard_step"}


def _func(frame: str) -> str:
    return frame.split(" (")[0].split(".")[-1]


def split_samples(raw: Path) -> dict:
    """Shares of py-spy's raw collapsed stacks (``frame;frame;... count`` lines)."""
    total = step = cache = forward = logits = 0
    leaves: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(n)
        total += n
        if not any(_func(f) in ("execute_model", "sample_tokens") for f in frames):
            continue
        step += n
        mine = [f for f in frames if "(omni_cache/core/" in f
                or ("(omni_cache/engine/runner.py" in f and _func(f) in CACHE_METHODS)]
        if mine:
            cache += n
            leaves[[f for f in frames if "(omni_cache/" in f][-1].split(" (")[0]] += n
        forward += n if any(_func(f) == "_model_forward" for f in frames) else 0
        logits += n if any(_func(f) == "compute_logits" for f in frames) else 0
    share = (lambda x: x / step) if step else (lambda x: 0.0)
    return {"samples": total, "step_samples": step, "omni_cache_samples": cache,
            "omni_cache_share": share(cache), "model_forward_share": share(forward),
            "compute_logits_share": share(logits), "omni_cache_leaf_frames": dict(leaves.most_common(10))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="omni_cache", choices=["off", "builtin", "omni_cache"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("error: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker inside the engine core
    import psutil

    from omni_cache.driver.variants import MemorySettings, variant_stage_config
    from benchmarks.prefill.workloads import WorkloadOptions, specs
    from omni_cache.driver.inputs import build_request
    from omni_cache.models import build_qwen3_omni, default_model_dir
    from omni_cache.driver.pipeline import OmniPipeline

    out = Path(args.out)
    work = out / f"profile-miss-{args.variant}.d"
    cfg = variant_stage_config(REPO / "stage_configs" / "qwen3_omni_cpu.yaml", work, args.variant, mem=MemorySettings())
    model = build_qwen3_omni(default_model_dir("bench"), "bench")
    raw = out / f"profile-miss-{args.variant}.txt"
    times = []
    with OmniPipeline(model, cfg) as pipe:
        for s in specs("miss", 99, WorkloadOptions(requests=2)):  # untimed: first-request costs
            pipe.generate([build_request(s["text"], system=s["system"])])
        thinker = [p for p in psutil.Process().children(recursive=True) if "stage0" in p.name()]
        if not thinker:
            print("error: no thinker engine-core process (name with 'stage0') found", file=sys.stderr)
            return 1
        rec = subprocess.Popen([spy, "record", "-p", str(thinker[0].pid), "-r", str(args.rate), "-f", "raw",
                                "-o", str(raw), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(2)
        for i, s in enumerate(specs("miss", 0, WorkloadOptions(requests=args.requests))):
            t0 = time.perf_counter()
            (r,) = pipe.generate([build_request(s["text"], system=s["system"])])
            times.append({"e2e_s": time.perf_counter() - t0, "prompt_tokens": r.num_prompt_tokens,
                          "cached_tokens": r.num_cached_tokens})
            print(f"miss {i + 1}/{args.requests}: {times[-1]['e2e_s']:.2f} s, {r.num_prompt_tokens} tokens", flush=True)
        rec.send_signal(signal.SIGINT)
        rec.wait(120)
    result = {"variant": args.variant, "requests": times, "rate_hz": args.rate, **split_samples(raw)}
    path = out / f"profile-miss-{args.variant}.json"
    path.write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    print(f"omni-cache share of the thinker's model-runner time: {100 * result['omni_cache_share']:.2f} % "
          f"({result['omni_cache_samples']} of {result['step_samples']} samples); model forward "
          f"{100 * result['model_forward_share']:.1f} %, compute_logits {100 * result['compute_logits_share']:.1f} %")
    print(f"wrote {path} and {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
