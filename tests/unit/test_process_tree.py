"""Stopping descendants on exit (omni_cache.driver.process_tree) leaves each exit status to the
process's parent: vLLM's process manager must see its stage exit in time, not force-kill a pid
that we had reaped (the CI failure of test_stop.py::test_run_stopped_during_start_up[SIGINT])."""

from __future__ import annotations

import json
import subprocess
import sys

# Runs in its own interpreter: stop_descendants stops *every* descendant of its process, which in
# pytest's would include other tests' helpers.
_SCRIPT = r"""
import json, multiprocessing as mp, time
from multiprocessing import resource_tracker
import psutil
from omni_cache.driver.process_tree import stop_descendants

def _sleep():
    time.sleep(60)

if __name__ == "__main__":
    proc = mp.get_context("spawn").Process(target=_sleep, daemon=True)  # as vLLM-Omni starts stages
    proc.start()
    tracker = resource_tracker._resource_tracker._pid  # spawn started it
    t0 = time.monotonic()
    stopped = stop_descendants(grace_s=10.0)
    stop_s = time.monotonic() - t0
    proc.join(5)
    print(json.dumps({"pid": proc.pid, "stopped": stopped, "alive": proc.is_alive(),
                      "exitcode": proc.exitcode, "stop_s": stop_s,
                      "tracker_running": tracker is not None and psutil.pid_exists(tracker)}))
    if proc.is_alive():
        proc.kill()
"""


def test_stopped_child_exit_status_stays_with_its_multiprocessing_handle(tmp_path):
    """Oracle: ``multiprocessing.Process`` (what ``vllm.v1.utils.shutdown`` joins and asks
    ``is_alive()``) reports the SIGTERM exit. With ``psutil.wait_procs`` (which reaps) in
    ``stop_descendants``, ``is_alive()`` stayed True and ``exitcode`` None; without sparing the
    resource tracker, the stop took the whole 10 s grace and SIGKILLed it."""
    script = tmp_path / "stop_child.py"
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["stopped"] == [res["pid"]]
    assert not res["alive"], "the child's exit status was taken from its parent's multiprocessing handle"
    assert res["exitcode"] == -15
    # the resource tracker (which ignores SIGTERM, and unlinks leaked shared memory when its
    # parent exits) was spared: no 10 s grace spent waiting for it, and it still runs
    assert res["tracker_running"], res
    assert res["stop_s"] < 5, res


def test_a_force_kill_of_a_process_seen_gone_earlier_is_stale_not_an_overrun():
    """The stop checks' reading of vLLM's force-kill lines (tests/pipeline/proctree.py): a
    process seen exited 4 s before the line is vLLM's stale ``is_alive()``; one seen gone only
    after the line (killed by it), or never, overran the grace."""
    from types import SimpleNamespace

    from tests.pipeline.proctree import overran_grace

    line = ("WARNING 11-29 01:34:31 [utils.py:657] [shutdown] Process manager: force killing remaining "
            "process StageEngineCoreProc_stage0_replica0 pid {}\n")
    w = SimpleNamespace(lines=["interrupted; stopping ...\n", line.format(11), line.format(12), line.format(13)],
                        line_at=[100.1, 105.5, 105.5, 105.5], gone_at={11: 101.0, 12: 105.7})
    overran, stale = overran_grace(w, signalled_at=100.0)
    assert [s.split(":")[0] for s in stale] == ["StageEngineCoreProc_stage0_replica0 pid 11"]
    assert [s.split(":")[0] for s in overran] == ["StageEngineCoreProc_stage0_replica0 pid 12",
                                                   "StageEngineCoreProc_stage0_replica0 pid 13"]
    assert "seen gone 1.0 s after it" in stale[0] and "seen gone never" in overran[1]


def test_a_force_kill_fails_the_stop_unless_the_host_was_overloaded(monkeypatch):
    """``judge_force_kills`` (the stop tests' and ``test_serve.py``'s rule): no force kill passes;
    a force kill fails at a load of 2 per core or less, and only warns above it (with the load)."""
    import pytest

    from tests.pipeline import proctree

    monkeypatch.setattr(proctree.os, "cpu_count", lambda: 2)
    proctree.judge_force_kills([], 9.0)
    proctree.judge_force_kills([], 0.5)
    with pytest.raises(AssertionError, match="load 3.9 on 2 cores"):
        proctree.judge_force_kills(["stage0 pid 11"], 3.9)
    with pytest.warns(UserWarning, match="overloaded host \\(load 4.5 on 2 cores"):
        proctree.judge_force_kills(["stage0 pid 11"], 4.5)
