"""Load on vLLM-Omni's OpenAI-compatible server: omni-cache on vs thinker prefix cache off.

Bursts of ``--concurrency`` streaming chat completions (text + audio) sharing one long system
prompt (fresh per round). Per request TTFT, TTFP, e2e (s), thinker prompt / cached tokens; one
server at a time (``on`` / ``off``: :func:`benchmarks.lab.prefix_cache_variant`), ``--cycles``
repeats of ``--order``; p50/p90/p99 and on/off ratios (docs/serving.md, "Load").

    .venv/bin/python -m benchmarks.serve_load --concurrency 16 --rounds 3 --model-size bench
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from openai import AsyncOpenAI

from benchmarks import lab
from omni_cache.driver.realtime import prefix_cache_counters

PARAGRAPH = ("You are a careful assistant for a museum of natural history. Visitors send photos "
             "and voice notes; answer briefly, name what you see, and keep a friendly tone. ")


def _percentiles(xs: list[float]) -> dict:
    return lab.describe(xs, "p50", "p90", "p99", "mean", "min", "max") or {"n": 0}


async def _one_chat(client, model: str, system: str, question: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    rec: dict = {"ttft_s": None, "ttfp_s": None, "e2e_s": None, "prompt_tokens": None,
                 "cached_tokens": None, "text_chars": 0, "audio_chunks": 0, "error": None}
    try:
        stream = await client.chat.completions.create(
            model=model, stream=True, modalities=["text", "audio"], max_tokens=max_tokens, seed=0,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        async for chunk in stream:
            now = time.perf_counter() - t0  # > 0: a first time is kept by `or`
            modality = (chunk.model_extra or {}).get("modality", "text")
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content and modality == "audio":
                rec.update(audio_chunks=rec["audio_chunks"] + 1, ttfp_s=rec["ttfp_s"] or now)
            elif content and modality == "text":
                rec.update(text_chars=rec["text_chars"] + len(content), ttft_s=rec["ttft_s"] or now)
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None and modality == "text":
                rec["prompt_tokens"] = chunk.usage.prompt_tokens
                rec["cached_tokens"] = chunk.usage.prompt_tokens_details.cached_tokens
    except Exception as exc:  # a failed request is reported, not hidden
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["e2e_s"] = time.perf_counter() - t0
    if rec["error"] is None and (rec["ttft_s"] is None or rec["ttfp_s"] is None):
        rec["error"] = "stream ended without " + ("text" if rec["ttft_s"] is None else "audio")
    return rec


async def _burst(base_url: str, model: str, system: str, concurrency: int, max_tokens: int, round_idx: int):
    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=900, max_retries=0)
    try:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*[
            _one_chat(client, model, system, f"Visitor {round_idx}-{i} asks: what is exhibit number {i * 7 + 3}?",
                      max_tokens)
            for i in range(concurrency)])
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    for i, r in enumerate(recs):
        r.update(round=round_idx, index=i)
    return recs, wall


def _run_variant(args, variant: str, cycle: int, model_dir: Path, out_dir: Path, tokenizer) -> dict:
    cfg = lab.prefix_cache_variant(args.stage_config, out_dir, variant)
    with lab.start("server", model_dir, cfg, log=out_dir / f"server-{variant}-{cycle}.log",
                   label=f"{variant} #{cycle}") as srv:
        model = srv.model_name()
        # Warm-up (excluded): one request with an unrelated system prompt.
        asyncio.run(_burst(srv.base_url, model, "Warm-up.", 1, args.max_tokens, -1))
        recs, walls = [], []
        for r in range(args.rounds):
            system = f"[session {cycle * 1000 + r}] "  # then PARAGRAPH repeated to --system-tokens
            while len(tokenizer.encode(system)) < args.system_tokens:
                system += PARAGRAPH
            rr, wall = asyncio.run(_burst(srv.base_url, model, system, args.concurrency, args.max_tokens, r))
            ok = [x for x in rr if not x["error"]]
            print(f"[{variant} #{cycle}] round {r}: {len(ok)}/{len(rr)} ok in {wall:.1f} s; TTFT p50 "
                  f"{_percentiles([x['ttft_s'] for x in ok]).get('p50', float('nan')):.2f} s", flush=True)
            recs += rr
            walls.append(wall)
        hits = prefix_cache_counters(srv.url)
    return {"variant": variant, "cycle": cycle, "ready_s": srv.ready_s, "exit_code": srv.exit_code,
            "round_wall_s": walls, "requests": recs, "prefix_cache_counters": hits}


def _summary(runs: list[dict]) -> dict:
    out = {}
    for variant in sorted({r["variant"] for r in runs}):
        recs = [x for r in runs if r["variant"] == variant for x in r["requests"]]
        ok = [x for x in recs if not x["error"]]
        prompt = sum(x["prompt_tokens"] or 0 for x in ok)
        cached = sum(x["cached_tokens"] or 0 for x in ok)
        out[variant] = {"requests": len(recs), "errors": len(recs) - len(ok), "prompt_tokens": prompt,
                        **{m: _percentiles([x[m] for x in ok]) for m in ("ttft_s", "ttfp_s", "e2e_s")},
                        "cached_tokens": cached, "hit_ratio": cached / prompt if prompt else 0.0}
    if "on" in out and "off" in out:
        out["off_over_on"] = {m: {p: out["off"][m][p] / out["on"][m][p] for p in ("p50", "p90", "p99")}
                              for m in ("ttft_s", "ttfp_s", "e2e_s")
                              if out["on"][m].get("n") and out["off"][m].get("n")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = lab.parser(__doc__, "serve-load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="bursts per server (fresh system prompt each)")
    ap.add_argument("--system-tokens", type=int, default=2000, help="length of the shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=16, help="thinker output tokens per request")
    ap.add_argument("--order", default="on,off", help="variant order per cycle")
    ap.add_argument("--cycles", type=int, default=1, help="repeat the whole order (fresh servers)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    model_dir = lab.model_dir(args.size, args.model)
    out_dir = lab.results_dir(args.out, "serve-load")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    runs = [_run_variant(args, variant.strip(), cycle, model_dir, out_dir, tokenizer)
            for cycle in range(args.cycles) for variant in args.order.split(",")]
    result = {"benchmark": "serve_load", **lab.stamp("benchmarks.serve_load", argv), "model": str(model_dir),
              "args": lab.jsonable(args), "summary": _summary(runs), "runs": runs}
    lab.write_result(out_dir, result, show=result["summary"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
