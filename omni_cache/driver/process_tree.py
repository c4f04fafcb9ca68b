"""Stopping the main job leaves no process behind.

vLLM-Omni starts a process per stage (spawn) and each stage its workers. Python's default
SIGTERM handling ends the driver at once, without running any cleanup, and the stage processes
it had started live on (re-parented to init, ~1 GB each) — seen with SIGTERM to
``omni-cache run`` during start-up. :func:`stop_descendants_on_exit` turns SIGTERM into a
normal exit (``SystemExit(143)``, so ``with`` blocks close the pipeline) and, whatever the way
out, stops every process still descending from this one: SIGTERM first, SIGKILL after a grace
period. Process listing: ``psutil`` (a vLLM dependency).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import psutil


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every live process descending from ``pid`` (default: this process)."""
    try:
        return psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_descendants(pid: int | None = None, grace_s: float = 10.0) -> list[int]:
    """SIGTERM every descendant of ``pid``, SIGKILL those still alive after ``grace_s``
    seconds; repeated until none is left (a process may start a child while being stopped).

    Returns:
        The pids that were stopped.
    """
    stopped: list[int] = []
    for _ in range(5):
        procs = descendants(pid)
        if not procs:
            break
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
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
