"""Pipeline start time: vLLM's default ``mp`` executor vs ``uni`` on every stage, side by side.

Each sample starts ``--stage-config`` in a fresh process, sends one request and stops; ``mp`` as
shipped, ``uni`` on every stage; alternated. Per variant (s): ``start_s``, ``process_s`` (launch →
started), ``request_s``, ``close_s``; medians, IQRs, mp / uni; JSON and a plot in ``--out``.

    .venv/bin/python -m benchmarks.start_bench --rounds 3
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import lab

VARIANTS = ("mp", "uni")

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
def main():
    from benchmarks import lab
    from omni_cache.driver.inputs import build_request
    with lab.start("streaming", sys.argv[2], sys.argv[1]) as p:
        t1 = time.perf_counter()
        r = p.run(build_request("Hello there, what is first?"))
        t2 = time.perf_counter()
    print("RESULT " + json.dumps({"start_s": p.start_s, "process_s": t1 - t0, "request_s": t2 - t1,
                                  "close_s": time.perf_counter() - t2, "error": r.error}), flush=True)
if __name__ == "__main__":
    main()
"""


def _sample(cfg: Path, model: Path, log: Path) -> dict:
    with log.open("a") as f:
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(cfg), str(model)], cwd=lab.REPO,
                              stdout=subprocess.PIPE, stderr=f, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the start of {cfg.name} failed (rc {proc.returncode}); log: {log}")
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    ap = lab.parser(__doc__, "start", size="tiny")
    ap.add_argument("--rounds", type=int, default=3, help="samples per variant (alternated)")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    out = lab.results_dir(args.out, "start")
    model = lab.model_dir(args.size, args.model)
    uni = {s: {"distributed_executor_backend": "uni"} for s in (0, 1, 2)}
    cfgs = {v: lab.variant_config(args.stage_config, out, v, stages=uni if v == "uni" else {}) for v in VARIANTS}
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tqdm(total=args.rounds * len(VARIANTS), desc="pipeline starts", unit="start") as bar:
        for r in range(args.rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                bar.set_postfix_str(v)
                samples[v].append(_sample(cfgs[v], model, out / f"log_{v}.txt"))
                bar.update()
    summary = {v: {k: lab.describe([s[k] for s in samples[v]], "median", "p25", "p75")
                   for k in ("start_s", "process_s", "request_s", "close_s")} for v in VARIANTS}
    ratio = summary["mp"]["start_s"]["median"] / summary["uni"]["start_s"]["median"]
    lab.write_result(out, {**lab.stamp("benchmarks.start_bench", argv), "args": lab.jsonable(args),
                           "samples": samples, "summary": summary, "ratio_start_mp_over_uni": ratio}, "start.json")
    with lab.figure(out / "start.png", figsize=(5, 3.5)) as (fig, ax):
        for i, v in enumerate(VARIANTS):
            ys = [x["start_s"] for x in samples[v]]
            ax.scatter([i] * len(ys), ys, label=v)
            ax.hlines(summary[v]["start_s"]["median"], i - 0.2, i + 0.2)
        ax.set_xticks(range(len(VARIANTS)), [f"{v} executor" for v in VARIANTS])
        ax.set(ylabel="pipeline start (s)", title="Qwen3-Omni, 3 stages, this machine")
    for v in VARIANTS:
        s, st = summary[v], summary[v]["start_s"]
        print(f"{v:>4}: start {st['median']:.1f} s (IQR {st['p25']:.1f}-{st['p75']:.1f}), "
              f"process {s['process_s']['median']:.1f} s, first request {s['request_s']['median']:.2f} s")
    print(f"start time mp / uni = {ratio:.2f}x   ({out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
