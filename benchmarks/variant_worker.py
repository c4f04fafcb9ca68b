"""One benchmark variant's pipeline in its own process (driven by benchmarks/prefill_bench.py).

Reads JSON commands from stdin, one per line: ``{"prompts": [str, ...]}`` sends the prompts
one request at a time and answers ``@@RESULT {...}`` on stdout with per-request timings;
``{"quit": true}`` stops the pipeline. Lines without the ``@@RESULT`` prefix are engine logs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--stage-config", required=True)
    args = ap.parse_args()
    from omni_cache.vllm_omni.pipeline import OmniPipeline

    pipe = OmniPipeline(args.model, args.stage_config)
    print("@@RESULT " + json.dumps({"ready": True, "start_s": pipe.start_s}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        out = []
        for p in cmd["prompts"]:
            t0 = time.perf_counter()
            (r,) = pipe.generate([{"prompt": p}])
            out.append({
                "wall_s": time.perf_counter() - t0,
                "thinker_ms": r.stage_durations.get("stage_0_gen_ms"),
                "stage_ms": r.stage_durations,
                "num_prompt_tokens": r.num_prompt_tokens,
                "num_cached_tokens": r.num_cached_tokens,
                "error": r.error,
            })
        print("@@RESULT " + json.dumps({"results": out}), flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
