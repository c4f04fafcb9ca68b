"""Realtime voice sessions (vLLM-Omni's ``/v1/realtime?duplex=1``, OpenAI Realtime events over a
websocket) per turn: time from the commit to the first audio and text delta, thinker and
talker prefix hits, with no prefix cache, vLLM-Omni's built-in cache and omni-cache, each
with vLLM-Omni's conversation window and omni-cache's (issue 30).

Three duplex servers up at once (``stage_configs/qwen3_omni_cpu_duplex.yaml`` on the bench
model as :func:`omni_cache.exactness.fuzz.recording_stage_config` variants — every thinker →
talker hand-off and every served hit recorded — each stage's worker in its engine process,
vLLM's ``uni`` executor, as the other side-by-side benchmarks run them; the two servers not
being timed are paused, SIGSTOP, unless ``--no-pause-idle``):

- ``off``: prefix caching off on the thinker and the talker;
- ``builtin``: vLLM-Omni's hidden-state cache on the thinker, talker caching off (as vLLM-Omni
  ships it);
- ``omni_cache``: omni-cache on the thinker, the talker's content-keyed cache on (the bundled
  config).

Each server first answers one throwaway turn (its cold first turn is reported apart:
``cold_first_turn``). Then per round and window (``stock``, ``omni_cache``: the session's
``extra_body.omni_cache_window``) one session per variant of ``--turns`` voice turns (clips of
the bundled speech recording; the same instructions and clips in every variant; instructions
differ per round and window, so sessions share nothing); the variants alternate turn by turn,
the first one rotated; one request in flight at a time. Per turn: commit → first audio
delta, commit → first text delta, the thinker's and talker's prompt and hit tokens (the
server's ``/metrics`` deltas). Then the oracles, on the recorded hand-offs:

- (a) omni-cache's served blocks equal their writers' rows and tokens
  (:func:`omni_cache.exactness.realtime.judge_session`), and every omni-cache turn got the hit
  it should (whole shared blocks with an earlier prompt);
- (b) omni-cache = built-in, bitwise (hand-offs, transcript, audio) where both served the same
  thinker hit;
- (c) tokens (prompt and transcript) = cache off's.

``result.json`` (every turn, per variant × window × turn p50/p95, ratios, bars, oracle
counts) and ``realtime.png``.

    .venv/bin/python -m benchmarks.realtime_bench --model-size bench-voice --rounds 3 --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("off", "builtin", "omni_cache")
WINDOWS = ("stock", "omni_cache")
BLOCK = 32


def _config(out: Path, variant: str) -> Path:
    import yaml

    from omni_cache.driver.stage_config import bundled_stage_config
    from omni_cache.exactness.fuzz import recording_stage_config

    cfg = recording_stage_config(out / variant, variant, streaming=True, in_process=True,
                                 base=bundled_stage_config("qwen3_omni_cpu_duplex.yaml"))
    raw = yaml.safe_load(cfg.read_text())
    for stage in raw["stages"]:
        if stage["stage_id"] == 1:
            stage["kv_cache_memory_bytes"] = 256 << 20  # bench-voice talker: ~9 KiB a token
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    return cfg


def _instructions(rnd: int, window: str) -> str:
    from omni_cache.driver.inputs import DEFAULT_SYSTEM_PROMPT

    return f"Session {rnd + 1} ({window} window). {DEFAULT_SYSTEM_PROMPT}"


def _pause(server, paused: bool) -> None:
    """SIGSTOP (``paused``) or SIGCONT a server and its stage processes: an idle server still
    polls (~0.06 of a core per stage process here), so the servers not being timed are paused,
    as the prefill benchmark freezes its idle pipelines."""
    import psutil

    try:
        root = psutil.Process(server.proc.pid)
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in (tree if paused else reversed(tree)):
        try:
            p.suspend() if paused else p.resume()
        except psutil.Error:
            pass


async def _turn(server, session, audio: bytes) -> dict:
    from omni_cache.driver.realtime import prefix_cache_counters

    before = await asyncio.to_thread(prefix_cache_counters, server.url)
    t = await session.turn(audio)
    after = await asyncio.to_thread(prefix_cache_counters, server.url)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {"first_audio_s": t.first_audio_s, "first_text_s": t.first_text_s, "done_s": t.done_s,
            "status": t.status, "text": t.text, "audio_md5": hashlib.md5(t.audio).hexdigest(),
            "audio_ms": t.audio_ms, "thinker_prompt": d.get("queries_0"), "thinker_hit": d.get("hits_0"),
            "talker_prompt": d.get("queries_1"), "talker_hit": d.get("hits_1")}


async def _run(servers: dict, args, records: list[dict], sessions: dict) -> dict:
    from omni_cache.driver.realtime import RealtimeSession, speech_clip

    cold = {}

    def only(v):  # the one server not paused
        for name, srv in servers.items():
            _pause(srv, name != v and args.pause_idle)

    for v in VARIANTS:  # the throwaway first turn of each server
        only(v)
        async with RealtimeSession(servers[v].realtime_url, instructions="Warm up.", ping_interval=None) as s:
            cold[v] = await _turn(servers[v], s, speech_clip(args.seconds, 0.0))
        print(f"cold first turn {v:>10}: first audio {cold[v]['first_audio_s']:.2f} s, "
              f"first text {cold[v]['first_text_s']:.2f} s", flush=True)
    k = 0
    for rnd in range(args.rounds):
        for window in WINDOWS:
            live = {}
            for v in VARIANTS:
                only(v)
                live[v] = RealtimeSession(servers[v].realtime_url, instructions=_instructions(rnd, window),
                                          extra_body={"omni_cache_window": window}, ping_interval=None)
                await live[v].open()
                sessions[(v, window, rnd)] = live[v].session_id
            for turn in range(args.turns):
                audio = speech_clip(args.seconds, 0.9 + 1.7 * turn + 0.37 * rnd)
                for v in VARIANTS[k % 3:] + VARIANTS[:k % 3]:
                    only(v)
                    rec = {"variant": v, "window": window, "round": rnd, "turn": turn + 1,
                           "session_id": live[v].session_id, **await _turn(servers[v], live[v], audio)}
                    records.append(rec)
                    print(f"round {rnd + 1} {window:>10} turn {turn + 1} {v:>10}: first audio "
                          f"{rec['first_audio_s']:.2f} s, text {rec['first_text_s']:.2f} s, thinker "
                          f"{rec['thinker_hit']:.0f}/{rec['thinker_prompt']:.0f}, talker "
                          f"{rec['talker_hit']:.0f}/{rec['talker_prompt']:.0f}", flush=True)
                k += 1
            for v, s in live.items():
                only(v)
                await s.close()
    for srv in servers.values():
        _pause(srv, False)
    return cold


def _oracles(out: Path, records: list[dict], sessions: dict, rounds: int) -> dict:
    """Oracles (a), (b), (c) over the recorded hand-offs (module docstring)."""
    from omni_cache.exactness import oracles
    from omni_cache.exactness.fuzz import records as handoffs
    from omni_cache.exactness.realtime import judge_session, session_requests

    res = {"a_violations": [], "a_verified_blocks": 0, "a_unverified_blocks": 0, "hit_below_expected": [],
           "b_compared": 0, "b_violations": [], "b_other_hit": 0, "c_compared": 0, "c_violations": []}
    by = {(r["variant"], r["window"], r["round"], r["turn"]): r for r in records}
    for window in WINDOWS:
        for rnd in range(rounds):
            ids = {v: session_requests(out / v, sessions[(v, window, rnd)]) for v in VARIANTS}
            for verdict in judge_session(out / "omni_cache", sessions[("omni_cache", window, rnd)]):
                res["a_verified_blocks"] += verdict.verified
                res["a_unverified_blocks"] += verdict.unverified
                res["a_violations"] += [f"{verdict.request_id}: {m}" for m in verdict.mismatches]
                if verdict.hit < verdict.expected_hit:
                    res["hit_below_expected"].append(f"{verdict.request_id}: {verdict.hit} < {verdict.expected_hit}")
            for turn, (rid_off, rid_bi, rid_on) in enumerate(zip(ids["off"], ids["builtin"], ids["omni_cache"]), 1):
                off, bi, on = (by[(v, window, rnd, turn)] for v in VARIANTS)
                name = f"{window}/round {rnd + 1}/turn {turn}"
                rec_off, rec_bi, rec_on = (handoffs(out / v, rid) for v, rid in
                                           zip(VARIANTS, (rid_off, rid_bi, rid_on)))
                res["c_compared"] += 1
                if rec_on[0]["ids.prompt"].tolist() != rec_off[0]["ids.prompt"].tolist() or on["text"] != off["text"]:
                    res["c_violations"].append(f"{name}: tokens differ from cache off's")
                if on["thinker_hit"] != bi["thinker_hit"]:
                    res["b_other_hit"] += 1
                    continue
                res["b_compared"] += 1
                bad = oracles.handoff_mismatches(rec_on, rec_bi)
                if on["text"] != bi["text"] or on["audio_md5"] != bi["audio_md5"]:
                    bad.append("transcript or audio differs")
                res["b_violations"] += [f"{name}: {m}" for m in bad]
    return res


def _summary(records: list[dict], turns: int) -> dict:
    import numpy as np

    def cell(xs):
        xs = [x for x in xs if x is not None]
        return ({"p50": float(np.percentile(xs, 50)), "p95": float(np.percentile(xs, 95)), "min": float(min(xs)),
                 "max": float(max(xs)), "n": len(xs)} if xs else None)

    out = {}
    for v in VARIANTS:
        for w in WINDOWS:
            for t in range(1, turns + 1):
                rs = [r for r in records if r["variant"] == v and r["window"] == w and r["turn"] == t]
                out[f"{v}/{w}/{t}"] = {m: cell([r[m] for r in rs]) for m in
                                       ("first_audio_s", "first_text_s", "thinker_prompt", "thinker_hit",
                                        "talker_prompt", "talker_hit")}
    return out


def _bars(out: Path, records: list[dict], sessions: dict, summary: dict, oracle: dict, turns: int,
          rounds: int) -> dict:
    """The issue's bars (module docstring of the issue; docs/benchmarks.md)."""
    import numpy as np

    from omni_cache.exactness.realtime import common_prompt_tokens, first_prompts, session_requests

    prompts = first_prompts(out / "omni_cache")
    shared_ratio = []  # omni-cache window: hit / blocks shared with the previous turn's prompt
    for rnd in range(rounds):
        rids = session_requests(out / "omni_cache", sessions[("omni_cache", "omni_cache", rnd)])
        for t in range(1, len(rids)):
            me, prev = prompts[rids[t]], prompts[rids[t - 1]]
            shared = (min(common_prompt_tokens(me, prev), len(me.ids) - 1) // BLOCK) * BLOCK
            rec = next(r for r in records if r["variant"] == "omni_cache" and r["window"] == "omni_cache"
                       and r["round"] == rnd and r["turn"] == t + 1)
            shared_ratio.append({"round": rnd, "turn": t + 1, "hit": rec["thinker_hit"], "shared": shared,
                                 "ratio": rec["thinker_hit"] / shared if shared else None,
                                 "talker_hit": rec["talker_hit"]})

    def p50(v, w, t, m="first_audio_s"):
        c = summary[f"{v}/{w}/{t}"][m]
        return c["p50"] if c else float("nan")

    late = [t for t in range(4, turns + 1)]
    ratios = {w: {t: {"off_over_omni": p50("off", w, t) / p50("omni_cache", w, t),
                      "builtin_over_omni": p50("builtin", w, t) / p50("omni_cache", w, t)}
                  for t in range(1, turns + 1)} for w in WINDOWS}
    pooled = {w: {v: float(np.median([r["first_audio_s"] for r in records if r["variant"] == v and r["window"] == w
                                      and r["turn"] >= 4])) for v in VARIANTS} for w in WINDOWS}
    return {
        "thinker_hit_ge_0.9_of_shared_blocks_turns_2_on": all(
            x["ratio"] is None or x["ratio"] >= 0.9 for x in shared_ratio),
        "talker_hits_from_turn_2": all((x["talker_hit"] or 0) > 0 for x in shared_ratio),
        "first_audio_5x_lower_than_off_turns_ge_4_p50": {
            w: pooled[w]["off"] / pooled[w]["omni_cache"] >= 5 for w in WINDOWS},
        "first_audio_le_builtin_every_turn_p50": {
            w: all(p50("omni_cache", w, t) <= p50("builtin", w, t) for t in range(1, turns + 1)) for w in WINDOWS},
        "oracles_0_violations": not (oracle["a_violations"] or oracle["b_violations"] or oracle["c_violations"]
                                     or oracle["hit_below_expected"]),
        "pooled_first_audio_p50_turns_ge_4_s": pooled,
        "pooled_off_over_omni_turns_ge_4": {w: pooled[w]["off"] / pooled[w]["omni_cache"] for w in WINDOWS},
        "per_turn_ratios": ratios, "shared_blocks": shared_ratio, "late_turns": late,
    }


def _plot(summary: dict, turns: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ts = list(range(1, turns + 1))
    styles = {"off": ("o", "C3"), "builtin": ("s", "C0"), "omni_cache": ("D", "C2")}  # marker, colour
    for w, ls in zip(WINDOWS, ("--", "-")):
        for v in VARIANTS:
            for ax, m, scale in ((axes[0], "first_audio_s", 1.0), (axes[1], "first_text_s", 1.0),
                                 (axes[2], "thinker_hit", 1.0)):
                cells = [summary[f"{v}/{w}/{t}"][m] for t in ts]
                ys = [c["p50"] * scale if c else float("nan") for c in cells]
                ax.plot(ts, ys, ls, marker=styles[v][0], color=styles[v][1], label=f"{v}, {w} window")
    axes[0].set_ylabel("commit → first audio delta (s), p50")
    axes[1].set_ylabel("commit → first text delta (s), p50")
    axes[2].set_ylabel("thinker prefix hit (tokens), p50")
    for ax in axes:
        ax.set_xlabel("turn")
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", choices=("tiny", "bench", "bench-voice"), default="bench-voice")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="sessions per variant and window")
    ap.add_argument("--seconds", type=float, default=2.0, help="speech per turn")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/realtime-<time>")
    ap.add_argument("--no-pause-idle", dest="pause_idle", action="store_false",
                    help="keep the servers not being timed running (default: SIGSTOP them)")
    args = ap.parse_args(argv)
    if args.turns < 4 or args.rounds < 1:
        ap.error("--turns must be >= 4 (the bars look at turns >= 4) and --rounds >= 1")

    from omni_cache.driver.server import OmniServer
    from omni_cache.models import build_qwen3_omni, default_model_dir

    out = (args.out or REPO / "benchmarks" / "results" / f"realtime-{dt.datetime.now():%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model_size} (built on first use) ...", flush=True)
    model = build_qwen3_omni(default_model_dir(args.model_size), args.model_size)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "MALLOC_ARENA_MAX": "2"}
    servers = {v: OmniServer(model, _config(out, v), log_path=out / f"server-{v}.log", env=env) for v in VARIANTS}
    records: list[dict] = []
    sessions: dict = {}
    t0 = time.perf_counter()
    try:
        for v in VARIANTS:  # one at a time: two cores
            print(f"starting the {v} server ...", flush=True)
            servers[v].start()
            servers[v].wait_ready(timeout=1800, progress=lambda s, v=v: print(f"[{v}] {s}", flush=True))
        cold = asyncio.run(_run(servers, args, records, sessions))
    finally:
        for s in servers.values():
            _pause(s, False)
            s.stop()
    oracle = _oracles(out, records, sessions, args.rounds)
    summary = _summary(records, args.turns)
    bars = _bars(out, records, sessions, summary, oracle, args.turns, args.rounds)
    command = [Path(sys.executable).name, "-m", "benchmarks.realtime_bench", *(argv or sys.argv[1:])]
    result = {"command": " ".join(command),
              "args": {k: (str(x) if isinstance(x, Path) else x) for k, x in vars(args).items()},
              "machine": {"platform": platform.platform(), "processor": platform.processor()},
              "wall_s": time.perf_counter() - t0, "cold_first_turn": cold, "bars": bars,
              "oracles": {k: (len(x) if isinstance(x, list) else x) for k, x in oracle.items()},
              "oracle_details": oracle, "summary": summary, "turns": records,
              "sessions": {"/".join(map(str, k)): x for k, x in sessions.items()}}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    _plot(summary, args.turns, out / "realtime.png",
          f"Realtime sessions ({args.rounds} per variant and window, {args.turns} voice turns, {args.model_size})")
    print(json.dumps({k: bars[k] for k in bars if k not in ("per_turn_ratios", "shared_blocks")}, indent=2))
    print(json.dumps(result["oracles"], indent=2))
    print(f"wrote {out / 'result.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
