"""Per-test outcomes written as each test ends, one JSON line each, so a run stopped from outside
(the GPU lane's group timeout) keeps what it ran: pytest's JUnit XML is written only at the end,
and a group killed at its timeout reported 0/0 (issue 44; ``yoco-eager`` / ``yoco-compiled`` on an
H100 had printed eight passing tests).

With ``OMNI_TEST_OUTCOMES=<path>`` set, ``tests/conftest.py`` appends a record per test phase
that decides the test's outcome (:func:`outcome_of`); :func:`read` folds them into one outcome per
test. Engine-free (no pytest import).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: environment variable naming the JSON-lines file the suite appends to
ENV = "OMNI_TEST_OUTCOMES"
#: worse outcomes win when a test's phases disagree (a passed call, then a teardown error)
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def outcome_of(report) -> dict | None:
    """The record of one pytest ``TestReport`` phase, or ``None`` for a phase that decides
    nothing (a passed set-up or tear-down).

    Returns:
        ``{"test": nodeid, "outcome": "passed" | "failed" | "error" | "skipped", "seconds": float
        (the phase's duration), "message": str | None (at most 500 characters)}``; a failed
        set-up or tear-down is an ``error``, as pytest counts it.
    """
    when, outcome = report.when, report.outcome
    if when != "call" and outcome == "passed":
        return None
    if outcome == "failed" and when != "call":
        outcome = "error"
    message = None
    if outcome in ("failed", "error"):
        crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
        message = getattr(crash, "message", None) or (str(getattr(report, "longreprtext", "") or "").strip()
                                                      .splitlines() or [""])[-1]
        message = message[:500]
    return {"test": report.nodeid, "outcome": outcome, "seconds": round(float(report.duration), 2),
            "message": message}


def append(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one JSON line and flush it to the file (it survives a kill)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read(path: str | os.PathLike) -> list[dict]:
    """One record per test, in the order the tests first reported, the worst outcome of its
    phases kept (seconds summed). A missing file or a line cut by the kill is skipped.
    """
    p = Path(path)
    if not p.exists():
        return []
    tests: dict[str, dict] = {}
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        old = tests.get(rec["test"])
        if old is None:
            tests[rec["test"]] = dict(rec)
            continue
        old["seconds"] = round(old["seconds"] + rec["seconds"], 2)
        if _RANK.get(rec["outcome"], 0) > _RANK.get(old["outcome"], 0):
            old["outcome"], old["message"] = rec["outcome"], rec["message"]
    return list(tests.values())
