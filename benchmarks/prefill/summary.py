"""Summaries, bar checks, tables and plots of prefill-benchmark samples (no engine needed).

A sample (one request on one variant) is a row of :mod:`benchmarks.prefill.worker` (times in ms);
``handoff_ms`` is derived here. Samples with ``measure: false`` (warm-up, chat turn 1) or an
``error`` are not summarized.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks import lab

METRICS = ("prefill_ms", "ttft_ms", "vllm_ttft_ms", "ttfp_ms", "e2e_ms", "stage_0_gen_ms", "thinker_tpot_ms",
           "talker_prefill_ms", "talker_decode_ms", "code2wav_ms", "handoff_ms")
TOKENS = ("num_prompt_tokens", "num_cached_tokens", "computed_tokens")
#: TTFP = TTFT + these + hand-off (per request; see benchmarks.prefill.worker)
TTFP_PARTS = ("ttft_ms", "talker_prefill_ms", "talker_decode_ms", "code2wav_ms")

#: fewest thinker output tokens for a time-per-output-token (``thinker_tpot_ms``)
MIN_TPOT_TOKENS = 8

# Bars of issue 5 (omni-cache vs off / builtin); all on the thinker prefill time.
HIGH_HIT = 0.95      # h ≥ this: speedup ≥ HIGH_HIT_SPEEDUP
HIGH_HIT_SPEEDUP = 10.0
LOW_HIT = 0.90       # h ≤ this: speedup ≥ IDEAL_FRACTION × 1/(1−h)
IDEAL_FRACTION = 0.8
MISS_TOLERANCE = 0.02   # miss-only: omni-cache within 2 % of cache off
BUILTIN_TOLERANCE = 0.02  # "not slower than builtin": within timer noise of 2 %
# Streaming bars (issue 14), on the time to the first audio packet
TTFP_SPEEDUP = 5.0       # text and chat at h ≥ HIGH_HIT: TTFP of off / omni-cache ≥ this
TTFP_BAR_WORKLOADS = ("text", "chat")


def metric(row: dict, name: str) -> float | None:
    """``row[name]``; ``handoff_ms``: TTFP minus its measured parts (None if any is missing);
    ``thinker_tpot_ms``: the thinker's time per output token after the first, ms, on the driver
    clock — (``thinker_last_ms`` − ``ttft_ms``) / (output tokens − 1); None with fewer than
    :data:`MIN_TPOT_TOKENS` output tokens (a 2-token answer times one decode step and the
    streaming's jitter, not a decode rate) or a part missing (results before 2026-11-29)."""
    if name == "thinker_tpot_ms":
        last, first, n = row.get("thinker_last_ms"), row.get("ttft_ms"), row.get("num_output_tokens") or 0
        return (last - first) / (n - 1) if last is not None and first is not None and n >= MIN_TPOT_TOKENS else None
    if name != "handoff_ms":
        return row.get(name)
    parts = [row.get(k) for k in ("ttfp_ms",) + TTFP_PARTS]
    return None if None in parts else parts[0] - sum(parts[1:])


def describe(xs: list[float | None]) -> dict[str, float] | None:
    """median (= p50), min, max, p25, p75, p95 (:func:`benchmarks.lab.describe`), relative IQR
    (``(p75−p25)/median``) and n of the values that are not None; None if there are none."""
    d = lab.describe(xs, "median", "min", "max", "p25", "p75", "p95")
    if d is not None:
        d["rel_iqr"] = (d["p75"] - d["p25"]) / d["median"] if d["median"] else 0.0
    return d


def bootstrap_median_ci(xs: list[float], level: float = 0.95, resamples: int = 4000,
                        seed: int = 0) -> list[float] | None:
    """Seeded percentile-bootstrap confidence interval ``[lo, hi]`` of the median of ``xs`` (Efron
    & Tibshirani 1993, ch. 13); None for fewer than 3 values."""
    if len(xs) < 3:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return [meds[int(tail * (resamples - 1))], meds[int((1.0 - tail) * (resamples - 1))]]


def ideal_speedup(h: float) -> float:
    """1/(1−h): the prefill speedup if cached tokens cost nothing and the rest is linear."""
    return math.inf if h >= 1.0 else 1.0 / (1.0 - h)


def valid(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("measure", True) and not r.get("error") and r.get("prefill_ms") is not None]


def _hit_ratio(rows: list[dict], empty: float | None) -> float | None:
    """Median of cached / prompt tokens of the thinker over ``rows`` (``empty`` without one)."""
    hs = [r["num_cached_tokens"] / r["num_prompt_tokens"] for r in rows if r.get("num_prompt_tokens")]
    return statistics.median(hs) if hs else empty


def _rounds(rows: list[dict]) -> list:
    return sorted({r.get("round") for r in rows}, key=lambda x: (x is None, x))


def summarize_workload(by_variant: dict[str, list[dict]], reference: str = "off") -> dict[str, dict[str, Any]]:
    """Per variant: statistics of every metric and of the tokens, hit ratio h (median of cached /
    prompt tokens), ``speedup_vs_off`` (median prefill of ``reference`` / the variant's),
    ``speedup_paired`` (median of per-request ratios, same round and index: robust to drift) with
    its 95 % bootstrap interval ``speedup_paired_ci95``, ``fraction_of_ideal`` (speedup / (1/(1−h))).
    """
    out: dict[str, dict[str, Any]] = {}
    for v, rows in by_variant.items():
        ok = valid(rows)
        out[v] = {"n": len(ok), "n_errors": sum(1 for r in rows if r.get("error")), "hit_ratio": _hit_ratio(ok, 0.0),
                  **{m: describe([metric(r, m) for r in ok]) for m in (*METRICS, *TOKENS)},
                  "prefill_ms_per_round": {str(k): statistics.median(r["prefill_ms"] for r in ok if r.get("round") == k)
                                           for k in _rounds(ok)}}
    ref = out.get(reference)
    ref_rows = {(r.get("round"), r.get("index")): r for r in valid(by_variant.get(reference, []))}
    for v, s in out.items():
        h = s["hit_ratio"]
        s["ideal_speedup"] = ideal_speedup(h)
        if ref and ref.get("prefill_ms") and s.get("prefill_ms"):
            s["speedup_vs_off"] = ref["prefill_ms"]["median"] / s["prefill_ms"]["median"]
            pairs = [ref_rows[(r.get("round"), r.get("index"))]["prefill_ms"] / r["prefill_ms"]
                     for r in valid(by_variant[v])
                     if (r.get("round"), r.get("index")) in ref_rows and r["prefill_ms"] > 0]
            s["speedup_paired"] = lab.stat(pairs)
            s["speedup_paired_ci95"] = bootstrap_median_ci(pairs)
            for m in ("ttft_ms", "ttfp_ms", "e2e_ms"):
                if ref.get(m) and s.get(m):
                    s[f"{m}_speedup_vs_off"] = ref[m]["median"] / s[m]["median"]
            s["fraction_of_ideal"] = (s["speedup_vs_off"] / s["ideal_speedup"]
                                      if math.isfinite(s["ideal_speedup"]) else 0.0)
        else:
            s["speedup_vs_off"] = s["speedup_paired"] = s["fraction_of_ideal"] = s["speedup_paired_ci95"] = None
    return out


#: shared-prefix workloads whose hits the ``floor`` workload bounds (same question suffix)
FLOOR_BOUNDS = ("text", "image", "audio", "chat")


def add_attainable(workloads: dict[str, dict[str, dict[str, Any]]], reference: str = "off") -> None:
    """Add in place to every cache variant of the shared-prefix workloads: ``attainable_speedup``
    (median prefill on ``reference`` / the ``floor`` workload's there: a hit that costs a prefill
    of the suffix alone), ``fraction_of_attainable``, ``floor_ms``, ``floor_prompt_tokens``,
    ``floor_ttfp_ms`` (the attainable TTFP) and ``ttfp_over_floor``. Nothing without that floor."""
    floor = (workloads.get("floor") or {}).get(reference)
    if not floor or not floor.get("prefill_ms"):
        return
    f_ms, f_tok, f_ttfp = (_stat(floor, m, "median") for m in ("prefill_ms", "num_prompt_tokens", "ttfp_ms"))
    for w in FLOOR_BOUNDS:
        summ = workloads.get(w) or {}
        ref = (summ.get(reference) or {}).get("prefill_ms")
        if not ref:
            continue
        attainable = ref["median"] / f_ms
        for v, s in summ.items():
            if v == reference:
                continue
            sp, ttfp = s.get("speedup_vs_off"), _stat(s, "ttfp_ms", "median")
            s.update(floor_ms=f_ms, floor_prompt_tokens=f_tok, attainable_speedup=attainable,
                     fraction_of_attainable=sp / attainable if sp else None, floor_ttfp_ms=f_ttfp,
                     ttfp_over_floor=lab.ratio(ttfp, f_ttfp))


def bar_target(h: float) -> float:
    """Minimum omni-cache prefill speedup vs off for hit ratio ``h``: ≥ 0.8·1/(1−h) for
    h ≤ 0.90, ≥ 10× for h ≥ 0.95, and min(0.8·1/(1−h), 10) in between (continuous)."""
    if h >= HIGH_HIT:
        return HIGH_HIT_SPEEDUP
    target = IDEAL_FRACTION * ideal_speedup(h)
    return target if h <= LOW_HIT else min(target, HIGH_HIT_SPEEDUP)


def bar_checks(workload: str, summ: dict[str, dict[str, Any]], variant: str = "omni_cache") -> list[dict[str, Any]]:
    """The bars of one workload for ``variant``, each ``{check, value, target, passed}``: ``miss``:
    prefill median ≤ 1.02 × off's; others: speedup vs off ≥ :func:`bar_target` (h) and prefill
    median ≤ 1.02 × builtin's; then :func:`ttfp_checks`. ``passed`` None (n/a, never PASS) where a
    variant or metric is missing."""
    return _prefill_checks(workload, summ, variant) + ttfp_checks(workload, summ, variant)


def ttfp_checks(workload: str, summ: dict[str, dict[str, Any]], variant: str = "omni_cache") -> list[dict[str, Any]]:
    """The streaming bars on the median time to the first audio packet (issue 14):
    ``miss``: TTFP ≤ (1 + 2 %) × off's; text and chat at h ≥ 0.95: off / variant ≥ 5; every
    shared-prefix workload: TTFP ≤ (1 + 2 %) × builtin's. Empty when no variant has a TTFP."""
    s, off, bi = (_stat(summ.get(v), "ttfp_ms", "median") for v in (variant, "off", "builtin"))
    if workload == "floor" or s is None:
        return []
    if workload == "miss":
        return [_at_most(f"miss TTFP: {variant} / off", lab.ratio(s, off), 1 + MISS_TOLERANCE)]
    out = []
    h = summ[variant].get("hit_ratio")
    if workload in TTFP_BAR_WORKLOADS and h is not None and h >= HIGH_HIT:
        out.append(_check(f"TTFP speedup vs off ≥ {TTFP_SPEEDUP:g} (h={h:.3f})", lab.ratio(off, s), TTFP_SPEEDUP,
                          lambda x: x >= TTFP_SPEEDUP))
    return [*out, _at_most(f"TTFP: {variant} / builtin", lab.ratio(s, bi), 1 + BUILTIN_TOLERANCE)]


def _prefill_checks(workload: str, summ: dict[str, dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    s, off, bi = summ.get(variant), summ.get("off"), summ.get("builtin")
    med = functools.partial(_stat, metric="prefill_ms", key="median")
    if workload == "floor":
        return []  # a reference measurement, no bar
    if workload == "miss":
        ci = (s or {}).get("speedup_paired_ci95")
        # paired per-request ratio variant / off: its 95 % interval says whether the run can
        # resolve the 2 % at all
        return [{**_at_most(f"miss: {variant} / off", lab.ratio(med(s), med(off)), 1 + MISS_TOLERANCE),
                 "paired_ratio_ci95": [1 / ci[1], 1 / ci[0]] if ci else None}]
    h = s["hit_ratio"] if s else None
    sp = s.get("speedup_vs_off") if s else None
    target = bar_target(h) if h is not None else None
    return [{"check": f"speedup vs off ≥ target(h={h:.3f})" if h is not None else "speedup vs off",
             "value": sp, "target": target, "passed": None if sp is None or target is None else sp >= target},
            _at_most(f"{variant} / builtin", lab.ratio(med(s), med(bi)), 1 + BUILTIN_TOLERANCE)]


def _stat(s: dict | None, metric: str, key: str) -> float | None:
    return ((s or {}).get(metric) or {}).get(key)


def _check(name: str, value: float | None, target: float, ok) -> dict[str, Any]:
    return {"check": name, "value": value, "target": target, "passed": None if value is None else bool(ok(value))}


def _at_most(name: str, value: float | None, target: float, note: str = "") -> dict[str, Any]:
    """The check ``name ≤ target`` (``passed`` None without a value)."""
    return _check(f"{name} ≤ {target:.2f}{note}", value, target, lambda x: x <= target)


def _check_lines(checks: dict[str, list[dict]]) -> list[str]:
    """One PASS / FAIL / n/a line per bar check (``checks``: per workload)."""
    return [f"  {({True: 'PASS', False: 'FAIL', None: 'n/a '})[c['passed']]}  {w:6} {c['check']}: value "
            f"{lab.fmt(c['value'], '.3f')} (target {lab.fmt(c['target'], '.3f')})"
            + (f"; paired per-request ratio 95% CI [{ci[0]:.3f}, {ci[1]:.3f}]" if (ci := c.get("paired_ratio_ci95"))
               else "") for w, cs in checks.items() for c in cs]


#: the composition bar of a KV-shared thinker (issue 16): at h >= YOCO_MIN_HIT,
#: speedup(both) >= YOCO_COMPOSE x speedup(cache) x speedup(fast prefill)
YOCO_MIN_HIT = 0.9
YOCO_COMPOSE = 0.9


def yoco_checks(workload: str, summ: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Whether fast prefill and the cache compose on a KV-shared thinker (one workload; variants
    :data:`omni_cache.driver.variants.YOCO_VARIANTS`): prefill speedups vs off (TTFP's reported)
    and the bar both / (fast x cache) >= 0.9 where the cache's h >= 0.9 (else ``passed`` None)."""
    names = {"fast": "fast", "cache": "omni_cache", "both": "fast+omni_cache"}  # in the check's keys: variant
    sp, tt = ({v: (summ.get(v) or {}).get(k) for v in names.values()}
              for k in ("speedup_vs_off", "ttfp_ms_speedup_vs_off"))
    h = (summ.get("omni_cache") or {}).get("hit_ratio")
    ok = all(sp.values())
    ratio = sp["fast+omni_cache"] / (sp["fast"] * sp["omni_cache"]) if ok else None
    applies = h is not None and h >= YOCO_MIN_HIT
    return [{"check": f"prefill speedup(both) / (speedup(fast) x speedup(cache)) >= {YOCO_COMPOSE} at h >= "
                      f"{YOCO_MIN_HIT} (h={h:.3f})" if h is not None else "composition",
             "value": ratio, "target": YOCO_COMPOSE,
             "passed": (ratio >= YOCO_COMPOSE) if ratio is not None and applies else None,
             "product": sp["fast"] * sp["omni_cache"] if ok else None,
             **{f"{pre}speedup_{n}": by[v] for pre, by in (("", sp), ("ttfp_", tt)) for n, v in names.items()}}]


def format_table(workloads: dict[str, dict[str, dict[str, Any]]], checks: dict[str, list[dict]]) -> str:
    """The end-of-run table: per workload and variant the medians, h, speedups; then the bars."""
    head = (f"{'workload':8} {'variant':10} {'prompt':>6} {'h':>6} {'prefill ms':>10} {'IQR%':>5} "
            f"{'TTFT ms':>8} {'TTFP ms':>8} {'E2E ms':>8} {'speedup':>7} {'ideal':>6} {'of ideal':>8} "
            f"{'attain.':>7} {'of att.':>7}")
    lines = [head, "-" * len(head)]
    for w, summ in workloads.items():
        for v, s in summ.items():
            pre = s.get("prefill_ms") or {}
            lines.append(
                f"{w:8} {v:10} {lab.fmt(_stat(s, 'num_prompt_tokens', 'median'), '.0f'):>6} "
                f"{s['hit_ratio']:6.3f} {lab.fmt(pre.get('median')):>10} "
                f"{lab.fmt(100 * pre['rel_iqr'] if pre else None, '.0f'):>5} "
                + " ".join(f"{lab.fmt(_stat(s, m, 'median')):>8}" for m in ("ttft_ms", "ttfp_ms", "e2e_ms"))
                + f" {lab.fmt(s.get('speedup_vs_off'), '.2f'):>7} {lab.fmt(s.get('ideal_speedup'), '.2f'):>6} "
                f"{lab.fmt(s.get('fraction_of_ideal'), '.2f'):>8} {lab.fmt(s.get('attainable_speedup'), '.2f'):>7} "
                f"{lab.fmt(s.get('fraction_of_attainable'), '.2f'):>7}")
    lines += ["", "attain. = off / floor: the speedup of a hit that costs a prefill of the suffix alone "
                  "(workload 'floor'); of att. = speedup / attain."]
    parts = [(w, v, s) for w, summ in workloads.items() for v, s in summ.items() if _stat(s, "ttfp_ms", "median")]
    if parts:
        lines += ["", "TTFP and its parts (medians, ms): TTFT + talker prefill + talker decode (rest of the first "
                      "codec chunk) + code2wav + hand-off"]
        for w, v, s in parts:
            vals = " ".join(f"{k.replace('_ms', '')} {lab.fmt(_stat(s, k, 'median'))}"
                            for k in ("ttfp_ms",) + TTFP_PARTS + ("handoff_ms",))
            extra = (f"; floor TTFP {s['floor_ttfp_ms']:.1f} ({s['ttfp_over_floor']:.2f}x)"
                     if s.get("ttfp_over_floor") else "")
            lines.append(f"  {w:8} {v:10} {vals}{extra}")
    return "\n".join([*lines, "", "bar checks (omni-cache; thinker prefill time, then TTFP):", *_check_lines(checks)])


#: a variant's colour in every plot; the parts of TTFP in the stacked bars
COLORS = {"off": "#888888", "builtin": "#4c72b0", "omni_cache": "#dd8452", "fast": "#8172b3",
          "fast+omni_cache": "#c44e52"}
PART_COLORS = {"ttft_ms": "#4c72b0", "talker_prefill_ms": "#dd8452", "talker_decode_ms": "#55a868",
               "code2wav_ms": "#c44e52", "handoff_ms": "#937860"}


def plot(workloads: dict[str, dict[str, dict[str, Any]]], path: str | Path, title: str = "") -> Path:
    """A PNG, one panel per workload: median thinker prefill per variant (p25–p75 error bars),
    dashed the ideal (off / (1/(1−h))); with TTFP a second row: its parts' medians stacked, a
    black tick at the median TTFP, dotted the floor's TTFP."""
    names = list(workloads)
    with_ttfp = any(_stat(s, "ttfp_ms", "median") for summ in workloads.values() for s in summ.values())
    nrows, ncols = 2 if with_ttfp else 1, max(len(names), 1)
    with lab.figure(Path(path), nrows, ncols, figsize=(3.2 * ncols, 3.6 * nrows), squeeze=False, title=title,
                    title_size=9) as (fig, axes):
        for ax, w in zip(axes[0], names):
            _prefill_panel(ax, workloads[w], w, first=ax is axes[0][0])
        if with_ttfp:
            for ax, w in zip(axes[1], names):
                _ttfp_panel(ax, workloads[w], w, first=ax is axes[1][0])
    return Path(path)


def _variant_axis(ax, vs: list[str], tops: list[float], title: str) -> None:
    """Variant names as x ticks (a combined variant, ``fast+omni_cache``, on two lines), y from 0 to
    1.3 × the highest of ``tops``, the panel's ``title``."""
    ax.set_xticks(range(len(vs)), [v.replace("+", "+\n") for v in vs], fontsize=8)
    if tops:
        ax.set_ylim(0, 1.3 * max(tops))
    ax.set_title(title, fontsize=9)


def _prefill_panel(ax, summ: dict[str, dict[str, Any]], w: str, first: bool) -> None:
    vs = [v for v in summ if summ[v].get("prefill_ms")]
    pre = [summ[v]["prefill_ms"] for v in vs]
    meds, hi = [p["median"] for p in pre], [p["p75"] - p["median"] for p in pre]
    ax.bar(range(len(vs)), meds, yerr=[[p["median"] - p["p25"] for p in pre], hi], capsize=3,
           color=[COLORS.get(v, "#55a868") for v in vs])
    off = summ.get("off", {}).get("prefill_ms")
    labelled = next((k for k, v in enumerate(vs) if v != "off"), None)  # the legend's: any order of variants
    for k, v in enumerate(vs):
        if v != "off" and off and math.isfinite(summ[v]["ideal_speedup"]):
            ax.hlines(off["median"] / summ[v]["ideal_speedup"], k - 0.4, k + 0.4, colors="k", linestyles="--",
                      linewidth=1, zorder=3, label="ideal 1/(1−h)" if k == labelled else None)
        if v != "off" and summ[v].get("floor_ms"):
            ax.hlines(summ[v]["floor_ms"], k - 0.4, k + 0.4, colors="#c44e52", linestyles=":", linewidth=1.5,
                      zorder=3, label="floor (suffix alone)" if k == labelled else None)
        sp = summ[v].get("speedup_vs_off")
        ax.text(k, meds[k] + hi[k], f"{meds[k]:.0f} ms" + (f"\n{sp:.1f}×" if sp and v != "off" else ""),
                ha="center", va="bottom", fontsize=7)
    _variant_axis(ax, vs, [m + e for m, e in zip(meds, hi)],
                  f"{w} (h={max((summ[v]['hit_ratio'] for v in vs), default=0.0):.2f})")
    ax.set_ylabel("thinker prefill, ms (median)" if first else "")
    if any(v != "off" for v in vs):
        ax.legend(fontsize=7, loc="upper right")


def _ttfp_panel(ax, summ: dict[str, dict[str, Any]], w: str, first: bool) -> None:
    vs = [v for v in summ if _stat(summ[v], "ttfp_ms", "median")]
    for k, v in enumerate(vs):
        bottom = 0.0
        for part in TTFP_PARTS + ("handoff_ms",):
            m = _stat(summ[v], part, "median")
            if m is not None and m > 0:
                ax.bar(k, m, bottom=bottom, color=PART_COLORS[part], width=0.6,
                       label=part.replace("_ms", "") if k == 0 else None)
                bottom += m
        t = summ[v]["ttfp_ms"]["median"]
        ax.hlines(t, k - 0.35, k + 0.35, colors="k", linewidth=2, zorder=3)
        sp = summ[v].get("ttfp_ms_speedup_vs_off")
        ax.text(k, t, f"{t:.0f} ms" + (f"\n{sp:.1f}×" if sp and v != "off" else ""), ha="center", va="bottom",
                fontsize=7)
        if v != "off" and summ[v].get("floor_ttfp_ms"):
            ax.hlines(summ[v]["floor_ttfp_ms"], k - 0.4, k + 0.4, colors="#c44e52", linestyles=":", linewidth=1.5,
                      zorder=3)
    _variant_axis(ax, vs, [summ[v]["ttfp_ms"]["median"] for v in vs], f"{w}: TTFP and its parts")
    if first:
        ax.set_ylabel("time to first audio packet, ms (median)")
        ax.legend(fontsize=6, loc="upper right")


# ---- under load (--concurrency c > 1) ------------------------------------------------------
#: driver-clock metrics summarized under load (vLLM's histogram-derived ones are not per request there)
LOAD_METRICS = ("ttft_ms", "ttfp_ms", "e2e_ms", "thinker_tpot_ms")
#: the load bars (issue 38): multi-turn chat at c = LOAD_CHAT_C with h ≥ LOAD_CHAT_MIN_HIT:
#: omni-cache's TTFP p50 ≤ LOAD_FLOOR_FACTOR × the floor's and ≤ the built-in's; at
#: c = LOAD_HIGH_C: omni-cache's throughput ≥ cache off's and its TTFP p95 ≤ the built-in's.
#: "≤" / "≥" allow LOAD_TOLERANCE (2 %, as the one-at-a-time bars' "within timer noise").
LOAD_CHAT_C = 4
LOAD_CHAT_MIN_HIT = 0.9
LOAD_FLOOR_FACTOR = 1.25
LOAD_HIGH_C = 64
LOAD_TOLERANCE = BUILTIN_TOLERANCE


def one_at_a_time_batches(rows: list[dict]) -> list[dict]:
    """The c = 1 samples as one batch per round, on the load batches' axes: ``wall_s`` = the sum
    of the round's e2e times (s), ``throughput_rps`` = its requests without error / ``wall_s``."""
    out = []
    for r in _rounds(rows):
        rs = [x for x in rows if x.get("round") == r]
        ok = [x for x in rs if not x.get("error") and x.get("e2e_ms") is not None]
        wall = sum(x["e2e_ms"] for x in ok) / 1000.0
        out.append({"round": r, "concurrency": 1, "wall_s": wall, "throughput_rps": len(ok) / wall if wall else None,
                    "n_requests": len(rs), "n_errors": len(rs) - len(ok), "results": rs,
                    "source": "one at a time (sum of e2e)"})
    return out


def summarize_batches(batches: list[dict]) -> dict[str, Any]:
    """One variant at one concurrency: :func:`describe` of ``ttft_ms`` / ``ttfp_ms`` / ``e2e_ms``
    over the timed requests of all batches; ``throughput_rps`` ``{"median" over rounds,
    "per_round"}`` (requests/s); ``hit_ratio``; ``n_errors``; ``wall_s`` per round."""
    rows = [r for b in batches for r in b.get("results", [])]
    ok = [r for r in rows if r.get("measure", True) and not r.get("error")]
    tps = [b["throughput_rps"] for b in batches if b.get("throughput_rps") is not None]
    return {"n": len(ok), "n_requests": len(rows), "n_errors": sum(1 for r in rows if r.get("error")),
            **{m: describe([metric(r, m) for r in ok]) for m in LOAD_METRICS}, "hit_ratio": _hit_ratio(ok, None),
            "throughput_rps": {"median": lab.stat(tps), "per_round": tps}, "wall_s": [b.get("wall_s") for b in batches],
            "source": batches[0].get("source", "closed loop") if batches else None}


def summarize_load(load_samples: dict[str, dict[str, dict[str, list[dict]]]],
                   one_at_a_time: dict[str, dict[str, list[dict]]] | None = None) -> dict[str, Any]:
    """``[workload][str(c)][variant]``: :func:`summarize_batches` at each concurrency c (ascending);
    with ``one_at_a_time`` (c = 1 samples, ``[workload][variant]``) also c = "1"."""
    out: dict[str, Any] = {}
    for w in dict.fromkeys(list(one_at_a_time or {}) + list(load_samples)):
        by_c: dict[str, dict[str, list[dict]]] = {}
        if one_at_a_time and w in one_at_a_time:
            by_c["1"] = {v: one_at_a_time_batches(rows) for v, rows in one_at_a_time[w].items()}
        by_c.update(load_samples.get(w, {}))
        out[w] = {c: {v: summarize_batches(bs) for v, bs in by_c[c].items()} for c in sorted(by_c, key=int)}
    return out


def load_checks(load: dict[str, Any], variant: str = "omni_cache") -> dict[str, list[dict[str, Any]]]:
    """The load bars for ``variant`` (the constants above; ``passed`` None = n/a, never a pass
    without samples): ``chat`` at c = 4 where h ≥ 0.9, TTFP p50 / the floor's (cache off) and /
    the built-in's; every workload but ``floor`` at c = 64, throughput / off's, TTFP p95 / builtin's."""
    out: dict[str, list[dict[str, Any]]] = {}
    chat = (load.get("chat") or {}).get(str(LOAD_CHAT_C))
    if chat is not None:
        s = chat.get(variant)
        h = (s or {}).get("hit_ratio")
        applies = h is not None and h >= LOAD_CHAT_MIN_HIT
        a = _stat(s, "ttfp_ms", "median") if applies else None
        floor = _stat(((load.get("floor") or {}).get(str(LOAD_CHAT_C)) or {}).get("off"), "ttfp_ms", "median")
        builtin = _stat(chat.get("builtin"), "ttfp_ms", "median")
        hs = f"h={h:.3f}" if h is not None else "h=n/a"
        note = f" ({hs})" + ("" if applies else f" (applies at h ≥ {LOAD_CHAT_MIN_HIT})")
        out["chat"] = [_at_most(f"c={LOAD_CHAT_C} TTFP p50: {variant} / {name}", _over(a, ref), target, note)
                       for name, ref, target in (("floor", floor, LOAD_FLOOR_FACTOR),
                                                 ("builtin", builtin, 1 + LOAD_TOLERANCE))]
    for w, by_c in load.items():
        at = by_c.get(str(LOAD_HIGH_C))
        if w == "floor" or at is None:
            continue
        s = at.get(variant)
        tp, tp_off = (((x or {}).get("throughput_rps") or {}).get("median") for x in (s, at.get("off")))
        if not (s or {}).get("n"):  # no timed request: no verdict on its batches either
            tp = None
        p95, p95_bi = _stat(s, "ttfp_ms", "p95"), _stat(at.get("builtin"), "ttfp_ms", "p95")
        out.setdefault(w, []).extend([
            _check(f"c={LOAD_HIGH_C} throughput: {variant} / off ≥ {1 - LOAD_TOLERANCE:.2f}", _over(tp, tp_off),
                   1 - LOAD_TOLERANCE, lambda x: x >= 1 - LOAD_TOLERANCE),
            _at_most(f"c={LOAD_HIGH_C} TTFP p95: {variant} / builtin", _over(p95, p95_bi), 1 + LOAD_TOLERANCE)])
    return out


#: issue 43's zero-overhead bar: the workloads without a (useful) hit — ``floor`` (the question
#: alone; its requests share at most a first block) and ``miss`` (distinct from the first token)
OVERHEAD_WORKLOADS = ("floor", "miss")
OVERHEAD_TOLERANCE = 0.02  # "within 2 % of cache off's"
SPIKE_FACTOR = 1.5         # a spike: a request's TTFT over this many times its variant's p50 (issue 43)


def ttft_spikes(rows: list[dict], factor: float = SPIKE_FACTOR) -> tuple[float | None, list[dict]]:
    """The TTFT p50 (ms) of one variant's timed requests of one workload, and those of them whose
    ``ttft_ms`` is over ``factor`` × it — ``(None, [])`` with fewer than two (also the JIT report's
    spikes, :mod:`benchmarks.prefill.jit`)."""
    ok = [r for r in rows if r.get("measure", True) and not r.get("error") and r.get("ttft_ms") is not None]
    if len(ok) < 2:
        return None, []
    p50 = statistics.median(r["ttft_ms"] for r in ok)
    return p50, [r for r in ok if r["ttft_ms"] > factor * p50]


def spikes(rows: list[dict], factor: float = SPIKE_FACTOR) -> list[dict]:
    """:func:`ttft_spikes`' requests."""
    return ttft_spikes(rows, factor)[1]


def overhead_checks(load: dict[str, Any], samples: dict[str, dict[str, list[dict]]] | None = None,
                    variant: str = "omni_cache") -> dict[str, list[dict[str, Any]]]:
    """Issue 43's zero-overhead bar for ``variant`` against cache off, on the workloads of
    :data:`OVERHEAD_WORKLOADS` at every concurrency in ``load`` (:func:`summarize_load`; c = 1 is
    there when the run sent requests one at a time): TTFT p50 and thinker time per output token
    p50 (``thinker_tpot_ms``) ≤ (1 + 2 %) × off's, throughput ≥ (1 − 2 %) × off's; and, from
    the one-at-a-time ``samples`` (``[workload][variant]`` rows), no more TTFT spikes
    (:func:`spikes`) than cache off shows. ``passed`` None (n/a, never a pass) without both
    variants' values."""
    out: dict[str, list[dict[str, Any]]] = {}
    hi, lo = 1 + OVERHEAD_TOLERANCE, 1 - OVERHEAD_TOLERANCE
    for w in OVERHEAD_WORKLOADS:
        for c, at in (load.get(w) or {}).items():
            s, off = at.get(variant), at.get("off")
            if s is None and off is None:
                continue
            tp = [((x or {}).get("throughput_rps") or {}).get("median") for x in (s, off)]
            out.setdefault(w, []).extend([
                _at_most(f"c={c} TTFT p50: {variant} / off", _over(_stat(s, "ttft_ms", "median"),
                                                                   _stat(off, "ttft_ms", "median")), hi),
                _at_most(f"c={c} thinker ms/token p50: {variant} / off",
                         _over(_stat(s, "thinker_tpot_ms", "median"), _stat(off, "thinker_tpot_ms", "median")), hi),
                _check(f"c={c} throughput: {variant} / off ≥ {lo:.2f}", _over(*tp), lo, lambda x: x >= lo)])
        rows = (samples or {}).get(w) or {}
        if variant in rows and "off" in rows:
            n, n_off = len(spikes(rows[variant])), len(spikes(rows["off"]))
            out.setdefault(w, []).append(
                {**_check(f"c=1 TTFT spikes (> {SPIKE_FACTOR:g} × p50): {variant} ≤ off's ({n_off})", float(n),
                          float(n_off), lambda x, most=n_off: x <= most),
                 "spikes": {v: [{"index": r.get("index"), "round": r.get("round"), "ttft_ms": r["ttft_ms"]}
                                for r in spikes(rows[v])] for v in (variant, "off")}})
    return out


def format_overhead(checks: dict[str, list[dict[str, Any]]]) -> str:
    """:func:`overhead_checks` as printed lines under a header."""
    if not checks:
        return "zero-overhead bar (issue 43): n/a (needs cache off and omni-cache, workloads floor / miss)"
    return "\n".join(["zero-overhead bar (issue 43: no hit, omni-cache within 2 % of cache off):",
                      *_check_lines(checks)])


def step_host_times(metrics: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per variant and runner phase (``execute_model``, ``output_builder``: the thinker runner's
    ``runner-<pid>.json``, :class:`omni_cache.engine.metrics.RunnerStepTimes`), summed over the
    variant's thinker processes: ``calls``, ``ms_wall`` and ``ms_cpu`` per call (wall minus CPU:
    waiting for the GIL or the device). Where a step-time difference between variants goes;
    warm-up steps included (the counters run from the engine's start). For omni-cache also its own
    share of a no-hit step, from ``metrics-<pid>.json`` (wall only, ``ms_cpu`` None):
    ``save_decode`` (the save of a no-hit decode step) and ``handoff_no_hit`` (the hand-off of a
    step without a hit)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for m in metrics:
        if str(m.get("file", "")).startswith("metrics-") and m.get("decode_steps") is not None:
            # omni-cache's own share of the no-hit decode step (CacheMetrics): wall time only
            for phase, n, sec in (("save_decode", "decode_steps", "seconds_save_decode"),
                                  ("handoff_no_hit", "fresh_handoffs", "seconds_materialize_fresh")):
                acc = out.setdefault(m["variant"], {}).setdefault(phase, {"calls": 0, "s_wall": 0.0, "s_cpu": None})
                acc["calls"] += int(m.get(n) or 0)
                acc["s_wall"] += float(m.get(sec) or 0.0)
            continue
        if not str(m.get("file", "")).startswith("runner-") or m.get("stage") not in (None, "thinker"):
            continue
        for phase, c in m.items():
            if not isinstance(c, dict) or "calls" not in c:
                continue
            acc = out.setdefault(m["variant"], {}).setdefault(phase, {"calls": 0, "s_wall": 0.0, "s_cpu": 0.0})
            acc["calls"] += int(c["calls"])
            acc["s_wall"] += float(c["seconds_wall"])
            acc["s_cpu"] += float(c["seconds_cpu"])
    return {v: {ph: {"calls": a["calls"], "ms_wall": 1e3 * a["s_wall"] / a["calls"] if a["calls"] else None,
                     "ms_cpu": 1e3 * a["s_cpu"] / a["calls"] if a["calls"] and a["s_cpu"] is not None else None}
                for ph, a in by.items()} for v, by in out.items()}


def format_step_host_times(times: dict[str, dict[str, dict[str, float]]]) -> str:
    """:func:`step_host_times` as lines: per variant, each phase's ms per call (wall / CPU)."""
    if not times:
        return "thinker host time per step: n/a (no runner-<pid>.json: OMNI_CACHE_METRICS_DIR unset)"
    lines = ["thinker host time per step (ms per call, wall / thread CPU; warm-up included):"]
    for v, by in times.items():
        lines.append(f"  {v:10} " + "  ".join(f"{ph} {lab.fmt(t['ms_wall'], '.3f')} / {lab.fmt(t['ms_cpu'], '.3f')}"
                                             f" ({t['calls']} calls)" for ph, t in sorted(by.items())))
    return "\n".join(lines)


def _over(a: float | None, b: float | None) -> float | None:
    """``a / b``; None where ``a`` is None or ``b`` is None or zero (``a`` = 0 gives 0)."""
    return a / b if a is not None and b else None


def format_load_table(load: dict[str, Any], checks: dict[str, list[dict]]) -> str:
    """Per workload, concurrency and variant: n, h, TTFT / TTFP / E2E p50 and p95 (ms),
    throughput (requests/s, median over rounds), errors; then the load bars."""
    head = (f"{'workload':8} {'c':>3} {'variant':10} {'n':>4} {'h':>6} {'TTFT p50':>8} {'p95':>7} "
            f"{'TTFP p50':>8} {'p95':>7} {'E2E p50':>8} {'p95':>7} {'req/s':>7} {'err':>3}")
    lines = ["under load (driver clock; c = 1 from the one-at-a-time requests)", head, "-" * len(head)]
    for w, by_c in load.items():
        for c, by_v in by_c.items():
            for v, s in by_v.items():
                lines.append(
                    f"{w:8} {c:>3} {v:10} {s['n']:>4} {lab.fmt(s.get('hit_ratio'), '.3f'):>6} "
                    + " ".join(f"{lab.fmt(_stat(s, m, 'median')):>8} {lab.fmt(_stat(s, m, 'p95')):>7}"
                               for m in LOAD_METRICS)
                    + f" {lab.fmt(_stat(s, 'throughput_rps', 'median'), '.2f'):>7} {s['n_errors']:>3}")
    lines += ["", "load bar checks (omni-cache):", *_check_lines(checks)]
    if not any(checks.values()):
        lines.append(f"  (none: the bars need chat at c={LOAD_CHAT_C} or c={LOAD_HIGH_C})")
    return "\n".join(lines)


def plot_load(load: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """A PNG, one column per workload: TTFP (else TTFT) p50 solid and p95 dashed, and throughput
    (requests/s, median over rounds), against concurrency (log axis) per variant."""
    names = list(load) or [""]
    with lab.figure(Path(path), 2, len(names), figsize=(3.4 * len(names), 6.4), squeeze=False, title=title,
                    title_size=9) as (fig, axes):
        for k, w in enumerate(names):
            by_c = load.get(w, {})
            cs = sorted(by_c, key=int)
            ttfp = any(_stat(by_c[c][v], "ttfp_ms", "median") for c in cs for v in by_c[c])
            metric = "ttfp_ms" if ttfp else "ttft_ms"
            top, bot = axes[0][k], axes[1][k]
            for v in dict.fromkeys(v for c in cs for v in by_c[c]):
                for ax, m, key, style, label in ((top, metric, "median", "-", f"{v} p50"),
                                                 (top, metric, "p95", "--", f"{v} p95"),
                                                 (bot, "throughput_rps", "median", "-", v)):
                    xy = [(int(c), y) for c in cs if (y := _stat(by_c[c].get(v), m, key)) is not None]
                    if xy:
                        ax.plot(*zip(*xy), style, marker="o", ms=3, color=COLORS.get(v, "#55a868"), label=label)
            name = metric.replace("_ms", "").upper()
            for ax, what in ((top, f"{name} p50 / p95"), (bot, "throughput")):
                if cs:
                    ax.set_xscale("log", base=2)
                    ax.set_xticks([int(c) for c in cs], cs, fontsize=8)
                ax.set(xlabel="concurrency" if ax is bot else "", ylim=(0, None))
                ax.set_title(f"{w}: {what}", fontsize=9)
                if k == 0 and ax.lines:
                    ax.legend(fontsize=6)
            if k == 0:
                top.set_ylabel(f"{name}, ms")
                bot.set_ylabel("requests/s (median over rounds)")
    return Path(path)


# ---- memory per variant ----------------------------------------------------------------------
def memory_per_variant(samples: list[dict], omni_metrics: list[dict], variants: list[str]) -> dict[str, Any]:
    """Per variant, in bytes, from its last memory sample (``samples``: the harness's) and
    omni-cache's metrics files (``omni_metrics``, rows with ``variant``): ``pss_bytes`` /
    ``rss_bytes`` of its process tree, ``gpu_bytes`` (NVML; None with ``gpu_reason``),
    ``omni_cache_pool_bytes`` and the pinned part ``omni_cache_pinned_host_bytes`` (None with
    ``pinned_reason`` without a metrics file). What is not counted: docs/benchmarks.md."""
    out: dict[str, Any] = {}
    for v in variants:
        last = ([s for s in samples if s.get("variant") == v] or [{}])[-1]
        total = last.get("total") or {}
        gpu = last.get("gpu") or {"gpu_bytes": None, "reason": "no memory sample"}
        rows = [m for m in omni_metrics if m.get("variant") == v and "pool_pinned_bytes" in m] or None
        out[v] = {"when": last.get("when"), "pss_bytes": total.get("pss"), "rss_bytes": total.get("rss"),
                  "gpu_bytes": gpu.get("gpu_bytes"), "gpu_reason": gpu.get("reason"),
                  "omni_cache_pool_bytes": rows and sum(int(m.get("pool_bytes") or 0) for m in rows),
                  "omni_cache_pool_tier": rows and sorted({m.get("pool_tier") for m in rows}),
                  "omni_cache_pinned_host_bytes": rows and sum(int(m["pool_pinned_bytes"]) for m in rows),
                  "pinned_reason": None if rows else
                  "no omni-cache metrics file with pool sizes for this variant (cache off / built-in have no pool)"}
    return out


def format_memory(mem: dict[str, Any]) -> str:
    """One line per variant: PSS, GPU memory, omni-cache pool and its pinned part (MiB)."""
    def mib(x):
        return "-" if x is None else f"{x / 2**20:.0f} MiB"

    lines = ["memory per variant (last sample): host PSS, GPU (NVML), omni-cache pool / pinned host"]
    for v, m in mem.items():
        gpu = mib(m["gpu_bytes"]) if m["gpu_bytes"] is not None else f"n/a ({m['gpu_reason']})"
        lines.append(f"  {v:12} PSS {mib(m['pss_bytes'])}, GPU {gpu}, pool {mib(m['omni_cache_pool_bytes'])} "
                     f"{m['omni_cache_pool_tier'] or ''} / pinned {mib(m['omni_cache_pinned_host_bytes'])}")
    return "\n".join(lines)
