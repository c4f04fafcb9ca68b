"""Issue 43's zero-overhead bar, recomputed from saved ``result.json`` files of the prefill
benchmark (runs from before the harness computed it included):

    python -m benchmarks.prefill.overhead benchmarks/results/gpu-size-*/result.json

For each file with cache off and omni-cache on a no-hit workload (``floor``, ``miss``): the
checks of :func:`benchmarks.prefill.summary.overhead_checks` from its samples, one line each,
and the GPU and commit it ran on. Exit code 0 (a report, not a gate).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.prefill import summary as S


def recompute(result: dict) -> dict[str, list[dict]]:
    """The overhead checks of one saved result (``samples`` and ``load_samples`` as the harness
    writes them); empty when it has no no-hit workload with both variants."""
    samples = result.get("samples") or {}
    load = S.summarize_load(result.get("load_samples") or {}, samples)
    return S.overhead_checks(load, samples)


def where(result: dict) -> str:
    """``<count> × <GPU>`` (or ``CPU``), commit and date of a saved result."""
    gpus = (result.get("machine") or {}).get("gpus") or []
    dev = f"{len(gpus)} × {gpus[0]['name']}" if gpus else "CPU"
    return f"{dev}, commit {(result.get('git') or {}).get('commit', '?')[:7]}, {result.get('date', '?')}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill.overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="result.json files of benchmarks.prefill")
    args = ap.parse_args(argv)
    for path in args.results:
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"{path}: not readable as JSON ({exc})", file=sys.stderr)
            continue
        checks = recompute(result)
        if not checks:
            continue
        print(f"== {path} ({where(result)})\n{S.format_overhead(checks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
