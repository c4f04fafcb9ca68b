"""Stopping the main job the way users and supervisors do — SIGTERM, or Ctrl-C (SIGINT) —
during start-up and during a request leaves no process behind: every process that ever
descended from ``omni-cache run`` / ``omni-cache serve`` (polled while it ran) is gone after
it exits. (Before: SIGTERM during start-up left a stage engine process running, re-parented
to init, ~1 GB resident.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytestmark = pytest.mark.pipeline


class Watched:
    """A command whose descendants are recorded every 0.2 s and whose output is collected."""

    def __init__(self, args: list[str], cwd):
        self.proc = subprocess.Popen([sys.executable, "-m", "omni_cache.cli", *args], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.seen: dict[int, float] = {}  # pid -> create_time (a pid can be reused)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._poll, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def _poll(self) -> None:
        while self.proc.poll() is None:
            try:
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    self.seen.setdefault(p.pid, p.create_time())
            except psutil.Error:
                pass
            time.sleep(0.2)

    def wait_for(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what}: not seen (rc={self.proc.poll()}); output:\n{''.join(self.lines[-40:])}")
            time.sleep(0.2)

    def left_behind(self) -> list[str]:
        out = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {p.name()} (parent {p.ppid()})")
            except psutil.NoSuchProcess:
                pass
        return out


def _stop_and_check(w: Watched, sig: int) -> None:
    w.proc.send_signal(sig)
    try:
        rc = w.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        w.proc.kill()
        raise AssertionError("the command did not exit within 180 s of the signal")
    time.sleep(1.0)
    left = w.left_behind()
    for pid in list(w.seen):  # never leave anything to later tests, whatever the outcome
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert len(w.seen) >= 2, f"no stage processes were seen: {w.seen}"
    assert not left, f"left behind after {signal.Signals(sig).name}: {left}"
    assert rc in (128 + sig, 130, 143, 0), rc


def _stage_processes_started(w: Watched) -> bool:
    return len(w.seen) >= 3


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_stopped_during_start_up(tiny_model_dir, tmp_path, sig):
    w = Watched(["run", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--no-image", "--no-audio"],
                tmp_path)
    w.wait_for(lambda: _stage_processes_started(w), 240, "stage processes")
    time.sleep(3)  # the stages are loading
    _stop_and_check(w, sig)


def test_run_stopped_during_a_request(tiny_model_dir, tmp_path):
    w = Watched(["run", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--repeat", "3"], tmp_path)
    w.wait_for(lambda: any("pipeline started" in ln for ln in w.lines), 600, "pipeline start")
    _stop_and_check(w, signal.SIGTERM)


def test_serve_stopped_during_start_up(tiny_model_dir, tmp_path):
    w = Watched(["serve", "--model", str(tiny_model_dir), "--port", "0", "--log", str(tmp_path / "s.log")], tmp_path)
    w.wait_for(lambda: _stage_processes_started(w), 240, "server processes")
    time.sleep(3)
    _stop_and_check(w, signal.SIGTERM)
