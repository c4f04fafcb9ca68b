"""Per-modality thinker prefill and TTFP of the multimodal KV-shared (YOCO) thinker:
{fast prefill off/on} x {omni-cache off/on}.

The embedded bench-size Gemma-4-style thinker (``omni-cache make-model --family gemma4 --size
bench``: hidden 768, 14 layers of which 8 KV-shared = 57 % like Gemma 4 E2B's 20 of 35, vision
tower 384 x 4 layers with 280 soft tokens per image, audio tower 384 x 4 layers) runs as stage
0 of the real streaming pipeline (``stage_configs/gemma4_yoco_cpu.yaml``: talker + code2wav of
the bench Qwen3-Omni) in the four variants of
:data:`omni_cache.driver.variants.YOCO_VARIANTS` — ``off`` (the slow path), ``fast``,
``omni_cache``, ``fast+omni_cache`` — through the prefill benchmark's harness
(:mod:`benchmarks.prefill.harness`: all pipelines up at once when memory allows, every request
sent to each variant in turn with the order rotated, idle pipelines frozen; else — as with
this bench model on a 24 GiB machine — one pipeline at a time, restarted every round in a
rotated order; several rounds; medians, spreads, JSON and a plot). Workloads
(:mod:`benchmarks.prefill.workloads`): ``text`` (a long shared document + a distinct
question), ``image`` / ``audio`` (``--media-copies`` items of the bundled photo / speech, each
copy its own content, + a distinct question; ``--modalities ...,floor`` adds the suffix-alone
reference). Per workload the summary states speedup(fast prefill),
speedup(cache), speedup(both) of the median thinker prefill vs ``off`` (and of TTFP), and the
bar: at h >= 0.9, speedup(both) >= 0.9 x speedup(cache) x speedup(fast prefill)
(:func:`benchmarks.prefill.summary.yoco_checks`).

    .venv/bin/python -m benchmarks.yoco_bench              # = --requests 3 --repeats 2 --modalities text,image,audio

Any other ``omni-cache bench prefill`` option passes through (``--alternation``,
``--prefix-words``, ...). Writes ``benchmarks/results/<name>/result.json`` and ``prefill.png``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "stage_configs" / "gemma4_yoco_cpu.yaml"
DEFAULTS = {"--variants": "off,fast,omni_cache,fast+omni_cache", "--modalities": "text,image,audio",
            "--stage-config": str(CONFIG), "--media-copies": "6", "--requests": "3", "--repeats": "2"}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.prefill import harness
    from omni_cache.models_gemma import default_gemma_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    size = "bench"
    if "--size" in argv:
        size = argv[argv.index("--size") + 1]
        del argv[argv.index("--size"):argv.index("--size") + 2]
    if "--model" not in argv:
        # built in a child process (importing torch here would grow this driver process, which
        # stays up next to the pipelines)
        subprocess.run([sys.executable, "-m", "omni_cache.cli", "make-model", "--family", "gemma4", "--size", size],
                       check=True)
        argv += ["--model", str(default_gemma_dir(size, family="gemma4"))]
    for k, v in DEFAULTS.items():
        if k not in argv:
            argv += [k, v]
    if "--name" not in argv:
        import time

        argv += ["--name", time.strftime(f"yoco-gemma4-{size}-%Y%m%d-%H%M%S")]
    return harness.main(argv)


if __name__ == "__main__":
    sys.exit(main())
