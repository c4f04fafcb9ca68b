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


class _FakeSession:
    """Stands in for :class:`omni_cache.driver.realtime.RealtimeSession`: turn k answers after 0.1·k s."""

    opened: list = []

    def __init__(self, url, instructions="", ping_interval=None, extra_body=None):
        self.url, self.session_id, self.k = url, f"{url}#{len(self.opened)}", 0
        self.opened.append(self)

    async def open(self):
        pass

    async def close(self):
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        pass

    async def turn(self, audio):
        from types import SimpleNamespace as NS

        self.k += 1
        return NS(first_audio_s=0.1 * self.k, first_text_s=0.05, done_s=1.0, status="completed", text=f"t{self.k}",
                  audio=audio, audio_ms=100)


def _fake_engine(monkeypatch):
    """No server: sessions, /metrics counters (each call +10 queries, +4 hits per stage) and clips faked."""
    calls = {"n": 0}

    def counters(url):
        calls["n"] += 1
        return {"queries_0": 10.0 * calls["n"], "hits_0": 4.0 * calls["n"], "queries_1": 2.0 * calls["n"]}

    _FakeSession.opened = []
    monkeypatch.setattr(R, "RealtimeSession", _FakeSession)
    monkeypatch.setattr(R, "prefix_cache_counters", counters)
    monkeypatch.setattr(R, "speech_clip", lambda seconds, offset_s=0.0: b"x" * int(10 * seconds + 100 * offset_s))


def test_a_turn_records_times_hits_and_errors(monkeypatch):
    """``_turn``: the /metrics deltas as the turn's hits (alone on the server), None with N > 1; a
    failed turn or one without audio is recorded with its error."""
    import asyncio
    from types import SimpleNamespace as NS

    _fake_engine(monkeypatch)
    srv, s = NS(url="http://x"), _FakeSession("ws://x")
    alone = asyncio.run(R._turn(srv, s, b"a", True))
    assert alone["first_audio_s"] == pytest.approx(0.1) and alone["audio_md5"] and "error" not in alone
    assert (alone["thinker_prompt"], alone["thinker_hit"], alone["talker_prompt"]) == (10.0, 4.0, 2.0)
    assert alone["talker_hit"] is None  # a counter the server does not report
    batched = asyncio.run(R._turn(srv, s, b"a", False))
    assert all(batched[k] is None for k in R.HIT_COUNTERS) and batched["hits_note"] == R.HITS_NOTE

    async def boom(audio):
        raise RuntimeError("socket closed")

    s.turn = boom
    failed = asyncio.run(R._turn(srv, s, b"a", True))
    assert failed["error"] == "RuntimeError: socket closed" and failed["first_audio_s"] is None
    s.turn = lambda audio: asyncio.sleep(0, NS(first_audio_s=None, first_text_s=0.1, done_s=1.0, status="failed",
                                                text="", audio=b"", audio_ms=0))
    assert asyncio.run(R._turn(srv, s, b"a", True))["error"] == "no audio delta (status failed)"


def test_run_covers_every_round_n_window_turn_and_the_floor(monkeypatch):
    """``_run``: a cold turn per server, then per round × N × window every session's turns on each
    variant and the floor's fresh sessions on cache off, each record naming where it ran."""
    import asyncio
    from argparse import Namespace
    from types import SimpleNamespace as NS

    _fake_engine(monkeypatch)
    servers = {v: NS(proc=None, url=f"http://{v}", realtime_url=f"ws://{v}") for v in R.VARIANTS}
    args = Namespace(rounds=2, sessions=[1, 2], turns=3, seconds=0.5, pause_idle=True)
    records, ids = [], {}
    cold = asyncio.run(R._run(servers, R.VARIANTS, args, records, ids))
    assert set(cold) == set(R.VARIANTS) and all(c["first_audio_s"] == pytest.approx(0.1) for c in cold.values())
    assert len(records) == 2 * (1 + 2) * len(R.WINDOWS) * 3 * (len(R.VARIANTS) + 1)
    assert list(records[0])[:7] == ["variant", "window", "round", "n_sessions", "turn", "session", "session_id"]
    first = [r["variant"] for r in records if (r["round"], r["n_sessions"], r["window"]) == (0, 1, "stock")]
    assert first == [*(v for t in range(3) for v in R.lab.rotate(R.VARIANTS, t)), R.FLOOR, R.FLOOR, R.FLOOR]
    floor = [r for r in records if r["variant"] == R.FLOOR]
    assert floor and all(r["server"] == R.FLOOR_ON and r["first_audio_s"] == pytest.approx(0.1) for r in floor)
    on = [r for r in records if r["variant"] == "omni_cache" and r["window"] == "stock" and r["round"] == 1
          and r["n_sessions"] == 2 and r["session"] == 1]
    assert [r["turn"] for r in on] == [1, 2, 3] and [r["text"] for r in on] == ["t1", "t2", "t3"]
    assert len(ids) == len(R.VARIANTS) * 2 * len(R.WINDOWS) * (1 + 2)
    assert ids[("builtin", "omni_cache", 1, 2, 1)].startswith("ws://builtin#")
    only_off = []
    asyncio.run(R._run({"builtin": servers["builtin"]}, ("builtin",), args, only_off, {}))
    assert {r["variant"] for r in only_off} == {"builtin"}  # no floor without cache off's server


def test_main_starts_the_servers_together_or_one_at_a_time(tmp_path, monkeypatch):
    """``main`` (``--no-record``): with ``--servers together`` all three servers are up at once, with
    ``one-at-a-time`` each alone; either way every variant's cold turn and turns are recorded."""
    import contextlib
    import json
    from types import SimpleNamespace as NS

    _fake_engine(monkeypatch)
    up, most = set(), {}

    @contextlib.contextmanager
    def start(kind, model, cfg, *, log=None, env=None, label=""):
        up.add(label)
        most[mode] = max(most.get(mode, 0), len(up))
        yield NS(proc=None, url=f"http://{label}", realtime_url=f"ws://{label}", ready_s=1.0)
        up.discard(label)

    monkeypatch.setattr(R.lab, "start", start)
    monkeypatch.setattr(R, "_config", lambda out, v, base, record: out / f"{v}.yaml")
    (tmp_path / "config.json").write_text("{}")
    for mode in R.SERVER_MODES:
        out = tmp_path / mode
        assert R.main(["--servers", mode, "--no-record", "--turns", "2", "--rounds", "1", "--model", str(tmp_path),
                       "--out", str(out)]) == 0
        res = json.loads((out / "result.json").read_text())
        assert set(res["cold_first_turn"]) == set(R.VARIANTS) and set(res["server_ready_s"]) == set(R.VARIANTS)
        assert {r["variant"] for r in res["turns"]} == {*R.VARIANTS, R.FLOOR} and not res["errors"]
        assert (out / "realtime.png").exists()
    assert most == {"together": 3, "one-at-a-time": 1}
