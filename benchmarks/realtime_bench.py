"""Realtime voice sessions (vLLM-Omni's ``/v1/realtime?duplex=1``) per turn: commit → first audio
and first text delta (s), thinker and talker prefix hits (tokens), for cache ``off``, ``builtin``
and ``omni_cache``, each with vLLM-Omni's conversation window and omni-cache's, for 1 and N
sessions at once, against the floor (the turn's utterance in a fresh session, on cache off).

Three duplex servers derived from ``--stage-config`` (hand-offs and served hits recorded unless
``--no-record``), together or one at a time (``--servers``); then the oracles on the recorded
hand-offs — (a) served blocks equal their writers' (every N), (b) omni-cache = built-in bitwise,
(c) tokens = cache off's (N = 1 only: batched steps are not batch-invariant) — and the bar
:func:`floor_bar`. Flags, schedule, results: docs/benchmarks.md, "Realtime voice sessions".
Writes ``result.json`` and ``realtime.png``.

    .venv/bin/python -m benchmarks.realtime_bench --model-size bench-voice --rounds 3 --turns 8 --sessions 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import itertools
import math
import time
from pathlib import Path

import yaml

from benchmarks import lab
from omni_cache import settings
from omni_cache.driver.inputs import DEFAULT_SYSTEM_PROMPT as SYSTEM_PROMPT
from omni_cache.driver.realtime import RealtimeSession, prefix_cache_counters, speech_clip
from omni_cache.driver.stage_config import StageConfigError, bundled_stage_config, load_stage_config

VARIANTS = ("off", "builtin", "omni_cache")
WINDOWS = ("stock", "omni_cache")
#: the pseudo-variant of the floor's turns (a fresh session per turn, no history)
FLOOR = "floor"
#: the server the floor runs on (no hit of any kind there)
FLOOR_ON = "off"
#: the bar looks at turns from this one on
LATE_TURN = 4
#: the bar: omni-cache's first audio p50 at most this many times the floor's
FLOOR_RATIO = 1.25
SERVER_MODES = ("together", "one-at-a-time")
DEFAULT_STAGE_CONFIG = "qwen3_omni_cpu_duplex.yaml"
#: why per-turn hits are None with N > 1
HITS_NOTE = ("N sessions at once: the server's /metrics deltas span every session's turn, so per-turn "
             "prefix hits are recorded only with N = 1")
METRICS = ("first_audio_s", "first_text_s", "thinker_prompt", "thinker_hit", "talker_prompt", "talker_hit")
#: a turn's hit fields (:data:`METRICS` after the times) and the server's /metrics counters they are deltas of
HIT_COUNTERS = {"thinker_prompt": "queries_0", "thinker_hit": "hits_0", "talker_prompt": "queries_1",
                "talker_hit": "hits_1"}


def parse_sessions(text: str) -> list[int]:
    """``--sessions`` (:func:`benchmarks.lab.positive_int_list`)."""
    return lab.positive_int_list(text, "--sessions", "1,8")


def resolve_stage_config(text: str) -> Path:
    """``--stage-config``: a path, else a bundled config's file name.

    Raises:
        ValueError: neither.
    """
    p = Path(text).expanduser()
    if p.is_file():
        return p.resolve()
    if p.parent != Path(".") or not text.endswith((".yaml", ".yml")):
        bundled = None
    else:  # this checkout's stage_configs/ first, then the installed package's
        here = lab.REPO / "stage_configs" / text
        bundled = here if here.is_file() else bundled_stage_config(text)
    if bundled is None:
        raise ValueError(f"--stage-config {text}: file not found (a path, or a bundled name such as "
                         f"{DEFAULT_STAGE_CONFIG})")
    return bundled


def check_stage_config(path: Path, sessions: list[int], servers: str) -> dict:
    """Validate the duplex stage config the variants derive from; returns its YAML.

    Raises:
        ValueError: invalid, not duplex, ``duplex_session.max_sessions`` below the largest
            ``--sessions``, or ``--servers together`` with GPU shares three servers cannot hold.
    """
    try:
        raw = load_stage_config(path).raw
    except StageConfigError as exc:
        raise ValueError(f"--stage-config {path}: {exc}") from None
    if raw.get("session_mode") != "duplex":
        raise ValueError(f"--stage-config {path}: not a duplex config (needs `session_mode: duplex`: the "
                         f"realtime endpoint /v1/realtime?duplex=1)")
    most = int((raw.get("duplex_session") or {}).get("max_sessions", 1))
    if max(sessions) > most:
        raise ValueError(f"--stage-config {path}: duplex_session.max_sessions is {most}, --sessions asks for "
                         f"{max(sessions)} at once")
    if servers == "together":
        share: dict[str, float] = {}
        for st in raw.get("stages") or []:
            if "gpu_memory_utilization" in st:
                for dev in str(st.get("devices", "0")).split(","):
                    share[dev.strip()] = share.get(dev.strip(), 0.0) + float(st["gpu_memory_utilization"])
        if full := {d: s for d, s in share.items() if 3 * s > 1}:
            raise ValueError(f"--stage-config {path}: three servers at once need 3 × {max(full.values()):.2f} of "
                             f"GPU {', '.join(sorted(full))}; use --servers one-at-a-time")
    return raw


def _config(out: Path, variant: str, base: Path, record: bool) -> Path:
    from omni_cache.exactness.fuzz import recording_stage_config

    cfg = recording_stage_config(out / variant, variant, streaming=True, in_process=True, base=base)
    raw = yaml.safe_load(cfg.read_text())
    for stage in raw["stages"]:
        if stage["stage_id"] == 1 and "kv_cache_memory_bytes" in stage:  # the CPU configs; bench-voice's
            stage["kv_cache_memory_bytes"] = max(stage["kv_cache_memory_bytes"], 256 << 20)  # talker: ~9 KiB a token
        if not record:
            for key in (settings.HANDOFF_DUMP.name, settings.HIT_AUDIT.name):
                (stage.get("env") or {}).pop(key, None)
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    return cfg


def _clips(seconds: float, turn: int, rnd: int, n: int) -> list[bytes]:
    """The utterances of sessions 0..n-1's 0-based ``turn``: the same in every variant and the floor."""
    return [speech_clip(seconds, 0.9 + 1.7 * turn + 0.37 * rnd + 0.23 * session) for session in range(n)]


def _pause(server, paused: bool) -> None:
    if server.proc is not None:
        lab.pause_tree(server.proc.pid, paused)


async def _turn(server, session, audio: bytes, metrics: bool) -> dict:
    """One voice turn (seconds from the commit); ``metrics``: the server's /metrics deltas as the
    turn's hits (only when nothing else runs on the server)."""
    before = await asyncio.to_thread(prefix_cache_counters, server.url) if metrics else {}
    try:
        t = await session.turn(audio)
    except Exception as exc:  # noqa: BLE001 - recorded per turn; the run goes on
        return {"first_audio_s": None, "first_text_s": None, "done_s": None, "status": None, "text": "",
                "audio_md5": None, "audio_ms": 0, **dict.fromkeys(METRICS[2:]), "error": f"{type(exc).__name__}: {exc}"}
    rec = {"first_audio_s": t.first_audio_s, "first_text_s": t.first_text_s, "done_s": t.done_s,
           "status": t.status, "text": t.text, "audio_md5": hashlib.md5(t.audio).hexdigest(), "audio_ms": t.audio_ms}
    if metrics:
        after = await asyncio.to_thread(prefix_cache_counters, server.url)
        rec.update({k: after[c] - before.get(c, 0.0) if c in after else None for k, c in HIT_COUNTERS.items()})
    else:
        rec.update(dict.fromkeys(METRICS[2:]), hits_note=HITS_NOTE)
    if t.first_audio_s is None:
        rec["error"] = f"no audio delta (status {t.status})"
    return rec


async def _turns(server, sessions: list, audios: list[bytes]) -> list[dict]:
    """The same turn of every session at once; per-turn hits only for one session."""
    if len(sessions) == 1:
        return [await _turn(server, sessions[0], audios[0], True)]
    return list(await asyncio.gather(*(_turn(server, s, a, False) for s, a in zip(sessions, audios))))


async def _run(servers: dict, active: tuple[str, ...], args, records: list[dict], session_ids: dict) -> dict:
    """Every round × N × window of the variants in ``active`` (servers up): the cold first turn of
    each (returned), the sessions' turns, the floor (when :data:`FLOOR_ON` is active)."""
    def only(v):  # the one server not paused
        for name, srv in servers.items():
            if name in active:
                _pause(srv, name != v and args.pause_idle)

    async def open_sessions(v, rnd, n, window) -> list:  # N sessions of one group, opened at once
        ss = [RealtimeSession(servers[v].realtime_url, extra_body={"omni_cache_window": window}, ping_interval=None,
                              instructions=f"Session {rnd + 1}.{i + 1} of {n} ({window} window). {SYSTEM_PROMPT}")
              for i in range(n)]
        await asyncio.gather(*(s.open() for s in ss))
        return ss

    def add(results: list[dict], sessions: list, **where) -> None:  # one record per session's turn
        for i, r in enumerate(results):
            records.append(rec := {**where, "session": i, "session_id": sessions[i].session_id, **r})
            print(f"round {rec['round'] + 1} N={rec['n_sessions']} {rec['window']:>10} turn {rec['turn']} "
                  f"{rec['variant']:>10}#{i}: first audio {lab.fmt(rec['first_audio_s'], '.2f')} s, text "
                  f"{lab.fmt(rec['first_text_s'], '.2f')} s, thinker {lab.fmt(rec['thinker_hit'], '.0f')}/"
                  f"{lab.fmt(rec['thinker_prompt'], '.0f')}" + (f"  ERROR {r['error']}" if r.get("error") else ""),
                  flush=True)

    cold = {}
    for v in active:  # the throwaway first turn of each server
        only(v)
        async with RealtimeSession(servers[v].realtime_url, instructions="Warm up.", ping_interval=None) as s:
            cold[v] = await _turn(servers[v], s, speech_clip(args.seconds, 0.0), True)
        print(f"cold first turn {v:>10}: first audio {lab.fmt(cold[v]['first_audio_s'], '.2f')} s, "
              f"first text {lab.fmt(cold[v]['first_text_s'], '.2f')} s", flush=True)
    k = 0
    for rnd, n, window in itertools.product(range(args.rounds), args.sessions, WINDOWS):
        group = {"window": window, "round": rnd, "n_sessions": n}
        live: dict[str, list] = {}
        for v in active:
            only(v)
            live[v] = await open_sessions(v, rnd, n, window)
            session_ids.update({(v, window, rnd, n, i): s.session_id for i, s in enumerate(live[v])})
        for turn in range(args.turns):
            audios = _clips(args.seconds, turn, rnd, n)
            for v in lab.rotate(active, k):
                only(v)
                add(await _turns(servers[v], live[v], audios), live[v], variant=v, **group, turn=turn + 1)
            k += 1
        for v, ss in live.items():
            only(v)
            await asyncio.gather(*(s.close() for s in ss))
        if FLOOR_ON in active:  # the floor: each turn's utterance in fresh sessions, no history
            only(FLOOR_ON)
            for turn in range(args.turns):
                fresh = await open_sessions(FLOOR_ON, rnd, n, window)
                res = await _turns(servers[FLOOR_ON], fresh, _clips(args.seconds, turn, rnd, n))
                await asyncio.gather(*(s.close() for s in fresh))
                add(res, fresh, variant=FLOOR, **group, turn=turn + 1, server=FLOOR_ON)
    for v in active:
        _pause(servers[v], False)
    return cold


def _oracles(out: Path, records: list[dict], session_ids: dict, rounds: int, sessions: list[int],
             block_size: int) -> dict:
    """Oracles (a) on every N, (b) and (c) on N = 1 (module docstring); ``block_size``: the
    thinker's tokens per KV block (:func:`lab.thinker_block_size`)."""
    from omni_cache.exactness import oracles
    from omni_cache.exactness.fuzz import records as handoffs
    from omni_cache.exactness.realtime import judge_session, session_requests

    res = {"a_violations": [], "a_verified_blocks": 0, "a_unverified_blocks": 0, "hit_below_expected": [],
           "b_compared": 0, "b_violations": [], "b_other_hit": 0, "c_compared": 0, "c_violations": [],
           "a_sessions_counts": list(sessions), "bc_sessions_counts": [1] if 1 in sessions else [],
           "bc_note": "(b) and (c) compare two servers' answers: with N > 1 each server batches its sessions' "
                      "steps as they arrive (kernels not batch-invariant), so they run on N = 1 only"}
    by = {(r["variant"], r["window"], r["round"], r["n_sessions"], r["session"], r["turn"]): r for r in records}
    for window, rnd in itertools.product(WINDOWS, range(rounds)):
        for key in ((window, rnd, n, i) for n in sessions for i in range(n)):
            for verdict in judge_session(out / "omni_cache", session_ids[("omni_cache", *key)], block_size=block_size):
                res["a_verified_blocks"] += verdict.verified
                res["a_unverified_blocks"] += verdict.unverified
                res["a_violations"] += [f"{verdict.request_id}: {m}" for m in verdict.mismatches]
                if verdict.hit < verdict.expected_hit:
                    res["hit_below_expected"].append(f"{verdict.request_id}: {verdict.hit} < {verdict.expected_hit}")
        if 1 not in sessions:
            continue
        ids = {v: session_requests(out / v, session_ids[(v, window, rnd, 1, 0)]) for v in VARIANTS}
        for turn, rids in enumerate(zip(*(ids[v] for v in VARIANTS)), 1):
            off, bi, on = (by[(v, window, rnd, 1, 0, turn)] for v in VARIANTS)
            name = f"{window}/round {rnd + 1}/turn {turn}"
            rec_off, rec_bi, rec_on = (handoffs(out / v, rid) for v, rid in zip(VARIANTS, rids))
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


def summarize(records: list[dict], turns: int, sessions: list[int]) -> dict:
    """Per ``variant/window/N/turn`` (with :data:`FLOOR`), each of :data:`METRICS`: p50 / p95 / min
    / max / n over sessions and rounds (seconds, tokens; None without a sample, e.g. hits at N > 1)."""
    by = collections.defaultdict(list)
    for r in records:
        by[f"{r['variant']}/{r['window']}/{r['n_sessions']}/{r['turn']}"].append(r)
    keys = [f"{v}/{w}/{n}/{t}" for v in (*VARIANTS, FLOOR) for w in WINDOWS for n in sessions
            for t in range(1, turns + 1)]
    return {k: {m: lab.describe([r.get(m) for r in by[k]], "p50", "p95", "min", "max") for m in METRICS} for k in keys}


def late_samples(records: list[dict], variant: str, window: str, n: int, metric: str = "first_audio_s") -> list[float]:
    """``metric`` of every turn ≥ :data:`LATE_TURN` of ``variant`` (or :data:`FLOOR`), window and
    N that has one (seconds)."""
    return [r[metric] for r in records if r["variant"] == variant and r["window"] == window
            and r["n_sessions"] == n and r["turn"] >= LATE_TURN and r.get(metric) is not None]


def floor_bar(records: list[dict], window: str, n: int) -> dict:
    """The bar for one window and N: over turns ≥ :data:`LATE_TURN`, omni-cache's commit → first
    audio p50 ≤ :data:`FLOOR_RATIO` × the floor's and ≤ the built-in's (s). ``verdict`` ``PASS``
    / ``FAIL``, or ``n/a`` where a side has no sample."""
    xs = {v: late_samples(records, v, window, n) for v in ("omni_cache", FLOOR, "builtin")}
    p50 = {v: lab.stat(x) for v, x in xs.items()}
    res = {"omni_cache_p50_s": p50["omni_cache"], "floor_p50_s": p50[FLOOR], "builtin_p50_s": p50["builtin"],
           "samples": {v: len(x) for v, x in xs.items()}, "max_ratio_to_floor": FLOOR_RATIO}
    if missing := [v for v, x in xs.items() if not x]:
        return {**res, "verdict": "n/a", "ratio_to_floor": None,
                "reason": f"no turn >= {LATE_TURN} with a first audio delta for {', '.join(missing)}"}
    ratio = p50["omni_cache"] / p50[FLOOR] if p50[FLOOR] > 0 else math.inf
    ok_floor = p50["omni_cache"] <= FLOOR_RATIO * p50[FLOOR]
    ok_builtin = p50["omni_cache"] <= p50["builtin"]
    return {**res, "verdict": "PASS" if ok_floor and ok_builtin else "FAIL", "ratio_to_floor": ratio,
            "le_floor_ratio": ok_floor, "le_builtin": ok_builtin}


def latency_bars(records: list[dict], summary: dict, turns: int, sessions: list[int]) -> dict:
    """Per window and N: :func:`floor_bar`, the pooled p50 (s) of turns ≥ :data:`LATE_TURN` per
    variant and the floor, and the issue-30 bars (first audio ≥ 5× lower than cache off pooled;
    ≤ the built-in's on every turn), None where a side has no sample."""
    def p50(v, w, n, t):
        c = summary[f"{v}/{w}/{n}/{t}"]["first_audio_s"]
        return c["p50"] if c else None

    out: dict = {k: {w: {} for w in WINDOWS} for k in (
        "floor_bar", "pooled_first_audio_p50_turns_ge_4_s", "first_audio_5x_lower_than_off_turns_ge_4_p50",
        "first_audio_le_builtin_every_turn_p50", "per_turn_ratios")}
    for w, n in itertools.product(WINDOWS, sessions):
        out["floor_bar"][w][n] = floor_bar(records, w, n)
        pooled = {v: lab.stat(late_samples(records, v, w, n)) for v in (*VARIANTS, FLOOR)}
        out["pooled_first_audio_p50_turns_ge_4_s"][w][n] = pooled
        out["first_audio_5x_lower_than_off_turns_ge_4_p50"][w][n] = (
            None if pooled["off"] is None or pooled["omni_cache"] is None
            else pooled["off"] / pooled["omni_cache"] >= 5)
        pairs = [(p50("omni_cache", w, n, t), p50("builtin", w, n, t)) for t in range(1, turns + 1)]
        out["first_audio_le_builtin_every_turn_p50"][w][n] = (
            None if any(a is None or b is None for a, b in pairs) else all(a <= b for a, b in pairs))
        out["per_turn_ratios"][w][n] = {t: {f"{v}_over_omni": lab.ratio(p50(v, w, n, t), p50("omni_cache", w, n, t))
                                            for v in ("off", "builtin", FLOOR)} for t in range(1, turns + 1)}
    return out


def _hit_bars(out: Path, records: list[dict], session_ids: dict, rounds: int, block: int) -> dict:
    """The hit bars at N = 1: every omni-cache turn from 2 on (its window) hit ≥ 0.9 of the blocks
    it shares with the previous turn's prompt; the talker hits from turn 2 on."""
    from omni_cache.exactness.realtime import common_prompt_tokens, first_prompts, session_requests

    prompts = first_prompts(out / "omni_cache")
    shared_ratio = []
    for rnd in range(rounds):
        rids = session_requests(out / "omni_cache", session_ids[("omni_cache", "omni_cache", rnd, 1, 0)])
        for t in range(1, len(rids)):
            me, prev = prompts[rids[t]], prompts[rids[t - 1]]
            shared = (min(common_prompt_tokens(me, prev), len(me.ids) - 1) // block) * block
            rec = next(r for r in records if r["variant"] == "omni_cache" and r["window"] == "omni_cache"
                       and r["round"] == rnd and r["n_sessions"] == 1 and r["turn"] == t + 1)
            hit = rec["thinker_hit"]
            shared_ratio.append({"round": rnd, "turn": t + 1, "hit": hit, "shared": shared,
                                 "ratio": hit / shared if shared and hit is not None else None,
                                 "talker_hit": rec["talker_hit"]})
    return {"thinker_hit_ge_0.9_of_shared_blocks_turns_2_on": all(
                x["ratio"] is None or x["ratio"] >= 0.9 for x in shared_ratio) if shared_ratio else None,
            "talker_hits_from_turn_2": all((x["talker_hit"] or 0) > 0 for x in shared_ratio) if shared_ratio else None,
            "shared_blocks": shared_ratio}


def _plot(summary: dict, turns: int, sessions: list[int], path: Path, title: str) -> None:
    """First audio and first text p50 per turn (s) per variant and window; one column per N."""
    with lab.figure(path, 2, len(sessions), figsize=(6.5 * len(sessions), 8), squeeze=False,
                    title=title, dpi=110) as (fig, axes):
        ts = list(range(1, turns + 1))
        styles = {"off": ("o", "C3"), "builtin": ("s", "C0"), "omni_cache": ("D", "C2"), FLOOR: ("", "k")}
        for col, n in enumerate(sessions):
            for row, m in enumerate(("first_audio_s", "first_text_s")):
                ax = axes[row][col]
                for w, ls in zip(WINDOWS, ("--", "-")):
                    for v in (*VARIANTS, FLOOR):
                        ys = [c["p50"] if (c := summary[f"{v}/{w}/{n}/{t}"][m]) else float("nan") for t in ts]
                        ax.plot(ts, ys, ls, marker=styles[v][0], color=styles[v][1],
                                lw=2.2 if v == FLOOR else 1.4,
                                label=f"floor (no history), {w} instructions" if v == FLOOR else f"{v}, {w} window")
                ax.set(title=f"N = {n} session{'s' if n > 1 else ''} at once", xlabel="turn", xticks=ts, ylim=(0, None),
                       ylabel=f"commit → first {'audio' if m == 'first_audio_s' else 'text'} delta (s), p50")
        axes[0][0].legend(fontsize=7)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, validated before anything starts (``SystemExit`` 2 naming the flag or
    file at fault); adds ``stage_config_path`` and ``stage_config_raw``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--stage-config", default=DEFAULT_STAGE_CONFIG, help=f"duplex stage config, a path or bundled name (default "
        f"{DEFAULT_STAGE_CONFIG}; full-size on one H200: qwen3_omni_30b_a3b_h200_dummy_duplex.yaml)")
    add("--model", type=Path, default=None, help="model directory (default: the embedded model of --model-size)")
    add("--model-size", choices=("tiny", "bench", "bench-voice"), default=None,
        help="embedded model to build and serve without --model (default bench-voice)")
    add("--turns", type=int, default=8, help="voice turns per session (the bar looks at turns >= 4)")
    add("--rounds", type=int, default=3, help="groups of sessions per variant, N and window")
    add("--sessions", default="1", help="comma list of session counts N run at once per variant (e.g. 1,8)")
    add("--seconds", type=float, default=2.0, help="speech per turn (seconds)")
    add("--servers", choices=SERVER_MODES, default="together", help="together: three servers up, variants "
        "alternating turn by turn (idle ones paused); one-at-a-time: for a card that holds one")
    add("--no-record", dest="record", action="store_false", help="record no hand-offs or hits (no oracles, hit bars)")
    add("--out", type=Path, default=None, help="default: benchmarks/results/realtime-<time>")
    add("--no-pause-idle", dest="pause_idle", action="store_false",
        help="--servers together: keep the servers not being timed running (default: SIGSTOP them)")
    args = ap.parse_args(argv)
    if args.turns < 1 or args.rounds < 1 or args.seconds <= 0:
        ap.error("--turns and --rounds must be >= 1 and --seconds > 0")
    if args.model is not None and args.model_size is not None:
        ap.error("--model and --model-size: give one (--model-size builds an embedded model)")
    if args.model is not None and not (args.model / "config.json").is_file():
        ap.error(f"--model {args.model}: not a model directory (no config.json)")
    try:
        args.sessions = parse_sessions(args.sessions)
        args.stage_config_path = resolve_stage_config(args.stage_config)
        args.stage_config_raw = check_stage_config(args.stage_config_path, args.sessions, args.servers)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = lab.results_dir(args.out, "realtime")
    model = lab.model_dir(args.model_size or "bench-voice", args.model).resolve()
    model_name = args.model.name if args.model is not None else args.model_size or "bench-voice"
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "MALLOC_ARENA_MAX": "2"}
    records, session_ids, cold, ready_s, t0 = [], {}, {}, {}, time.perf_counter()

    def up(stack: contextlib.ExitStack, v: str):
        srv = stack.enter_context(lab.start("server", model, _config(out, v, args.stage_config_path, args.record),
                                            log=out / f"server-{v}.log", env=env, label=v))
        stack.callback(_pause, srv, False)  # a paused server is continued before it is stopped
        ready_s[v] = srv.ready_s
        return srv

    for group in [VARIANTS] if args.servers == "together" else [(v,) for v in VARIANTS]:
        with contextlib.ExitStack() as stack:
            servers = {v: up(stack, v) for v in group}  # started one at a time: two cores
            cold.update(asyncio.run(_run(servers, group, args, records, session_ids)))
    summary = summarize(records, args.turns, args.sessions)
    bars = latency_bars(records, summary, args.turns, args.sessions)
    if args.record:
        block = lab.thinker_block_size(args.stage_config_path, out / "omni_cache")
        oracle = _oracles(out, records, session_ids, args.rounds, args.sessions, block)
        if 1 in args.sessions:
            bars.update(_hit_bars(out, records, session_ids, args.rounds, block))
        bars["oracles_0_violations"] = not (oracle["a_violations"] or oracle["b_violations"]
                                            or oracle["c_violations"] or oracle["hit_below_expected"])
    else:
        oracle = {"not_run": "--no-record: no hand-offs recorded"}
    errors = [f"{r['variant']}/{r['window']}/round {r['round'] + 1}/N={r['n_sessions']}/session {r['session']}/"
              f"turn {r['turn']}: {r['error']}" for r in records if r.get("error")]
    result = {**lab.stamp("benchmarks.realtime_bench", argv), "args": lab.jsonable(args, drop=("stage_config_raw",)),
              "model": str(model), "stage_config": str(args.stage_config_path),
              "wall_s": time.perf_counter() - t0, "server_ready_s": ready_s, "sessions_counts": args.sessions,
              "floor": {"on": FLOOR_ON, "how": "per turn, N fresh sessions at once with the sessions' instructions "
                                              "and that turn's clip, no history, after the group's sessions closed"},
              "hits_note": HITS_NOTE, "errors": errors, "cold_first_turn": cold, "bars": bars,
              "oracles": {k: (len(x) if isinstance(x, list) and k.endswith(("violations", "expected")) else x)
                          for k, x in oracle.items()}, "oracle_details": oracle, "summary": summary, "turns": records,
              "sessions": {"/".join(map(str, k)): x for k, x in session_ids.items()}}
    shown = {"floor_bar": bars["floor_bar"], "pooled": bars["pooled_first_audio_p50_turns_ge_4_s"]}
    lab.write_result(out, result, show={**shown, "oracles": result["oracles"]}, also=[out / "realtime.png"])
    _plot(summary, args.turns, args.sessions, out / "realtime.png",
          f"Realtime sessions ({args.rounds} rounds, {args.turns} voice turns, {model_name}, "
          f"{args.stage_config_path.name}, servers {args.servers})")
    print(f"{len(errors)} turn errors" + (f"; first: {errors[0]}" if errors else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
