"""Multi-turn voice chat: time to the first audio packet (TTFP) and the talker's prefill per
turn, with no prefix cache (``off``), omni-cache on the thinker (``thinker``), and omni-cache
on the thinker plus the talker's content-keyed prefix cache (``thinker+talker``) (issue 15).

Three streaming CPU pipelines; per round one conversation of ``--turns`` speech turns per
variant, alternating turn by turn. Per request TTFP (s), the talker's prompt / hit tokens and
prefill time; per variant and turn median and min-max, ratios and the bars (turns >= 3: talker
prefill >= 4x lower; TTFP below thinker-only from turn 2). docs/benchmarks.md, "Voice chat".

    .venv/bin/python -m benchmarks.voice_chat_bench --model-size bench-voice --turns 6 --rounds 3
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from benchmarks import lab
from omni_cache import settings
from omni_cache.driver.inputs import DEFAULT_SYSTEM_PROMPT, Turn, build_request, sample_path
from omni_cache.driver.variants import MemorySettings, variant_stage_config

VARIANTS = ("off", "thinker", "thinker+talker")
QUESTIONS = ["What do you hear?", "Say it again, slower.", "Which word was the longest?",
             "And the shortest one?", "Repeat the first sentence.", "Summarise everything so far.",
             "Anything else?", "Thank you, goodbye."]


def _talker_record(metrics_dir: Path, request_id: str) -> dict:
    """The talker scheduler's record of ``request_id`` (run as ``<request_id>-<suffix>``), or ``{}``."""
    from omni_cache.driver.talker_identity import _engine_request_id

    recs: dict = {}
    for p in metrics_dir.glob("talker-*.json"):
        with contextlib.suppress(OSError, ValueError):
            recs.update(json.loads(p.read_text()).get("requests", {}))
    rid = _engine_request_id(recs, request_id)
    return recs[rid] if rid is not None else {}


def main(argv: list[str] | None = None) -> int:
    ap = lab.parser(__doc__, "voice-chat", size="bench-voice", sizes=("tiny", "bench", "bench-voice"))
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="conversations per variant")
    args = ap.parse_args(argv)
    if not 1 <= args.turns <= len(QUESTIONS):
        ap.error(f"--turns must be 1..{len(QUESTIONS)}")

    out = lab.results_dir(args.out, "voice-chat")
    model = lab.model_dir(args.size, args.model)
    mem = MemorySettings(thinker_kv_bytes=256 << 20, talker_kv_bytes=256 << 20)  # bench-voice talker: ~9 KiB a token
    # three pipelines side by side, as the prefill harness runs them (the stage processes inherit these): each
    # stage's worker in its engine process (vLLM's CPU platform turns "uni" into "mp" otherwise), fewer malloc arenas
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["MALLOC_ARENA_MAX"] = str(mem.malloc_arena_max)
    pipes, metrics, records, t_start = {}, {}, [], time.perf_counter()
    with contextlib.ExitStack() as stack:
        for v in VARIANTS:
            cfg = variant_stage_config(args.stage_config, out, "off" if v == "off" else "omni_cache", mem=mem,
                                       async_chunk=True, talker_prefix_caching=v == "thinker+talker")
            metrics[v] = out / f"metrics_talker_{v.replace('+', '_')}"
            cfg = lab.variant_config(cfg, out, v, env={1: {settings.METRICS_DIR.name: str(metrics[v].resolve())}})
            print(f"starting {v} ...", flush=True)
            pipes[v] = stack.enter_context(lab.start("streaming", model, cfg))
            pipes[v].run(build_request("Warm up.", system="Hello."))
        speech = sample_path("speech.wav")
        for rnd in range(args.rounds):
            system = f"Conversation {rnd + 1}. {DEFAULT_SYSTEM_PROMPT}"
            history = {v: [] for v in VARIANTS}
            for turn in range(args.turns):
                for v in lab.rotate(VARIANTS, rnd * args.turns + turn):
                    req = build_request(QUESTIONS[turn], audio=speech, system=system, history=history[v])
                    r = pipes[v].run(req)
                    if r.error:
                        raise SystemExit(f"{v} round {rnd} turn {turn + 1}: {r.error}")
                    history[v] = req.turns[1:] + [Turn("assistant", r.text)]
                    talker = _talker_record(metrics[v], r.request_id)
                    records.append(rec := dict(
                        variant=v, round=rnd, turn=turn + 1, request_id=r.request_id,
                        thinker_prompt_tokens=r.num_prompt_tokens, thinker_cached_tokens=r.num_cached_tokens,
                        **{f"talker_{k}": talker.get(k) for k in ("prompt_tokens", "cached_tokens", "prefill_s")},
                        ttft_s=r.ttft_s, ttfp_s=r.ttfp_s))
                    tp = rec["talker_prefill_s"]
                    print(f"round {rnd + 1}/{args.rounds} turn {turn + 1} {v:>14}: thinker {r.num_prompt_tokens} tok "
                          f"(hit {r.num_cached_tokens}), talker {rec['talker_prompt_tokens']} tok "
                          f"(hit {rec['talker_cached_tokens']}), talker prefill "
                          f"{'?' if tp is None else f'{tp * 1e3:.1f} ms'}, TTFP {r.ttfp_s:.2f} s", flush=True)

    turns = list(range(1, args.turns + 1))
    summary = {v: {t: {m: lab.describe([r[m] for r in records if r["variant"] == v and r["turn"] == t],
                                       "median", "min", "max")
                       for m in ("ttfp_s", "talker_prefill_s", "talker_cached_tokens", "talker_prompt_tokens",
                                 "thinker_cached_tokens")}
                   for t in turns} for v in VARIANTS}

    def med(v, t, m):
        c = summary[v][t][m]
        return c["median"] if c else float("nan")

    ratios = {t: {f"{name}_over_both": med(v, t, m) / med("thinker+talker", t, m) for name, v, m in (
        ("talker_prefill_thinker", "thinker", "talker_prefill_s"), ("ttfp_thinker", "thinker", "ttfp_s"),
        ("ttfp_off", "off", "ttfp_s"))} for t in turns}
    bars = {"talker_prefill_4x_lower_on_turns_ge_3": all(ratios[t]["talker_prefill_thinker_over_both"] >= 4
                                                         for t in turns[2:]),
            "ttfp_lower_than_thinker_only_on_turns_ge_2": all(ratios[t]["ttfp_thinker_over_both"] > 1
                                                              for t in turns[1:])}
    lab.write_result(out, {**lab.stamp("benchmarks.voice_chat_bench", argv), "args": lab.jsonable(args),
                           "wall_s": time.perf_counter() - t_start, "summary": summary, "ratios": ratios, "bars": bars,
                           "requests": records}, show={"ratios": ratios, "bars": bars}, also=[out / "voice_chat.png"])

    with lab.figure(out / "voice_chat.png", 1, 2, figsize=(11, 4),
                    title=f"Voice chat ({args.turns} speech turns, {args.rounds} rounds, {args.size} model): "
                          "median, min-max") as (fig, axes):
        for ax, metric, label, scale in ((axes[0], "talker_prefill_s", "talker prefill (ms)", 1e3),
                                         (axes[1], "ttfp_s", "TTFP (s)", 1.0)):
            for v, marker in zip(VARIANTS, "osD"):
                ys = [med(v, t, metric) * scale for t in turns]
                c = [summary[v][t][metric] for t in turns]
                ax.errorbar(turns, ys, yerr=[[y - x["min"] * scale if x else 0 for y, x in zip(ys, c)],
                                             [x["max"] * scale - y if x else 0 for y, x in zip(ys, c)]],
                            marker=marker, capsize=3, label=v)
            ax.set(xlabel="turn", ylabel=label, ylim=(0, None))
            ax.legend()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
