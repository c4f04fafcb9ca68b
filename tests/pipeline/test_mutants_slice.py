"""The CPU CI's slice of the mutation run (issue 44, item 3: "the CPU CI keeps a slice of the
same harness"): ``python -m tests.lanes.mutants`` itself, on one planted fault whose pipeline
kill is an exactness oracle's — ``write_batch_shift`` (a batched step's rows written one row
late), killed by oracle (a) (served rows = their writer's) in
``test_cache_equality.py::test_served_rows_equal_their_writers_rows``. Asserts what the
report records: the verdict, that the pipeline selection failed on an assertion (not a crash or
a fixture error), the killing test and its message. ~1.7 min on the 2-core CPU machine. On a GPU
host the same harness runs with ``--device cuda`` (docs/gpu.md, step ``M``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pipeline
REPO = Path(__file__).resolve().parents[2]


def test_mutation_harness_kills_a_planted_write_shift_by_oracle_a(tmp_path):
    p = subprocess.run([sys.executable, "-m", "tests.lanes.mutants", "--only", "write_batch_shift",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "report.json").read_text())
    (result,) = report["results"]
    assert p.returncode == 0 and result["verdict"] == "killed", p.stdout[-3000:]
    unit, pipeline = result["runs"]
    assert unit["outcome"] == "failed" and unit["killed_by"]["assertion"]
    assert pipeline["tests"] == "tests/pipeline/test_cache_equality.py -k served_rows"
    assert pipeline["outcome"] == "failed" and pipeline["planted_in"] >= 2, pipeline
    killed = pipeline["killed_by"]
    assert killed["assertion"] and killed["test"].endswith("::test_served_rows_equal_their_writers_rows"), killed
    assert "served rows differ from their writer" in killed["message"], killed
