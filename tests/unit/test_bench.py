"""Prefill-benchmark harness pieces that need no engine: workloads, stage configs, summary,
bar checks, table and plot (synthetic samples)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from benchmarks.prefill import summary as S
from benchmarks.prefill.workloads import WARMUP_REQUESTS, WORKLOADS, WorkloadOptions, specs, warmup_specs
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


def test_prefill_legend_whatever_the_variant_order():
    """The prefill panel's legend (the ideal 1/(1−h) and floor lines) is drawn whatever order
    the variants ran in: the eighth GPU session's ``--variants omni_cache,off`` drew none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = S.summarize_workload({"omni_cache": _rows([11], 0.95), "off": _rows([100], 0.0)})
    fig, ax = plt.subplots()
    S._prefill_panel(ax, summ, "text", True)
    assert "ideal 1/(1−h)" in ax.get_legend_handles_labels()[1]
    plt.close(fig)


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
    # the c = 1 warm-up: the first request puts the prefix in the cache, the later ones prefill a
    # hit's suffix as the timed requests do (a cache variant's hit-shaped prefill is not first met
    # in a timed request: docs/gpu.md "Thirteenth session"); none timed, no timed prompt repeated
    warm = warmup_specs(list(WORKLOADS), opts)
    assert len(warm) == WARMUP_REQUESTS * len(WORKLOADS) and WARMUP_REQUESTS >= 3
    assert not any(s["measure"] for s in warm)
    wtext = [s for s in warm if s["workload"] == "text"]
    assert len({s["text"].split("\n\n")[0] for s in wtext}) == 1 and len({s["text"] for s in wtext}) == len(wtext)
    assert not {s["text"] for s in wtext} & {s["text"] for s in text}
    assert [s["chat"]["turn"] for s in warm if s["workload"] == "chat"] == list(range(WARMUP_REQUESTS))
    with pytest.raises(ValueError, match="unknown workload"):
        specs("video", 0, opts)


def test_answer_tokens_set_every_request_but_chat_turns():
    # default: the variant's stage config decides (max_tokens None); --answer-tokens N: every
    # timed and warm-up request of the other workloads answers N tokens, chat turns keep theirs
    assert all(s["max_tokens"] is None for w in ("text", "floor", "miss") for s in specs(w, 0, WorkloadOptions()))
    opts = WorkloadOptions(requests=3, answer_tokens=32, chat_answer_tokens=48)
    for w in ("text", "image", "audio", "floor", "miss"):
        assert {s["max_tokens"] for s in specs(w, 0, opts) + specs(w, 0, opts, concurrency=4)} == {32}, w
        assert {s["max_tokens"] for s in warmup_specs([w], opts) + warmup_specs([w], opts, 4)} == {32}, w
    assert {s["max_tokens"] for s in specs("chat", 0, opts)} == {48}


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
    from benchmarks.prefill.harness import main

    assert main(["--modalities", "text,video", "--out", str(tmp_path)]) == 2
    assert "video" in capsys.readouterr().err
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    assert main(["--image", str(bad), "--out", str(tmp_path)]) == 2
    assert "broken.jpg" in capsys.readouterr().err
    assert main(["--modalities", "chat", "--requests", "1", "--out", str(tmp_path)]) == 2
    assert main(["--answer-tokens", "1", "--out", str(tmp_path)]) == 2
    assert "--answer-tokens 1" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
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


# ---- under load (--concurrency) -----------------------------------------------------------

def _load_rows(ttfp: list[float], h: float = 0.95, prompt: int = 1000, **extra) -> list[dict]:
    return [{"round": 0, "index": i, "measure": True, "ttft_ms": t / 2, "ttfp_ms": t, "e2e_ms": 2 * t,
             "num_prompt_tokens": prompt, "num_cached_tokens": int(round(h * prompt)), **extra}
            for i, t in enumerate(ttfp)]


def _batches(ttfp: list[float], rps: list[float], h: float = 0.95) -> list[dict]:
    """One batch per entry of ``rps`` (requests/s), each holding the requests ``ttfp`` (ms)."""
    return [{"round": r, "throughput_rps": x, "wall_s": len(ttfp) / x, "results": _load_rows(ttfp, h)}
            for r, x in enumerate(rps)]


def test_load_summary_percentiles_and_throughput():
    ttfp = [float(x) for x in range(1, 21)]                     # 1..20 ms
    batches = _batches(ttfp, [2.0, 4.0, 3.0])
    batches[0]["results"].append({"round": 0, "index": 99, "measure": True, "error": "boom", "ttfp_ms": 1e6})
    batches[0]["results"].append({"round": 0, "index": 98, "measure": False, "ttfp_ms": 1e6,
                                  "num_prompt_tokens": 10, "num_cached_tokens": 0})  # chat turn 1: untimed
    s = S.summarize_batches(batches)
    assert s["n"] == 60 and s["n_errors"] == 1 and s["n_requests"] == 62
    assert s["ttfp_ms"]["median"] == pytest.approx(10.5)
    assert s["ttfp_ms"]["p95"] == pytest.approx(19.05)          # 1 + 0.95 × 19 (interpolated order statistics)
    assert s["ttft_ms"]["p95"] == pytest.approx(19.05 / 2) and s["e2e_ms"]["p25"] == pytest.approx(2 * 5.75)
    assert s["throughput_rps"] == {"median": 3.0, "per_round": [2.0, 4.0, 3.0]}
    assert s["hit_ratio"] == pytest.approx(0.95)
    # c = 1 rows (one at a time): throughput = requests / sum of their e2e per round
    one = S.one_at_a_time_batches(_load_rows([250.0, 250.0], 0.0) + [{"round": 0, "index": 5, "error": "x"}])
    assert one[0]["throughput_rps"] == pytest.approx(2 / 1.0) and one[0]["n_errors"] == 1
    load = S.summarize_load({"text": {"4": {"off": batches}}}, {"text": {"off": _load_rows([250.0, 250.0])}})
    assert list(load["text"]) == ["1", "4"]
    assert load["text"]["1"]["off"]["throughput_rps"]["median"] == pytest.approx(2.0)
    assert load["text"]["4"]["off"]["ttfp_ms"]["median"] == pytest.approx(10.5)


def _chat_load(oc: float, builtin: float, floor: float, h: float = 0.95) -> dict:
    return S.summarize_load({
        "chat": {"4": {"off": _batches([1000.0] * 4, [1.0], 0.0), "builtin": _batches([builtin] * 4, [1.0], h),
                       "omni_cache": _batches([oc] * 4, [1.0], h)}},
        "floor": {"4": {"off": _batches([floor] * 4, [1.0], 0.0)}}})


def test_load_bar_chat_c4():
    # omni-cache 120 ms, floor 100 ms (1.2 ≤ 1.25), builtin 130 ms: both pass
    checks = S.load_checks(_chat_load(120.0, 130.0, 100.0))["chat"]
    assert [c["passed"] for c in checks] == [True, True]
    assert checks[0]["value"] == pytest.approx(1.2) and checks[1]["value"] == pytest.approx(120 / 130)
    # 130 ms: 1.3× the floor fails; slower than builtin (125 ms) by more than 2 % fails
    checks = S.load_checks(_chat_load(130.0, 125.0, 100.0))["chat"]
    assert [c["passed"] for c in checks] == [False, False]
    # prefix hit below 0.9: the bar does not apply
    assert [c["passed"] for c in S.load_checks(_chat_load(120.0, 130.0, 100.0, h=0.5))["chat"]] == [None, None]
    # no samples: n/a, never a pass
    empty = S.summarize_load({"chat": {"4": {"off": [], "builtin": [], "omni_cache": []}}})
    checks = S.load_checks(empty)["chat"]
    assert [c["passed"] for c in checks] == [None, None]
    assert "PASS" not in S.format_load_table(empty, {"chat": checks})
    # c = 4 not run: no chat bar at all
    assert "chat" not in S.load_checks(S.summarize_load({"chat": {"16": {"omni_cache": _batches([1.0], [1.0])}}}))


def _c64_load(oc_rps: float, oc_p95: float, off_rps: float = 10.0, builtin_p95: float = 200.0) -> dict:
    def b(p95: float, rps: float):  # 20 requests, the largest one sets the p95 (19 × 100 ms + 1 × big)
        return _batches([100.0] * 19 + [100.0 + (p95 - 100.0) / 0.05], [rps])

    return S.summarize_load({"text": {"64": {"off": b(300.0, off_rps), "builtin": b(builtin_p95, 11.0),
                                             "omni_cache": b(oc_p95, oc_rps)}}})


def test_load_bar_c64():
    load = _c64_load(oc_rps=12.0, oc_p95=150.0)
    assert load["text"]["64"]["omni_cache"]["ttfp_ms"]["p95"] == pytest.approx(150.0)
    checks = S.load_checks(load)["text"]
    assert [c["passed"] for c in checks] == [True, True]
    assert checks[0]["value"] == pytest.approx(1.2) and checks[1]["value"] == pytest.approx(0.75)
    checks = S.load_checks(_c64_load(oc_rps=9.0, oc_p95=250.0))["text"]
    assert [c["passed"] for c in checks] == [False, False]
    # throughput within 2 % of off still passes (timer noise), 3 % below fails
    assert S.load_checks(_c64_load(oc_rps=9.85, oc_p95=150.0))["text"][0]["passed"] is True
    assert S.load_checks(_c64_load(oc_rps=9.7, oc_p95=150.0))["text"][0]["passed"] is False
    # omni-cache's batches without a timed request: no verdict; floor gets no bar
    load = _c64_load(oc_rps=12.0, oc_p95=150.0)
    load["text"]["64"]["omni_cache"] = S.summarize_batches([{"round": 0, "throughput_rps": 50.0, "results": []}])
    load["floor"] = {"64": load["text"]["64"]}
    checks = S.load_checks(load)
    assert [c["passed"] for c in checks["text"]] == [None, None] and "floor" not in checks


def test_load_table_and_plot(tmp_path):
    load = _chat_load(120.0, 130.0, 100.0)
    load["chat"]["1"] = load["chat"]["4"]
    checks = S.load_checks(load)
    table = S.format_load_table(load, checks)
    assert "TTFP p50" in table and "PASS" in table and "req/s" in table
    png = S.plot_load(load, tmp_path / "load.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    S.plot_load({}, tmp_path / "empty.png")


def test_chat_sessions_under_load():
    """c > 1: c distinct conversations per round, each one's turns in order, turn 1 untimed;
    c = 1 is today's single conversation; no prompt repeats across concurrencies."""
    from benchmarks.prefill.worker import request_chains

    opts = WorkloadOptions(requests=3, prefix_words=20)
    one = specs("chat", 0, opts)
    assert [s["chat"] for s in one] == [{"session": "round0", "turn": t} for t in range(3)]
    assert one[0]["system"].startswith("Conversation 0. ")
    four = specs("chat", 0, opts, concurrency=4)
    assert len(four) == 12
    sessions = list(dict.fromkeys(s["chat"]["session"] for s in four))
    assert len(sessions) == 4 and "round0" not in sessions
    assert len({s["system"] for s in four}) == 4                     # distinct openings: each turn 1 a miss
    assert [s["measure"] for s in four] == [False] * 4 + [True] * 8
    chains = request_chains(four)
    assert [[s["chat"]["session"] for s in ch] for ch in chains] == [[x] * 3 for x in sessions]
    assert all([s["chat"]["turn"] for s in ch] == [0, 1, 2] for ch in chains)
    assert len({s["index"] for s in four}) == 12
    assert request_chains(list(reversed(four)))[0][0]["chat"]["turn"] == 0   # turns sorted within a chain
    # other workloads: max(N, 2c) requests, prompts distinct from those at any other c
    text4, text1 = specs("text", 0, opts, concurrency=4), specs("text", 0, opts)
    assert len(text4) == 8 and len(specs("text", 0, WorkloadOptions(requests=20), concurrency=4)) == 20
    # --load-requests: the c > 1 batch only (c = 1 and the load warm-up keep their sizes)
    more = WorkloadOptions(requests=3, load_requests=40)
    assert [len(specs(w, 0, more, concurrency=c)) for w in ("floor", "miss") for c in (1, 4)] == [3, 40, 3, 40]
    assert len(specs("floor", 0, WorkloadOptions(requests=3, load_requests=5), concurrency=4)) == 8  # >= 2c
    assert len([s for s in warmup_specs(["floor"], more, 4) if s.get("concurrency") == 4]) == 8
    assert not {s["text"] for s in text4} & {s["text"] for s in text1}
    assert not {s["text"] for s in text4} & {s["text"] for s in specs("text", 0, opts, concurrency=8)}
    assert not {s["system"] for s in specs("miss", 0, opts, 4)} & {s["system"] for s in specs("miss", 0, opts)}
    assert [len(request_chains(specs(w, 0, opts, 4))) for w in ("text", "floor")] == [8, 8]
    with pytest.raises(ValueError, match="concurrency"):
        specs("text", 0, opts, concurrency=0)


class _FakeAsyncOmni:
    """Stands in for AsyncOmni: each request yields a thinker token, then an audio packet."""

    def __init__(self):
        self.in_flight = self.max_in_flight = 0
        self.events: list[tuple] = []

    async def generate(self, prompt, request_id, sampling_params_list):
        import asyncio
        from types import SimpleNamespace as NS

        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.events.append(("start", prompt["key"], request_id))
        await asyncio.sleep(0.01)
        yield NS(error=None, stage_durations={}, metrics=None, stage_id=0, prompt_token_ids=[1] * 10,
                 num_cached_tokens=8, outputs=[NS(token_ids=[5], text="a")], final_output_type="text",
                 multimodal_output=None)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        self.events.append(("end", prompt["key"], request_id))
        yield NS(error=None, stage_durations={}, metrics=None, stage_id=2, prompt_token_ids=None,
                 num_cached_tokens=None, outputs=[], final_output_type="audio",
                 multimodal_output={"audio": NS(numel=lambda: 480)})


def _fake_worker():
    import asyncio
    from types import SimpleNamespace as NS

    from benchmarks.prefill.worker import VariantWorker

    w = object.__new__(VariantWorker)
    w.stream, w.hooks, w._seq, w.sessions = True, None, 0, {}
    loop = asyncio.new_event_loop()
    w.pipe = NS(omni=_FakeAsyncOmni(), run_async=loop.run_until_complete, loop=loop)
    w.engine_prompt = lambda spec: {"key": (spec.get("chat") or {}).get("session", spec["index"])}
    w.sampling_params = lambda spec: []
    w._im_end = lambda: -1
    return w


def test_run_concurrent_is_a_closed_loop_with_ordered_turns():
    from benchmarks.prefill.worker import UNDER_LOAD

    w = _fake_worker()
    try:
        ans = w.run_concurrent(specs("text", 0, WorkloadOptions(requests=10, prefix_words=5), 4), 4)
        assert w.omni.max_in_flight == 4 and ans["n_requests"] == 10 and ans["n_errors"] == 0
        assert ans["throughput_rps"] == pytest.approx(10 / ans["wall_s"])
        row = ans["results"][0]
        assert row["prefill_ms"] is None and row["stage_breakdown"] == UNDER_LOAD
        assert row["ttft_ms"] > 0 and row["ttfp_ms"] >= row["ttft_ms"] and row["e2e_ms"] >= row["ttfp_ms"]
        assert row["hit_ratio"] == pytest.approx(0.8) and row["audio_samples"] == 480
        assert len({r["request_id"] for r in ans["results"]}) == 10
        # chat: 3 conversations at once, never two turns of one conversation in flight
        w.pipe.omni = _FakeAsyncOmni()
        chat = specs("chat", 0, WorkloadOptions(requests=3, prefix_words=5), 3)
        ans = w.run_concurrent(chat, 3)
        assert w.omni.max_in_flight == 3 and ans["n_errors"] == 0
        for sess in {s["chat"]["session"] for s in chat}:
            ev = [e[0] for e in w.omni.events if e[1] == sess]
            assert ev == ["start", "end"] * 3, ev
            assert [r["turn"] for r in ans["results"] if r["session"] == sess] == [0, 1, 2]
    finally:
        w.pipe.loop.close()
    w.stream = False
    with pytest.raises(ValueError, match="streaming"):
        w.run_concurrent(chat, 3)


def test_cli_rejects_bad_concurrency_before_starting_anything(tmp_path, capsys, monkeypatch):
    from benchmarks.prefill import harness
    from benchmarks.prefill.harness import main, parse_concurrency

    def started(*a, **k):  # a check that lets a bad value through fails here, starting nothing
        raise AssertionError("the harness went on to build a model / start a pipeline")

    monkeypatch.setattr(harness.subprocess, "run", started)
    monkeypatch.setattr(harness, "Variant", started)

    assert parse_concurrency("1,4, 16,64,4") == [1, 4, 16, 64]
    for bad, msg in (("0", "0 < 1"), ("4,x", "'x' is not an integer"), ("", "not an integer"), ("1.5", "1.5")):
        assert main(["--concurrency", bad, "--out", str(tmp_path)]) == 2, bad
        assert msg in capsys.readouterr().err
    assert main(["--concurrency", "1,4", "--no-stream", "--out", str(tmp_path)]) == 2
    assert "--no-stream" in capsys.readouterr().err
    assert not any(tmp_path.glob("prefill-*"))   # no run directory, no pipeline


def test_memory_per_variant_and_gpu_without_nvml(monkeypatch):
    import sys

    from benchmarks.prefill.worker import gpu_memory

    monkeypatch.setitem(sys.modules, "pynvml", None)   # not importable, as on a CPU-only machine
    g = gpu_memory([1])
    assert g["gpu_bytes"] is None and "pynvml" in g["reason"]
    samples = [{"variant": "omni_cache", "when": "after warm-up", "total": {"pss": 1, "rss": 2}, "gpu": g},
               {"variant": "omni_cache", "when": "end", "total": {"pss": 3, "rss": 4},
                "gpu": {"gpu_bytes": 5 << 20, "reason": None}},
               {"variant": "off", "when": "end", "total": {"pss": 7, "rss": 8}, "gpu": g}]
    metrics = [{"variant": "omni_cache", "pool_bytes": 100, "pool_tier": "pinned_host", "pool_pinned_bytes": 100},
               {"variant": "omni_cache", "pool_bytes": 50, "pool_tier": "device", "pool_pinned_bytes": 0},
               {"variant": "omni_cache", "hits_served": 3}]             # an older file without pool sizes
    m = S.memory_per_variant(samples, metrics, ["off", "omni_cache"])
    assert m["omni_cache"]["pss_bytes"] == 3 and m["omni_cache"]["gpu_bytes"] == 5 << 20
    assert m["omni_cache"]["omni_cache_pool_bytes"] == 150 and m["omni_cache"]["omni_cache_pinned_host_bytes"] == 100
    assert m["off"]["gpu_bytes"] is None and "pynvml" in m["off"]["gpu_reason"]
    assert m["off"]["omni_cache_pinned_host_bytes"] is None and m["off"]["pinned_reason"]
    assert "n/a (pynvml" in S.format_memory(m)


def test_cache_reports_its_pinned_bytes():
    import torch

    from omni_cache.core.cache import HiddenStateCache
    from omni_cache.core.interface import KeySpec
    from omni_cache.core.pool import Tier

    c = HiddenStateCache(4, 2, [KeySpec("hidden", 8, torch.float32)], tier=Tier.HOST)
    assert c.nbytes == 4 * 2 * 8 * 4 and c.pinned_nbytes == 0


class _FakeVariant:
    """Stands in for harness.Variant (no pipeline): answers with synthetic rows."""

    def __init__(self, name, model, cfg, log, *, env, stream=True):
        self.name, self.frozen, self.ready = name, False, None
        self.fast = {"off": 1.0, "builtin": 0.3, "omni_cache": 0.2}[name]

    def wait_ready(self, timeout=0):
        self.ready = {"ready": True, "start_s": 0.1}
        return self.ready

    def _row(self, spec):
        hit = 0.0 if self.name == "off" or spec["workload"] == "floor" else 0.95
        t = 100.0 * (self.fast if hit else 0.5 if spec["workload"] == "floor" else 1.0)
        return {"workload": spec["workload"], "round": spec["round"], "index": spec["index"],
                "measure": spec["measure"], "prefill_ms": t / 2, "ttft_ms": t, "ttfp_ms": 2 * t, "e2e_ms": 3 * t,
                "num_prompt_tokens": 1000, "num_cached_tokens": int(hit * 1000)}

    def run(self, batch):
        return [self._row(s) for s in batch]

    def run_concurrent(self, batch, c):
        rows = [dict(self._row(s), prefill_ms=None) for s in batch]
        return {"results": rows, "wall_s": 1.0, "throughput_rps": len(rows) / (self.fast * 10),
                "n_requests": len(rows), "n_errors": 0, "concurrency": c}

    def mem(self):
        return [{"pid": 1, "rss": 2, "pss": 1, "uss": 1, "cpu_s": 0.0}], {"gpu_bytes": None, "reason": "no GPU"}

    def cpu_s(self):
        return 0.0

    def freeze(self):
        self.frozen = True

    def thaw(self):
        self.frozen = False

    def close(self):
        pass


@pytest.mark.parametrize("alternation", ["concurrent", "restart"])
def test_harness_under_load_with_a_fake_pipeline(tmp_path, monkeypatch, alternation):
    """The driver's whole flow, pipelines replaced by _FakeVariant: the c = 1 sections keep
    their keys, the load section, its bars, memory per variant and load.png are written."""
    from benchmarks.prefill import harness

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(harness, "Variant", _FakeVariant)
    rc = harness.main(["--model", str(model), "--modalities", "text,chat,floor", "--requests", "2", "--repeats", "2",
                       "--concurrency", "1,4,64", "--alternation", alternation, "--idle-probe-s", "0",
                       "--out", str(tmp_path), "--name", "run"])
    assert rc == 0
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["concurrency"] == [1, 4, 64] and "max-num-seqs" in res["load_note"]
    assert set(res["workloads"]["text"]) == {"off", "builtin", "omni_cache"}          # c = 1 as before
    assert res["workloads"]["text"]["omni_cache"]["prefill_ms"]["median"] == pytest.approx(10.0)
    assert list(res["load"]["chat"]) == ["1", "4", "64"]
    chat4 = res["load_samples"]["chat"]["4"]["omni_cache"]
    assert len(chat4) == 2 and len(chat4[0]["results"]) == 4 * 2                     # 4 conversations x 2 turns
    assert len(res["load_samples"]["text"]["64"]["off"][0]["results"]) == 128        # max(N, 2c)
    assert res["load"]["text"]["64"]["omni_cache"]["ttfp_ms"]["p95"] == pytest.approx(40.0)
    verdicts = {w: [c["passed"] for c in cs] for w, cs in res["load_bar_checks"].items()}
    # chat c=4: TTFP 40 ms vs floor 100 ms and builtin 60 ms; c=64 (chat, text): 5x off's throughput
    assert verdicts == {"chat": [True, True, True, True], "text": [True, True]}
    assert res["load_bar_checks"]["chat"][0]["value"] == pytest.approx(0.4)
    assert res["memory_per_variant"]["off"]["gpu_reason"] == "no GPU"
    assert (tmp_path / "run" / "load.png").stat().st_size > 10_000


class _DyingVariant(_FakeVariant):
    """omni-cache's pipeline dies at its first chat request and logs why, as vLLM's engine core does."""

    def __init__(self, name, model, cfg, log, *, env, stream=True):
        super().__init__(name, model, cfg, log, env=env, stream=stream)
        self.log, self.dead = log, False

    def run(self, batch):
        rows = super().run(batch)
        if self.name == "omni_cache" and any(s["workload"] == "chat" for s in batch) and not self.dead:
            self.dead = True
            self.log.write_text("INFO starting\n[omni-cache bench] continued at 10:15:02\n"
                                "(EngineCore pid=7) Traceback (most recent call last):\n"
                                "(EngineCore pid=7)   File \"runner.py\", line 1, in step\n"
                                "(EngineCore pid=7) IndexError: index 3013 is out of bounds\nINFO after\n")
        if self.dead:
            rows = [dict(r, error="OmniEngineDeadError: EngineCore encountered an issue.") for r in rows]
        return rows


def test_a_dead_variant_leaves_its_cause_in_the_result(tmp_path, monkeypatch):
    """A pipeline that dies mid-run: result.json names the exception from the variant's log (on a lent
    GPU host the logs may never come back); the variants that kept running have no entry."""
    from benchmarks.prefill import harness

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(harness, "Variant", _DyingVariant)
    harness.main(["--model", str(model), "--modalities", "text,chat", "--requests", "2", "--repeats", "1",
                  "--alternation", "concurrent", "--idle-probe-s", "0", "--out", str(tmp_path), "--name", "run"])
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert set(res["variant_failures"]) == {"omni_cache"}
    failure = res["variant_failures"]["omni_cache"]
    assert failure["tracebacks"] == 1 and failure["log"] == "log_omni_cache.txt"
    assert failure["first"]["exception"].endswith("IndexError: index 3013 is out of bounds")
    assert failure["first"]["traceback"][0].endswith("Traceback (most recent call last):")
    assert failure["first"]["harness_before"] == "[omni-cache bench] continued at 10:15:02"


def test_gpu_memory_sums_the_variants_processes_over_devices(monkeypatch):
    """gpu_memory with a stand-in NVML: only the given pids count, summed over every device."""
    import sys
    from types import SimpleNamespace as NS

    from benchmarks.prefill.worker import gpu_memory

    procs = {0: [NS(pid=10, usedGpuMemory=100), NS(pid=99, usedGpuMemory=5000)],
             1: [NS(pid=10, usedGpuMemory=20), NS(pid=11, usedGpuMemory=3), NS(pid=12, usedGpuMemory=None)]}
    fake = NS(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
              nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetComputeRunningProcesses=lambda h: procs[h])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    g = gpu_memory([10, 11, 12])
    assert g == {"gpu_bytes": 123, "per_process": {10: 120, 11: 3}, "per_device": {0: 100, 1: 23}, "reason": None}
    assert gpu_memory([7])["gpu_bytes"] is None and "no process" in gpu_memory([7])["reason"]


def test_gpu_fit_decides_per_device_with_the_first_pipelines_use():
    """auto alternation on a GPU host: every card must hold the other variants' share of it."""
    from benchmarks.prefill.harness import GiB, gpu_fit

    one = {"per_device": {0: 20 * GiB, 1: 8 * GiB}}
    gpus = [{"index": 0, "memory_free": 45 * GiB}, {"index": 1, "memory_free": 60 * GiB}]
    ok, why = gpu_fit(one, gpus, 2, 1 * GiB)
    assert ok and "GPU 0" in why and "GPU 1" in why
    ok, why = gpu_fit(one, [{"index": 0, "memory_free": 40 * GiB}, gpus[1]], 2, 1 * GiB)
    assert not ok and "GPU 0: free 40.0 GiB < 41.0 GiB" in why
    assert gpu_fit(None, gpus, 2, 0)[0] is False  # NVML saw nothing: one at a time


def test_memory_settings_keep_the_stage_configs_kv_on_a_gpu_host():
    from types import SimpleNamespace as NS

    from benchmarks.prefill.harness import MiB, _memory_settings

    args = NS(thinker_kv_mib=None, talker_kv_mib=64, code2wav_kv_mib=None, max_num_seqs=4, cpu_executor=None)
    gpu = _memory_settings(args, gpu_host=True)
    assert gpu.thinker_kv_bytes is None and gpu.talker_kv_bytes == 64 * MiB and gpu.cpu_executor is None
    cpu = _memory_settings(args, gpu_host=False)
    assert cpu.thinker_kv_bytes == 256 * MiB and cpu.cpu_executor == "uni"


def test_max_num_seqs_is_the_stage_configs_on_a_gpu_host(tmp_path):
    """On a GPU host the variants keep the stage config's max_num_seqs unless given: vLLM sizes the
    CUDA-graph capture range from it (min(2 x max_num_seqs, 512) tokens), and the old default (2)
    ran every prefill over 4 tokens without graphs at full size (docs/gpu.md, "Fourteenth session")."""
    from types import SimpleNamespace as NS

    from benchmarks.prefill.harness import _memory_settings, base_max_num_seqs

    full = Path(__file__).resolve().parents[2] / "stage_configs" / "qwen3_omni_30b_a3b_h200_dummy.yaml"
    args = NS(thinker_kv_mib=None, talker_kv_mib=None, code2wav_kv_mib=None, max_num_seqs=None, cpu_executor=None)
    seqs = {}
    for host, gpu in (("gpu", True), ("cpu", False)):
        cfg = variant_stage_config(full, tmp_path / host, "omni_cache", mem=_memory_settings(args, gpu_host=gpu))
        seqs[host] = [st["max_num_seqs"] for st in yaml.safe_load(cfg.read_text())["stages"]]
    assert seqs == {"gpu": [64, 64, 64], "cpu": [2, 2, 2]}
    assert base_max_num_seqs(full) == 64
    given = _memory_settings(NS(**{**vars(args), "max_num_seqs": 16}), gpu_host=True)
    assert given.max_num_seqs == 16


def test_capture_note_when_max_num_seqs_shrinks_the_graph_range():
    from benchmarks.prefill.harness import capture_note

    assert "capture range to 32 tokens" in capture_note(16, 64) and "128" in capture_note(16, 64)
    assert capture_note(None, 64) is None and capture_note(64, 64) is None
    assert capture_note(256, 512) is None  # both at vLLM's 512-token ceiling


def test_variant_devices_parse_and_refuse():
    from benchmarks.prefill.harness import parse_variant_devices

    vs = ["omni_cache", "off", "builtin"]
    assert parse_variant_devices(None, vs) == {}
    assert parse_variant_devices("omni_cache=0; off=1 ;builtin=2", vs) == {"omni_cache": "0", "off": "1",
                                                                          "builtin": "2"}
    assert parse_variant_devices("omni_cache=0,1;off=2,3", ["omni_cache", "off"]) == {"omni_cache": "0,1",
                                                                                     "off": "2,3"}
    for bad, why in [("omni_cache=0;off=1", "no devices for"), ("omni_cache=0;off=0;builtin=1", "share a card"),
                     ("omni_cache:0;off=1;builtin=2", "not <variant>"), ("omni_cache=a;off=1;builtin=2", "integers"),
                     ("omni_cache=0;omni_cache=1;off=2;builtin=3", "not <variant>")]:
        with pytest.raises(ValueError, match=why):
            parse_variant_devices(bad, vs)


def test_each_variant_gets_its_own_cards_and_auto_alternation_runs_them_at_once(tmp_path, monkeypatch, capsys):
    """``--variant-devices``: every pipeline is started with its own ``CUDA_VISIBLE_DEVICES``
    (the launcher's otherwise), auto alternation becomes concurrent, and the result records it;
    a bad value is refused before anything starts."""
    from benchmarks.prefill import harness

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    seen = {}

    class Recording(_FakeVariant):
        def __init__(self, name, model, cfg, log, *, env, stream=True):
            super().__init__(name, model, cfg, log, env=env, stream=stream)
            seen[name] = env.get("CUDA_VISIBLE_DEVICES")

    monkeypatch.setattr(harness, "Variant", Recording)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    base = ["--model", str(model), "--modalities", "text", "--requests", "2", "--repeats", "1",
            "--idle-probe-s", "0", "--out", str(tmp_path)]
    assert harness.main(base + ["--variant-devices", "omni_cache=0;off=0;builtin=1", "--name", "bad"]) == 2
    assert "share a card" in capsys.readouterr().err and not seen
    assert harness.main(base + ["--variant-devices", "omni_cache=2;off=0;builtin=1", "--name", "run"]) == 0
    assert seen == {"omni_cache": "2", "off": "0", "builtin": "1"}
    alt = json.loads((tmp_path / "run" / "result.json").read_text())["alternation"]
    assert alt["mode"] == "concurrent" and alt["variant_devices"]["omni_cache"] == "2"
    seen.clear()
    assert harness.main(base + ["--alternation", "restart", "--name", "plain"]) == 0
    assert set(seen.values()) == {"0,1,2,3"}  # without it every pipeline sees the launcher's devices


def test_step_overhead_smoke(tmp_path):
    """``benchmarks.step_overhead`` (docs/gpu.md, "Zero overhead"): one tiny round runs the stage
    manager's seam calls and writes its result."""
    from benchmarks import step_overhead

    r = step_overhead.main(["--batch", "1,3", "--steps", "5", "--rounds", "1", "--out", str(tmp_path)])
    assert set(r["batches"]) == {"1", "3"} and all(v["us_per_step_median"] > 0 for v in r["batches"].values())
    assert (tmp_path / "result.json").exists()
    # the CUDA default's hand-off path (snapshot), on the stager's CPU mode
    r = step_overhead.main(["--batch", "3", "--steps", "5", "--rounds", "1", "--handoff", "snapshot",
                            "--out", str(tmp_path / "snap")])
    assert r["args"]["handoff"] == "snapshot" and r["batches"]["3"]["us_per_step_median"] > 0


def test_sync_probe_drives_every_phase_on_the_cpu():
    """``benchmarks.sync_probe`` (docs/gpu.md, "Twenty-second session") on the CPU (no busy-wait):
    the prefill, the decode steps with placeholders on the host, and the hit rounds all run, the
    hits served from the cache (the probe asserts the hit tokens). (No time is checked: "waited"
    means something only behind a GPU busy-wait.)"""
    from benchmarks import sync_probe

    r = sync_probe.probe(3, 40, 20.0, 1.0, device="cpu", hit_rounds=2, profile=True)  # 80 decode steps: 5+ blocks
    phases = {k: v for k, v in r.items() if isinstance(v, dict)}
    assert {k: v["steps"] for k, v in phases.items()} == {"prefill": 1, "decode": 40, "hit": 2, "long_prefill": 6}
    assert any("write_step_rows" in row["function"] for row in r["long_prefill"]["profile"])
    assert all(len(v["save_ms"]) == v["steps"] for v in phases.values())
    assert r["fused_launches"] == 0  # (the CPU: the pools' own path)
    top = r["decode"]["profile"]  # the profiled pass: functions with calls and time per step
    assert top and all({"function", "calls_per_step", "own_ms_per_step", "cum_ms_per_step"} <= set(row) for row in top)


def test_results_record_the_settings_in_effect_but_never_the_secret():
    from benchmarks import lab
    from omni_cache.settings import PREFIX as settings_prefix

    env = {"OMNI_CACHE_JIT_WARMUP": "0", "OMNI_CACHE_CUDA_PLATFORM": "1", "OMNI_CACHE_TALKER_KEYS_SECRET": "s3cret",
           settings_prefix + "UNKNOWN": "x", "PATH": "/bin"}  # not a setting: not recorded
    assert lab.settings_in_effect(env) == {"OMNI_CACHE_CUDA_PLATFORM": "1", "OMNI_CACHE_JIT_WARMUP": "0"}
    assert "settings" in lab.stamp("benchmarks.prefill", [])


def _overhead_rows(ttft: list[float], gen_ms: float, first_ms: float = 50.0, tokens: int = 33) -> list[dict]:
    return [{"ttft_ms": t, "ttfp_ms": t + 100.0, "e2e_ms": gen_ms + 200.0, "thinker_last_ms": t + gen_ms - first_ms,
             "num_output_tokens": tokens, "num_prompt_tokens": 100,
             "num_cached_tokens": 0, "measure": True, "index": i, "round": 0} for i, t in enumerate(ttft)]


def _overhead_load(oc_ttft: float, oc_gen: float, oc_rps: float) -> dict:
    """floor at c = 16: cache off 100 ms TTFT, 370 ms generation (10 ms a token after the first), 10 req/s."""
    def b(ttft, gen, rps):
        return [{"round": 0, "throughput_rps": rps, "results": _overhead_rows([ttft] * 16, gen)}]

    return S.summarize_load({"floor": {"16": {"off": b(100.0, 370.0, 10.0), "omni_cache": b(oc_ttft, oc_gen, oc_rps)}}})


def test_zero_overhead_bar_on_ttft_thinker_tpot_throughput_and_spikes():
    """Issue 43's bar: no hit, omni-cache within 2 % of cache off (TTFT p50, thinker ms per token
    p50, throughput) at each c, and no TTFT spike cache off does not show."""
    assert S.metric(_overhead_rows([100.0], 370.0)[0], "thinker_tpot_ms") == pytest.approx(10.0)  # (370 - 50) / 32
    assert S.metric({**_overhead_rows([100.0], 370.0)[0], "num_output_tokens": 2}, "thinker_tpot_ms") is None
    ok = S.overhead_checks(_overhead_load(101.0, 375.0, 9.9))["floor"]
    assert [c["passed"] for c in ok] == [True, True, True]
    assert ok[1]["value"] == pytest.approx((375.0 - 50.0) / (370.0 - 50.0))
    bad = S.overhead_checks(_overhead_load(104.0, 390.0, 9.6))["floor"]  # 4 %, 6 %, -4 %: all three fail
    assert [c["passed"] for c in bad] == [False, False, False]
    # one-at-a-time samples: a spike omni-cache shows and cache off does not fails; one both show passes
    samples = {"floor": {"off": _overhead_rows([100.0] * 7 + [200.0], 370.0),
                         "omni_cache": _overhead_rows([100.0] * 6 + [200.0, 210.0], 370.0)}}
    spike = S.overhead_checks({}, samples)["floor"][-1]
    assert spike["passed"] is False and spike["value"] == 2.0 and spike["target"] == 1.0
    samples["floor"]["omni_cache"] = _overhead_rows([100.0] * 7 + [210.0], 370.0)
    assert S.overhead_checks({}, samples)["floor"][-1]["passed"] is True
    # without cache off's numbers: n/a, never a pass; a workload with a hit gets no overhead bar
    load = _overhead_load(101.0, 375.0, 9.9)
    del load["floor"]["16"]["off"]
    assert [c["passed"] for c in S.overhead_checks(load)["floor"]] == [None, None, None]
    assert S.overhead_checks({"text": _overhead_load(101.0, 375.0, 9.9)["floor"]}) == {}
    assert "PASS" in S.format_overhead({"floor": ok}) and "n/a" in S.format_overhead({})


def test_overhead_recomputed_from_saved_results(tmp_path, capsys):
    from benchmarks.prefill import overhead

    rows = {"off": _overhead_rows([100.0] * 4, 370.0), "omni_cache": _overhead_rows([130.0] * 4, 370.0)}
    saved = {"samples": {"floor": rows, "text": rows}, "load_samples": {}, "git": {"commit": "abcdef0123"},
             "machine": {"gpus": [{"name": "NVIDIA H200"}]}, "date": "2026-11-29T05:00:00"}
    (tmp_path / "a.json").write_text(json.dumps(saved))
    (tmp_path / "b.json").write_text("{not json")
    assert overhead.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr()
    assert "1 × NVIDIA H200, commit abcdef0" in out.out and "FAIL  floor  c=1 TTFT p50" in out.out
    assert "b.json: not readable as JSON" in out.err and "text" not in out.out.split("\n", 2)[2]


def test_scheduler_overhead_variants_and_result(tmp_path):
    """``benchmarks.scheduler_overhead``: each variant is the scheduler it names (cache off without
    prefix caching, the built-in cache's vLLM-Omni scheduler with it, omni-cache's capped one),
    every timed step is a decode step of the whole batch, and one tiny alternated run writes its
    result and plot with ratios to cache off."""
    from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler

    from benchmarks import scheduler_overhead as so
    from omni_cache.engine.scheduler import OmniCacheARAsyncScheduler

    kinds = {}
    for v in so.VARIANTS:
        d = tmp_path / v
        d.mkdir()
        s = so.make_scheduler(v, d, batch=2, prompt=32, steps=8)
        kinds[v] = (type(s), s.cache_config.enable_prefix_caching)
    assert kinds == {"off": (OmniARAsyncScheduler, False), "builtin": (OmniARAsyncScheduler, True),
                     "omni_cache": (OmniCacheARAsyncScheduler, True)}
    with pytest.raises(ValueError, match="variant 'nope'"):
        so.make_scheduler("nope", tmp_path, batch=1, prompt=8, steps=1)
    r = so.main(["--batch", "1,3", "--steps", "4", "--prompt", "40", "--rounds", "2", "--out", str(tmp_path / "out")])
    for b in ("1", "3"):
        cells = r["batches"][b]
        assert set(cells) == set(so.VARIANTS)
        assert cells["off"]["ratio_to_off"] == 1.0
        assert all(len(c["rounds"]) == 2 and c["total_us_median"] > 0 for c in cells.values())
    assert json.loads((tmp_path / "out" / "result.json").read_text())["batches"]["3"]["omni_cache"]["rounds"]
    assert (tmp_path / "out" / "scheduler_overhead.png").stat().st_size > 0
