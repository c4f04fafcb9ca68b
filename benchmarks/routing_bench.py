"""Prefix-aware routing vs vLLM-Omni's own routing over two real thinker replicas: hit ratio,
TTFT and TTFP per policy (issue 17; docs/routing.md).

One streaming pipeline with two thinker replicas runs both policies, alternated by round
(``prefix``: omni-cache's router; ``vllm_omni``: vLLM-Omni's round-robin). Each round sends
``--conversations`` fresh conversations (odd: round-robin splits their turns) for ``--turns``
turns, interleaved; a turn >= 2 hits when its cached prefix covers the previous prompt's
blocks. ``result.json`` (:func:`summarize`) and ``routing_bench.png``.

    .venv/bin/python -m benchmarks.routing_bench --model-size bench
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import yaml

from benchmarks import lab
from omni_cache import settings

POLICIES = ("prefix", "vllm_omni")
QUESTIONS = ["Tell me a story about it.", "And then what happened?", "Why did that happen?",
             "What comes next?", "How does it end?", "Tell me one more detail."]


def _first_prompt(tok, system: str) -> list[int]:
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{QUESTIONS[0]}"
                      "<|im_end|>\n<|im_start|>assistant\n")


def _next_prompt(tok, prev: list[int], answer: list[int], turn: int) -> list[int]:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tail = tok.encode(f"\n<|im_start|>user\n{QUESTIONS[turn % len(QUESTIONS)]}<|im_end|>\n"
                      "<|im_start|>assistant\n")
    return prev + [t for t in answer if t != im_end] + [im_end] + tail


def summarize(records: list[dict]) -> dict:
    """Per policy: hit ratio (turns >= 2), TTFT / TTFP p50 / p95 (all requests and turns >= 2,
    seconds), per-round medians; plus round-robin / prefix ratios of the p50s."""
    out: dict = {}
    for policy in POLICIES:
        rs = [r for r in records if r["policy"] == policy]
        later = [r for r in rs if r["turn"] >= 1]
        s = {"requests": len(rs), "hit_ratio_turn2plus": (sum(r["hit"] for r in later) / len(later)) if later else None}
        for metric in ("ttft_s", "ttfp_s"):
            for name, group in (("all", rs), ("turn2plus", later)):
                d = lab.describe([r[metric] for r in group], "p50", "p95") or {}
                s.update({f"{metric}_{p}_{name}": d.get(p) for p in ("p50", "p95")})
            s[f"{metric}_round_medians"] = [lab.stat([r[metric] for r in rs if r["round"] == k])
                                            for k in sorted({r["round"] for r in rs})]
        out[policy] = s
    out["ratios"] = ratios = {f"{k}_vllm_omni_over_prefix": lab.ratio(out["vllm_omni"].get(k), out["prefix"].get(k))
                              for k in ("ttft_s_p50_all", "ttft_s_p95_all", "ttfp_s_p50_all", "ttfp_s_p95_all",
                                          "ttft_s_p50_turn2plus", "ttfp_s_p50_turn2plus")}
    out["bars"] = {"hit_ratio_turn2plus_prefix >= 0.95": (out["prefix"]["hit_ratio_turn2plus"] or 0) >= 0.95,
                   "ttft_p50 vllm_omni / prefix >= 1.8": (ratios["ttft_s_p50_all_vllm_omni_over_prefix"] or 0) >= 1.8}
    return out


def plot(records: list[dict], path: Path) -> None:
    title = "Two thinker replicas, interleaved conversations: prefix routing vs round-robin"
    with lab.figure(path, 1, 2, figsize=(10, 4), title=title) as (fig, axes):
        for ax, metric, label in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "ttfp_s", "TTFP, first audio packet (s)")):
            data = [[r[metric] for r in records if r["policy"] == p and r[metric] is not None] for p in POLICIES]
            ax.boxplot(data, tick_labels=["prefix routing", "vLLM-Omni round-robin"], showfliers=True)
            for i, p in enumerate(POLICIES, 1):
                later = [r[metric] for r in records if r["policy"] == p and r["turn"] >= 1 and r[metric] is not None]
                first = [r[metric] for r in records if r["policy"] == p and r["turn"] == 0 and r[metric] is not None]
                ax.scatter([i - 0.15] * len(first), first, s=10, c="tab:gray", label="turn 1" if i == 1 else None)
                ax.scatter([i + 0.15] * len(later), later, s=10, c="tab:blue", label="turn >= 2" if i == 1 else None)
            ax.set(ylabel=label, ylim=(0, None))
            ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    ap = lab.parser(__doc__, "routing-bench")
    ap.add_argument("--conversations", type=int, default=3, help="per round (odd: see the module docstring)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4, help="policies alternate by round")
    ap.add_argument("--system-tokens", type=int, default=1536, help="each conversation's system prompt (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    out = lab.results_dir(args.out, "routing-bench")
    model = lab.model_dir(args.size, args.model)
    tok = AutoTokenizer.from_pretrained(model)
    cfg = lab.variant_config(args.stage_config, out, "routing", stages={0: {"num_replicas": 2}},
                             env={0: {settings.ROUTING.name: "prefix"}})
    block = int(next(s for s in yaml.safe_load(cfg.read_text())["stages"] if s["stage_id"] == 0)["block_size"])
    records, t_start = [], time.perf_counter()
    print(f"starting the pipeline ({args.size} model, 2 thinker replicas) ...", flush=True)
    with lab.start("streaming", model, cfg) as pipe:
        router, engine = pipe.router, pipe.omni.engine
        if router is None:
            raise SystemExit("prefix routing was not installed (one thinker replica?)")
        print(f"started in {pipe.start_s:.0f} s", flush=True)
        pipe.run({"prompt_token_ids": _first_prompt(tok, "Warm-up.")})  # not recorded
        for rnd in range(args.rounds):
            policy = POLICIES[rnd % 2]
            (router.install if policy == "prefix" else router.uninstall)(engine)
            rng = random.Random(f"{args.seed}-{rnd}")
            prompts = {c: _first_prompt(tok, f"Session {rnd}.{c}. " + lab.random_text(rng, args.system_tokens, tok))
                       for c in range(args.conversations)}
            prev: dict[int, int] = {}
            for turn in range(args.turns):
                for c in range(args.conversations):
                    if turn:
                        prompts[c] = _next_prompt(tok, prompts[c], records[prev[c]]["answer"], turn)
                    r = pipe.run({"prompt_token_ids": prompts[c]})
                    if r.error:
                        raise SystemExit(f"round {rnd} conversation {c} turn {turn}: {r.error}")
                    hit = bool(turn) and r.num_cached_tokens >= records[prev[c]]["prompt_tokens"] // block * block
                    prev[c] = len(records)
                    records.append(dict(round=rnd, policy=policy, conversation=c, turn=turn, ttft_s=r.ttft_s,
                                        ttfp_s=r.ttfp_s, prompt_tokens=r.num_prompt_tokens,
                                        cached_tokens=r.num_cached_tokens, hit=hit, answer=r.token_ids))
                    print(f"round {rnd + 1}/{args.rounds} {policy:9s} conv {c} turn {turn + 1}: "
                          f"{r.num_prompt_tokens} tokens, {r.num_cached_tokens} cached, "
                          f"TTFT {r.ttft_s:.2f} s, TTFP {r.ttfp_s:.2f} s", flush=True)
    summary = summarize(records)
    result = {**lab.stamp("benchmarks.routing_bench", argv), "args": lab.jsonable(args),
              "wall_s": time.perf_counter() - t_start, "summary": summary,
              "requests": [{k: v for k, v in r.items() if k != "answer"} for r in records]}
    lab.write_result(out, result, show=summary, also=[out / "routing_bench.png"])
    plot(records, out / "routing_bench.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
