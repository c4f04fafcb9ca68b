"""Triton JIT compiles after a variant's warm-up, matched with its TTFT spikes.

A Triton kernel compiled for a new shape during inference costs ~1 s on a GPU (vLLM's
``vllm/utils/jit_monitor.py``: "This causes a latency spike"). Two sources, both passive:

- the variant's log: vLLM's kernel JIT monitor logs the **first** compile of each kernel
  (``logger.warning_once``), with its stage. Its ``jit_monitor_verbose`` engine argument would
  log every one, but vLLM-Omni 0.30 refuses it in a stage config ("explicit engine argument(s)
  with no structured config owner"; the twelfth GPU session's first try), so it is not set;
- Triton's disk caches (``TRITON_CACHE_DIR`` or ``~/.triton/cache``, and Inductor's
  ``<tmp>/torchinductor_<user>/triton``): every compile writes its kernel's ``<name>.json``
  there once (``triton/runtime/cache.py``), so a file's mtime is the compile's time — host-wide,
  no stage; under restart alternation only one variant's pipeline runs at a time, so the files
  written while it was timed are its compiles.

:func:`jit_report` counts each variant's compiles after its warm-up and lists which TTFT spikes
(over 1.5× the variant's p50, the at-size issue's definition) had a compile while they ran —
and, where vLLM's GC debugger logged collections (``VLLM_GC_DEBUG=1``), which overlapped a
collection of :data:`GC_PAUSE_MS` or more. The
first pipeline started on a fresh host compiles what later variants find in Triton's disk cache;
this report is how a spike of that kind is told from one of the variant's own.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.prefill.summary import ttft_spikes

#: a monitored compile: ``(StageEngineCoreProc_stage0_replica0 pid=4821) WARNING 11-27 23:06:21
#: [jit_monitor.py:141] Triton kernel JIT compilation during inference: fused_moe_kernel. ...``
COMPILE_LINE = re.compile(r"(?:stage(?P<stage>\d+)\S*\s+pid=\d+\)\s+)?\w+\s+(?P<t>\d\d-\d\d \d\d:\d\d:\d\d)\s.*"
                          r"compilation during inference: (?P<kernel>[A-Za-z_][\w]*)")
#: a collection vLLM's GC debugger logs (``VLLM_GC_DEBUG=1``, ``vllm/utils/gc_utils.py``): ``(StageEngineCoreProc_
#: stage0_replica0 pid=1) INFO 11-28 04:39:43 [gc_utils.py:81] GC took 412.410ms to complete. ... generation 2.``
GC_LINE = re.compile(r"(?:stage(?P<stage>\d+)\S*\s+pid=\d+\)\s+)?\w+\s+(?P<t>\d\d-\d\d \d\d:\d\d:\d\d)\s.*"
                     r"GC took (?P<ms>[\d.]+)ms to complete.*generation (?P<gen>\d)")
#: collections at least this long (ms) are reported with the spikes they overlap
GC_PAUSE_MS = 20.0


def triton_cache_dirs() -> list[Path]:
    """Triton's disk caches on this host: ``TRITON_CACHE_DIR`` (else ``~/.triton/cache``) and
    Inductor's ``<tmp>/torchinductor_*/triton`` (those that exist)."""
    env = os.environ.get("TRITON_CACHE_DIR")
    dirs = [Path(env) if env else Path.home() / ".triton" / "cache"]
    dirs += sorted(Path(tempfile.gettempdir()).glob("torchinductor_*/triton"))
    return [d for d in dirs if d.is_dir()]


def cache_compiles(dirs: Sequence[Path], since: float) -> list[dict[str, Any]]:
    """The kernels compiled into the Triton caches ``dirs`` at or after ``since`` (unix s):
    ``{"t": the kernel metadata file's mtime (unix s), "stage": None, "kernel": name}``, by time.
    Triton keeps a compile as ``<hash>/<name>.json`` beside its binaries (``__grp__*`` files
    are its group index, not a compile)."""
    out = []
    for d in dirs:
        for meta in d.rglob("*.json"):
            if meta.name.startswith("__grp__"):
                continue
            with contextlib.suppress(OSError):
                if (t := meta.stat().st_mtime) >= since:
                    out.append({"t": t, "stage": None, "kernel": meta.stem})
    return sorted(out, key=lambda e: e["t"])


def compile_events(log: Path, year: int) -> list[dict[str, Any]]:
    """The compiles logged in ``log``: ``{"t": unix seconds (host local time, 1 s resolution),
    "stage": stage id or None, "kernel": name}``, in log order. ``year``: the log's year (vLLM
    logs month-day only)."""
    return _log_events(log, year, "compilation during inference", COMPILE_LINE, lambda m: {"kernel": m["kernel"]})


def gc_pauses(log: Path, year: int) -> list[dict[str, Any]]:
    """The collections of at least :data:`GC_PAUSE_MS` that vLLM's GC debugger logged in ``log``
    (only with ``VLLM_GC_DEBUG=1``): ``{"t", "stage", "kernel": "GC gen <g> <ms> ms", "ms"}``."""
    return [e for e in _log_events(log, year, "GC took", GC_LINE, lambda m: {
        "kernel": f"GC gen {m['gen']} {float(m['ms']):.0f} ms", "ms": float(m["ms"])}) if e["ms"] >= GC_PAUSE_MS]


def _log_events(log: Path, year: int, marker: str, pattern: re.Pattern, fields) -> list[dict[str, Any]]:
    out = []
    if not log.is_file():
        return out
    with log.open(errors="replace") as f:
        for line in f:
            if marker in line and (m := pattern.search(line)):
                t = time.mktime(time.strptime(f"{year}-{m['t']}", "%Y-%m-%d %H:%M:%S"))
                out.append({"t": t, "stage": int(m["stage"]) if m["stage"] else None, **fields(m)})
    return out


def jit_report(out: Path, variants: list[str], warmups: dict[str, list[tuple[float, float]]],
               samples: dict[str, dict[str, list[dict]]], cache_dirs: Sequence[Path] = ()) -> dict[str, Any]:
    """Per variant: compiles logged after its first warm-up and outside every warm-up
    (``warmups``: the unix ``(start, end)`` of each of its pipeline's warm-ups — one per start,
    so restart alternation has one a round; the untimed re-warm request of each workload counts
    with the timed ones; a variant never warmed is left out), counted by stage and kernel, and
    every TTFT spike of a request sent alone (``samples[workload][variant]`` rows with
    ``started_unix``) with the compiles logged while it ran (from its start's second to the
    second after its first token). With ``cache_dirs`` (:func:`triton_cache_dirs`), the compiles
    Triton wrote there while one of the variant's requests ran (±1 s; key ``cache: <kernel>``)
    count too, less those its log already names (the same kernel within 2 s)."""
    report: dict[str, Any] = {}
    for v in variants:
        if not warmups.get(v):
            continue
        windows = [(int(a), b) for a, b in warmups[v]]
        t0 = windows[0][1]
        events = [e for e in compile_events(out / f"log_{v}.txt", time.localtime(t0).tm_year)
                  if e["t"] >= int(t0) and not any(a <= e["t"] <= b for a, b in windows)]
        spans = [(r["started_unix"] - 1, r["started_unix"] + (r.get("e2e_ms") or r.get("ttft_ms") or 0) / 1000 + 1)
                 for per_variant in samples.values() for r in per_variant.get(v, []) if r.get("started_unix")]
        events += [e for e in cache_compiles(cache_dirs, t0) if any(a <= e["t"] <= b for a, b in spans)
                   and not any(x["kernel"] == e["kernel"] and -1 <= e["t"] - x["t"] <= 2 for x in events)]
        events.sort(key=lambda e: e["t"])
        gcs = [e for e in gc_pauses(out / f"log_{v}.txt", time.localtime(t0).tm_year)
               if e["t"] >= int(t0) and not any(a <= e["t"] <= b for a, b in windows)]
        by = dict(collections.Counter(map(_where, events)))
        spikes = []
        for w, per_variant in samples.items():
            p50, spiked = ttft_spikes(per_variant.get(v, []))
            for r in spiked:
                if r.get("started_unix") is None:
                    continue
                lo, hi = int(r["started_unix"]), r["started_unix"] + r["ttft_ms"] / 1000 + 1
                during = [_where(e) for e in events if lo <= e["t"] <= hi]
                spikes.append({"workload": w, "index": r.get("index"), "ttft_ms": r["ttft_ms"], "p50_ms": p50,
                               "compiles_while_it_ran": during,
                               "gc_pauses_while_it_ran": [_where(e) for e in gcs if lo <= e["t"] <= hi]})
        report[v] = {"compiles_after_warmup": len(events), "by_stage_and_kernel": by, "ttft_spikes": spikes,
                     "gc_pauses_after_warmup": [_where(e) for e in gcs]}
    return report


def _where(event: dict[str, Any]) -> str:
    return f"{'cache' if event['stage'] is None else 'stage ' + str(event['stage'])}: {event['kernel']}"


def format_jit(report: dict[str, Any]) -> str:
    """The report as lines for the run's printed summary."""
    if not report:
        return "JIT compiles after warm-up: (no variant timed)"
    lines = ["JIT compiles after warm-up (vLLM's JIT monitor: first compile of a kernel, by stage; Triton's disk "
             "cache: every compile, host-wide; a compile ≈ a latency spike):"]
    for v, r in report.items():
        kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(r["by_stage_and_kernel"].items())) or "none"
        lines.append(f"  {v:12s} {r['compiles_after_warmup']:3d}  ({kinds})"
                     + (f"; GC pauses ≥ {GC_PAUSE_MS:.0f} ms: {', '.join(r['gc_pauses_after_warmup'])}"
                        if r.get("gc_pauses_after_warmup") else ""))
        for s in r["ttft_spikes"]:
            why = ", ".join(s["compiles_while_it_ran"] + s.get("gc_pauses_while_it_ran", [])) or "no compile or GC"
            lines.append(f"    spike: {s['workload']} #{s['index']} TTFT {s['ttft_ms']:.0f} ms "
                         f"(p50 {s['p50_ms']:.0f}): {why}")
    return "\n".join(lines)
