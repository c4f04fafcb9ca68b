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

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import lab
from benchmarks.prefill import harness
from benchmarks.prefill import summary as S

CONFIG = lab.REPO / "stage_configs" / "gemma4_yoco_cpu.yaml"
DEFAULTS = {"--variants": "off,fast,omni_cache,fast+omni_cache", "--modalities": "text,image,audio",
            "--stage-config": str(CONFIG), "--media-copies": "6", "--requests": "3", "--repeats": "2"}
#: --paired: the miss pair and the hit pair, run apart
PAIRS = {"miss": "off,fast", "hit": "omni_cache,fast+omni_cache"}


def combine_pairs(root: Path, name: str, tags: list[str]) -> int:
    """Summarize the runs ``<root>/<name>-<tag>/result.json`` together into ``<root>/<name>/``
    (``result.json``, ``prefill.png``) and print the table; returns 0.

    Raises:
        FileNotFoundError: a run's ``result.json`` is missing."""
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
    out = lab.results_dir(root / name, "yoco")
    result = {"command": " ".join(sys.argv), "mode": "paired",
              "how": "composition = (omni_cache / fast+omni_cache, measured side by side in the hit run) / "
                     "(off / fast, measured side by side in the miss run); medians of prefill_ms",
              "runs": {tag: str(root / f"{name}-{tag}") for tag in tags},
              "alternation": {tag: r.get("alternation") for tag, r in parts.items()},
              "git": {tag: r.get("git") for tag, r in parts.items()},
              "workloads": summ, "bar_checks": checks, "samples": samples}
    path = lab.write_result(out, result)
    png = S.plot(summ, out / "prefill.png", title=f"YOCO thinker prefill, paired runs ({name})")
    print("\n" + S.format_table(summ, checks))
    print(f"wrote {path} and {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the rest (--help too) goes to the harness
    ap.add_argument("--paired", action="store_true")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", type=Path, default=lab.RESULTS)
    args, rest = ap.parse_known_args(argv)
    if "--model" not in rest:
        rest += ["--model", str(lab.model_dir(args.size, family="gemma4", child=True))]
    rest += [x for k, v in DEFAULTS.items() if k not in rest for x in (k, v)] + ["--out", str(args.out)]
    name = args.name or time.strftime(f"yoco-gemma4-{args.size}-%Y%m%d-%H%M%S") + ("-paired" if args.paired else "")
    if not args.paired:
        return harness.main([*rest, "--name", name])
    for tag, variants in PAIRS.items():  # a later --variants / --name wins
        print(f"== {tag} pair: {variants}", flush=True)
        if rc := harness.main([*rest, "--variants", variants, "--name", f"{name}-{tag}"]):
            return rc
    return combine_pairs(args.out, name, list(PAIRS))


if __name__ == "__main__":
    sys.exit(main())
