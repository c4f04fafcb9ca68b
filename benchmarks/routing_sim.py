"""Routing simulation: prefix-aware vs vLLM-Omni's policies over 8-256 thinker replicas.

The policy code itself (:mod:`omni_cache.routing`), no engine: multi-turn conversations on
Zipf-picked shared system prompts, Poisson arrivals, per replica ``batch`` requests at a time of
service time ``t_fixed + t_block x uncached blocks`` and an LRU KV cache as ground truth (a turn
>= 2 hits when its replica holds the previous prompt's blocks). Bar: 64 replicas, Zipf: hit ratio
>= 0.9 with max/mean load <= 1.3 (prefix). docs/routing.md, "Simulation".

    PYTHONPATH=. .venv/bin/python benchmarks/routing_sim.py    # writes benchmarks/results/routing-sim/
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import sys
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import lab  # noqa: E402
from omni_cache import routing  # noqa: E402
from omni_cache.core.block_hashes import chained_block_hashes  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "routing-sim"
POLICIES = ("prefix", "prefix+events", "random", "round-robin", "least-queue")
DEFAULT_POLICIES = ("prefix", "random", "round-robin", "least-queue")


@dataclass(frozen=True)
class Workload:
    replicas: int
    conversations: int
    turns: int
    zipf_s: float            # 0 = uniform
    system_prompts: int = 16
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (24, 120)
    answer_tokens: tuple[int, int] = (16, 96)
    block_size: int = 16
    capacity_blocks: int = 2048   # per replica KV blocks
    batch: int = 8
    utilization: float = 0.7
    t_fixed: float = 1.0
    t_block: float = 0.05
    seed: int = 0


class _LRU:
    """Ground truth: one replica's KV prefix cache (block hashes, LRU eviction)."""

    def __init__(self, capacity: int) -> None:
        self.cap, self.d = capacity, OrderedDict()

    def leading_hits(self, hashes: list[int]) -> int:
        return next((i for i, h in enumerate(hashes) if h not in self.d), len(hashes))

    def store(self, hashes: list[int]) -> list[int]:
        for h in hashes:
            if h in self.d:
                self.d.move_to_end(h)
            else:
                self.d[h] = None
        return [self.d.popitem(last=False)[0] for _ in range(len(self.d) - self.cap)]  # evicted, oldest first


def build_conversations(w: Workload) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, per turn: (prompt block hashes, prompt + answer block hashes).
    Block hashes are extended incrementally (``parent=``), equal to hashing each prompt whole."""
    rng = random.Random(w.seed)
    gen = np.random.default_rng(w.seed)
    vocab, bs = 150_000, w.block_size
    systems = [gen.integers(0, vocab, w.system_tokens).tolist() for _ in range(w.system_prompts)]
    sys_cum = list(accumulate(1.0 / (k + 1) ** w.zipf_s for k in range(w.system_prompts)))
    convs = []
    for _ in range(w.conversations):
        k = bisect_left(sys_cum, rng.random() * sys_cum[-1])
        toks = list(systems[k])
        hashes: list[int] = []                     # of toks' first len(hashes) full blocks
        turns = []
        for _ in range(w.turns):
            toks += gen.integers(0, vocab, rng.randint(*w.user_tokens)).tolist()
            answer = gen.integers(0, vocab, rng.randint(*w.answer_tokens)).tolist()
            tail = (toks + answer)[len(hashes) * bs:]  # hashed on from the last known block
            full = (hashes + chained_block_hashes(tail, bs, parent=hashes[-1]) if hashes
                    else routing.request_block_hashes(tail, bs))
            turns.append((full[: len(toks) // bs], full))  # chained: the prompt's are a prefix
            toks += answer
            hashes = full
        convs.append(turns)
    return convs


def simulate(w: Workload, policy_name: str, convs) -> dict:
    rng = random.Random(w.seed + 1)
    R, N = w.replicas, len(convs)
    if policy_name.startswith("prefix"):  # prefix, prefix+events
        policy = routing.PrefixAwarePolicy(routing.RoutingConfig(load_margin=4, capacity_blocks=w.capacity_blocks))
    else:
        policy = {"random": lambda: routing.RandomPolicy(w.seed), "round-robin": routing.RoundRobinPolicy,
                  "least-queue": lambda: routing.LeastQueuePolicy(w.seed)}[policy_name]()
    events_on = policy_name == "prefix+events"
    keys = [f"replica-{i}" for i in range(R)]
    kv = [_LRU(w.capacity_blocks) for _ in range(R)]
    queue = dict.fromkeys(keys, 0)                   # queued + running, what the policy sees
    waiting = [deque() for _ in range(R)]
    running, served, busy = [0] * R, [0] * R, [0.0] * R
    weight = [1.0 / (i + 1) ** w.zipf_s for i in range(N)]
    rng.shuffle(weight)                              # popularity rank independent of system prompt
    next_turn = [0] * N
    ready = np.array(weight)                         # a conversation's weight while its next turn may be sent, else 0
    total = to_issue = sum(len(c) for c in convs)
    # arrival rate: utilization x capacity with every prompt a miss (no policy overloads)
    mean_blocks = sum(len(t[0]) for c in convs for t in c) / sum(len(c) for c in convs)
    rate = w.utilization * R * w.batch / (w.t_fixed + w.t_block * mean_blocks)
    heap: list[tuple[float, int, str, tuple]] = []
    seq = itertools.count()  # the heap's tie-break
    hits = later = cached = prompt_blocks = done = 0
    now = 0.0
    reasons: dict[str, int] = {}

    def start(r: int, t: float) -> None:
        nonlocal hits, later, cached, prompt_blocks
        c, turn, prompt, full = waiting[r].popleft()
        running[r] += 1
        h = kv[r].leading_hits(prompt)
        if turn >= 1:
            later += 1
            prev = len(convs[c][turn - 1][0])
            hits += h >= prev
            cached += h
            prompt_blocks += len(prompt)
        dur = w.t_fixed + w.t_block * (len(prompt) - h)
        busy[r] += dur
        heapq.heappush(heap, (t + dur, next(seq), "finish", (r, c, full)))

    heapq.heappush(heap, (rng.expovariate(rate), next(seq), "arrive", ()))
    while done < total:
        now, _, kind, data = heapq.heappop(heap)
        if kind == "arrive":
            cum = np.cumsum(ready)                   # weighted draw: the first prefix sum above x
            if cum[-1] > 1e-12:
                c = min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), N - 1)
                while ready[c] == 0.0:               # float residue at an edge
                    c = (c + 1) % N
                ready[c] = 0.0
                to_issue -= 1
                turn = next_turn[c]
                next_turn[c] += 1
                prompt, full = convs[c][turn]
                d = policy.route(prompt, queue, tie_key=c)
                reasons[d.reason] = reasons.get(d.reason, 0) + 1
                r = int(d.replica.rsplit("-", 1)[1])
                queue[d.replica] += 1
                served[r] += 1
                waiting[r].append((c, turn, prompt, full))
                if running[r] < w.batch:
                    start(r, now)
            if to_issue:
                heapq.heappush(heap, (now + rng.expovariate(rate), next(seq), "arrive", ()))
        else:
            r, c, full = data
            running[r] -= 1
            queue[keys[r]] -= 1
            evicted = kv[r].store(full)
            if events_on:                            # what BlockStored / BlockRemoved carry
                policy.record(keys[r], full)
                policy.forget(keys[r], evicted)
            done += 1
            if next_turn[c] < w.turns:
                ready[c] = weight[c]
            if waiting[r] and running[r] < w.batch:
                start(r, now)
    return {"policy": policy_name, "requests": total, "turn2_hit_ratio": hits / later if later else 0.0,
            "cached_block_ratio": cached / prompt_blocks if prompt_blocks else 0.0,
            "load_max_mean": max(served) / (sum(served) / R), "busy_max_mean": max(busy) / (sum(busy) / R),
            "makespan": now, "reasons": reasons}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--conversations-per-replica", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the skewed runs")
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=POLICIES)
    ap.add_argument("--pressure-capacity", type=int, default=200,
                    help="KV blocks per replica of the eviction-pressure runs (64 replicas, Zipf: "
                         "prefix vs prefix+events); 0 = skip them")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    rows, t_all = [], time.perf_counter()
    runs = [(R, skew, s, None, args.policies) for R in args.replicas
            for skew, s in (("uniform", 0.0), ("zipf", args.zipf_s))]
    if args.pressure_capacity:  # eviction pressure
        runs.append((64, f"zipf, {args.pressure_capacity} KV blocks", args.zipf_s, args.pressure_capacity,
                     ("prefix", "prefix+events", "least-queue")))
    for R, skew, s, capacity, policies in runs:
        w = Workload(replicas=R, conversations=R * args.conversations_per_replica, turns=args.turns, zipf_s=s,
                     **({"capacity_blocks": capacity} if capacity else {}))
        convs = build_conversations(w)
        for p in policies:
            t1 = time.perf_counter()
            rows.append(row := {"replicas": R, "skew": skew, **simulate(w, p, convs)})
            print(f"[{time.perf_counter() - t_all:6.1f}s] R={R:<4} {skew:<7} {p:<14} "
                  f"hit(turn>=2)={row['turn2_hit_ratio']:.3f} cached={row['cached_block_ratio']:.3f} "
                  f"load max/mean={row['load_max_mean']:.2f} busy max/mean={row['busy_max_mean']:.2f} "
                  f"({time.perf_counter() - t1:.1f}s)", flush=True)
    bar = [r for r in rows if r["replicas"] == 64 and r["skew"] == "zipf" and r["policy"] == "prefix"]
    bar_ok = bool(bar) and bar[0]["turn2_hit_ratio"] >= 0.9 and bar[0]["load_max_mean"] <= 1.3
    base = Workload(replicas=0, conversations=0, turns=args.turns, zipf_s=args.zipf_s)
    result = {"command": "PYTHONPATH=. python benchmarks/routing_sim.py " + " ".join(argv or sys.argv[1:]),
              "workload": {**asdict(base), "replicas": args.replicas,
                           "conversations_per_replica": args.conversations_per_replica},
              "policy_config": {"load_margin": 4, "shared_prefix_fanout": 4, "capacity_blocks": base.capacity_blocks},
              "bar": {"replicas": 64, "skew": "zipf", "policy": "prefix", "hit_ratio_min": 0.9,
                      "load_max_mean_max": 1.3, "met": bar_ok, "row": bar[0] if bar else None},
              "rows": rows, "runtime_s": round(time.perf_counter() - t_all, 1)}
    lab.write_result(lab.results_dir(args.out, "routing-sim"), result)
    if not args.no_plot:
        plot(rows, args.out / "routing_sim.png")
    print(f"bar (64 replicas, zipf, prefix: hit >= 0.9, max/mean <= 1.3): {'MET' if bar_ok else 'NOT MET'}"
          f"; wrote {args.out} in {result['runtime_s']} s")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    title = "Routing simulation (omni_cache.routing): prefix-aware vs vLLM-Omni's policies"
    with lab.figure(path, 2, 2, figsize=(11, 7), sharex=True, dpi=110, title=title) as (fig, axes):
        for j, skew in enumerate(("uniform", "zipf")):
            for p in POLICIES:
                rs = sorted((r for r in rows if r["skew"] == skew and r["policy"] == p), key=lambda r: r["replicas"])
                if not rs:
                    continue
                x = [r["replicas"] for r in rs]
                axes[0][j].plot(x, [r["turn2_hit_ratio"] for r in rs], marker="o", label=p)
                axes[1][j].plot(x, [r["load_max_mean"] for r in rs], marker="o", label=p)
            axes[0][j].set(title=f"{skew} conversation popularity", ylabel="turn >= 2 hit ratio", ylim=(0, 1.05))
            axes[1][j].set(ylabel="max / mean requests per replica", xlabel="thinker replicas")
            axes[1][j].set_xscale("log", base=2)
            axes[0][j].axhline(0.9, color="grey", ls=":", lw=1)
            axes[1][j].axhline(1.3, color="grey", ls=":", lw=1)
        axes[0][0].legend(fontsize=8)


if __name__ == "__main__":
    raise SystemExit(main())
