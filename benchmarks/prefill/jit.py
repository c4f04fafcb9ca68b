"""Triton JIT compiles after a variant's warm-up, read from its log (vLLM's kernel JIT monitor).

A Triton kernel compiled for a new shape during inference costs ~1 s on a GPU (vLLM's
``vllm/utils/jit_monitor.py``: "This causes a latency spike"). By default the monitor logs only
the first compile of each kernel (``logger.warning_once``); the prefill harness turns on its
``jit_monitor_verbose`` engine argument (``vllm/config/observability.py``) in every stage of
every variant on a GPU host (:func:`verbose_jit_monitor`), so each compile is logged with its
time, and :func:`jit_report` matches the compiles after a variant's warm-up with its requests:
how many each variant paid while timed, and which TTFT spikes (over 1.5× the variant's p50, the
at-size issue's definition) had a compile in the thinker, talker or code2wav while they ran.
The first pipeline started on a fresh host compiles what later variants find in Triton's disk
cache; this report is how a spike of that kind is told from one of the variant's own.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import Any

#: a monitored compile: ``(StageEngineCoreProc_stage0_replica0 pid=4821) WARNING 11-27 23:06:21
#: [jit_monitor.py:141] Triton kernel JIT compilation during inference: fused_moe_kernel. ...``
COMPILE_LINE = re.compile(r"(?:stage(?P<stage>\d+)\S*\s+pid=\d+\)\s+)?\w+\s+(?P<t>\d\d-\d\d \d\d:\d\d:\d\d)\s.*"
                          r"compilation during inference: (?P<kernel>[A-Za-z_][\w]*)")
#: a request is a spike when its TTFT is over this many times its variant's p50 for the workload
SPIKE_FACTOR = 1.5


def verbose_jit_monitor(stage_config: Path) -> None:
    """Set ``jit_monitor_verbose: true`` in every stage of a (derived, machine-written) stage
    config YAML: vLLM-Omni passes a stage's keys that are engine arguments to vLLM
    (``filter_dataclass_kwargs(OmniEngineArgs, ...)``). Benchmarks only: it adds a log line per
    compile, no work on the step path."""
    import yaml

    raw = yaml.safe_load(stage_config.read_text())
    for st in raw.get("stages", []) or []:
        st.setdefault("jit_monitor_verbose", True)
    stage_config.write_text(yaml.safe_dump(raw, sort_keys=False))


def compile_events(log: Path, year: int) -> list[dict[str, Any]]:
    """The compiles logged in ``log``: ``{"t": unix seconds (host local time, 1 s resolution),
    "stage": stage id or None, "kernel": name}``, in log order. ``year``: the log's year (vLLM
    logs month-day only)."""
    out = []
    if not log.is_file():
        return out
    with log.open(errors="replace") as f:
        for line in f:
            if "compilation during inference" not in line:
                continue
            m = COMPILE_LINE.search(line)
            if not m:
                continue
            t = time.mktime(time.strptime(f"{year}-{m['t']}", "%Y-%m-%d %H:%M:%S"))
            out.append({"t": t, "stage": int(m["stage"]) if m["stage"] else None, "kernel": m["kernel"]})
    return out


def jit_report(out: Path, variants: list[str], warmups: dict[str, list[tuple[float, float]]],
               samples: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """Per variant: compiles logged after its first warm-up and outside every warm-up
    (``warmups``: the unix ``(start, end)`` of each of its pipeline's warm-ups — one per start,
    so restart alternation has one a round; the untimed re-warm request of each workload counts
    with the timed ones; a variant never warmed is left out), counted by stage and kernel, and
    every TTFT spike of a request sent alone (``samples[workload][variant]`` rows with
    ``started_unix``) with the compiles logged while it ran (from its start's second to the
    second after its first token)."""
    report: dict[str, Any] = {}
    for v in variants:
        if not warmups.get(v):
            continue
        windows = [(int(a), b) for a, b in warmups[v]]
        t0 = windows[0][1]
        events = [e for e in compile_events(out / f"log_{v}.txt", time.localtime(t0).tm_year)
                  if e["t"] >= int(t0) and not any(a <= e["t"] <= b for a, b in windows)]
        by: dict[str, int] = {}
        for e in events:
            key = f"stage {e['stage']}: {e['kernel']}"
            by[key] = by.get(key, 0) + 1
        spikes = []
        for w, per_variant in samples.items():
            rows = [r for r in per_variant.get(v, []) if r.get("measure", True) and r.get("ttft_ms") is not None]
            if len(rows) < 2:
                continue
            p50 = statistics.median(r["ttft_ms"] for r in rows)
            for r in rows:
                if r["ttft_ms"] <= SPIKE_FACTOR * p50 or r.get("started_unix") is None:
                    continue
                lo, hi = int(r["started_unix"]), r["started_unix"] + r["ttft_ms"] / 1000 + 1
                during = [f"stage {e['stage']}: {e['kernel']}" for e in events if lo <= e["t"] <= hi]
                spikes.append({"workload": w, "index": r.get("index"), "ttft_ms": r["ttft_ms"], "p50_ms": p50,
                               "compiles_while_it_ran": during})
        report[v] = {"compiles_after_warmup": len(events), "by_stage_and_kernel": by, "ttft_spikes": spikes}
    return report


def format_jit(report: dict[str, Any]) -> str:
    """The report as lines for the run's printed summary."""
    if not report:
        return "JIT compiles after warm-up: (no variant timed)"
    lines = ["JIT compiles after warm-up (vLLM's kernel JIT monitor, verbose; a compile ≈ a latency spike):"]
    for v, r in report.items():
        kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(r["by_stage_and_kernel"].items())) or "none"
        lines.append(f"  {v:12s} {r['compiles_after_warmup']:3d}  ({kinds})")
        for s in r["ttft_spikes"]:
            why = ", ".join(s["compiles_while_it_ran"]) or "no compile logged while it ran"
            lines.append(f"    spike: {s['workload']} #{s['index']} TTFT {s['ttft_ms']:.0f} ms "
                         f"(p50 {s['p50_ms']:.0f}): {why}")
    return "\n".join(lines)
