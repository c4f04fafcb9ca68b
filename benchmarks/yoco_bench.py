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
    .venv/bin/python -m benchmarks.yoco_bench --paired --modalities image,floor --repeats 3

``--paired``: the bar is a ratio of two ratios, both / (fast x cache) = (omni_cache /
fast+omni_cache) / (off / fast): fast prefill's gain on a hit over its gain on a miss. When the
four pipelines do not fit beside each other, ``--paired`` measures each of those two ratios
side by side instead of across restarted pipelines: one harness run of ``off`` and ``fast``,
then one of ``omni_cache`` and ``fast+omni_cache`` (each pair up at once, requests alternated
— two bench pipelines fit in 24 GiB where four do not), written as ``<name>-miss`` and
``<name>-hit``; the two runs' samples are then summarized together into ``<name>``
(``result.json`` with both runs' paths, ``prefill.png``). The composition is exactly the
product of the two in-run ratios (the medians of ``off`` cancel); speedup(cache) and
speedup(both) alone set one run's medians against the other's (reported, no bar on them).

Any other ``python -m benchmarks.prefill`` option passes through (``--alternation``,
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


def _opt(argv: list[str], key: str) -> str:
    return argv[argv.index(key) + 1]


def _set(argv: list[str], key: str, value: str) -> list[str]:
    out = list(argv)
    if key in out:
        out[out.index(key) + 1] = value
    else:
        out += [key, value]
    return out


def paired(argv: list[str]) -> int:
    """Run the miss pair and the hit pair (see the module doc) and summarize them together.

    Returns the harness's exit code (non-zero if either run failed or was incomplete)."""
    from benchmarks.prefill import harness

    name, root = _opt(argv, "--name"), Path(_opt(argv, "--out")) if "--out" in argv else REPO / "benchmarks" / "results"
    runs = {"miss": "off,fast", "hit": "omni_cache,fast+omni_cache"}
    for tag, variants in runs.items():
        print(f"== {tag} pair: {variants}", flush=True)
        rc = harness.main(_set(_set(argv, "--variants", variants), "--name", f"{name}-{tag}"))
        if rc:
            return rc
    return combine_pairs(root, name, list(runs))


def combine_pairs(root: Path, name: str, tags: list[str]) -> int:
    """Summarize the runs ``<root>/<name>-<tag>/result.json`` together into ``<root>/<name>/``
    (``result.json``, ``prefill.png``) and print the table; returns 0.

    Raises:
        FileNotFoundError: a run's ``result.json`` is missing."""
    import json

    from benchmarks.prefill import summary as S

    parts = {tag: json.loads((root / f"{name}-{tag}" / "result.json").read_text()) for tag in tags}
    samples: dict[str, dict[str, list]] = {}
    for r in parts.values():
        for w, by_variant in r["samples"].items():
            samples.setdefault(w, {}).update(by_variant)
    summ = {w: S.summarize_workload(by_variant) for w, by_variant in samples.items()}
    S.add_attainable(summ)
    checks = {w: S.yoco_checks(w, summ[w]) for w in summ if w in ("text", "image", "audio", "chat")}
    for (c,) in checks.values():
        if c.get("speedup_fast") and c.get("speedup_cache"):
            c["hit_gain_fast"] = c["speedup_both"] / c["speedup_cache"]  # omni_cache / fast+omni_cache, hit pair
            c["miss_gain_fast"] = c["speedup_fast"]                      # off / fast, miss pair
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(sys.argv), "mode": "paired",
              "how": "composition = (omni_cache / fast+omni_cache, measured side by side in the hit run) / "
                     "(off / fast, measured side by side in the miss run); medians of prefill_ms",
              "runs": {tag: str(root / f"{name}-{tag}") for tag in tags},
              "alternation": {tag: r.get("alternation") for tag, r in parts.items()},
              "git": {tag: r.get("git") for tag, r in parts.items()},
              "workloads": summ, "bar_checks": checks, "samples": samples}
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    png = S.plot(summ, out / "prefill.png", title=f"YOCO thinker prefill, paired runs ({name})")
    print()
    print(S.format_table(summ, checks))
    print(f"wrote {out / 'result.json'} and {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.prefill import harness
    from omni_cache.models.gemma import default_gemma_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    pair = "--paired" in argv
    if pair:
        argv.remove("--paired")
    size = "bench"
    if "--size" in argv:
        size = _opt(argv, "--size")
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

        argv += ["--name", time.strftime(f"yoco-gemma4-{size}-%Y%m%d-%H%M%S") + ("-paired" if pair else "")]
    return paired(argv) if pair else harness.main(argv)


if __name__ == "__main__":
    sys.exit(main())
