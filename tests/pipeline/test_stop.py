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
PARTIAL_STARTS = 2


def _stage_processes_started(w: Watched) -> bool:
    return len(w.seen) >= 3


# One signal per command (CI time: each case is a pipeline start): SIGTERM, as supervisors stop
# `run`; Ctrl-C (SIGINT), as a person stops `serve`. Until 2026-11-27 `run` took both signals and
# `serve` SIGTERM; `run` with SIGINT exited cleanly but took 25 s alone and 99-151 s in whole CI
# runs (docs/cpu.md, "CI"), the cost this change saves.
def test_run_stopped_during_start_up(tiny_model_dir, tmp_path):
    w = Watched(["run", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--no-image", "--no-audio",
                 *run_args()],
                tmp_path)
    w.wait_for(lambda: _stage_processes_started(w), 240, "stage processes")
    time.sleep(3)  # the stages are loading
    stop_and_check(w, signal.SIGTERM)


def test_serve_stopped_by_ctrl_c_during_start_up(tiny_model_dir, tmp_path):
    w = Watched(["serve", "--model", str(tiny_model_dir), "--port", "0", "--log", str(tmp_path / "s.log"),
                 *run_args()], tmp_path)
    w.wait_for(lambda: _stage_processes_started(w), 240, "server processes")
    time.sleep(3)
    stop_and_check(w, signal.SIGINT)
