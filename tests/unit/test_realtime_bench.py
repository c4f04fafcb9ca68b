"""The realtime benchmark's pieces that need no engine (``benchmarks/realtime_bench.py``):
summary per variant × window × sessions count N × turn, the floor, the bar (omni-cache's
commit → first audio p50 over turns ≥ 4 ≤ 1.25 × the floor's and ≤ the built-in's), the plot,
and the command line's early errors (synthetic turns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import realtime_bench as R

REPO = Path(__file__).resolve().parents[2]


def _turns(first_audio: dict[str, float], *, sessions=(1, 8), turns: int = 6, rounds: int = 2,
           late: dict[str, float] | None = None) -> list[dict]:
    """Synthetic turn records: every variant and the floor, both windows, each N; first audio
    ``first_audio[v]`` seconds (``late[v]`` from turn 4 on, if given), plus a small spread per
    session and round; hits only with N = 1 (as the benchmark records them)."""
    out = []
    for v in (*R.VARIANTS, R.FLOOR):
        if v not in first_audio:
            continue
        for w in R.WINDOWS:
            for n in sessions:
                for rnd in range(rounds):
                    for i in range(n):
                        for t in range(1, turns + 1):
                            base = (late or {}).get(v, first_audio[v]) if t >= R.LATE_TURN else first_audio[v]
                            fa = base + 0.01 * i + 0.005 * rnd
                            hit = None if n > 1 else 32.0 * (t - 1)
                            out.append({"variant": v, "window": w, "round": rnd, "n_sessions": n, "session": i,
                                        "turn": t, "first_audio_s": fa, "first_text_s": fa / 4,
                                        "thinker_prompt": None if n > 1 else 200.0 + 150 * t, "thinker_hit": hit,
                                        "talker_prompt": None, "talker_hit": None})
    return out


def test_summary_has_every_variant_window_n_and_turn_and_the_floor():
    recs = _turns({"off": 2.0, "builtin": 1.5, "omni_cache": 1.4, R.FLOOR: 1.3})
    s = R.summarize(recs, 6, [1, 8])
    assert len(s) == (len(R.VARIANTS) + 1) * len(R.WINDOWS) * 2 * 6
    cell = s["omni_cache/omni_cache/8/5"]["first_audio_s"]
    assert cell["n"] == 8 * 2 and cell["min"] == pytest.approx(1.4) and cell["max"] == pytest.approx(1.475)
    assert s["floor/stock/1/1"]["first_audio_s"]["p50"] == pytest.approx(1.3025)
    # hits: per turn with N = 1 only; None with N > 1 (not attributable)
    assert s["builtin/stock/1/3"]["thinker_hit"]["p50"] == 64.0
    assert s["builtin/stock/8/3"]["thinker_hit"] is None
    assert s["omni_cache/stock/8/3"]["first_text_s"]["p95"] >= s["omni_cache/stock/8/3"]["first_text_s"]["p50"]


def test_floor_bar_pass():
    recs = _turns({"off": 2.0, "builtin": 1.5, "omni_cache": 1.4, R.FLOOR: 1.3})
    for n in (1, 8):
        bar = R.floor_bar(recs, "omni_cache", n)
        assert bar["verdict"] == "PASS", bar
        assert bar["ratio_to_floor"] == pytest.approx(bar["omni_cache_p50_s"] / bar["floor_p50_s"])
        assert bar["samples"] == {"omni_cache": 3 * 2 * n, R.FLOOR: 3 * 2 * n, "builtin": 3 * 2 * n}
    # exactly at the limits still passes (≤, not <)
    recs = _turns({"off": 2.0, "builtin": 1.25, "omni_cache": 1.25, R.FLOOR: 1.0}, sessions=(1,), rounds=1)
    assert R.floor_bar(recs, "stock", 1)["verdict"] == "PASS"


def test_floor_bar_fails_above_the_floor_ratio_or_the_builtin():
    # early turns fast, late turns slow for omni-cache: only turns >= 4 count
    recs = _turns({"off": 2.0, "builtin": 1.8, "omni_cache": 1.0, R.FLOOR: 1.0}, late={"omni_cache": 1.3})
    bar = R.floor_bar(recs, "omni_cache", 1)
    assert bar["verdict"] == "FAIL" and not bar["le_floor_ratio"] and bar["le_builtin"], bar
    assert bar["ratio_to_floor"] > R.FLOOR_RATIO
    recs = _turns({"off": 2.0, "builtin": 1.1, "omni_cache": 1.2, R.FLOOR: 1.0})
    bar = R.floor_bar(recs, "stock", 8)
    assert bar["verdict"] == "FAIL" and bar["le_floor_ratio"] and not bar["le_builtin"], bar


def test_floor_bar_is_na_without_samples():
    # no floor turns at all
    bar = R.floor_bar(_turns({"off": 2.0, "builtin": 1.5, "omni_cache": 1.4}), "omni_cache", 1)
    assert bar["verdict"] == "n/a" and bar["ratio_to_floor"] is None and "floor" in bar["reason"], bar
    # fewer than 4 turns: nothing late to judge, even with every variant fast
    recs = _turns({"off": 2.0, "builtin": 1.5, "omni_cache": 0.1, R.FLOOR: 1.0}, turns=3)
    bar = R.floor_bar(recs, "omni_cache", 8)
    assert bar["verdict"] == "n/a" and bar["samples"]["omni_cache"] == 0
    # turns whose first audio never came are no samples
    recs = _turns({"off": 2.0, "builtin": 1.5, "omni_cache": 1.4, R.FLOOR: 1.3}, sessions=(1,))
    for r in recs:
        if r["variant"] == "omni_cache":
            r["first_audio_s"] = None
    assert R.floor_bar(recs, "stock", 1)["verdict"] == "n/a"


def test_latency_bars_per_window_and_n():
    recs = _turns({"off": 2.0, "builtin": 1.5, "omni_cache": 1.4, R.FLOOR: 1.3}, late={"omni_cache": 1.7})
    s = R.summarize(recs, 6, [1, 8])
    bars = R.latency_bars(recs, s, 6, [1, 8])
    for w in R.WINDOWS:
        for n in (1, 8):
            assert bars["floor_bar"][w][n]["verdict"] == "FAIL"
            pooled = bars["pooled_first_audio_p50_turns_ge_4_s"][w][n]
            assert set(pooled) == {*R.VARIANTS, R.FLOOR} and pooled["omni_cache"] > pooled[R.FLOOR]
            assert bars["first_audio_5x_lower_than_off_turns_ge_4_p50"][w][n] is False
            assert bars["first_audio_le_builtin_every_turn_p50"][w][n] is False  # turns >= 4 above built-in
            assert bars["per_turn_ratios"][w][n][1]["floor_over_omni"] == pytest.approx(1.3 / 1.4, rel=0.02)
    good = _turns({"off": 8.0, "builtin": 1.5, "omni_cache": 1.4, R.FLOOR: 1.3})
    good_bars = R.latency_bars(good, R.summarize(good, 6, [1, 8]), 6, [1, 8])
    assert good_bars["first_audio_le_builtin_every_turn_p50"]["omni_cache"][8] is True
    assert good_bars["first_audio_5x_lower_than_off_turns_ge_4_p50"]["stock"][1] is True
    # a variant with no turns: its bars are None, not a crash
    bars = R.latency_bars([r for r in recs if r["variant"] != "off"], s, 6, [1, 8])
    assert bars["first_audio_5x_lower_than_off_turns_ge_4_p50"]["stock"][1] is None


def test_plot_one_panel_per_n(tmp_path):
    recs = _turns({"off": 2.0, "builtin": 1.5, "omni_cache": 1.4, R.FLOOR: 1.3}, rounds=1)
    R._plot(R.summarize(recs, 6, [1, 8]), 6, [1, 8], tmp_path / "realtime.png", "synthetic")
    assert (tmp_path / "realtime.png").stat().st_size > 10_000


def test_parse_sessions():
    assert R.parse_sessions("1") == [1]
    assert R.parse_sessions("1, 8,1") == [1, 8]
    for bad, msg in (("", "'' is not an integer"), ("1,x", "'x' is not an integer"), ("0", "must be >= 1"),
                     ("1,-2", "must be >= 1"), ("1.5", "not an integer")):
        with pytest.raises(ValueError, match=msg):
            R.parse_sessions(bad)


@pytest.mark.parametrize("argv, msg", [
    (["--sessions", "1,x"], "--sessions '1,x': 'x' is not an integer"),
    (["--sessions", "0"], "--sessions '0': 0 < 1"),
    (["--sessions", "9"], "max_sessions is 8, --sessions asks for 9"),
    (["--stage-config", "/nope/rt.yaml"], "--stage-config /nope/rt.yaml: file not found"),
    (["--stage-config", "no_such_config.yaml"], "--stage-config no_such_config.yaml: file not found"),
    (["--stage-config", "qwen3_omni_cpu.yaml"], "not a duplex config"),
    (["--stage-config", "qwen3_omni_30b_a3b_h200_dummy_duplex.yaml"], "use --servers one-at-a-time"),
    (["--model", "/nope-model"], "--model /nope-model: not a model directory"),
    (["--model", "/nope-model", "--model-size", "tiny"], "--model and --model-size: give one"),
    (["--turns", "0"], "--turns and --rounds must be >= 1"),
])
def test_cli_errors_name_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        R.parse_args(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_accepts_the_gpu_config_one_server_at_a_time(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = R.parse_args(["--stage-config", str(REPO / "stage_configs" / "qwen3_omni_30b_a3b_h200_dummy_duplex.yaml"),
                         "--servers", "one-at-a-time", "--sessions", "1,8", "--model", str(tmp_path)])
    assert args.sessions == [1, 8] and args.stage_config_raw["session_mode"] == "duplex"
    args = R.parse_args([])
    assert args.stage_config_path == REPO / "stage_configs" / R.DEFAULT_STAGE_CONFIG and args.sessions == [1]


def test_a_broken_stage_config_is_named(tmp_path):
    bad = tmp_path / "rt.yaml"
    bad.write_text((REPO / "stage_configs" / "qwen3_omni_cpu_duplex.yaml").read_text().replace(
        "max_num_seqs: 8", "max_num_seqs: eight", 1))
    with pytest.raises(ValueError, match=r"--stage-config .*rt.yaml: .*max_num_seqs"):
        R.check_stage_config(bad, [1], "together")
