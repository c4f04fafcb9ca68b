"""The CPU idle back-off (``OMNI_CACHE_CPU_IDLE_BACKOFF_MS``, docs/cpu.md) on and off, side by
side: does it shorten the thinker's prefill while the streaming talker and code2wav wait for
chunks? (issue 14 item 6)

Two streaming CPU pipelines, ``backoff-0`` and ``backoff-N`` (``--backoff-ms``), alternate
fresh ``--prompt-tokens`` misses; TTFT and TTFP (s) per request, medians and off/on ratios in
``result.json``; ``idle_backoff.png``.

    .venv/bin/python -m benchmarks.idle_backoff_bench --model-size bench --rounds 5
"""

from __future__ import annotations

import contextlib
import random
import time

from benchmarks import lab
from omni_cache import settings
from omni_cache.driver.inputs import build_request


def main(argv: list[str] | None = None) -> int:
    ap = lab.parser(__doc__, "idle-backoff")
    ap.add_argument("--rounds", type=int, default=5, help="one request per variant per round")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--backoff-ms", type=int, default=8, help="the 'on' variant's setting")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    out = lab.results_dir(args.out, "idle-backoff")
    model = lab.model_dir(args.size, args.model)
    tok = AutoTokenizer.from_pretrained(model)
    variants = {f"backoff-{ms}": ms for ms in (0, args.backoff_ms)}
    pipes, records, t_start = {}, [], time.perf_counter()
    with contextlib.ExitStack() as stack:
        for name, ms in variants.items():
            env = {settings.CPU_IDLE_BACKOFF_MS.name: str(ms)}
            cfg = lab.variant_config(args.stage_config, out, name, env={0: env, 1: env, 2: env})
            print(f"starting {name} ({args.size} model) ...", flush=True)
            pipes[name] = stack.enter_context(lab.start("streaming", model, cfg))
            pipes[name].run(build_request("Warm up.", system="Hello."))
        rng = random.Random(0)
        names = list(variants)
        for rnd in range(args.rounds):
            for name in lab.rotate(names, rnd):
                system = f"Request {rnd}-{name}. " + lab.random_text(rng, args.prompt_tokens, tok)
                r = pipes[name].run(build_request("Summarise it in one sentence.", system=system))
                if r.error:
                    raise SystemExit(f"{name} round {rnd}: {r.error}")
                records.append(dict(variant=name, round=rnd, prompt_tokens=r.num_prompt_tokens,
                                    cached_tokens=r.num_cached_tokens, ttft_s=r.ttft_s, ttfp_s=r.ttfp_s))
                print(f"round {rnd + 1}/{args.rounds} {name}: {r.num_prompt_tokens} tokens, "
                      f"TTFT {r.ttft_s:.2f} s, TTFP {r.ttfp_s:.2f} s", flush=True)
    summary = {name: {m: lab.describe([r[m] for r in records if r["variant"] == name], "median", "min", "max")
                      for m in ("ttft_s", "ttfp_s")} for name in names}
    off, on = names
    summary["ratios_off_over_on"] = {m: summary[off][m]["median"] / summary[on][m]["median"]
                                     for m in ("ttft_s", "ttfp_s")}
    lab.write_result(out, {**lab.stamp("benchmarks.idle_backoff_bench", argv), "args": lab.jsonable(args),
                           "wall_s": time.perf_counter() - t_start, "summary": summary, "requests": records},
                     show=summary)

    title = f"Idle back-off off vs on, streaming, {args.prompt_tokens}-token misses ({args.size} model)"
    with lab.figure(out / "idle_backoff.png", 1, 2, figsize=(9, 4), title=title) as (fig, axes):
        for ax, metric, label in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "ttfp_s", "TTFP (s)")):
            ax.boxplot([[r[metric] for r in records if r["variant"] == n] for n in names], tick_labels=names)
            ax.set(ylabel=label, ylim=(0, None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
