"""Stopping the main job leaves no process behind.

vLLM-Omni starts a process per stage (spawn) and each stage its workers. Python's default
SIGTERM handling ends the driver at once, without running any cleanup, and the stage processes
it had started live on (re-parented to init, ~1 GB each) — seen with SIGTERM to
``omni-cache run`` during start-up. :func:`stop_descendants_on_exit` turns SIGTERM into a
normal exit (``SystemExit(143)``, so ``with`` blocks close the pipeline) and, whatever the way
out, stops every process still descending from this one: SIGTERM first, SIGKILL after a grace
period. Process listing: ``psutil`` (a vLLM dependency).

Waiting never reaps. vLLM-Omni's orchestrator thread shuts the same stages down at the same time
(``vllm.v1.utils.shutdown``: SIGTERM, ``Process.join``, then ``is_alive()``). Had we reaped a
stage process (``psutil.wait_procs`` calls ``os.waitpid`` on our own children), its
``multiprocessing`` handle could never learn the exit status: ``is_alive()`` stays True and vLLM
logs "[shutdown] Process manager: force killing remaining process StageEngineCoreProc_stage0"
for a process that had exited in time (seen in CI on Ctrl-C during start-up: the stage was gone
0.5 s after the signal). A zombie counts as stopped; its parent reaps it.

This process's own ``multiprocessing`` resource tracker is left alone: it ignores SIGTERM (so
stopping it cost the whole grace, 10 s, on every stop) and ends by itself once this process
exits, unlinking the shared-memory segments the stages leaked — which SIGKILL would prevent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator

import psutil


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every live process descending from ``pid`` (default: this process)."""
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _own_resource_tracker() -> int | None:
    """The pid of this process's ``multiprocessing`` resource tracker, if it started one."""
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def _running(p: psutil.Process) -> bool:
    """True while ``p`` runs; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: Iterable[psutil.Process], timeout_s: float, poll_s: float = 0.05) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` seconds for ``procs`` to exit, without reaping any of them (unlike
    ``psutil.wait_procs``: see the module's docstring). Returns those still running."""
    alive = [p for p in procs if _running(p)]
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = [p for p in alive if _running(p)]
    return alive


def stop_descendants(pid: int | None = None, grace_s: float = 10.0) -> list[int]:
    """SIGTERM every descendant of ``pid``, SIGKILL those still running after ``grace_s``
    seconds; repeated until none is left (a process may start a child while being stopped).
    Reaps nothing: each exit status stays with the process's parent; spares this process's own
    resource tracker (module docstring).

    Returns:
        The pids that were stopped.
    """
    stopped: list[int] = []
    spare = _own_resource_tracker() if pid in (None, os.getpid()) else None
    for _ in range(5):
        procs = [p for p in descendants(pid) if p.pid != spare and _running(p)]
        if not procs:
            break
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        alive = wait_gone(procs, grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        wait_gone(alive, 5)
        stopped.extend(p.pid for p in procs)
    return stopped


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stop_descendants_on_exit(grace_s: float = 10.0) -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` (Ctrl-C raises
    ``KeyboardInterrupt`` as usual); on leaving it — normally, by an exception or by either
    signal — every descendant process still running is stopped (:func:`stop_descendants`).
    A second signal during that cleanup is ignored so the cleanup finishes."""
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        yield
    finally:
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            stop_descendants(grace_s=grace_s)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, previous)
