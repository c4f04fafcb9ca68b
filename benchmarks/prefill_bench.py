"""Thinker prefill time: cache off vs vLLM-Omni's built-in cache vs omni-cache, side by side.

Each variant runs in its own pipeline process (same model, same stage config except the
thinker's prefix-cache setting). With ``--concurrent`` all variants are up at once and every
round sends the same prompts to each variant in turn (alternating, order rotated per round);
by default (2 cores / 24 GiB cannot hold three bench-size pipelines: 9 stage processes
exhausted the memory) the variants run one after another, each for ``--repeats`` rounds;
reported: median and spread of the thinker's generation time (``stage_0_gen_ms``, thinker
``max_tokens: 2``: prefill plus one decode step), hit ratio h = cached / prompt tokens, speedup vs off
and its ratio to the ideal 1/(1-h).

Workloads: ``miss`` — every prompt has a distinct opening (no shared block), so every
request is a miss; ``shared`` — one long shared prefix + a short distinct suffix (the
prefix is warmed once per variant before timing).

    python -m benchmarks.prefill_bench --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("off", "builtin", "omni_cache")
WORDS = ("river stone cloud lantern meadow copper violin harbor orchard falcon ember "
         "glacier canyon thistle marble compass willow saffron beacon tundra").split()


def stage_config(out: Path, variant: str) -> Path:
    raw = yaml.safe_load((REPO / "stage_configs" / "qwen3_omni_cpu.yaml").read_text())
    s0, s1 = raw["stages"][0], raw["stages"][1]
    # thinker time = prefill + one decode step (max_tokens 1 breaks vLLM-Omni's talker hand-off:
    # "size of tensor a (8) must match b (9)")
    s0["default_sampling_params"]["max_tokens"] = 2
    s1["default_sampling_params"]["max_tokens"] = 4
    s0["max_num_batched_tokens"] = 8192
    s0["kv_cache_memory_bytes"] = 1 << 30
    if variant == "off":
        s0["enable_prefix_caching"] = False
    else:
        s0["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] = variant
        s0["env"]["OMNI_CACHE_METRICS_DIR"] = str(out / f"metrics_{variant}")
    for s in raw["stages"]:  # three pipelines share two cores
        s["env"]["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
    p = out / f"stage_config_{variant}.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13 + (i * i) % 17) % len(WORDS)] for i in range(n_words))


def chat(body: str) -> str:
    return f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


class Variant:
    def __init__(self, name: str, model: str, cfg: Path, log: Path):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.variant_worker", "--model", model, "--stage-config", str(cfg)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.log = open(log, "w")

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@RESULT "):
                return json.loads(line[len("@@RESULT "):])
            self.log.write(line)
        raise RuntimeError(f"variant {self.name} exited (rc={self.proc.wait()}); see its log")

    def run(self, prompts: list[str]) -> list[dict]:
        self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        return self.read()["results"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)
        except Exception:
            self.proc.kill()


def summarize(samples: dict[str, list[dict]]) -> dict:
    out = {}
    for v, rows in samples.items():
        t = [r["thinker_ms"] for r in rows]
        h = [r["num_cached_tokens"] / r["num_prompt_tokens"] for r in rows]
        out[v] = {
            "thinker_ms_median": statistics.median(t),
            "thinker_ms_min": min(t), "thinker_ms_max": max(t),
            "wall_s_median": statistics.median(r["wall_s"] for r in rows),
            "hit_ratio_median": statistics.median(h),
            "num_prompt_tokens_median": statistics.median(r["num_prompt_tokens"] for r in rows),
            "n": len(rows),
        }
    off = out["off"]["thinker_ms_median"]
    for v, s in out.items():
        s["speedup_vs_off"] = off / s["thinker_ms_median"]
        h = s["hit_ratio_median"]
        s["ideal_speedup"] = 1.0 / (1.0 - h) if h < 1 else float("inf")
        s["fraction_of_ideal"] = s["speedup_vs_off"] / s["ideal_speedup"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: build the 'bench' size)")
    ap.add_argument("--size", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--requests", type=int, default=5, help="prompts per workload per round")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix-words", type=int, default=400, help="shared prefix length in words (~7 byte-level tokens each)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--concurrent", action="store_true", help="all variants up at once, requests alternated")
    ap.add_argument("--order", help="variant order, e.g. omni_cache,builtin,off (sequential mode: checks run-order drift)")
    args = ap.parse_args()

    from omni_cache.models import build_qwen3_omni, default_model_dir

    out = Path(args.out) / time.strftime("prefill-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build_qwen3_omni(default_model_dir(args.size), args.size))
    shared = text(args.prefix_words, 1)
    workloads = {
        "miss": lambda r, i: chat(f"{text(8, 1000 * r + i + 7)}. " + text(args.prefix_words, 50 + r * 31 + i)),
        "shared": lambda r, i: chat(shared + f" Question {r}-{i}: " + text(12, 900 + 37 * r + i)),
    }
    samples = {w: {v: [] for v in VARIANTS} for w in workloads}
    starts: dict[str, float] = {}
    order = args.order.split(",") if args.order else list(VARIANTS)
    if sorted(order) != sorted(VARIANTS):
        ap.error(f"--order must name each of {VARIANTS} once")
    groups = [order] if args.concurrent else [[v] for v in order]
    bar = tqdm(total=len(workloads) * args.repeats * len(VARIANTS), desc="rounds x variants")
    for names in groups:
        print(f"starting pipeline(s) {', '.join(names)} on {model} ...", flush=True)
        variants = [Variant(v, model, stage_config(out, v), out / f"log_{v}.txt") for v in names]
        try:
            starts.update({v.name: v.read()["start_s"] for v in variants})
            for v in variants:  # warm the shared prefix (and the engine) once per variant
                v.run([chat(shared + " warm-up")])
            for r in range(args.repeats):
                for w, make in workloads.items():
                    prompts = [make(r, i) for i in range(args.requests)]
                    order = variants[r % len(variants):] + variants[: r % len(variants)]
                    for v in order:
                        samples[w][v.name].extend(v.run(prompts))
                        bar.update(1)
        finally:
            for v in variants:
                v.close()
    bar.close()
    result = {
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count()},
        "versions": _versions(),
        "git_commit": _git_commit(),
        "model": model, "args": vars(args), "pipeline_start_s": starts,
        "workloads": {w: summarize(s) for w, s in samples.items()},
        "samples": samples,
        "omni_cache_metrics": [json.loads(p.read_text()) for p in (out / "metrics_omni_cache").glob("*.json")],
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'workload':8} {'variant':11} {'thinker ms':>11} {'h':>6} {'speedup':>8} {'ideal':>7} {'of ideal':>8}")
    for w, s in result["workloads"].items():
        for v, m in s.items():
            print(f"{w:8} {v:11} {m['thinker_ms_median']:11.1f} {m['hit_ratio_median']:6.3f} "
                  f"{m['speedup_vs_off']:8.2f} {m['ideal_speedup']:7.2f} {m['fraction_of_ideal']:8.2f}")
    print(f"wrote {out / 'result.json'}")
    return 0


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "vllm-cpu", "vllm-omni", "omni-cache")}


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True).strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
