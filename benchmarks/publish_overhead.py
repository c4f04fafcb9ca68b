"""What a step's deferred counters publish costs its thread, with a busy Python thread beside
it (as in a vLLM worker: vLLM-Omni's output and hand-off threads). Engine-free:
``MetricsFile.publish(..., defer=True)`` called at a decode step's cadence for ``--seconds``
(a file write allowed every ``--interval`` seconds), the calling thread's time per call
measured (the file's first publish, which may start its writer thread once, left out);
``--busy 0`` drops the busy thread. Run it in each tree to compare (each in its own process,
rounds alternated by the caller):

    .venv/bin/python -m benchmarks.publish_overhead --seconds 3 --rounds 3 --label <tree> --out <dir>

Writes ``result-<label>.json`` under ``--out`` (µs per call: mean, median, max; calls; the
file's writes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

from benchmarks import lab


def one_round(seconds: float, interval: float, step_s: float, busy: int) -> dict:
    """Publish at every ``step_s`` for ``seconds``; returns the per-call µs statistics."""
    from omni_cache.engine.metrics import MetricsFile

    stop = threading.Event()

    def spin() -> None:  # pure-Python work that wants the GIL, as a busy output thread does
        x = 0
        while not stop.is_set():
            x += 1

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in spinners:
        t.start()
    mf = MetricsFile("metrics", min_interval_s=interval)
    counters = {"steps": 0}
    mf.publish(lambda: dict(counters), defer=True)  # the first: it may start the file's writer thread, once
    time.sleep(interval)
    costs = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            counters["steps"] += 1
            t0 = time.perf_counter()
            mf.publish(lambda: dict(counters), defer=True)
            costs.append((time.perf_counter() - t0) * 1e6)
            time.sleep(step_s)
    finally:
        stop.set()
    return {"calls": len(costs), "us_mean": statistics.fmean(costs), "us_median": statistics.median(costs),
            "us_max": max(costs), "us_total_per_second": sum(costs) / seconds}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of publishing per round (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--interval", type=float, default=0.5,
                    help="the file's min_interval_s (default 0.5, the stage manager's)")
    ap.add_argument("--step-ms", type=float, default=2.0, help="ms between two publishes (default 2)")
    ap.add_argument("--busy", type=int, default=1, help="busy Python threads beside (default 1)")
    ap.add_argument("--label", default="tree", help="names the result file (default tree)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/publish-overhead-<time>)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OMNI_CACHE_METRICS_DIR"] = tmp
        rounds = []
        for k in range(args.rounds):
            rounds.append(one_round(args.seconds, args.interval, args.step_ms / 1e3, args.busy))
            print(f"[{args.label} round {k + 1}/{args.rounds}] {rounds[-1]['us_mean']:.1f} us a call (mean), "
                  f"max {rounds[-1]['us_max']:.0f} us", flush=True)
    result = {**lab.stamp("benchmarks.publish_overhead", argv), "args": lab.jsonable(args), "rounds": rounds,
              "us_mean_median": statistics.median(r["us_mean"] for r in rounds)}
    out = lab.results_dir(args.out, "publish-overhead")
    print(f"result: {lab.write_result(out, result, f'result-{args.label}.json')}")
    return result


if __name__ == "__main__":
    main()
