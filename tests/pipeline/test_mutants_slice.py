"""The CPU CI's slice of the mutation run (issue 44, item 3: "the CPU CI keeps a slice of the
same harness"): ``python -m tests.lanes.mutants`` itself on one planted fault,
``write_batch_shift`` (a batched step's rows written one row late). In CI its engine-free
selection (``--unit-only``, seconds); with ``OMNI_TEST_MUTANT_PIPELINE=1`` also its pipeline
selection, killed by oracle (a) (served rows = their writer's) in
``test_cache_equality.py::test_served_rows_equal_their_writers_rows`` (~1.7 min on the 2-core
CPU machine; left out of CI, which ran at 39 of its 40 minutes on a slow day). Asserts what
the report records: the verdict, that each selection failed on an assertion (not a crash or a
fixture error), the killing test and its message. On a GPU host the same harness runs with
``--device cuda`` (docs/gpu.md, step ``M``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pipeline
REPO = Path(__file__).resolve().parents[2]


def test_mutation_harness_kills_a_planted_write_shift(tmp_path):
    pipeline = os.environ.get("OMNI_TEST_MUTANT_PIPELINE", "0") == "1"
    p = subprocess.run([sys.executable, "-m", "tests.lanes.mutants", "--only", "write_batch_shift",
                        *([] if pipeline else ["--unit-only"]), "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / ("report.json" if pipeline else "report-unit.json")).read_text())
    (result,) = report["results"]
    assert p.returncode == 0 and result["verdict"] == "killed", p.stdout[-3000:]
    unit = result["runs"][0]
    assert unit["outcome"] == "failed" and unit["killed_by"]["assertion"], unit
    assert unit["killed_by"]["test"].endswith("::test_step_write_equals_one_write_per_request"), unit
    if not pipeline:
        assert len(result["runs"]) == 1
        return
    pipe = result["runs"][1]
    assert pipe["tests"] == "tests/pipeline/test_cache_equality.py -k served_rows"
    assert pipe["outcome"] == "failed" and pipe["planted_in"] >= 2, pipe
    killed = pipe["killed_by"]
    assert killed["assertion"] and killed["test"].endswith("::test_served_rows_equal_their_writers_rows"), killed
    assert "served rows differ from their writer" in killed["message"], killed
