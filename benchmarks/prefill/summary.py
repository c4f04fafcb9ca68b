"""Summaries, bar checks, table and plot of prefill-benchmark samples (no engine needed).

A sample (one request on one variant) is a dict with at least ``prefill_ms``,
``num_prompt_tokens``, ``num_cached_tokens``, ``round``, ``index`` and ``measure``; optional
``ttft_ms``, ``ttfp_ms``, ``e2e_ms``, ``stage_0_gen_ms``, ``computed_tokens``, ``error`` and
TTFP's parts (``talker_prefill_ms``, ``talker_decode_ms``, ``code2wav_ms``;
``handoff_ms`` is derived here). Samples with ``measure: false`` (warm-up, chat turn 1) or an
``error`` are not summarized.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

METRICS = ("prefill_ms", "ttft_ms", "vllm_ttft_ms", "ttfp_ms", "e2e_ms", "stage_0_gen_ms",
           "talker_prefill_ms", "talker_decode_ms", "code2wav_ms", "handoff_ms")
#: TTFP = TTFT + these + hand-off (per request; see benchmarks.prefill.worker)
TTFP_PARTS = ("ttft_ms", "talker_prefill_ms", "talker_decode_ms", "code2wav_ms")

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
    """``row[name]``; ``handoff_ms`` is derived: TTFP minus its measured parts (None if any is
    missing)."""
    if name != "handoff_ms":
        return row.get(name)
    parts = [row.get(k) for k in ("ttfp_ms",) + TTFP_PARTS]
    if any(x is None for x in parts):
        return None
    return parts[0] - sum(parts[1:])


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(xs: list[float]) -> dict[str, float] | None:
    """median, min, max, p25, p75, relative IQR (``(p75−p25)/median``) and n; None if empty."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None
    med = statistics.median(xs)
    p25, p75 = _q(xs, 0.25), _q(xs, 0.75)
    return {"median": med, "min": min(xs), "max": max(xs), "p25": p25, "p75": p75,
            "rel_iqr": (p75 - p25) / med if med else 0.0, "n": len(xs)}


def bootstrap_median_ci(xs: list[float], level: float = 0.95, resamples: int = 4000,
                        seed: int = 0) -> list[float] | None:
    """Percentile-bootstrap confidence interval ``[lo, hi]`` of the median of ``xs`` (Efron &
    Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13); seeded, so a result file
    is reproducible. None for fewer than 3 values."""
    import random

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


def summarize_workload(by_variant: dict[str, list[dict]], reference: str = "off") -> dict[str, dict[str, Any]]:
    """Per variant: statistics of every metric, hit ratio, tokens, speedups vs ``reference``.

    ``speedup_vs_off`` = median prefill of ``reference`` / median prefill of the variant;
    ``speedup_paired`` = median over requests (same round and index) of the per-request ratio
    (robust to drift between rounds), ``speedup_paired_ci95`` its 95 % bootstrap interval;
    ``fraction_of_ideal`` = speedup / (1/(1−h)) with h the median hit ratio h = cached /
    prompt tokens of the variant.
    """
    out: dict[str, dict[str, Any]] = {}
    for v, rows in by_variant.items():
        ok = valid(rows)
        s: dict[str, Any] = {"n": len(ok), "n_errors": sum(1 for r in rows if r.get("error"))}
        for m in METRICS:
            s[m] = describe([metric(r, m) for r in ok])
        hs = [r["num_cached_tokens"] / r["num_prompt_tokens"] for r in ok if r.get("num_prompt_tokens")]
        s["hit_ratio"] = statistics.median(hs) if hs else 0.0
        s["num_prompt_tokens"] = describe([r.get("num_prompt_tokens") for r in ok])
        s["num_cached_tokens"] = describe([r.get("num_cached_tokens") for r in ok])
        s["computed_tokens"] = describe([r.get("computed_tokens") for r in ok])
        rounds = sorted({r.get("round") for r in ok}, key=lambda x: (x is None, x))
        s["prefill_ms_per_round"] = {str(k): statistics.median(r["prefill_ms"] for r in ok if r.get("round") == k)
                                     for k in rounds}
        out[v] = s
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
            s["speedup_paired"] = statistics.median(pairs) if pairs else None
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
    """Add the attainable speedup to every cache variant of the shared-prefix workloads, in place.

    With a ``floor`` workload (only the part a hit computes, see
    :mod:`benchmarks.prefill.workloads`) measured on ``reference``: ``attainable_speedup`` =
    median prefill of the workload on ``reference`` / median prefill of ``floor`` on
    ``reference`` — the speedup of a prefix cache whose hit costs exactly a prefill of the
    uncached suffix alone (the step's fixed cost included, no attention over the prefix);
    ``fraction_of_attainable`` = ``speedup_vs_off`` / ``attainable_speedup``; ``floor_ms`` and
    ``floor_prompt_tokens`` (to compare with ``computed_tokens`` of the hit); ``floor_ttfp_ms``
    (the attainable TTFP) and ``ttfp_over_floor``. Without a floor on ``reference`` nothing
    is added.
    """
    floor = (workloads.get("floor") or {}).get(reference)
    if not floor or not floor.get("prefill_ms"):
        return
    f_ms = floor["prefill_ms"]["median"]
    f_tok = (floor.get("num_prompt_tokens") or {}).get("median")
    f_ttfp = (floor.get("ttfp_ms") or {}).get("median")
    for w in FLOOR_BOUNDS:
        summ = workloads.get(w) or {}
        ref = (summ.get(reference) or {}).get("prefill_ms")
        if not ref:
            continue
        attainable = ref["median"] / f_ms
        for v, s in summ.items():
            if v == reference:
                continue
            s["floor_ms"], s["floor_prompt_tokens"] = f_ms, f_tok
            s["attainable_speedup"] = attainable
            sp = s.get("speedup_vs_off")
            s["fraction_of_attainable"] = sp / attainable if sp else None
            # the attainable TTFP: a request whose prefix is fully cached costs at least the
            # floor's TTFP (its suffix alone through all three stages)
            ttfp = (s.get("ttfp_ms") or {}).get("median")
            s["floor_ttfp_ms"] = f_ttfp
            s["ttfp_over_floor"] = ttfp / f_ttfp if ttfp and f_ttfp else None


def bar_target(h: float) -> float:
    """Minimum omni-cache prefill speedup vs off for hit ratio ``h``: ≥ 0.8·1/(1−h) for
    h ≤ 0.90, ≥ 10× for h ≥ 0.95, and min(0.8·1/(1−h), 10) in between (continuous)."""
    if h >= HIGH_HIT:
        return HIGH_HIT_SPEEDUP
    target = IDEAL_FRACTION * ideal_speedup(h)
    return target if h <= LOW_HIT else min(target, HIGH_HIT_SPEEDUP)


def bar_checks(workload: str, summ: dict[str, dict[str, Any]], variant: str = "omni_cache") -> list[dict[str, Any]]:
    """The bars of one workload for ``variant``: a list of ``{check, value, target, passed}``.

    ``miss``: prefill median ≤ (1 + 2 %) × cache off. Other workloads: speedup vs off ≥
    :func:`bar_target` (h) and prefill median ≤ (1 + 2 %) × builtin's. With TTFP measured
    (:func:`ttfp_checks`) the streaming bars follow. A missing variant or metric gives
    ``passed: None`` (reported as n/a, never as PASS).
    """
    return _prefill_checks(workload, summ, variant) + ttfp_checks(workload, summ, variant)


def ttfp_checks(workload: str, summ: dict[str, dict[str, Any]], variant: str = "omni_cache") -> list[dict[str, Any]]:
    """The streaming bars on the median time to the first audio packet (issue 14):
    ``miss``: TTFP ≤ (1 + 2 %) × off's; text and chat at h ≥ 0.95: off / variant ≥ 5; every
    shared-prefix workload: TTFP ≤ (1 + 2 %) × builtin's. Empty when no variant has a TTFP."""
    s, off, bi = summ.get(variant), summ.get("off"), summ.get("builtin")

    def med(x):
        return (x.get("ttfp_ms") or {}).get("median") if x else None

    if workload == "floor" or med(s) is None:
        return []
    a = med(s)
    if workload == "miss":
        b = med(off)
        ratio = a / b if b else None
        return [{"check": f"miss TTFP: {variant} / off ≤ {1 + MISS_TOLERANCE:.2f}", "value": ratio,
                 "target": 1 + MISS_TOLERANCE, "passed": None if ratio is None else ratio <= 1 + MISS_TOLERANCE}]
    out = []
    h = s.get("hit_ratio")
    if workload in TTFP_BAR_WORKLOADS and h is not None and h >= HIGH_HIT:
        sp = med(off) / a if med(off) else None
        out.append({"check": f"TTFP speedup vs off ≥ {TTFP_SPEEDUP:g} (h={h:.3f})", "value": sp,
                    "target": TTFP_SPEEDUP, "passed": None if sp is None else sp >= TTFP_SPEEDUP})
    b = med(bi)
    ratio = a / b if b else None
    out.append({"check": f"TTFP: {variant} / builtin ≤ {1 + BUILTIN_TOLERANCE:.2f}", "value": ratio,
                "target": 1 + BUILTIN_TOLERANCE, "passed": None if ratio is None else ratio <= 1 + BUILTIN_TOLERANCE})
    return out


def _prefill_checks(workload: str, summ: dict[str, dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    s, off, bi = summ.get(variant), summ.get("off"), summ.get("builtin")
    checks: list[dict[str, Any]] = []

    def med(x):
        return x["prefill_ms"]["median"] if x and x.get("prefill_ms") else None

    if workload == "floor":
        return checks  # a reference measurement, no bar
    if workload == "miss":
        a, b = med(s), med(off)
        ratio = a / b if a and b else None
        ci = (s or {}).get("speedup_paired_ci95")
        checks.append({"check": f"miss: {variant} / off ≤ {1 + MISS_TOLERANCE:.2f}", "value": ratio,
                       "target": 1 + MISS_TOLERANCE, "passed": None if ratio is None else ratio <= 1 + MISS_TOLERANCE,
                       # paired per-request ratio variant / off: its 95 % interval says whether
                       # the run can resolve the 2 % at all
                       "paired_ratio_ci95": [1 / ci[1], 1 / ci[0]] if ci else None})
        return checks
    h = s["hit_ratio"] if s else None
    sp = s.get("speedup_vs_off") if s else None
    target = bar_target(h) if h is not None else None
    checks.append({"check": f"speedup vs off ≥ target(h={h:.3f})" if h is not None else "speedup vs off",
                   "value": sp, "target": target, "passed": None if sp is None or target is None else sp >= target})
    a, b = med(s), med(bi)
    ratio = a / b if a and b else None
    checks.append({"check": f"{variant} / builtin ≤ {1 + BUILTIN_TOLERANCE:.2f}", "value": ratio,
                   "target": 1 + BUILTIN_TOLERANCE,
                   "passed": None if ratio is None else ratio <= 1 + BUILTIN_TOLERANCE})
    return checks


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return fmt.format(x)


#: the composition bar of a KV-shared thinker (issue 16): at h >= YOCO_MIN_HIT,
#: speedup(both) >= YOCO_COMPOSE x speedup(cache) x speedup(fast prefill)
YOCO_MIN_HIT = 0.9
YOCO_COMPOSE = 0.9


def yoco_checks(workload: str, summ: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Whether fast prefill and the cache compose on a KV-shared thinker, for one workload of
    a run with the variants ``off`` (slow path), ``fast``, ``omni_cache`` and
    ``fast+omni_cache`` (:data:`omni_cache.driver.variants.YOCO_VARIANTS`): speedups vs off of
    the median thinker prefill (and of the median TTFP, reported, no bar); the bar
    ``both / (fast x cache) >= 0.9``, applied where the cache's median hit ratio is >= 0.9
    (``passed: None`` below that or when a variant is missing)."""
    sp = {v: (summ.get(v) or {}).get("speedup_vs_off") for v in ("fast", "omni_cache", "fast+omni_cache")}
    tt = {v: (summ.get(v) or {}).get("ttfp_ms_speedup_vs_off") for v in ("fast", "omni_cache", "fast+omni_cache")}
    h = (summ.get("omni_cache") or {}).get("hit_ratio")
    ok = all(sp.values())
    ratio = sp["fast+omni_cache"] / (sp["fast"] * sp["omni_cache"]) if ok else None
    applies = h is not None and h >= YOCO_MIN_HIT
    return [{"check": f"prefill speedup(both) / (speedup(fast) x speedup(cache)) >= {YOCO_COMPOSE} "
                      f"at h >= {YOCO_MIN_HIT}"
                      f" (h={h:.3f})" if h is not None else "composition",
             "value": ratio, "target": YOCO_COMPOSE,
             "passed": (ratio >= YOCO_COMPOSE) if ratio is not None and applies else None,
             "speedup_fast": sp["fast"], "speedup_cache": sp["omni_cache"], "speedup_both": sp["fast+omni_cache"],
             "product": sp["fast"] * sp["omni_cache"] if ok else None,
             "ttfp_speedup_fast": tt["fast"], "ttfp_speedup_cache": tt["omni_cache"],
             "ttfp_speedup_both": tt["fast+omni_cache"]}]


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
                f"{w:8} {v:10} {_f((s.get('num_prompt_tokens') or {}).get('median'), '{:.0f}'):>6} "
                f"{s['hit_ratio']:6.3f} {_f(pre.get('median')):>10} "
                f"{_f(100 * pre['rel_iqr'] if pre else None, '{:.0f}'):>5} "
                f"{_f((s.get('ttft_ms') or {}).get('median')):>8} {_f((s.get('ttfp_ms') or {}).get('median')):>8} "
                f"{_f((s.get('e2e_ms') or {}).get('median')):>8} {_f(s.get('speedup_vs_off'), '{:.2f}'):>7} "
                f"{_f(s.get('ideal_speedup'), '{:.2f}'):>6} {_f(s.get('fraction_of_ideal'), '{:.2f}'):>8} "
                f"{_f(s.get('attainable_speedup'), '{:.2f}'):>7} {_f(s.get('fraction_of_attainable'), '{:.2f}'):>7}")
    lines.append("")
    lines.append("attain. = off / floor: the speedup of a hit that costs a prefill of the suffix alone "
                 "(workload 'floor'); of att. = speedup / attain.")
    parts = [(w, v, s) for w, summ in workloads.items() for v, s in summ.items()
             if (s.get("ttfp_ms") or {}).get("median")]
    if parts:
        lines.append("")
        lines.append("TTFP and its parts (medians, ms): TTFT + talker prefill + talker decode (rest of the first "
                     "codec chunk) + code2wav + hand-off")
        for w, v, s in parts:
            vals = " ".join(f"{k.replace('_ms', '')} {_f((s.get(k) or {}).get('median'))}"
                            for k in ("ttfp_ms",) + TTFP_PARTS + ("handoff_ms",))
            extra = (f"; floor TTFP {s['floor_ttfp_ms']:.1f} ({s['ttfp_over_floor']:.2f}x)"
                     if s.get("ttfp_over_floor") else "")
            lines.append(f"  {w:8} {v:10} {vals}{extra}")
    lines.append("")
    lines.append("bar checks (omni-cache; thinker prefill time, then TTFP):")
    for w, cs in checks.items():
        for c in cs:
            verdict = {True: "PASS", False: "FAIL", None: "n/a "}[c["passed"]]
            ci = c.get("paired_ratio_ci95")
            extra = f"; paired per-request ratio 95% CI [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
            lines.append(f"  {verdict}  {w:6} {c['check']}: value {_f(c['value'], '{:.3f}')} "
                         f"(target {_f(c['target'], '{:.3f}')}){extra}")
    return "\n".join(lines)


def plot(workloads: dict[str, dict[str, dict[str, Any]]], path: str | Path, title: str = "") -> Path:
    """One panel per workload: median thinker prefill time per variant (bar, p25–p75 error bar);
    a dashed line marks the ideal for each cache variant (off median / (1/(1−h))). When TTFP
    was measured, a second row beside it: per variant the medians of TTFP's parts stacked
    (TTFT, talker prefill, talker decode, code2wav, hand-off), a black tick at the
    median TTFP and a dotted line at the floor's TTFP (the attainable). PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(workloads)
    with_ttfp = any((s.get("ttfp_ms") or {}).get("median") for summ in workloads.values() for s in summ.values())
    nrows = 2 if with_ttfp else 1
    fig, axes = plt.subplots(nrows, max(len(names), 1), figsize=(3.2 * max(len(names), 1), 3.6 * nrows),
                             squeeze=False)
    colors = {"off": "#888888", "builtin": "#4c72b0", "omni_cache": "#dd8452", "fast": "#8172b3",
              "fast+omni_cache": "#c44e52"}
    for ax, w in zip(axes[0], names):
        summ = workloads[w]
        vs = [v for v in summ if summ[v].get("prefill_ms")]
        meds = [summ[v]["prefill_ms"]["median"] for v in vs]
        lo = [summ[v]["prefill_ms"]["median"] - summ[v]["prefill_ms"]["p25"] for v in vs]
        hi = [summ[v]["prefill_ms"]["p75"] - summ[v]["prefill_ms"]["median"] for v in vs]
        ax.bar(range(len(vs)), meds, yerr=[lo, hi], capsize=3, color=[colors.get(v, "#55a868") for v in vs])
        off = summ.get("off", {}).get("prefill_ms")
        for k, v in enumerate(vs):
            if v != "off" and off and math.isfinite(summ[v]["ideal_speedup"]):
                ideal = off["median"] / summ[v]["ideal_speedup"]
                ax.hlines(ideal, k - 0.4, k + 0.4, colors="k", linestyles="--", linewidth=1, zorder=3,
                          label="ideal 1/(1−h)" if k == 1 else None)
            if v != "off" and summ[v].get("floor_ms"):
                ax.hlines(summ[v]["floor_ms"], k - 0.4, k + 0.4, colors="#c44e52", linestyles=":", linewidth=1.5,
                          zorder=3,
                          label="floor (suffix alone)" if k == 1 else None)
            sp = summ[v].get("speedup_vs_off")
            ax.text(k, meds[k] + hi[k], f"{meds[k]:.0f} ms" + (f"\n{sp:.1f}×" if sp and v != "off" else ""),
                    ha="center", va="bottom", fontsize=7)
        if vs:
            ax.set_ylim(0, 1.3 * max(m + e for m, e in zip(meds, hi)))
        h = max((summ[v]["hit_ratio"] for v in vs), default=0.0)
        ax.set_title(f"{w} (h={h:.2f})", fontsize=9)
        ax.set_xticks(range(len(vs)))
        ax.set_xticklabels(_tick_labels(vs), fontsize=8)
        ax.set_ylabel("thinker prefill, ms (median)" if ax is axes[0][0] else "")
        if any(v != "off" for v in vs):
            ax.legend(fontsize=7, loc="upper right")
    if with_ttfp:
        for ax, w in zip(axes[1], names):
            _ttfp_panel(ax, workloads[w], w, first=ax is axes[1][0])
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _tick_labels(variants: list[str]) -> list[str]:
    """Variant names for x ticks, a combined variant (``fast+omni_cache``) on two lines so
    neighbouring labels do not overlap."""
    return [v.replace("+", "+\n") for v in variants]


_PART_COLORS = {"ttft_ms": "#4c72b0", "talker_prefill_ms": "#dd8452", "talker_decode_ms": "#55a868",
                "code2wav_ms": "#c44e52", "handoff_ms": "#937860"}


def _ttfp_panel(ax, summ: dict[str, dict[str, Any]], w: str, first: bool) -> None:
    vs = [v for v in summ if (summ[v].get("ttfp_ms") or {}).get("median")]
    for k, v in enumerate(vs):
        bottom = 0.0
        for part in TTFP_PARTS + ("handoff_ms",):
            m = (summ[v].get(part) or {}).get("median")
            if m is None or m <= 0:
                continue
            ax.bar(k, m, bottom=bottom, color=_PART_COLORS[part], width=0.6,
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
    if vs:
        ax.set_ylim(0, 1.3 * max(summ[v]["ttfp_ms"]["median"] for v in vs))
    ax.set_xticks(range(len(vs)))
    ax.set_xticklabels(_tick_labels(vs), fontsize=8)
    ax.set_title(f"{w}: TTFP and its parts", fontsize=9)
    if first:
        ax.set_ylabel("time to first audio packet, ms (median)")
        ax.legend(fontsize=6, loc="upper right")
