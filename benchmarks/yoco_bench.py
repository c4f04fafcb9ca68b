"""Per-modality thinker prefill and TTFP of the multimodal KV-shared (YOCO) thinker:
{fast prefill off/on} x {omni-cache off/on}.

The embedded Gemma-4-style thinker in the four variants of
:data:`omni_cache.driver.variants.YOCO_VARIANTS` through the prefill harness, defaults
:data:`DEFAULTS` (any other ``python -m benchmarks.prefill`` option passes through); the bar:
:func:`benchmarks.prefill.summary.yoco_checks`. ``--paired``: where four pipelines do not fit,
the miss pair (off, fast) and the hit pair (omni_cache, fast+omni_cache) run apart and are
summarized together (:func:`combine_pairs`). Runs: docs/yoco.md, docs/benchmarks.md.

    .venv/bin/python -m benchmarks.yoco_bench              # = --requests 3 --repeats 2 --modalities text,image,audio
    .venv/bin/python -m benchmarks.yoco_bench --paired --modalities image,floor --repeats 3
"""

from __future__ import annotations

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
    """Run the miss pair and the hit pair and summarize them together; the harness's exit code."""
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
    from benchmarks import lab
    from benchmarks.prefill import harness

    argv = list(sys.argv[1:] if argv is None else argv)
    pair = "--paired" in argv
    if pair:
        argv.remove("--paired")
    size = "bench"
    if "--size" in argv:
        size = _opt(argv, "--size")
        del argv[argv.index("--size"):argv.index("--size") + 2]
    if "--model" not in argv:
        argv += ["--model", str(lab.model_dir(size, family="gemma4", child=True))]
    for k, v in DEFAULTS.items():
        if k not in argv:
            argv += [k, v]
    if "--name" not in argv:
        import time

        argv += ["--name", time.strftime(f"yoco-gemma4-{size}-%Y%m%d-%H%M%S") + ("-paired" if pair else "")]
    return paired(argv) if pair else harness.main(argv)


if __name__ == "__main__":
    sys.exit(main())
