"""The mutation run: plant one fault at a time — each a real way omni-cache could serve a wrong
row (:mod:`tests.mutants`) — run the tests that should catch it, and report which faults the
suite kills.

A fault is planted from test code only: in the engine processes through a throw-away
``vllm.general_plugins`` entry point on ``PYTHONPATH`` (:func:`tests.mutants.write_plugin_dist`),
in the test process as a pytest plugin (``-p tests.mutants``); the fault's name travels in
:data:`tests.mutants.ENV`. Each mutant runs only its own selection (the affected modules, not
the suite), each selection with ``-x`` (a mutant is killed at its first failing test). A
selection that starts a pipeline runs under ``--lock`` (``flock``), one at a time.

A mutant is **killed** only when a test of some selection fails on an assertion (an
``AssertionError``, or pytest's ``Failed`` such as "DID NOT RAISE": an exactness oracle or the
refusal a test expects); the report records which test and which message killed it.
**error** when a selection fails otherwise (an engine crash, another exception, a fixture error)
or could not run (collection error, no tests, time out): never counted as killed;
**survived** when every selection passed. Writes ``report.json`` into ``--out`` after every mutant
(``complete``, ``pending``: the mutants not run yet, so a run cut short keeps what it did); prints a table.

    .venv/bin/python -m tests.lanes.mutants --lock /tmp/cpu-heavy.lock
    .venv/bin/python -m tests.lanes.mutants --only bit_flip,cap_disabled --baseline

On a GPU host (issue 44, item 3): ``--device cuda`` runs the selections in the GPU lane's
environment (:func:`tests.lanes.gpu_check.lane_env`: the CUDA platform, ``OMNI_TEST_DEVICE=cuda``,
so the tests take their CUDA variants) on the default kernels (``OMNI_TEST_BATCH_INVARIANT=0``:
cache off relaxed to oracle (c)'s precision, as on CUDA) and only the selections that
start a pipeline — a kill on the GPU is an exactness oracle's, not a unit test's. Without it the
pipeline tests start the CPU stage configs (the first GPU run, 2026-11-27, errored on every
pipeline selection: vLLM-Omni's parallel stage admission refuses a CPU config's unresolved devices).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.mutants import ENV, EVIDENCE_ENV, FAULTS, write_plugin_dist  # noqa: E402

CACHE_EQ = "tests/pipeline/test_cache_equality.py"
STREAM_EQ = "tests/pipeline/test_streaming_equality.py"
STRESS = "tests/pipeline/test_stress.py"


@dataclass(frozen=True)
class Mutant:
    """A fault (:data:`tests.mutants.FAULTS` key), what it models, and the pytest selections
    (each a list of pytest arguments) that should catch it."""

    name: str
    models: str
    selections: tuple[tuple[str, ...], ...]


CORE_CACHE = "tests/unit/test_core_cache.py"
STEP_WRITE = "tests/unit/test_core_step_write.py"
STAGE_MANAGER = "tests/unit/test_stage_manager.py"

MUTANTS = (
    # read-path faults: the pipeline selection is oracle (a) itself (served rows = their writer's,
    # bitwise on CPU and CUDA); the whole file's first failure was cache off's, relaxed on CUDA
    Mutant("foreign_block", "another request's rows served for a block (the last block of every hit)",
           ((CORE_CACHE,), (CACHE_EQ, "-k", "served_rows"))),
    Mutant("slot_shift", "served rows one KV slot off", ((CORE_CACHE,), (CACHE_EQ, "-k", "served_rows"))),
    Mutant("stale_generation", "a block served after its slot was reused: the new generation's rows "
           "never reach the pool, the ledger records them", ((CORE_CACHE,), (STRESS,))),
    Mutant("cap_disabled", "the scheduler cap disabled: vLLM's KV hit served whatever the hidden tier "
           "covers", (("tests/unit/test_scheduler_cap.py",), (STREAM_EQ, "-k", "capped"))),
    Mutant("deferred_write_dropped", "a deferred ledger write dropped",
           (("tests/unit/test_core_ledger.py", "tests/unit/test_core_cache.py",
             "tests/unit/test_core_properties.py"),)),
    Mutant("talker_length_keys", "talker blocks keyed by length only",
           (("tests/unit/test_talker_identity.py",), (CACHE_EQ, "-k", "talker"))),
    Mutant("talker_media_dropped", "a media identifier left out of the talker's block keys",
           (("tests/unit/test_talker_identity.py",), (CACHE_EQ, "-k", "talker"))),
    Mutant("thinker_media_dropped", "a media identifier left out of the thinker's block hash (the ledger's)",
           (("tests/unit/test_core_block_hashes.py", "tests/unit/test_stage_manager.py"),)),
    Mutant("yoco_truncation_ignored", "the hit not truncated at a YOCO fast-prefill boundary (final rows of "
           "fast-prefill chunks written and vouched for)",
           (("tests/unit/test_yoco_manager.py", "tests/unit/test_scheduler_cap.py",
             "tests/unit/test_core_coverage.py"),)),
    Mutant("bit_flip", "one bit flipped in a served row", ((CORE_CACHE,), (CACHE_EQ, "-k", "served_rows"))),
    Mutant("decode_rows_corrupted", "a decode step's row stored with one bit flipped (the talker got the "
           "right one; a later hit on the decode-filled block is served the wrong one)",
           ((STEP_WRITE, STAGE_MANAGER), (CACHE_EQ, "-k", "served_rows"))),
    Mutant("write_batch_shift", "a batched step's rows written one row late (start + 1)",
           ((STEP_WRITE,), (CACHE_EQ, "-k", "served_rows"))),
    Mutant("seam_off_by_one", "the hand-off repeats the last cached row at the seam with the fresh rows",
           # fresh rows, which oracle (a) does not see: oracle (b), omni-cache = the built-in, bitwise
           ((STAGE_MANAGER,), (STREAM_EQ, "-k", "builtin_cache_bitwise"))),
    Mutant("ledger_check_off", "the ledger's block hash / fill check switched off",
           ((CORE_CACHE, "tests/unit/test_core_ledger.py"),)),
    Mutant("key_misaligned", "one hand-off key's served rows one KV slot off, the others right",
           ((CORE_CACHE,), (CACHE_EQ, "-k", "served_rows"))),
    Mutant("talker_seed_dropped", "talker block keys without speaker / language / salt",
           (("tests/unit/test_talker_identity.py",), (CACHE_EQ, "-k", "talker_prefix_cache"))),
    # async scheduling runs on GPUs only (the CPU platform schedules synchronously): on the CPU only
    # the unit tests reach it; on CUDA the worker's blocks go uncached, its output says so, the
    # scheduler caps the chat's hit on them (the engine keeps serving): oracle (b) sees a hit
    # shorter than the built-in's on the same request
    Mutant("async_placeholders_unresolved", "async scheduling's device input ids not kept: decode-filled "
           "blocks never hashed (the H200 defect of 22d261f)",
           ((STAGE_MANAGER,), (STREAM_EQ, "-k", "builtin_cache_bitwise"))),
    Mutant("resume_rows_lost", "a request resumed after preemption hands off only its recomputed rows",
           ((STAGE_MANAGER,), (STRESS,))),
)
assert {m.name for m in MUTANTS} == set(FAULTS), "every planted fault has a mutant and vice versa"


@dataclass
class SelectionRun:
    tests: str
    outcome: str  # "failed" | "passed" | "error"
    rc: int
    seconds: float
    failed: list[str] = field(default_factory=list)
    #: seconds pytest itself reported (its summary line): the run, without the wait for ``--lock``
    pytest_seconds: float | None = None
    #: processes that planted the fault (the test process and each engine process that loaded
    #: the entry point: ``<log>.planted`` lists them)
    planted_in: int = 0
    #: the first failed test and its message (pytest's short summary), when a test failed
    killed_by: dict | None = None


@dataclass
class MutantResult:
    name: str
    models: str
    verdict: str  # "killed" | "survived" | "error" | "skipped"
    minutes: float  # wall, waits for --lock included
    runs: list[SelectionRun]
    #: minutes pytest ran (summed over the selections; no lock wait)
    test_minutes: float | None = None


def _heavy(selection: tuple[str, ...]) -> bool:
    return any(a.startswith("tests/pipeline") for a in selection)


def selection_env(device: str) -> dict[str, str]:
    """The environment a selection runs in: this process's (``cpu``), or the GPU lane's
    (``cuda``: :func:`tests.lanes.gpu_check.lane_env`).

    Raises:
        ValueError: another ``device``.
    """
    if device == "cpu":
        return dict(os.environ)
    if device == "cuda":
        from tests.lanes.gpu_check import lane_env

        # the default (production) kernels: cache off holds only to oracle (c)'s stated precision
        # there, so a kill comes from oracle (a) or (b) (issue 44, item 3)
        return lane_env({"OMNI_TEST_BATCH_INVARIANT": "0"})
    raise ValueError(f"--device must be cpu or cuda, got {device!r}")


def run_selection(selection: tuple[str, ...], fault: str | None, plugin_dir: Path, *, lock: str | None,
                  timeout_s: float, log: Path, device: str = "cpu") -> SelectionRun:
    """One pytest run of ``selection`` with ``fault`` planted (None: nothing planted)."""
    env = selection_env(device)
    env.pop(ENV, None)
    evidence = log.with_suffix(".planted")
    evidence.unlink(missing_ok=True)
    env[EVIDENCE_ENV] = str(evidence)
    if fault:
        env[ENV] = fault
    env["COLUMNS"] = "2000"  # pytest cuts its short summary lines (the killing message) to the terminal width
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir), str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", "-p", "tests.mutants",
           *selection]
    # the time limit starts once the lock is held (``timeout`` inside ``flock``), and ends the
    # whole process group (pytest and the engine processes it started)
    cmd = ["timeout", "-k", "30", str(int(timeout_s)), *cmd]
    if lock and _heavy(selection):
        cmd = ["flock", lock, *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    rc, out = p.returncode, p.stdout + p.stderr
    if rc in (124, 137):
        out = f"timed out after {timeout_s} s (lock held)\n{out}"
    secs = time.perf_counter() - t0
    log.write_text(out if isinstance(out, str) else out.decode(errors="replace"))
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.M) if isinstance(out, str) else []
    killed_by = assertion_failure(out) if rc == 1 else None
    outcome = ("failed" if killed_by and killed_by["assertion"] else "error") if rc == 1 else \
        "passed" if rc == 0 else "error"
    planted = len({line.split()[1] for line in evidence.read_text().splitlines()}) if evidence.exists() else 0
    if fault and outcome == "passed" and planted < (2 if _heavy(selection) else 1):
        outcome = "error"  # the fault never reached the engine processes: a pass proves nothing
    return SelectionRun(" ".join(selection), outcome, rc, round(secs, 1), failed, pytest_seconds(out), planted,
                        killed_by)


#: exception names in pytest's short summary that count as a kill: a failed assertion, or
#: pytest's own ``Failed`` (``pytest.raises``' "DID NOT RAISE", ``pytest.fail``)
ASSERTION_TYPES = ("AssertionError", "Failed")


def assertion_failure(output: str) -> dict | None:
    """The first ``FAILED <test> - <Type>: <message>`` line of pytest's short summary (``-rf``)
    as ``{"test", "type", "message" (≤ 300 chars), "assertion"}``, ``assertion`` true iff the
    type is one of :data:`ASSERTION_TYPES`; ``None`` without a FAILED line (only errors)."""
    m = re.search(r"^FAILED (\S+)(?: - (.*))?$", output, flags=re.M)
    if m is None:
        return None
    summary = (m.group(2) or "").strip()
    # a bare ``assert`` is summarised as its expression ("assert 8 == 4"), without the type
    typ = "AssertionError" if summary.startswith("assert ") else \
        summary.split(":", 1)[0].strip().rsplit(".", 1)[-1] if summary else ""
    return {"test": m.group(1), "type": typ, "message": summary[:300], "assertion": typ in ASSERTION_TYPES}


def pytest_seconds(output: str) -> float | None:
    """The seconds in pytest's summary line (``... in 123.45s``), if any."""
    found = re.findall(r"=* .*? in ([0-9.]+)s(?: \(|\s*=*$)", output, flags=re.M)
    return float(found[-1]) if found else None


def run_mutant(m: Mutant, plugin_dir: Path, out: Path, *, lock: str | None, timeout_s: float,
               baseline: bool, unit_only: bool = False, device: str = "cpu") -> MutantResult:
    runs = []
    t0 = time.perf_counter()
    for i, sel in enumerate(m.selections):
        if (unit_only and _heavy(sel)) or (device == "cuda" and not _heavy(sel)):
            continue
        fault = None if baseline else m.name
        tag = ("-unit" if unit_only else "") + ("-baseline" if baseline else "")
        runs.append(run_selection(sel, fault, plugin_dir, lock=lock, timeout_s=timeout_s,
                                  log=out / f"{m.name}-{i}{tag}.log", device=device))
        r = runs[-1]
        print(f"  {m.name}: {r.tests}: {r.outcome} in {r.seconds:.0f} s (planted in {r.planted_in} processes) "
              f"{r.failed[:2]}", flush=True)
    outcomes = {r.outcome for r in runs}
    # skipped: no selection ran (on cuda, a mutant whose selections are all unit tests)
    verdict = "skipped" if not runs else "killed" if "failed" in outcomes else \
        "error" if "error" in outcomes else "survived"
    ran = [r.pytest_seconds for r in runs if r.pytest_seconds is not None]
    return MutantResult(m.name, m.models, verdict, round((time.perf_counter() - t0) / 60, 2), runs,
                        round(sum(ran) / 60, 2) if ran else None)


def rescan(out: Path) -> int:
    """Add ``pytest_seconds`` / ``test_minutes`` read from the selection logs to a report
    written before they were recorded."""
    report = json.loads((out / "report.json").read_text())
    for m in report["results"]:
        for i, r in enumerate(m["runs"]):
            log = out / f"{m['name']}-{i}{'-baseline' if report['baseline'] else ''}.log"
            r["pytest_seconds"] = pytest_seconds(log.read_text()) if log.exists() else None
        ran = [r["pytest_seconds"] for r in m["runs"] if r["pytest_seconds"] is not None]
        m["test_minutes"] = round(sum(ran) / 60, 2) if ran else None
    report["test_minutes"] = round(sum(m["test_minutes"] or 0 for m in report["results"]), 2)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    ap.add_argument("--lock", default=None, help="flock file held around each selection that starts a pipeline")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per selection, once the lock is held")
    ap.add_argument("--baseline", action="store_true", help="run the selections with nothing planted")
    ap.add_argument("--out", default=None, help="report folder (default benchmarks/results/mutants-<date>)")
    ap.add_argument("--unit-only", action="store_true",
                    help="run only the selections that start no pipeline (report-unit.json)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the GPU lane's environment, pipeline selections only (module docstring)")
    ap.add_argument("--rescan", default=None, metavar="DIR",
                    help="only add pytest's own seconds (from the logs) to DIR/report.json")
    args = ap.parse_args(argv)
    if args.rescan:
        return rescan(Path(args.rescan))
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"mutants-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    results = []
    t0 = time.perf_counter()
    report_path = out / ("report-unit.json" if args.unit_only else "report.json")

    def write_report() -> dict:
        # after every mutant, so a run cut short (a GPU hold's end, a timeout) keeps what it did
        report = {"date": stamp, "commit": commit, "baseline": args.baseline, "unit_only": args.unit_only,
                  "device": args.device,
                  "command": "python -m tests.lanes.mutants " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "minutes": round((time.perf_counter() - t0) / 60, 2),
                  "test_minutes": round(sum(r.test_minutes or 0 for r in results), 2),
                  "killed": sum(r.verdict == "killed" for r in results), "mutants": len(results),
                  "complete": len(results) == len(chosen),
                  "pending": [m.name for m in chosen[len(results):]],
                  "results": [asdict(r) for r in results]}
        report_path.write_text(json.dumps(report, indent=1) + "\n")
        return report

    report = write_report()
    with tempfile.TemporaryDirectory(prefix="omni-cache-mutants-") as tmp:
        plugin_dir = Path(tmp)
        write_plugin_dist(plugin_dir)
        for m in chosen:
            print(f"[mutants] {m.name}: {m.models}", flush=True)
            results.append(run_mutant(m, plugin_dir, out, lock=args.lock, timeout_s=args.timeout,
                                      baseline=args.baseline, unit_only=args.unit_only, device=args.device))
            report = write_report()
    print(f"\n{'mutant':<26} {'verdict':<9} {'min':>5}  tests")
    for r in results:
        print(f"{r.name:<26} {r.verdict:<9} {r.minutes:>5.1f}  " + " | ".join(
            f"{x.tests} ({x.outcome})" for x in r.runs))
    print(f"[mutants] {report['killed']}/{len(results)} killed in {report['minutes']:.1f} min; {out}")
    # baseline: every selection passes with nothing planted; else: every mutant killed
    expected = "survived" if args.baseline else "killed"
    return 0 if all(r.verdict == expected for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
