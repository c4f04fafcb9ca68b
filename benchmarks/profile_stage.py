"""Where a stage's prefill time goes: py-spy on one stage (default the thinker) of a bench pipeline, per workload.

One pipeline of ``--variant`` (``uni`` executor: the model runner in the engine core) serves
``--requests`` per workload while py-spy records ``--stage``'s engine core; :func:`split_samples`
splits the model-runner samples (omni-cache's work, model forward, ``compute_logits``, leaves).

    .venv/bin/python -m benchmarks.profile_stage --workloads miss --variant omni_cache --requests 8
    .venv/bin/python -m benchmarks.profile_stage --stage-config stage_configs/gemma4_yoco_cpu.yaml \\
        --variant fast+omni_cache --workloads image,floor --media-copies 6 --requests 6

With ``--concurrency c`` (> 1) each workload's requests run as one closed loop of c senders
(as ``benchmarks.prefill``'s), recorded as one profile: where a stage's time goes under load.

With ``--stalls`` py-spy also samples idle threads (``--idle --threads``: a thread blocked in a
CUDA sync or a lock counts), and the result lists, for every request whose prefill took over
:data:`STALL_FACTOR` x its workload's median, the heaviest stacks recorded while it ran
(:func:`heaviest_stacks`): what a ~1 s stall was doing.

Writes ``<out>/profile-<variant>-stage<N>[-c<c>].json`` and the raw stacks beside it.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import lab

#: the runner's cache methods (omni_cache/engine/runner.py); omni_cache/core counts whole
CACHE_METHODS = {"new_step_starts", "save_outputs", "materialize", "_tags", "_ensure_cache",
                 "_restart_resumed_payloads", "_publish_metrics", "discard_step"}


#: a request is a stall when its prefill exceeds this many times its workload's median (the
#: at-size issue's spike: over 1.5 x the variant's p50 TTFT)
STALL_FACTOR = 1.5


def heaviest_stacks(raw: str, top: int = 8, depth: int = 8) -> list[dict]:
    """The ``top`` stacks with the most samples in py-spy's raw output, each cut to its
    innermost ``depth`` frames (thread frames kept first) — ``[{"samples": n, "stack": [...]}]``."""
    by: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        head = [f for f in frames[:1] if f.startswith(("thread", "process"))]
        by[tuple(head + frames[len(head):][-depth:])] += int(n)
    return [{"samples": n, "stack": list(k)} for k, n in by.most_common(top)]


def stalls(prefill_ms: list, raws: list[str], factor: float = STALL_FACTOR) -> list[dict]:
    """Requests whose prefill took over ``factor`` x the median of ``prefill_ms`` (ms, one per
    request, ``None`` where unknown), with the heaviest stacks of their raw profile (``raws``,
    one per request, same order)."""
    known = [v for v in prefill_ms if v is not None]
    med = lab.stat(known)
    if not med:
        return []
    return [{"index": i, "prefill_ms": v, "median_ms": med, "stacks": heaviest_stacks(r)}
            for i, (v, r) in enumerate(zip(prefill_ms, raws)) if v is not None and v > factor * med]


def _func(frame: str) -> str:
    return frame.split(" (")[0].split(".")[-1]


def split_samples(raw: str) -> dict:
    """Shares of py-spy's raw collapsed stacks (``frame;frame;... count`` lines)."""
    total = step = cache = forward = logits = 0
    leaves: collections.Counter = collections.Counter()
    mine_leaves: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(n)
        total += n
        if not any(_func(f) in ("execute_model", "sample_tokens") for f in frames):
            continue
        step += n
        leaves[frames[-1].split(" (")[0] + " (" + frames[-1].split(" (")[-1].split("/")[-1]] += n
        mine = [f for f in frames if "(omni_cache/core/" in f
                or ("(omni_cache/engine/runner.py" in f and _func(f) in CACHE_METHODS)]
        if mine:
            cache += n
            mine_leaves[[f for f in frames if "(omni_cache/" in f][-1].split(" (")[0]] += n
        forward += n if any(_func(f) == "_model_forward" for f in frames) else 0
        logits += n if any(_func(f) == "compute_logits" for f in frames) else 0
    share = (lambda x: x / step) if step else (lambda x: 0.0)
    return {"samples": total, "step_samples": step, "omni_cache_samples": cache,
            "omni_cache_share": share(cache), "model_forward_share": share(forward),
            "compute_logits_share": share(logits), "omni_cache_leaf_frames": dict(mine_leaves.most_common(10)),
            "leaf_frames": {k: round(share(v), 4) for k, v in leaves.most_common(25)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage-config", default=str(lab.BASE_CONFIG))
    ap.add_argument("--model", help="model directory (default: the stage config's embedded model of --model-size)")
    ap.add_argument("--model-size", default="bench", help="embedded model size (Qwen3-Omni: bench, bench-voice)")
    ap.add_argument("--stage", type=int, default=0, help="stage id to record (0 thinker, 1 talker, 2 code2wav)")
    ap.add_argument("--variant", default="omni_cache", help="a benchmark variant (omni_cache.driver.variants)")
    ap.add_argument("--workloads", default="miss", help="comma-separated prefill-benchmark workloads")
    ap.add_argument("--requests", type=int, default=8, help="timed requests per workload")
    ap.add_argument("--media-copies", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=None,
                    help="thinker tokens per answer (default: the stage config's max_tokens): a decode to profile")
    ap.add_argument("--thinker-kv-mib", type=int, default=None, help="default 256 on the CPU, a GPU host's config's")
    ap.add_argument("--talker-kv-mib", type=int, default=None,
                    help="default 32 (bench-voice 256: ~9 KiB of KV a token) on the CPU, a GPU host's config's")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="c > 1: each workload as one closed loop of c senders, one profile (as benchmarks.prefill)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="every stage's (default 2 on the CPU, the stage config's on a GPU host; >= c)")
    ap.add_argument("--thinker-cache-only", action="store_true", help="no talker prefix cache (as benchmarks.prefill)")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--stalls", action="store_true", help="py-spy --idle --threads, and the heaviest stacks of "
                    f"each request whose prefill took over {STALL_FACTOR} x its workload's median")
    ap.add_argument("--out", default=str(lab.RESULTS), help="folder the profile files are written to")
    args = ap.parse_args()
    # PATH, this interpreter's bin, or a --target install's bin on sys.path (the offline bundle's
    # /tmp/site/bin: the ninth GPU session's first try found none of the others)
    spy = shutil.which("py-spy") or next(
        (str(c) for c in [Path(sys.executable).parent / "py-spy", *(Path(p) / "bin" / "py-spy" for p in sys.path if p)]
         if c.exists()), None)
    if spy is None:
        print("error: py-spy not found on PATH, beside this Python or in a bin/ of sys.path (pip install py-spy)",
              file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker inside the engine core
    import psutil

    from benchmarks.prefill.harness import base_max_num_seqs, capture_note, gpu_inventory, talker_cache
    from benchmarks.prefill.worker import VariantWorker
    from benchmarks.prefill.workloads import WorkloadOptions, specs, warmup_specs
    from omni_cache.driver.stage_config import load_stage_config
    from omni_cache.driver.variants import MemorySettings, variant_stage_config

    workloads = [w for w in args.workloads.split(",") if w]
    out = Path(args.out)
    if args.concurrency < 1:
        ap.error(f"--concurrency must be >= 1, got {args.concurrency}")
    c = args.concurrency
    tag = f"{args.variant}-stage{args.stage}" + (f"-c{c}" if c > 1 else "")
    work = out / f"profile-{tag}.d"
    gpu_host = bool(gpu_inventory())
    if graph_note := gpu_host and capture_note(args.max_num_seqs, base_max_num_seqs(args.stage_config)):
        print(f"note: {graph_note}", flush=True)
    thinker_mib = args.thinker_kv_mib or (None if gpu_host else 256)
    talker_mib = args.talker_kv_mib or (None if gpu_host else 256 if args.model_size == "bench-voice" else 32)
    talker = talker_cache(args.stage_config, args.variant, thinker_cache_only=args.thinker_cache_only)
    cfg = variant_stage_config(Path(args.stage_config), work, args.variant, mem=MemorySettings(
        thinker_kv_bytes=thinker_mib and thinker_mib << 20, talker_kv_bytes=talker_mib and talker_mib << 20,
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {"max_num_seqs": None} if gpu_host else {})),
        talker_prefix_caching=talker)
    family = "gemma4" if load_stage_config(args.stage_config).thinker_family == "gemma4" else "qwen3-omni"
    model = str(lab.model_dir(args.model_size, args.model, family=family))
    opts = WorkloadOptions(requests=args.requests, media_copies=args.media_copies, answer_tokens=args.answer_tokens)
    w = VariantWorker(model, str(cfg))
    fields = {"prefill_ms": "prefill_ms", "talker_prefill_ms": "talker_prefill_ms", "cached": "num_cached_tokens",
              "prompt": "num_prompt_tokens"}  # per workload: a list of each request's
    per: dict[str, dict] = {wl: {k: [] for k in ("raw", *fields)} for wl in workloads}

    def recorded(raw: Path, run):
        """``run()`` while py-spy records the stage's engine core into ``raw``."""
        rec = subprocess.Popen([spy, "record", "-p", str(target[0].pid), "-r", str(args.rate), "-f", "raw",
                                "-o", str(raw), "--nonblocking", *(["--idle", "--threads"] if args.stalls else [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(1.5)
        try:
            return run()
        finally:
            rec.send_signal(signal.SIGINT)
            rec.wait(120)

    def keep(wl: str, raw: Path, rows: list[dict]) -> None:
        per[wl]["raw"].append(raw.read_text() if raw.exists() else "")
        for r in rows:
            for k, field in fields.items():
                per[wl][k].append(r.get(field))

    try:
        if c == 1:
            for s in warmup_specs(workloads, opts):  # untimed: shared prefixes, first-request costs
                w.run_one(s)
        else:  # one untimed batch per workload at c: new batch sizes compile before the recording
            w.run_concurrent(warmup_specs(workloads, opts, concurrency=c), c)
        name = f"stage{args.stage}"
        if not (target := [p for p in psutil.Process().children(recursive=True) if name in p.name()]):
            print(f"error: no engine-core process of stage {args.stage} (name with {name!r}) found", file=sys.stderr)
            return 1
        if c > 1:
            for wl in workloads:
                raw = work / f"{wl}-c{c}.txt"
                batch = recorded(raw, lambda wl=wl: w.run_concurrent(specs(wl, 0, opts, concurrency=c), c))
                keep(wl, raw, batch["results"])
                per[wl]["throughput_rps"], per[wl]["n_errors"] = batch["throughput_rps"], batch["n_errors"]
                print(f"{wl} c={c}: {batch['n_requests']} requests, {batch['throughput_rps'] or 0:.2f} req/s, "
                      f"{batch['n_errors']} errors", flush=True)
        todo = list(zip(*[specs(wl, 0, opts) for wl in workloads])) if c == 1 else []
        for i, row in enumerate(todo):
            for s in row:
                raw = work / f"{s['workload']}-{i}.txt"
                r = recorded(raw, lambda s=s: w.run_one(s))
                keep(s["workload"], raw, [r])
                print(f"{s['workload']} {i + 1}/{len(todo)}: prefill {r.get('prefill_ms') or float('nan'):.0f} ms, "
                      f"{r.get('num_cached_tokens')}/{r.get('num_prompt_tokens')} tokens cached, talker prefill "
                      f"{r.get('talker_prefill_ms') or float('nan'):.0f} ms (hit {r.get('talker_hit_tokens')}/"
                      f"{r.get('talker_prompt_tokens')})", flush=True)
    finally:
        w.close()
    result = {**lab.stamp("benchmarks.profile_stage"), "variant": args.variant, "stage": args.stage,
              "concurrency": c, "talker_prefix_caching": talker, "stage_config": str(args.stage_config),
              "rate_hz": args.rate, **({"graph_note": graph_note} if graph_note else {}), "workloads": {}}
    for wl, d in per.items():
        raws = d.pop("raw")
        raw = "\n".join(raws)
        (out / f"profile-{tag}-{wl}.txt").write_text(raw)
        r = result["workloads"][wl] = {**d, "prefill_ms_median": lab.stat(d["prefill_ms"]),
                                       "talker_prefill_ms_median": lab.stat(d["talker_prefill_ms"]),
                                       **split_samples(raw)}
        if args.stalls and c == 1:
            r["stalls"] = stalls(d["prefill_ms"], raws)
            print(f"{wl}: {len(r['stalls'])} stalls (prefill > {STALL_FACTOR} x median)")
        print(f"{wl}: prefill median {r['prefill_ms_median'] or float('nan'):.0f} ms; of stage {args.stage}'s "
              f"model-runner samples: omni-cache {100 * r['omni_cache_share']:.1f} %, model forward "
              f"{100 * r['model_forward_share']:.1f} %, compute_logits {100 * r['compute_logits_share']:.1f} %")
    path = lab.write_result(out, result, f"profile-{tag}.json")
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {path} and the raw stacks beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
