"""Does omni-cache's per-step save wait for the GPU? Engine-free, on CUDA: the stage manager
driven as vLLM-Omni's AR runner drives it under async scheduling (vLLM-Omni's default on
GPUs) — decode steps of ``--batch`` requests whose host-side output tokens are placeholders
(their values only in the device's input ids), the pool on the device.

Each step enqueues a GPU busy-wait of ``--busy-ms`` (``torch.cuda._sleep``: the forward still
running) before the save, as the runner's ``execute_model`` calls it right after launching the
forward. A save that never synchronises with the device returns long before the busy-wait ends;
one that waits (a blocking copy, ``Event.synchronize``, ``.item()``) takes the rest of it. The
result counts the steps whose save took over half the busy-wait ("synced") and gives the save's
host time per step (median, max), per batch. Twenty-second session: at 9616e9c a step that
completed a block by decoding read that step's input ids with ``Event.synchronize`` — on a
GPU, a wait for the step's forward (docs/gpu.md, "Twenty-second session").

    python3 -m benchmarks.sync_probe --batch 1,16 --steps 64 --label <name> --out <dir> [--profile]

vLLM-Omni is not needed (the probe runs on a bare GPU host): where it is not installed, the two
helpers the stage manager imports from it (``flatten_payload``, ``to_payload_element``) are
stood in for by minimal equivalents for flat outputs. ``--profile``: a second decode pass under
cProfile — where a save's host time goes, per function and step. Writes
``result-<label>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace as NS

WIDTH = 2048  # Qwen3-Omni-30B-A3B's thinker hidden size
KEYS = ("hidden_states.layer_0", "hidden_states.layer_24")
BLOCK = 16


def _stand_in_vllm_omni() -> bool:
    """Minimal stand-ins for the vLLM-Omni helpers the seam imports, where it is missing."""
    try:
        import vllm_omni  # noqa: F401
        return False
    except ImportError:
        pass
    root, keys, mm = (types.ModuleType(n) for n in ("vllm_omni", "vllm_omni.data_entry_keys",
                                                     "vllm_omni.utils.mm_outputs"))
    keys.flatten_payload = lambda d: dict(d)  # the probe's outputs are flat already

    def to_payload_element(*a, **k):
        raise NotImplementedError("probe: no pass-through outputs")

    mm.to_payload_element = to_payload_element
    utils = types.ModuleType("vllm_omni.utils")
    sys.modules.update({"vllm_omni": root, "vllm_omni.data_entry_keys": keys, "vllm_omni.utils": utils,
                        "vllm_omni.utils.mm_outputs": mm})
    return True


def _sched(new=(), cached=(), computed=None):
    computed = computed or {}
    return NS(finished_req_ids=set(),
              scheduled_new_reqs=[NS(req_id=r, block_ids=(list(b),), num_computed_tokens=computed.get(r, 0))
                                  for r, b, _ in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, _ in cached], new_block_ids=[None] * len(cached),
                                       num_computed_tokens=[c for _, c in cached], resumed_req_ids=set()),
              num_scheduled_tokens={**{r: n for r, _, n in new}, **{r: 1 for r, _ in cached}})


def _summary(times: list[float], busy_ms: float) -> dict:
    return {"steps": len(times), "synced_steps": sum(t > busy_ms / 2 for t in times),
            "save_ms_median": statistics.median(times), "save_ms_max": max(times), "save_ms": times}


class _Scheduler:
    """A stand-in for the stage's scheduler in the worker's process (vLLM's ``uni`` executor,
    :mod:`omni_cache.engine.scheduler_tokens`): each request's prompt and every sampled token
    but the last (the scheduler gets a step's token a step later), and its chained block hashes
    (``block_hashes``, as vLLM's ``Request`` keeps them: computed when tokens arrive — call
    :meth:`get` once per new request before its step, as vLLM hashes a prompt on arrival)."""

    def __init__(self, runner) -> None:
        self.vllm_config, self.runner = runner.vllm_config, runner
        self.requests = self
        self.hash_block_size, self.cache_config = BLOCK, NS(enable_prefix_caching=True)
        self._reqs: dict[str, NS] = {}

    def get(self, rid: str):
        st = self.runner.requests.get(rid)
        if st is None:
            return None
        req = self._reqs.get(rid)
        if req is None or req.prompt is not st.prompt_token_ids:  # (a new request under an old id)
            req = self._reqs[rid] = NS(prompt=st.prompt_token_ids, all_token_ids=list(st.prompt_token_ids),
                                       block_hashes=[])
        tokens, hashes = req.all_token_ids, req.block_hashes  # (extended as tokens arrive, as vLLM's)
        tokens += [7] * (len(st.prompt_token_ids) + max(len(st.output_token_ids) - 1, 0) - len(tokens))
        parent = int.from_bytes(hashes[-1][:8], "little", signed=True) if hashes else 0
        for j in range(len(hashes), len(tokens) // BLOCK):
            parent = hash((parent, tuple(tokens[j * BLOCK:(j + 1) * BLOCK])))
            hashes.append(parent.to_bytes(8, "little", signed=True) + bytes(24))
        return req


def probe(batch: int, steps: int, busy_ms: float, cycles_per_ms: float, device: str = "cuda",
          hit_rounds: int = 8, profile: bool = False, prompt_tokens: int = 3048, long_rounds: int = 6,
          tokens: str = "scheduler") -> dict:
    """Save host times (ms) behind a ``busy_ms`` busy-wait, per phase: ``prefill`` (one step of
    ``batch`` prompts), ``decode`` (``steps`` steps of ``batch`` requests, placeholders on the
    host), ``hit`` (``hit_rounds`` steps, each of ``batch`` new requests whose prompts repeat
    the first ones': prefix hits on their full blocks, served from the device pool). ``device`` ``cpu``: the
    same calls without a busy-wait (a check of the probe itself). ``profile``: as many decode
    steps again under cProfile, no busy-wait (``decode.profile``: where a save's host time goes).
    ``long_prefill``: ``long_rounds`` steps, each the whole prefill of one new request of
    ``prompt_tokens`` tokens that hits nothing (A4's ``miss`` workload: 3,048), its blocks those
    of the previous round's finished request; with ``profile`` as many again under cProfile.
    ``tokens``: where decode-filled blocks' token ids come from — ``scheduler`` (a stand-in
    scheduler in this process, as vLLM's ``uni`` executor runs a stage) or ``kept`` (each decode
    step's input ids kept with a device → host copy, the path of a worker in another process)."""
    import torch

    from omni_cache.engine.stage_manager import OmniCacheStageManager

    dev = torch.device(device)
    if dev.type == "cuda":  # as the runner does at start-up (OmniCacheRunnerMixin): no JIT in a timed save
        from omni_cache.core import fused

        fused.warm_up(dev, BLOCK)
    runner = NS(cache_config=NS(kv_sharing_fast_prefill=False), kv_sharing_fast_prefill_eligible_layers=None,
                model=NS(omni_pooler_payload_include_hidden=True), requests={}, input_batch=NS(req_ids=[]),
                vllm_config=object())
    scheduler = _Scheduler(runner)  # (kept alive for the probe: registered weakly)
    if tokens == "scheduler":
        from omni_cache.engine import scheduler_tokens

        scheduler_tokens.register(scheduler)
    elif tokens != "kept":
        raise ValueError(f"tokens {tokens!r}: scheduler or kept")
    prompts = [64 + 1 + i % BLOCK for i in range(batch)]  # blocks complete at staggered steps
    decode_steps = steps * (2 if profile else 1)  # the profiled pass decodes as many steps again
    nblk = (max(prompts) + decode_steps) // BLOCK + 2
    long_blocks = -(-prompt_tokens // BLOCK)
    m = OmniCacheStageManager(runner, block_size=BLOCK, num_blocks=2 * batch * nblk + long_blocks)
    rids = [f"r{i}" for i in range(batch)]
    for i, r in enumerate(rids):
        runner.requests[r] = NS(prompt_token_ids=list(range(i * 10_000, i * 10_000 + prompts[i])),
                                output_token_ids=[], mm_features=None)
    runner.input_batch.req_ids = rids
    for r in rids:
        scheduler.get(r)

    def step(sched, n: int, busy: bool, rids=rids, prof=None) -> float:
        m.new_step_starts(sched)
        runner.input_ids = NS(gpu=torch.arange(n, device=dev) + 7)
        hidden = torch.randn(n, WIDTH, dtype=torch.bfloat16, device=dev)
        mm = {k: hidden for k in KEYS}
        if busy and dev.type == "cuda":
            torch.cuda._sleep(int(busy_ms * cycles_per_ms))  # the forward, still running
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        sid = m.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=n)
        if prof is not None:
            prof.disable()
        dt = time.perf_counter() - t0
        if m._from_snapshot:  # vLLM-Omni's async-output snapshot: host copies (outside the timing)
            m.attach_snapshot(sid, hidden.cpu(), {k: v.cpu() for k, v in mm.items()})
        m.materialize(sid, rids)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return dt * 1e3

    prefill = step(_sched(new=[(r, range(i * nblk, (i + 1) * nblk), prompts[i]) for i, r in enumerate(rids)]),
                   sum(prompts), busy=True)
    times, prof = [], cProfile.Profile() if profile else None
    for s in range(decode_steps):  # with a profile: the second half profiled, without a busy-wait
        for r in rids:
            runner.requests[r].output_token_ids.append(-1)  # async scheduling: a placeholder on the host
        t = step(_sched(cached=[(r, prompts[i] + s) for i, r in enumerate(rids)]), batch, busy=s < steps,
                 prof=prof if s >= steps else None)
        if s < steps:
            times.append(t)
    t_hits = []
    for k in range(hit_rounds):  # every round new requests: in steady state, not only the first hit step
        hits = [f"h{k}-{i}" for i in range(batch)]
        hit = {h: prompts[i] // BLOCK * BLOCK for i, h in enumerate(hits)}  # full prompt blocks, as vLLM's hit
        for i, h in enumerate(hits):
            runner.requests[h] = NS(prompt_token_ids=list(runner.requests[rids[i]].prompt_token_ids),
                                    output_token_ids=[], mm_features=None)
        runner.input_batch.req_ids = hits
        for h in hits:  # (vLLM hashes a prompt on arrival, not in the step)
            scheduler.get(h)
        shared = {h: list(range(i * nblk, i * nblk + hit[h] // BLOCK)) for i, h in enumerate(hits)}
        own = {h: list(range((batch + i) * nblk, (batch + i + 1) * nblk)) for i, h in enumerate(hits)}
        t_hits.append(step(_sched(new=[(h, shared[h] + own[h], prompts[i] - hit[h]) for i, h in enumerate(hits)],
                                  computed=hit),
                           sum(prompts[i] - hit[h] for i, h in enumerate(hits)), busy=True, rids=hits))
        finished = _sched()
        finished.finished_req_ids = set(hits)
        m.new_step_starts(finished)
        for h in hits:
            del runner.requests[h]
    assert m.metrics()["hit_tokens"] == hit_rounds * sum(hit.values()), m.metrics()
    t_long, prof_long = [], cProfile.Profile() if profile else None
    table = list(range(2 * batch * nblk, 2 * batch * nblk + long_blocks))
    for k in range(long_rounds * (2 if profile else 1)):  # with a profile: the second half profiled, not busy
        rid = f"p{k}"
        first = 1_000_000 + k * prompt_tokens  # token ids no earlier prompt has: no hit
        runner.requests[rid] = NS(prompt_token_ids=list(range(first, first + prompt_tokens)),
                                  output_token_ids=[], mm_features=None)
        runner.input_batch.req_ids = [rid]
        scheduler.get(rid)
        t = step(_sched(new=[(rid, table, prompt_tokens)]), prompt_tokens, busy=k < long_rounds, rids=[rid],
                 prof=prof_long if k >= long_rounds else None)
        if k < long_rounds:
            t_long.append(t)
        finished = _sched()
        finished.finished_req_ids = {rid}
        m.new_step_starts(finished)
        del runner.requests[rid]
    out = {"prefill": _summary([prefill], busy_ms), "decode": _summary(times, busy_ms),
           "hit": _summary(t_hits, busy_ms), "long_prefill": _summary(t_long, busy_ms),
           # one-launch step writes (omni_cache.core.fused) made, 0 where the pools' index_copy_ path ran
           "fused_launches": m.cache._writer.launches if m.cache._writer is not None else 0}
    if prof is not None:
        out["decode"]["profile"] = _top(prof, steps)
        out["long_prefill"]["profile"] = _top(prof_long, long_rounds)
    return out


def _top(prof, steps: int, n: int = 30) -> list[dict]:
    """The ``n`` functions with the most own time in a profiled decode pass: calls and ms per step."""
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": nc / steps,
             "own_ms_per_step": 1e3 * tt / steps, "cum_ms_per_step": 1e3 * ct / steps}
            for (f, line, name), (_, nc, tt, ct, _) in rows]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,16", help="requests per decode step, comma-separated")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per batch (default 64: 4 blocks each)")
    ap.add_argument("--busy-ms", type=float, default=20.0, help="GPU busy-wait enqueued before each save, ms")
    ap.add_argument("--profile", action="store_true", help="also profile the saves of a second decode pass (cProfile)")
    ap.add_argument("--prompt-tokens", type=int, default=3048,
                    help="tokens of each long_prefill request (default: A4's miss workload)")
    ap.add_argument("--tokens", default="scheduler", choices=["scheduler", "kept"],
                    help="decode tokens from the scheduler of the same process (vLLM's uni executor, default) "
                         "or kept input ids (a worker in another process)")
    ap.add_argument("--label", default="", help="a name for this tree in the result (a plain name, e.g. a commit)")
    ap.add_argument("--out", default="sync-probe", help="results folder")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: the probe needs CUDA", file=sys.stderr)
        sys.exit(2)
    stood_in = _stand_in_vllm_omni()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 100_000_000 / start.elapsed_time(end)
    import omni_cache

    result = {"label": args.label, "omni_cache": str(Path(omni_cache.__file__).parent), "gpu":
              torch.cuda.get_device_name(), "torch": torch.__version__, "vllm_omni_stood_in": stood_in,
              "busy_ms": args.busy_ms, "tokens": args.tokens, "batches": {}}
    for b in (int(x) for x in args.batch.split(",")):
        result["batches"][str(b)] = phases = probe(b, args.steps, args.busy_ms, cycles_per_ms,
                                                   profile=args.profile, prompt_tokens=args.prompt_tokens,
                                                   tokens=args.tokens)
        print(f"[{args.label}] batch {b}: {phases['fused_launches']} one-launch step writes", flush=True)
        for phase, r in ((k, v) for k, v in phases.items() if isinstance(v, dict)):
            print(f"[{args.label}] batch {b} {phase}: {r['synced_steps']}/{r['steps']} saves waited for the GPU; "
                  f"save {r['save_ms_median']:.3f} ms median, {r['save_ms_max']:.1f} ms max", flush=True)
        for phase in ("decode", "long_prefill"):
            for row in phases[phase].get("profile", [])[:12]:
                print(f"    {phase}: {row['own_ms_per_step']:.3f} ms own / {row['cum_ms_per_step']:.3f} cum per step, "
                      f"{row['calls_per_step']:.1f} calls: {row['function']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result-{args.label or 'tree'}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
