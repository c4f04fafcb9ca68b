"""Prefill-benchmark harness pieces that need no engine: workloads, stage configs, summary,
bar checks, table and plot (synthetic samples)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from benchmarks.prefill import summary as S
from benchmarks.prefill.workloads import WORKLOADS, WorkloadOptions, specs, warmup_specs
from omni_cache.driver.variants import MemorySettings, variant_stage_config
from tests.util import CPU_STAGE_CONFIG

REPO = Path(__file__).resolve().parents[2]


def _rows(ms: list[float], h: float, prompt: int = 1000, rounds: int = 2) -> list[dict]:
    out = []
    for r in range(rounds):
        for i, t in enumerate(ms):
            out.append({"round": r, "index": i, "prefill_ms": t, "num_prompt_tokens": prompt,
                        "num_cached_tokens": int(round(h * prompt)), "e2e_ms": 3 * t, "measure": True})
    return out


def test_ideal_and_bar_target():
    assert S.ideal_speedup(0.0) == 1.0
    assert S.ideal_speedup(0.9) == pytest.approx(10.0)
    assert math.isinf(S.ideal_speedup(1.0))
    assert S.bar_target(0.5) == pytest.approx(1.6)           # 0.8 × 2
    assert S.bar_target(0.9) == pytest.approx(8.0)           # 0.8 × 10
    assert S.bar_target(0.93) == pytest.approx(10.0)         # min(0.8 × 14.3, 10)
    assert S.bar_target(0.92) == pytest.approx(0.8 / 0.08)   # 10.0 → capped at 10
    assert S.bar_target(0.97) == 10.0


def test_summary_speedups_and_checks():
    by_v = {"off": _rows([100, 110, 90], 0.0), "builtin": _rows([10, 11, 9], 0.96),
            "omni_cache": _rows([9.0, 10.0, 8.0], 0.96)}
    by_v["omni_cache"].append({"round": 0, "index": 9, "measure": False, "prefill_ms": 1e6,
                               "num_prompt_tokens": 1, "num_cached_tokens": 0})  # warm-up: ignored
    by_v["omni_cache"].append({"round": 0, "index": 8, "error": "boom", "prefill_ms": None})
    s = S.summarize_workload(by_v)
    assert s["off"]["prefill_ms"]["median"] == 100
    assert s["omni_cache"]["n"] == 6 and s["omni_cache"]["n_errors"] == 1
    assert s["omni_cache"]["speedup_vs_off"] == pytest.approx(100 / 9)
    assert s["omni_cache"]["speedup_paired"] == pytest.approx(100 / 9)
    assert s["omni_cache"]["hit_ratio"] == pytest.approx(0.96)
    assert s["omni_cache"]["ideal_speedup"] == pytest.approx(25.0)
    assert s["omni_cache"]["fraction_of_ideal"] == pytest.approx(100 / 9 / 25)
    assert s["omni_cache"]["e2e_ms_speedup_vs_off"] == pytest.approx(100 / 9)
    checks = S.bar_checks("text", s)
    assert [c["passed"] for c in checks] == [True, True]
    # slower than the built-in cache by more than 2 %: the second bar fails
    by_v["omni_cache"] = _rows([10.5, 11.5, 9.5], 0.96)
    checks = S.bar_checks("text", S.summarize_workload(by_v))
    assert [c["passed"] for c in checks] == [False, False]


def test_miss_bar_and_missing_variant():
    s = S.summarize_workload({"off": _rows([100, 100], 0.0), "omni_cache": _rows([101.5, 101.5], 0.0)})
    assert S.bar_checks("miss", s)[0]["passed"] is True
    s = S.summarize_workload({"off": _rows([100, 100], 0.0), "omni_cache": _rows([103, 103], 0.0)})
    assert S.bar_checks("miss", s)[0]["passed"] is False
    # no builtin variant: that bar is n/a (None), never PASS
    s = S.summarize_workload({"off": _rows([100], 0.0), "omni_cache": _rows([50], 0.5)})
    checks = S.bar_checks("image", s)
    assert checks[0]["passed"] is True           # speedup 2.0 ≥ 0.8 × 1/(1−0.5) = 1.6
    assert checks[1]["passed"] is None


def _stream_rows(ttfp: list[float], h: float, parts: dict | None = None, **kw) -> list[dict]:
    rows = _rows([10.0] * len(ttfp), h, **kw)
    for r in rows:
        r["ttfp_ms"] = ttfp[r["index"]]
        r.update(parts or {})
    return rows


def test_ttfp_parts_and_handoff():
    parts = {"ttft_ms": 50.0, "talker_prefill_ms": 20.0, "talker_decode_ms": 30.0, "code2wav_ms": 10.0}
    s = S.summarize_workload({"off": _stream_rows([200.0, 200.0], 0.0, parts)})
    assert s["off"]["handoff_ms"]["median"] == pytest.approx(200 - 110)
    # a missing part: no hand-off figure rather than a wrong one
    rows = _stream_rows([200.0], 0.0, {**parts, "code2wav_ms": None})
    assert S.metric(rows[0], "handoff_ms") is None


def test_ttfp_bars():
    by_v = {"off": _stream_rows([1000.0, 1100.0], 0.0), "builtin": _stream_rows([180.0, 190.0], 0.96),
            "omni_cache": _stream_rows([150.0, 160.0], 0.96)}
    s = S.summarize_workload(by_v)
    ttfp = S.ttfp_checks("text", s)
    assert [c["passed"] for c in ttfp] == [True, True]
    assert ttfp[0]["value"] == pytest.approx(1050 / 155)
    assert S.bar_checks("text", s)[-2:] == ttfp
    # image: no 5x bar (text and chat only), the builtin bar stays; slower than builtin fails
    by_v["omni_cache"] = _stream_rows([200.0, 210.0], 0.96)
    s = S.summarize_workload(by_v)
    assert [c["passed"] for c in S.ttfp_checks("image", s)] == [False]
    # text below 5x fails
    by_v["omni_cache"] = _stream_rows([250.0, 250.0], 0.96)
    assert S.ttfp_checks("text", S.summarize_workload(by_v))[0]["passed"] is False
    # h below 0.95: the 5x bar does not apply
    by_v = {"off": _stream_rows([1000.0], 0.0), "omni_cache": _stream_rows([900.0], 0.5)}
    checks = S.ttfp_checks("chat", S.summarize_workload(by_v))
    assert len(checks) == 1 and checks[0]["passed"] is None  # no builtin: n/a
    # miss: within 2 % of off
    miss = {"off": _stream_rows([1000.0], 0.0), "omni_cache": _stream_rows([1030.0], 0.0)}
    assert S.ttfp_checks("miss", S.summarize_workload(miss))[0]["passed"] is False
    # no TTFP measured: no TTFP bars
    assert S.ttfp_checks("text", S.summarize_workload({"off": _rows([1.0], 0.0)})) == []


def test_floor_ttfp_is_the_attainable():
    summ = {"text": S.summarize_workload({"off": _stream_rows([1000.0], 0.0),
                                          "omni_cache": _stream_rows([150.0], 0.96)}),
            "floor": S.summarize_workload({"off": _stream_rows([120.0], 0.0)})}
    S.add_attainable(summ)
    assert summ["text"]["omni_cache"]["floor_ttfp_ms"] == 120.0
    assert summ["text"]["omni_cache"]["ttfp_over_floor"] == pytest.approx(1.25)


def test_stream_table_and_plot(tmp_path):
    parts = {"ttft_ms": 50.0, "talker_prefill_ms": 20.0, "talker_decode_ms": 30.0, "code2wav_ms": 10.0}
    summ = {"text": S.summarize_workload({"off": _stream_rows([1000.0], 0.0, parts),
                                          "omni_cache": _stream_rows([150.0], 0.96, parts)})}
    table = S.format_table(summ, {"text": S.bar_checks("text", summ["text"])})
    assert "TTFP and its parts" in table and "handoff" in table
    png = S.plot(summ, tmp_path / "p.png")
    assert png.stat().st_size > 10_000


def test_table_and_plot(tmp_path):
    summ = {"text": S.summarize_workload({"off": _rows([100], 0.0), "builtin": _rows([12], 0.95),
                                          "omni_cache": _rows([11], 0.95)}),
            "miss": S.summarize_workload({"off": _rows([100], 0.0), "builtin": _rows([99], 0.0),
                                          "omni_cache": _rows([100.5], 0.0)})}
    checks = {w: S.bar_checks(w, summ[w]) for w in summ}
    table = S.format_table(summ, checks)
    assert "omni_cache" in table and "PASS" in table and "FAIL" in table
    png = S.plot(summ, tmp_path / "p.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workload_specs_share_prefix_and_miss_does_not():
    opts = WorkloadOptions(requests=3, prefix_words=50)
    text = specs("text", 0, opts)
    assert len(text) == 3 and len({s["text"] for s in text}) == 3
    assert len({s["text"].split("\n\n")[0] for s in text}) == 1      # shared document
    assert all(s["image"] for s in specs("image", 1, opts)) and all(s["audio"] for s in specs("audio", 1, opts))
    # rounds never repeat a timed prompt
    assert not {s["text"] for s in text} & {s["text"] for s in specs("text", 1, opts)}
    miss = specs("miss", 0, opts) + specs("miss", 1, opts)
    assert len({s["system"][:8] for s in miss}) == len(miss)          # distinct from the first token on
    chat = specs("chat", 0, opts)
    assert [s["chat"]["turn"] for s in chat] == [0, 1, 2] and [s["measure"] for s in chat] == [False, True, True]
    assert len(warmup_specs(list(WORKLOADS), opts)) == len(WORKLOADS)
    with pytest.raises(ValueError, match="unknown workload"):
        specs("video", 0, opts)


def test_variant_stage_configs(tmp_path):
    mem = MemorySettings(thinker_kv_bytes=64 << 20)
    off = yaml.safe_load(variant_stage_config(CPU_STAGE_CONFIG, tmp_path, "off", mem=mem).read_text())
    oc = yaml.safe_load(variant_stage_config(CPU_STAGE_CONFIG, tmp_path, "omni_cache", mem=mem).read_text())
    bi = yaml.safe_load(variant_stage_config(CPU_STAGE_CONFIG, tmp_path, "builtin", mem=mem).read_text())
    assert off["stages"][0]["enable_prefix_caching"] is False
    assert oc["stages"][0]["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] == "omni_cache"
    assert bi["stages"][0]["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] == "builtin"
    for cfg in (off, oc, bi):
        assert cfg["stages"][0]["kv_cache_memory_bytes"] == 64 << 20
        assert cfg["stages"][0]["default_sampling_params"]["max_tokens"] == 2
    # apart from the thinker's cache settings the variants are identical
    for cfg in (off, bi):
        for k in ("enable_prefix_caching", "env"):
            cfg["stages"][0].pop(k)
            oc["stages"][0].pop(k, None)
        assert cfg == oc
    from omni_cache.driver.stage_config import load_stage_config

    for v in ("off", "builtin", "omni_cache"):
        load_stage_config(tmp_path / f"stage_config_{v}.yaml")   # valid for omni-cache's validator
    with pytest.raises(ValueError, match="unknown variant"):
        variant_stage_config(CPU_STAGE_CONFIG, tmp_path, "nope", mem=mem)


def test_media_copies_differ():
    import numpy as np
    from PIL import Image

    from benchmarks.prefill.workloads import audio_copy, image_copy

    img = Image.fromarray((np.arange(48 * 32 * 3) % 251).astype(np.uint8).reshape(32, 48, 3))
    copies = [np.asarray(image_copy(img, k)).tobytes() for k in range(12)]
    assert len(set(copies)) == 12 and copies[0] == np.asarray(img).tobytes()
    wav = np.arange(100, dtype=np.float32)
    assert len({audio_copy(wav, k, 4).tobytes() for k in range(4)}) == 4
    opts = WorkloadOptions(requests=2, media_copies=3)
    assert all(s["media_copies"] == 3 for s in specs("image", 0, opts))


def test_cli_rejects_bad_input_before_starting_anything(tmp_path, capsys):
    from omni_cache.cli import main

    assert main(["bench", "prefill", "--modalities", "text,video", "--out", str(tmp_path)]) == 2
    assert "video" in capsys.readouterr().err
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    assert main(["bench", "prefill", "--image", str(bad), "--out", str(tmp_path)]) == 2
    assert "broken.jpg" in capsys.readouterr().err
    assert main(["bench", "prefill", "--modalities", "chat", "--requests", "1", "--out", str(tmp_path)]) == 2
    assert main(["bench", "prefill", "--model", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert not any(tmp_path.glob("prefill-*"))   # no run directory, no pipeline


def test_no_samples_is_never_a_pass(tmp_path):
    s = {"text": S.summarize_workload({"off": [], "builtin": [], "omni_cache": []})}
    checks = {"text": S.bar_checks("text", s["text"])}
    assert all(c["passed"] is None for c in checks["text"])
    assert "PASS" not in S.format_table(s, checks)
    S.plot(s, tmp_path / "empty.png")


def test_floor_gives_the_attainable_speedup():
    """``floor`` (a hit's suffix alone) on cache off bounds what any prefix cache can reach."""
    summ = {"text": S.summarize_workload({"off": _rows([200, 220], 0.0), "builtin": _rows([60], 0.9),
                                          "omni_cache": _rows([50], 0.9)}),
            "floor": S.summarize_workload({"off": _rows([40, 40], 0.0, prompt=100),
                                           "omni_cache": _rows([41], 0.0, prompt=100)})}
    S.add_attainable(summ)
    oc = summ["text"]["omni_cache"]
    assert oc["attainable_speedup"] == pytest.approx(210 / 40)
    assert oc["fraction_of_attainable"] == pytest.approx((210 / 50) / (210 / 40))
    assert oc["floor_ms"] == 40 and oc["floor_prompt_tokens"] == 100
    assert "attainable_speedup" not in summ["text"]["off"] and "attainable_speedup" not in summ["floor"]["off"]
    assert S.bar_checks("floor", summ["floor"]) == []
    assert "attain." in S.format_table(summ, {w: S.bar_checks(w, summ[w]) for w in summ})
    # no floor measured on cache off: nothing is claimed
    bare = {"text": S.summarize_workload({"off": _rows([200], 0.0), "omni_cache": _rows([50], 0.9)})}
    S.add_attainable(bare)
    assert "attainable_speedup" not in bare["text"]["omni_cache"]
    # floor prompts share no block with each other (distinct questions, empty system prompt)
    floor = specs("floor", 0, WorkloadOptions(requests=3)) + specs("floor", 1, WorkloadOptions(requests=3))
    assert len({s["text"] for s in floor}) == 6 and all(s["system"] == "" for s in floor)


def test_paired_speedup_has_a_bootstrap_interval():
    off = _rows([100, 100, 100, 100, 100], 0.0, rounds=2)
    slow = [dict(r, prefill_ms=r["prefill_ms"] * (1.04 + 0.01 * r["index"])) for r in off]
    s = S.summarize_workload({"off": off, "omni_cache": slow})
    lo, hi = s["omni_cache"]["speedup_paired_ci95"]
    assert lo <= s["omni_cache"]["speedup_paired"] <= hi < 1.0   # reliably slower than off
    assert S.bootstrap_median_ci([1.0, 2.0]) is None
    assert S.bootstrap_median_ci([1.0] * 5) == [1.0, 1.0]


def test_serve_bench_command_and_summary(tmp_path):
    """benchmarks/serve_bench.py: the vllm-omni tool's command line and the off / on summary."""
    import argparse

    from benchmarks import serve_bench as SB

    args = argparse.Namespace(prefix_len=1536, suffix_len=32, num_prefixes=2, output_len=16, num_prompts=24,
                              max_concurrency=4, seed=0)
    cmd = SB.tool_command(args, "http://127.0.0.1:8091/v1", "m", tmp_path, tmp_path, "r.json")
    assert cmd[1:5] == ["bench", "serve", "--omni", "--backend"] and "openai-chat-omni" in cmd
    assert cmd[cmd.index("--base-url") + 1] == "http://127.0.0.1:8091"  # the tool appends the endpoint
    assert cmd[cmd.index("--dataset-name") + 1] == "prefix_repetition"
    assert "audio_ttfp" in cmd[cmd.index("--percentile-metrics") + 1]

    def run(variant, cycle, ttft, ttfp, hits):
        return {"variant": variant, "cycle": cycle, "completed": 24, "failed": 0,
                "headline": {"median_ttft_ms": ttft, "median_audio_ttfp_ms": ttfp, "request_throughput": 1.0},
                "stage0_prefix_cache": {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": hits}}

    summ = SB.summarize([run("on", 0, 100.0, 400.0, 90.0), run("off", 0, 500.0, 900.0, 0.0),
                         run("on", 1, 120.0, 420.0, 90.0), run("off", 1, 520.0, 940.0, 0.0)])
    assert summ["on"]["median_ttft_ms"] == 110.0 and summ["off"]["median_ttft_ms"] == 510.0
    assert summ["off_over_on"]["median_ttft_ms"] == pytest.approx(510 / 110)
    assert summ["on"]["thinker_hit_ratio"] == pytest.approx(0.9) and summ["off"]["thinker_hit_ratio"] == 0.0
    assert "p99_ttft_ms" not in summ["off_over_on"]  # not measured: no ratio
    assert SB.plot(summ, tmp_path / "s.png", "t").stat().st_size > 10_000


def test_routing_bench_summary():
    """benchmarks/routing_bench.py's summary: hit ratio over turns >= 2, percentiles, ratios, bars."""
    from benchmarks.routing_bench import summarize

    def rec(policy, rnd, turn, ttft, hit):
        return dict(policy=policy, round=rnd, conversation=0, turn=turn, ttft_s=ttft, ttfp_s=2 * ttft, hit=hit)

    records = [rec("prefix", 0, 0, 4.0, False), rec("prefix", 0, 1, 1.0, True), rec("prefix", 0, 2, 1.0, True),
               rec("vllm_omni", 1, 0, 4.0, False), rec("vllm_omni", 1, 1, 4.0, False),
               rec("vllm_omni", 1, 2, 2.0, True)]
    s = summarize(records)
    assert s["prefix"]["hit_ratio_turn2plus"] == 1.0 and s["vllm_omni"]["hit_ratio_turn2plus"] == 0.5
    assert s["prefix"]["ttft_s_p50_all"] == 1.0 and s["vllm_omni"]["ttft_s_p50_all"] == 4.0
    assert s["ratios"]["ttft_s_p50_all_vllm_omni_over_prefix"] == 4.0
    assert s["prefix"]["ttfp_s_round_medians"] == [2.0]
    assert all(s["bars"].values())


def test_yoco_variant_stage_configs(tmp_path):
    """The four YOCO variants of a KV-shared thinker's config: fast prefill and the cache set
    as named; a fast variant of a config without fast prefill is refused."""
    from tests.util import REPO

    base = REPO / "stage_configs" / "gemma4_yoco_cpu.yaml"
    mem = MemorySettings(thinker_kv_bytes=64 << 20)
    got = {}
    for v in ("off", "fast", "omni_cache", "fast+omni_cache"):
        got[v] = yaml.safe_load(variant_stage_config(base, tmp_path, v, mem=mem).read_text())["stages"][0]
    assert [got[v]["kv_sharing_fast_prefill"] for v in got] == [False, True, False, True]
    assert [got[v]["enable_prefix_caching"] for v in got] == [False, False, True, True]
    assert got["fast+omni_cache"]["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] == "omni_cache"
    assert "OMNI_CACHE_PREFIX_CACHE_BACKEND" not in got["fast"]["env"]
    with pytest.raises(ValueError, match="kv_sharing_fast_prefill"):
        variant_stage_config(CPU_STAGE_CONFIG, tmp_path, "fast", mem=mem)


def test_yoco_composition_check():
    """speedup(both) / (speedup(fast) x speedup(cache)): a pass at >= 0.9 with h >= 0.9, a
    fail below 0.9, and no verdict at h < 0.9."""
    by_v = {"off": _rows([100, 100], 0.0), "fast": _rows([50, 50], 0.0),
            "omni_cache": _rows([10, 10], 0.95), "fast+omni_cache": _rows([5.2, 5.2], 0.95)}
    (c,) = S.yoco_checks("text", S.summarize_workload(by_v))
    assert c["speedup_fast"] == pytest.approx(2) and c["speedup_cache"] == pytest.approx(10)
    assert c["value"] == pytest.approx(100 / 5.2 / 20) and c["passed"] is True
    by_v["fast+omni_cache"] = _rows([7, 7], 0.95)
    assert S.yoco_checks("text", S.summarize_workload(by_v))[0]["passed"] is False
    by_v["omni_cache"] = _rows([10, 10], 0.5)
    assert S.yoco_checks("text", S.summarize_workload(by_v))[0]["passed"] is None
    del by_v["fast"]
    assert S.yoco_checks("text", S.summarize_workload(by_v))[0]["passed"] is None


def test_yoco_paired_runs_combine_to_the_same_composition(tmp_path):
    """--paired: a 4-variant run split into its miss pair and hit pair gives back the run's
    composition exactly (the medians of ``off`` cancel)."""
    from benchmarks.yoco_bench import combine_pairs

    src = json.loads((REPO / "benchmarks/results/yoco-gemma4-bench-20261124-225007/result.json").read_text())
    for tag, keep in (("miss", ("off", "fast")), ("hit", ("omni_cache", "fast+omni_cache"))):
        d = tmp_path / f"p-{tag}"
        d.mkdir()
        part = {"samples": {w: {v: rows for v, rows in by.items() if v in keep} for w, by in src["samples"].items()}}
        (d / "result.json").write_text(json.dumps(part))
    assert combine_pairs(tmp_path, "p", ["miss", "hit"]) == 0
    got = json.loads((tmp_path / "p" / "result.json").read_text())["bar_checks"]["image"][0]
    want = src["bar_checks"]["image"][0]
    assert got["value"] == pytest.approx(want["value"], rel=1e-12)
    assert got["passed"] is want["passed"]
    assert got["hit_gain_fast"] / got["miss_gain_fast"] == pytest.approx(want["value"], rel=1e-12)
    assert (tmp_path / "p" / "prefill.png").stat().st_size > 0
