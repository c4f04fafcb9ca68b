"""Unlink the shared-memory hand-offs a finished request left behind, in the server's process.

vLLM-Omni 0.30's ``SharedMemoryConnector`` (``distributed/omni_connectors/connectors/
shm_connector.py``) carries every chunk a stage hands the next one (``async_chunk: true``) in a
POSIX segment ``/dev/shm/<request id>_<stage>_<chunk>`` with an empty lock file
``/dev/shm/shm_<request id>_<stage>_<chunk>_lockfile.lock``. Only the *receiving* stage unlinks
a segment, when it reads it; the sender unlinks its own only when the request is aborted before
its terminal chunk went out (``OmniChunkTransferAdapter.cleanup_sender``). A chunk that was
sent but is never read stays until the server exits (Python's ``resource_tracker`` then
unlinks the segment, warning of "leaked shared_memory objects"; the lock file stays for good).
Measured on the CPU server (issue 45, ``benchmarks/soak.py``): a streamed request the client
closes after its first chunk left ``<id>_0_6`` — the thinker had sent everything, then the
abort reached the talker before it read the rest. The text-only case (a terminal marker to a
stage the request never reaches) is not created in the first place by omni-cache's schedulers
(:mod:`omni_cache.engine.shm_hygiene`).

:func:`install_shm_sweeper` wraps the server engine's ``generate`` (on the instance
``omni-cache serve`` builds; :func:`omni_cache.driver.vllm_serve.sweep_request_segments`):
when a request's output stream ends — finished, failed or closed by the client —
:class:`ShmSweeper` unlinks that request's segments and lock files :data:`SWEEP_AFTER_S`
seconds later (every stage has finished or aborted it by then; request ids are unique: vLLM-Omni
appends a random suffix to the client's ``X-Request-Id``). A segment is unlinked through
``multiprocessing.shared_memory`` so the resource tracker that the stage processes share with
this process forgets it too. Nothing of vLLM / vLLM-Omni is edited or patched.

Not covered: realtime sessions (``DuplexOmni``'s session path does not go through
``generate`` per turn), and requests of engines this module is not installed on (plain
``vllm-omni serve``, vLLM-Omni's own ``Omni`` / ``AsyncOmni`` users): there the upstream
behaviour above stands.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import deque
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: seconds between a request's output stream ending and the unlinking of its hand-offs
SWEEP_AFTER_S = 5.0
SHM_DIR = Path("/dev/shm")


def request_entries(request_id: str, names: list[str]) -> tuple[list[str], list[str]]:
    """``(segments, lock files)`` among ``names`` (``/dev/shm`` entries) that the connector
    made for ``request_id``: ``<id>_<stage>_<chunk>`` and ``shm_<id>_<stage>_<chunk>_lockfile.lock``
    exactly (another request whose id merely starts with ``request_id`` is not matched)."""
    rid = re.escape(request_id)
    seg = re.compile(rf"{rid}_\d+_\d+")
    lock = re.compile(rf"shm_{rid}_\d+_\d+_lockfile\.lock")
    return [n for n in names if seg.fullmatch(n)], [n for n in names if lock.fullmatch(n)]


def unlink_segment(name: str, shm_dir: Path = SHM_DIR) -> bool:
    """Unlink the POSIX segment ``name`` (through ``multiprocessing.shared_memory``, so the
    resource tracker forgets it; a plain unlink of ``shm_dir/name`` when it cannot be mapped,
    e.g. size 0). Returns whether it existed."""
    if shm_dir == SHM_DIR:
        try:
            seg = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            return False
        except (ValueError, OSError):
            pass
        else:
            seg.close()
            try:
                seg.unlink()
                return True
            except FileNotFoundError:
                return False
    try:
        os.unlink(shm_dir / name)
        return True
    except FileNotFoundError:
        return False


def sweep_requests(request_ids: list[str], shm_dir: Path = SHM_DIR) -> tuple[int, int]:
    """Unlink every segment and lock file of ``request_ids`` in ``shm_dir`` (one directory
    listing). Returns ``(segments, lock files)`` removed."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0, 0
    segments = locks = 0
    for rid in request_ids:
        segs, lockfiles = request_entries(rid, names)
        segments += sum(unlink_segment(n, shm_dir) for n in segs)
        for n in lockfiles:
            try:
                os.unlink(shm_dir / n)
                locks += 1
            except FileNotFoundError:
                pass
    return segments, locks


class ShmSweeper:
    """Unlinks a request's hand-offs ``after_s`` seconds after :meth:`request_ended` (on the
    running asyncio loop; one directory listing per batch of due requests).

    Attributes:
        swept_segments / swept_lockfiles: totals removed so far (segments a stage left unread).
    """

    def __init__(self, after_s: float = SWEEP_AFTER_S, shm_dir: Path = SHM_DIR):
        self.after_s = after_s
        self.shm_dir = shm_dir
        self.due: deque[tuple[float, str]] = deque()
        self.swept_segments = 0
        self.swept_lockfiles = 0
        self._scheduled = False

    def request_ended(self, request_id: str) -> None:
        """Note that ``request_id``'s output stream ended; its entries go ``after_s`` s later."""
        if not request_id:
            return
        self.due.append((time.monotonic() + self.after_s, request_id))
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled or not self.due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (tests call sweep_due themselves)
        self._scheduled = True
        loop.call_later(max(0.0, self.due[0][0] - time.monotonic()), self._run)

    def _run(self) -> None:
        self._scheduled = False
        try:
            self.sweep_due()
        finally:
            self._schedule()

    def sweep_due(self, now: float | None = None) -> list[str]:
        """Sweep the requests whose time has come; returns their ids."""
        now = time.monotonic() if now is None else now
        ready = []
        while self.due and self.due[0][0] <= now:
            ready.append(self.due.popleft()[1])
        if ready:
            segments, locks = sweep_requests(ready, self.shm_dir)
            self.swept_segments += segments
            self.swept_lockfiles += locks
            if segments:
                logger.debug("omni-cache: unlinked %d unread shared-memory hand-offs of %d finished requests",
                             segments, len(ready))
        return ready


def install_shm_sweeper(engine: Any, sweeper: ShmSweeper | None = None) -> ShmSweeper:
    """Wrap ``engine.generate`` (vLLM-Omni's ``AsyncOmni.generate(prompt, sampling_params,
    request_id, ...)``, an async generator) on the instance so that :class:`ShmSweeper` is told
    when each request's stream ends. Returns the sweeper.

    Raises:
        TypeError: ``engine`` has no ``generate``.
    """
    sweeper = sweeper or ShmSweeper()
    original = getattr(engine, "generate", None)
    if original is None:
        raise TypeError(f"{type(engine).__name__} has no generate(); cannot sweep its hand-offs")
    if getattr(original, "_omni_cache_shm_sweeper", None) is not None:
        return original._omni_cache_shm_sweeper

    async def generate(*args, **kwargs):
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else "")
        try:
            async for out in original(*args, **kwargs):
                yield out
        finally:
            sweeper.request_ended(str(request_id or ""))

    generate._omni_cache_shm_sweeper = sweeper
    engine.generate = generate
    return sweeper
