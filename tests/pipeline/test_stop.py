"""Stopping the main job the way users and supervisors do — SIGTERM, or Ctrl-C (SIGINT) —
during start-up leaves no process behind (during a request: tests/pipeline/test_run.py): every process that ever
descended from ``omni-cache run`` / ``omni-cache serve`` (polled while it ran) is gone after
it exits. (Before: SIGTERM during start-up left a stage engine process running, re-parented
to init, ~1 GB resident.)"""

from __future__ import annotations

import signal
import time

import pytest

from tests.device import run_args
from tests.pipeline.proctree import Watched, stop_and_check

pytestmark = pytest.mark.pipeline
#: pipeline starts stopped on purpose during start-up (the suite's time table, tests/conftest.py)
PARTIAL_STARTS = 3


def _stage_processes_started(w: Watched) -> bool:
    return len(w.seen) >= 3


# SIGTERM as supervisors stop a command, Ctrl-C (SIGINT) as a person does. Each case is a
# pipeline start stopped after ~3 s (~20 s each on the CI machine). Until 2026-11-27 the SIGINT
# cases ran in CI with SIGINT inherited as ignored (the suite runs in the background): `run`
# then simply finished its requests and exited 0, which the check accepted, and `serve` did not
# stop at all; proctree now gives the command a terminal's SIGINT, and a stop must exit with the
# signal's code (`serve` with 0 after "stopping the server").
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_stopped_during_start_up(tiny_model_dir, tmp_path, sig):
    w = Watched(["run", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--no-image", "--no-audio",
                 *run_args()],
                tmp_path)
    w.wait_for(lambda: _stage_processes_started(w), 240, "stage processes")
    time.sleep(3)  # the stages are loading
    stop_and_check(w, sig)  # 143 (SIGTERM -> SystemExit) or 130 (KeyboardInterrupt)
    assert not [ln for ln in w.lines if ln.startswith("[request ")], "a request ran: not stopped during start-up"


def test_serve_stopped_by_ctrl_c_during_start_up(tiny_model_dir, tmp_path):
    w = Watched(["serve", "--model", str(tiny_model_dir), "--port", "0", "--log", str(tmp_path / "s.log"),
                 *run_args()], tmp_path)
    w.wait_for(lambda: _stage_processes_started(w), 240, "server processes")
    time.sleep(3)
    stop_and_check(w, signal.SIGINT, rcs=(0,))
    assert any("stopping the server" in ln for ln in w.lines), "".join(w.lines[-20:])
