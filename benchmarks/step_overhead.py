"""omni-cache's own host time per decode step, engine-free: the stage manager's seam calls on a
fake runner, every step of ``--batch`` requests writing one row per request and key (width
2,048, bf16, three keys). It bounds the bookkeeping omni-cache adds to an engine step and the
host tier's copies, not the GPU path's (docs/gpu.md, "Zero overhead").

    .venv/bin/python -m benchmarks.step_overhead --batch 1,16 --steps 300 --rounds 5

Writes ``result.json`` (per batch: µs per step, median and spread over the rounds; µs per
request) under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace as NS

from benchmarks import lab

WIDTH = 2048  # Qwen3-Omni-30B-A3B's thinker hidden size
KEYS = ("hidden_states.layer_0", "hidden_states.layer_24")


def _scheduler_output(new=(), cached=()):
    """A scheduler output as vLLM's: ``new`` ``(rid, block_ids, computed, scheduled)``, ``cached``
    ``(rid, computed, scheduled)`` (no new blocks)."""
    return NS(finished_req_ids=set(),
              scheduled_new_reqs=[NS(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c, _ in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, *_ in cached], new_block_ids=[None] * len(cached),
                                       num_computed_tokens=[c for _, c, _ in cached], resumed_req_ids=set()),
              num_scheduled_tokens={**{r: n for r, _, _, n in new}, **{r: n for r, _, n in cached}})


def decode_step_us(batch: int, steps: int, *, prompt: int = 64, block_size: int = 16,
                   handoff: str = "merge") -> float:
    """Mean µs of one decode step's seam calls (``batch`` requests, one token each), after a
    prefill of ``prompt`` tokens per request. ``handoff``: ``merge`` (the CPU platform's path)
    or ``snapshot`` (the CUDA default's, ``OMNI_CACHE_HANDOFF_STAGING=snapshot``, with the stager's
    CPU mode: the fresh rows from the host copy vLLM-Omni's async output takes of every step,
    handed over by ``attach_snapshot`` before ``materialize``)."""
    import torch

    from omni_cache.core.staging import HostStager
    from omni_cache.engine.stage_manager import HIDDEN_KEY, OmniCacheStageManager

    runner = NS(cache_config=NS(kv_sharing_fast_prefill=False), kv_sharing_fast_prefill_eligible_layers=None,
                model=NS(omni_pooler_payload_include_hidden=True), requests={}, input_batch=NS(req_ids=[]))
    nblk = (prompt + steps) // block_size + 2
    m = OmniCacheStageManager(runner, block_size=block_size, num_blocks=batch * nblk)
    rids = [f"r{i}" for i in range(batch)]
    for i, r in enumerate(rids):
        runner.requests[r] = NS(prompt_token_ids=list(range(i * 10_000, i * 10_000 + prompt)),
                                output_token_ids=[], mm_features=None)
    runner.input_batch.req_ids = rids
    rows = {n: torch.randn(n, WIDTH, dtype=torch.bfloat16) for n in (batch, batch * prompt)}

    def step(sched) -> None:
        m.new_step_starts(sched)
        hidden = rows[sum(sched.num_scheduled_tokens.values())]
        mm = {k: hidden for k in KEYS if k != HIDDEN_KEY}
        sid = m.save_outputs(hidden, mm, num_tokens_unpadded=hidden.shape[0], num_tokens_padded=hidden.shape[0])
        if m._from_snapshot:
            m.attach_snapshot(sid, hidden, mm)
        m.materialize(sid, rids)

    if handoff not in ("merge", "snapshot"):
        raise ValueError(f"handoff {handoff!r}: merge or snapshot")
    step(_scheduler_output(new=[(r, range(i * nblk, (i + 1) * nblk), 0, prompt) for i, r in enumerate(rids)]))
    if handoff == "snapshot":  # as _ensure_keys sets it up on CUDA
        m._stager, m._from_snapshot = HostStager(torch.device("cpu")), True
    scheds = [_scheduler_output(cached=[(r, prompt + s, 1) for r in rids]) for s in range(steps)]
    elapsed = 0.0
    for s, sched in enumerate(scheds):
        for r in rids:
            runner.requests[r].output_token_ids.append(7 + s)
        t0 = time.perf_counter()
        step(sched)
        elapsed += time.perf_counter() - t0
    return elapsed / steps * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,16", help="requests per decode step, comma-separated (default 1,16)")
    ap.add_argument("--steps", type=int, default=300, help="decode steps per round (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per batch, alternated (default 5)")
    ap.add_argument("--handoff", default="merge", choices=["merge", "snapshot"],
                    help="the hand-off path: merge (the CPU platform's) or snapshot (the CUDA default's)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/step-overhead-<time>)")
    args = ap.parse_args(argv)
    batches = lab.positive_int_list(args.batch, "--batch")
    samples: dict[int, list[float]] = {b: [] for b in batches}
    for k in range(args.rounds):  # alternated: each round runs every batch size once
        for b in batches:
            samples[b].append(decode_step_us(b, args.steps, handoff=args.handoff))
            print(f"[round {k + 1}/{args.rounds}] batch {b}: {samples[b][-1]:.0f} us per decode step", flush=True)
    result = {**lab.stamp("benchmarks.step_overhead", argv), "args": lab.jsonable(args), "width": WIDTH,
              "keys": ["hidden_states.output", *KEYS],
              "batches": {str(b): {"us_per_step_median": statistics.median(v), "us_per_step_min": min(v),
                                   "us_per_step_max": max(v), "us_per_request": statistics.median(v) / b,
                                   "rounds_us": v} for b, v in samples.items()}}
    out = lab.results_dir(args.out, "step-overhead")
    print(f"result: {lab.write_result(out, result)}")
    return result


if __name__ == "__main__":
    main()
