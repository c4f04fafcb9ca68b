"""Per-test outcomes survive a run stopped from outside (tests/outcomes.py): a real pytest run
with ``OMNI_TEST_OUTCOMES`` set, killed after its first tests, leaves their records."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import outcomes

REPO = Path(__file__).resolve().parents[2]


def test_records_survive_a_kill_mid_run(tmp_path):
    """Oracle: the outcomes the tests were written to have (pass, fail, error in set-up, skip);
    the run is killed while a fifth test sleeps, so pytest never writes its summary."""
    mod = tmp_path / "test_victim.py"
    mod.write_text(
        "import time, pytest\n"
        "@pytest.fixture\n"
        "def broken():\n    raise RuntimeError('set-up broke')\n"
        "def test_a():\n    pass\n"
        "def test_b():\n    assert 1 == 2\n"
        "def test_c(broken):\n    pass\n"
        "def test_d():\n    pytest.skip('not here')\n"
        "def test_e():\n    time.sleep(60)\n")
    # the suite's conftest writes the records: the victim runs with tests/conftest.py as a plugin
    log = tmp_path / "outcomes.jsonl"
    env = {**os.environ, outcomes.ENV: str(log), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                             str(mod)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(outcomes.read(log)) < 4:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    got = {r["test"].split("::")[-1]: r["outcome"] for r in outcomes.read(log)}
    assert got == {"test_a": "passed", "test_b": "failed", "test_c": "error", "test_d": "skipped"}, got
    assert "set-up broke" in next(r["message"] for r in outcomes.read(log) if r["test"].endswith("test_c"))


def test_read_keeps_the_worst_phase_and_skips_a_cut_line(tmp_path):
    log = tmp_path / "o.jsonl"
    outcomes.append(log, {"test": "t::x", "outcome": "passed", "seconds": 1.0, "message": None})
    outcomes.append(log, {"test": "t::x", "outcome": "error", "seconds": 0.5, "message": "teardown"})
    log.write_text(log.read_text() + '{"test": "t::y", "outc')  # the line the kill cut
    assert outcomes.read(log) == [{"test": "t::x", "outcome": "error", "seconds": 1.5, "message": "teardown"}]


def test_lane_group_killed_at_its_timeout_keeps_the_tests_that_ended(tmp_path, monkeypatch):
    """The GPU lane's runner (``gpu_check.run_group``) on a group that overruns its timeout:
    the group is ``timeout`` and still reports the tests that ended before it (was 0/0)."""
    from tests.lanes import gpu_check

    mod = tmp_path / "test_slow_group.py"
    mod.write_text("import time\ndef test_quick():\n    pass\ndef test_hangs():\n    time.sleep(120)\n")
    monkeypatch.setitem(gpu_check.GROUPS, "slow", (["-p", "tests.conftest", str(mod)], {}))
    monkeypatch.setattr(gpu_check, "lane_env", lambda extra=None: {**os.environ, "PYTHONPATH": str(REPO)})
    # the group is killed at 8 s: pytest starts and test_quick ends in ~2 s here (4x headroom)
    res = gpu_check.run_group("slow", tmp_path, timeout=8)
    assert res["rc"] == "timeout"
    assert [(t["test"].split("::")[-1], t["outcome"]) for t in res["tests"]] == [("test_quick", "passed")]
    assert gpu_check.group_timeout("streaming") == 2 * gpu_check.MEASURED_S["streaming"]
    assert gpu_check.group_timeout("unit") == gpu_check.MIN_TIMEOUT_S
    assert gpu_check.group_timeout("unit", 30) == 30


def test_merged_lane_report_takes_its_longest_part(tmp_path, monkeypatch):
    """``gpu_check --groups "" --merge A B``: the parts ran side by side on their cards, so the
    lane's wall time is the longest part's (the first merge wrote 0.0), each part is named, and
    every part's groups and tests are kept."""
    import json

    import omni_cache.models
    from tests.lanes import gpu_check

    monkeypatch.setattr(omni_cache.models, "build_qwen3_omni", lambda *a, **k: tmp_path)
    monkeypatch.setattr(gpu_check, "host_facts", lambda: {"gpu": "test", "versions": {}})
    parts = []
    for i, (group, wall) in enumerate([("equality", 615.0), ("unit", 567.2)]):
        test = {"test": f"t{i}", "outcome": "passed"}
        p = tmp_path / f"L{i}.json"
        p.write_text(json.dumps({"commit": "abc", "gpu": "H200", "lane_wall_s": wall,
                                 "groups": [{"group": group, "rc": 0, "tests": [test]}]}))
        parts.append(str(p))
    assert gpu_check.main(["--groups", "", "--out", str(tmp_path / "L"), "--commit", "abc", "--merge", *parts]) == 0
    report = json.loads((tmp_path / "L" / "report.json").read_text())
    assert report["lane_wall_s"] == 615.0
    assert [p["lane_wall_s"] for p in report["parts"]] == [615.0, 567.2]
    assert report["counts"]["passed"] == 2 and [g["group"] for g in report["groups"]] == ["equality", "unit"]
