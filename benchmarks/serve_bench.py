"""vLLM-Omni's own serving benchmark (``vllm-omni bench serve --omni``) against ``omni-cache serve``:
omni-cache on vs the thinker's prefix cache off, streaming.

The tool's ``prefix_repetition`` dataset against a fresh server per variant (``on`` / ``off``:
:func:`benchmarks.lab.prefix_cache_variant`), ``--cycles`` rotations of ``--order``; the tool's
JSON is kept, ``result.json`` has its :data:`HEADLINE` figures per variant and off / on ratios.
docs/serving.md, "vLLM-Omni's own serving benchmark".

    .venv/bin/python -m benchmarks.serve_bench --model-size bench --num-prompts 24 --max-concurrency 4
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import lab
from omni_cache.driver.realtime import prefix_cache_counters

#: the tool's headline figures compared between variants (ms unless named otherwise)
HEADLINE = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_audio_ttfp_ms", "p90_audio_ttfp_ms",
            "p99_audio_ttfp_ms", "median_e2el_ms", "p99_e2el_ms", "request_throughput", "median_audio_rtf")


def tool_command(args, base_url: str, model_name: str, tokenizer: Path, result_dir: Path, filename: str) -> list[str]:
    """The ``vllm-omni bench serve --omni`` command line for one run (list of argv strings)."""
    exe = Path(sys.executable).with_name("vllm-omni")
    return [str(exe), "bench", "serve", "--omni", "--backend", "openai-chat-omni", "--endpoint", "/v1/chat/completions",
            "--base-url", base_url.removesuffix("/v1"), "--model", model_name, "--tokenizer", str(tokenizer),
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
            str(args.num_prefixes), "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--num-warmups", "1", "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,e2el,audio_ttfp,audio_rtf", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename]


def _run_variant(args, variant: str, cycle: int, model_dir: Path, out_dir: Path) -> dict:
    cfg = lab.prefix_cache_variant(args.stage_config, out_dir, variant)
    filename = f"vllm-omni-bench-{variant}-{cycle}.json"
    with lab.start("server", model_dir, cfg, log=out_dir / f"server-{variant}-{cycle}.log",
                   label=f"{variant} #{cycle}") as srv:
        print(f"[{variant} #{cycle}] running vllm-omni bench serve", flush=True)
        cmd = tool_command(args, srv.base_url, srv.model_name(), model_dir, out_dir, filename)
        log = out_dir / f"tool-{variant}-{cycle}.log"
        with open(log, "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=out_dir,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        counters = prefix_cache_counters(srv.url)
    if rc != 0:
        raise RuntimeError(f"vllm-omni bench serve failed (rc={rc}) for {variant} #{cycle}; see {log}")
    tool = json.loads((out_dir / filename).read_text())
    hits = {f"vllm:prefix_cache_{k}_total": counters.get(f"{k}_0", 0.0) for k in ("hits", "queries")}
    return {"variant": variant, "cycle": cycle, "ready_s": srv.ready_s, "exit_code": srv.exit_code, "command": cmd,
            "tool_result_file": filename, "stage0_prefix_cache": hits, "headline": {k: tool.get(k) for k in HEADLINE},
            "completed": tool.get("completed"), "failed": tool.get("failed", 0)}


def summarize(runs: list[dict]) -> dict:
    """Per variant: the median over cycles of each headline figure and the thinker's prefix hit
    ratio (``/metrics`` stage 0, warm-up included); ``off_over_on``: off / on for every figure
    (> 1: omni-cache faster; for ``request_throughput`` < 1 means omni-cache serves more)."""
    out: dict = {}
    for v in sorted({r["variant"] for r in runs}):
        rs = [r for r in runs if r["variant"] == v]
        fig = {k: lab.stat([r["headline"].get(k) for r in rs]) for k in HEADLINE}
        q = sum(r["stage0_prefix_cache"].get("vllm:prefix_cache_queries_total", 0.0) for r in rs)
        h = sum(r["stage0_prefix_cache"].get("vllm:prefix_cache_hits_total", 0.0) for r in rs)
        out[v] = {**fig, "thinker_hit_ratio": h / q if q else 0.0, "completed": sum(r["completed"] or 0 for r in rs),
                  "failed": sum(r["failed"] or 0 for r in rs)}
    if "on" in out and "off" in out:
        out["off_over_on"] = {k: out["off"][k] / out["on"][k] for k in HEADLINE
                              if out["on"].get(k) and out["off"].get(k)}
    return out


def plot(summary: dict, path: Path, title: str) -> Path:
    with lab.figure(path, 1, 2, figsize=(9, 3.6), title=title, title_size=9) as (fig, axes):
        for ax, metric in zip(axes, ("ttft", "audio_ttfp")):
            keys = [f"median_{metric}_ms", f"p90_{metric}_ms", f"p99_{metric}_ms"]
            for j, v in enumerate(("off", "on")):
                vals = [(summary.get(v) or {}).get(k) or 0.0 for k in keys]
                bars = ax.bar([i + 0.38 * j for i in range(3)], vals, width=0.38, label=v,
                              color="#888888" if v == "off" else "#dd8452")
                for b, x in zip(bars, vals):
                    ax.text(b.get_x() + b.get_width() / 2, x, f"{x:.0f}", ha="center", va="bottom", fontsize=7)
            ax.set_xticks([i + 0.19 for i in range(3)], ["p50", "p90", "p99"])
            ax.set_title({"ttft": "TTFT (text), ms", "audio_ttfp": "TTFP (first audio packet), ms"}[metric], fontsize=9)
            ax.legend(fontsize=7)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = lab.parser(__doc__, "serve-bench")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=1536, help="shared prefix tokens (prefix_repetition)")
    ap.add_argument("--suffix-len", type=int, default=32, help="distinct suffix tokens per prompt")
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=16, help="thinker output tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", default="on,off", help="variant order in the first cycle (rotated per cycle)")
    ap.add_argument("--cycles", type=int, default=1)
    args = ap.parse_args(argv)

    model_dir = lab.model_dir(args.size, args.model)
    out_dir = lab.results_dir(args.out, "serve-bench")
    order = [v.strip() for v in args.order.split(",")]
    runs = []
    for cycle in range(args.cycles):
        for variant in lab.rotate(order, cycle):
            runs.append(_run_variant(args, variant, cycle, model_dir, out_dir))
            print(f"[{variant} #{cycle}] " + ", ".join(f"{k} {v:.1f}" for k, v in runs[-1]["headline"].items()
                                                      if isinstance(v, (int, float))), flush=True)
    summary = summarize(runs)
    result = {"benchmark": "serve_bench (vllm-omni bench serve --omni)", **lab.stamp("benchmarks.serve_bench", argv),
              "model": str(model_dir), "args": lab.jsonable(args), "summary": summary, "runs": runs}
    lab.write_result(out_dir, result, show=summary, also=[out_dir / "serve_bench.png"])
    plot(summary, out_dir / "serve_bench.png",
         f"vllm-omni bench serve --omni, prefix_repetition {args.prefix_len}+{args.suffix_len} tokens, "
         f"{args.num_prompts} prompts, concurrency {args.max_concurrency}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
