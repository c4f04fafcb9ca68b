"""The GPU test lane: omni-cache's tests and main job on one CUDA GPU, with a committed report.

    OMNI_CACHE_CUDA_PLATFORM=1 python -m tests.lanes.gpu_check --commit $(git rev-parse HEAD)

runs, on the card of this host (docs/gpu.md, "The GPU lane"):

- ``unit``: the unit suite (its CUDA-only tests run here: the fused writer, the device and
  pinned pools);
- ``main-job``: ``omni-cache run --stage-config stage_configs/qwen3_omni_gpu1.yaml`` (the
  embedded model, three requests: the repeats hit) — every request must get audio packets and a
  TTFP, the repeats must hit in the thinker and the talker;
- the pipeline tests on CUDA variants of their engines (``OMNI_TEST_DEVICE=cuda``,
  ``tests/device.py``) with vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT=1``: cache on
  = cache off bitwise, as on the CPU; the main job keeps the default kernels):
  ``equality`` (served rows = their writer's, everything = cache off bitwise),
  ``equality-default`` (the same on the default kernels: cache off to oracle (c)'s precision),
  ``streaming`` (streaming, talker cache; omni-cache = the built-in cache bitwise; the fuzzer's
  slice), ``stress`` (preemptions, aborts), ``serve`` (chat + realtime), ``yoco-eager`` and
  ``yoco-compiled`` (the Gemma-4 YOCO thinker, fast prefill x the cache, eager and with
  torch.compile + CUDA graphs), ``equality-compiled`` (the Qwen3-Omni thinker with torch.compile +
  CUDA graphs: the equality and streaming tests, production mode).

Groups run as separate pytest processes, ``--jobs`` at a time (each starts its own engines on
the one card). Writes ``report.json`` under ``--out`` (default
``benchmarks/results/gpu-check-<date>/``): commit, GPU, driver, versions, each test's outcome
and seconds, each group's wall time, the main job's per-request TTFT / TTFP / hits; with
``--merge`` earlier partial reports (other groups, run in other calls) are folded in.
Exit status: 0 iff every test that ran passed and the main job's checks held.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import lab

REPO = Path(__file__).resolve().parents[2]
GPU1 = REPO / "stage_configs" / "qwen3_omni_gpu1.yaml"

#: vLLM's batch-invariant kernels: with them cache on equals cache off bitwise on CUDA as on the
#: CPU (tests/device.py; docs/gpu.md, "The cache-off oracle on CUDA")
INVARIANT = {"OMNI_TEST_BATCH_INVARIANT": "1"}
#: group -> (pytest arguments, extra environment); the main job is not a pytest group
GROUPS: dict[str, tuple[list[str], dict[str, str]]] = {
    "unit": (["tests/unit"], {}),
    "equality": (["tests/pipeline/test_cache_equality.py"], INVARIANT),
    # the same tests on the default (production) kernels: cache off held to oracle (c)'s stated precision
    "equality-default": (["tests/pipeline/test_cache_equality.py"], {"OMNI_TEST_BATCH_INVARIANT": "0"}),
    "streaming": (["tests/pipeline/test_streaming_equality.py", "tests/pipeline/test_exactness_fuzz.py"], INVARIANT),
    "stress": (["tests/pipeline/test_stress.py"], INVARIANT),
    "serve": (["tests/pipeline/test_serve.py", "tests/pipeline/test_realtime.py"], INVARIANT),
    "yoco-eager": (["tests/pipeline/test_yoco_pipeline.py"], INVARIANT),
    "yoco-compiled": (["tests/pipeline/test_yoco_pipeline.py"], {"OMNI_TEST_COMPILED": "1", **INVARIANT}),
    # production mode for Qwen3-Omni: the thinker compiled with CUDA graphs (its capture and the hand-off
    # staged off the graph's buffers), streaming under async scheduling, the default kernels: served rows =
    # their writer's, omni-cache = the built-in cache bitwise, cache off to oracle (c)'s precision. With
    # batch-invariant kernels the tiny thinker did not compile on the H100 (torch.compile: "Assigning /
    # modifying buffers of nn.Module during forward pass", rotary_emb.cos_sin_cache; docs/gpu.md)
    "equality-compiled": (["tests/pipeline/test_cache_equality.py", "tests/pipeline/test_streaming_equality.py"],
                          {"OMNI_TEST_COMPILED": "1", "OMNI_TEST_BATCH_INVARIANT": "0"}),
}
#: seconds each group took on one H100 with nothing else on the card (issue 44's lane run at
#: 5f03d11, docs/gpu.md "The GPU lane"; equality-compiled: its first run, a24cb8b, whose engines
#: died early, so a guess; the YOCO groups ran past 600 s after 8 of their 9 tests); a group's
#: timeout is twice this, at least :data:`MIN_TIMEOUT_S` (``--timeout`` overrides)
MEASURED_S = {"unit": 247, "equality": 421, "equality-default": 448, "streaming": 561, "stress": 392,
              "serve": 480, "yoco-eager": 700, "yoco-compiled": 700, "equality-compiled": 704, "main-job": 300}
MIN_TIMEOUT_S = 900


def group_timeout(name: str, override: float | None = None) -> float:
    """Seconds a group may run: ``override`` if given, else ``max(2 × MEASURED_S, MIN_TIMEOUT_S)``."""
    return float(override) if override else float(max(2 * MEASURED_S.get(name, MIN_TIMEOUT_S), MIN_TIMEOUT_S))


#: longest first, so ``--jobs`` slots fill well
ORDER = ("streaming", "main-job", "equality-compiled", "serve", "stress", "yoco-compiled", "yoco-eager", "equality",
         "equality-default", "unit")


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def lane_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every lane process: the CUDA platform, the test device, the tree
    first on ``PYTHONPATH`` (stage processes import omni-cache from it)."""
    env = {"OMNI_CACHE_PARALLEL_STAGE_INIT": "1",  # stages start together (docs/gpu.md, "Start-up")
           **os.environ, "OMNI_CACHE_CUDA_PLATFORM": "1", "OMNI_TEST_DEVICE": "cuda",
           "PYTHONUNBUFFERED": "1", **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def host_facts() -> dict:
    """GPU, driver and the stack's versions (each ``None`` where it cannot be read)."""
    facts: dict = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        facts["gpu"], facts["gpu_memory"], facts["driver"] = (x.strip() for x in q[0].split(","))
    except Exception as e:  # noqa: BLE001 - reported
        facts["gpu_error"] = repr(e)
    code = ("import json, torch; v = {'python': __import__('sys').version.split()[0], 'torch': torch.__version__, "
            "'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(), "
            "'nccl': '.'.join(map(str, torch.cuda.nccl.version()))}\n"
            "for m in ('triton', 'flashinfer', 'transformers', 'vllm', 'vllm_omni'):\n"
            "    try: v[m] = __import__(m).__version__\n"
            "    except Exception as e: v[m] = repr(e)\n"
            "print(json.dumps(v))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=lane_env(), timeout=300)
    ok = r.returncode == 0
    facts["versions"] = json.loads(r.stdout.strip().splitlines()[-1]) if ok else {"error": r.stderr[-2000:]}
    return facts


def parse_junit(path: Path) -> list[dict]:
    """pytest's JUnit XML as ``[{"test", "outcome", "seconds", "message"}]``."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:500]
                break
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out.append({"test": name, "outcome": outcome, "seconds": round(float(case.get("time") or 0), 2),
                    "message": message})
    return out


def run_group(name: str, out: Path, timeout: float) -> dict:
    """One pytest group in its own process; its JUnit XML and log under ``out``."""
    args, extra = GROUPS[name]
    xml, logf = out / f"junit-{name}.xml", out / f"log-{name}.log"
    jsonl = out / f"outcomes-{name}.jsonl"  # written as each test ends: kept if the group is killed
    jsonl.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"--junitxml={xml}",
           "-o", f"junit_suite_name={name}", *args]
    log(f"{name}: start ({' '.join(args)}; timeout {timeout:.0f} s)")
    t0 = time.perf_counter()
    with open(logf, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env={**lane_env(extra), "OMNI_TEST_OUTCOMES": str(jsonl)},
                                stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    tests = parse_junit(xml) if rc != "timeout" else []
    if not tests:  # killed at its timeout (no JUnit file): the tests that ended before it
        from tests import outcomes

        tests = outcomes.read(jsonl)
    for t in tests:
        t["group"] = name
    log(f"{name}: rc={rc} in {wall:.0f} s, {sum(t['outcome'] == 'passed' for t in tests)}/{len(tests)} passed")
    return {"group": name, "rc": rc, "wall_s": round(wall, 1), "tests": tests, "env": extra, "log": logf.name}


def run_main_job(out: Path, model_dir: Path, timeout: float, repeat: int = 3) -> dict:
    """``omni-cache run`` on the one-GPU config; checks: audio packets + TTFP on every request,
    thinker and talker hits on every repeat."""
    job = out / "main-job"
    cmd = [sys.executable, "-m", "omni_cache.cli", "run", "--stage-config", str(GPU1), "--model", str(model_dir),
           "--out", str(job), "--repeat", str(repeat)]
    log(f"main-job: start ({' '.join(cmd[2:])})")
    t0 = time.perf_counter()
    with open(out / "log-main-job.log", "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=lane_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    summary_path = job / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"requests": []}
    reqs = [{k: r.get(k) for k in ("ttft_s", "ttfp_s", "audio_packets", "audio_s", "audio_samples",
                                    "num_prompt_tokens", "num_cached_tokens", "talker_num_prompt_tokens",
                                    "talker_num_cached_tokens", "wall_s", "error")} for r in summary["requests"]]
    checks = {
        "ran": rc == 0 and len(reqs) == repeat,
        "audio_on_every_request": bool(reqs) and all((r["audio_packets"] or 0) > 0 and r["ttfp_s"] for r in reqs),
        "thinker_hit_on_repeats": len(reqs) > 1 and all((r["num_cached_tokens"] or 0) > 0 for r in reqs[1:]),
        "talker_hit_on_repeats": len(reqs) > 1 and all((r["talker_num_cached_tokens"] or 0) > 0 for r in reqs[1:]),
    }
    ok = all(checks.values())
    log(f"main-job: rc={rc} in {wall:.0f} s, checks {checks}")
    return {"group": "main-job", "rc": rc, "wall_s": round(wall, 1), "start_s": summary.get("start_s"),
            "requests": reqs, "checks": checks, "log": "log-main-job.log",
            "tests": [{"test": "omni-cache run --stage-config stage_configs/qwen3_omni_gpu1.yaml", "group": "main-job",
                       "outcome": "passed" if ok else "failed", "seconds": round(wall, 1),
                       "message": None if ok else json.dumps(checks)}]}


def write_logs_tgz(out: Path, dest: Path) -> Path:
    """``dest``: a gzipped tar of ``out``'s text files (``*.log``, ``*.xml``, ``*.json``,
    ``*.jsonl``), paths relative to ``out``. Returns ``dest``."""
    import tarfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for f in sorted(out.rglob("*")):
            if f.is_file() and f.suffix in (".log", ".xml", ".json", ".jsonl"):
                tar.add(f, arcname=str(f.relative_to(out)))
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default=",".join(ORDER), help=f"comma-separated, from {', '.join(ORDER)}")
    ap.add_argument("--jobs", type=int, default=4, help="groups run at once (each its own engines)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / f"gpu-check-{time.strftime('%Y%m%d')}"))
    ap.add_argument("--commit", help="the code commit under test")
    ap.add_argument("--install-json", help="install facts to record (bundle size, install seconds, import check)")
    ap.add_argument("--merge", nargs="*", default=[], help="earlier report.json files whose groups are kept")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per group (then it counts as failed; the tests that ended before are kept); "
                         "default: twice the group's measured time, at least 900 (MEASURED_S)")
    ap.add_argument("--logs-tgz", help="also write the groups' logs, JUnit files and the main job's summary "
                                       "(no tensors, no audio) into this .tgz: one file to bring back from a "
                                       "machine that returns few")
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = [g for g in groups if g not in ORDER]
    if unknown:
        ap.error(f"unknown groups {unknown}; choose from {', '.join(ORDER)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from omni_cache.models import build_qwen3_omni, default_model_dir

    t0 = time.perf_counter()
    model_dir = build_qwen3_omni(default_model_dir("tiny"), "tiny")
    if any(g.startswith("yoco") for g in groups):  # built once here, not by two groups at once
        from omni_cache.models.gemma import build_gemma_omni, default_gemma_dir

        build_gemma_omni(default_gemma_dir("tiny", family="gemma4"), "tiny", family="gemma4")
        build_gemma_omni(default_gemma_dir("tiny"), "tiny")
    log(f"embedded models built ({time.perf_counter() - t0:.0f} s); host facts")
    facts = host_facts()
    log(f"{facts.get('gpu')} driver {facts.get('driver')}: {facts['versions']}")
    results: list[dict] = []
    t_lane = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futs = [pool.submit(run_group, g, out, group_timeout(g, args.timeout))
                for g in sorted(groups, key=ORDER.index) if g != "main-job"]
        results = [f.result() for f in futs]
    if "main-job" in groups:  # alone on the card: its stages size their KV by gpu_memory_utilization
        results.append(run_main_job(out, model_dir, group_timeout("main-job", args.timeout)))
    lane_s = time.perf_counter() - t_lane
    parts = []
    for path in args.merge:
        old = json.loads(Path(path).read_text())
        results += [g for g in old["groups"] if g["group"] not in groups]
        parts.append({"report": str(path), "commit": old.get("commit"), "gpu": old.get("gpu"),
                      "lane_wall_s": old.get("lane_wall_s")})
    # parts run side by side (one per card): the lane took as long as its longest part
    lane_s = max([lane_s] + [p["lane_wall_s"] or 0 for p in parts])
    tests = [t for g in results for t in g["tests"]]
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    main_job = next((g for g in results if g["group"] == "main-job"), None)
    report = {
        "commit": args.commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **facts,
        "install": json.loads(Path(args.install_json).read_text()) if args.install_json else None,
        "command": "OMNI_CACHE_CUDA_PLATFORM=1 python -m tests.lanes.gpu_check " + " ".join(argv or sys.argv[1:]),
        "settings": lab.settings_in_effect(lane_env()),  # e.g. OMNI_CACHE_JIT_WARMUP=0 from gpu_session.sh
        "lane_wall_s": round(lane_s, 1), "parts": parts, "counts": counts,
        "passed": counts["failed"] == 0 and counts["error"] == 0 and all(
            g["rc"] == 0 for g in results if g["group"] != "main-job") and (main_job is None or all(
                main_job["checks"].values())),
        "main_job": main_job and {k: main_job[k] for k in ("start_s", "wall_s", "requests", "checks")},
        "groups": results, "tests": tests,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if args.logs_tgz:
        write_logs_tgz(out, Path(args.logs_tgz))
    log(f"report {out / 'report.json'}: {counts}, passed={report['passed']}, lane {lane_s:.0f} s")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
