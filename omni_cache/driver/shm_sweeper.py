"""Unlink the shared-memory hand-offs a finished request left behind, in the server's process.

vLLM-Omni 0.30's ``SharedMemoryConnector`` (``distributed/omni_connectors/connectors/
shm_connector.py``) carries every chunk a stage hands the next one (``async_chunk: true``) in a
POSIX segment ``/dev/shm/<request id>_<stage>_<chunk>`` with an empty lock file
``/dev/shm/shm_<request id>_<stage>_<chunk>_lockfile.lock``. Only the *receiving* stage unlinks
a segment, when it reads it; the sender unlinks its own only when the request is aborted before
its terminal chunk went out (``OmniChunkTransferAdapter.cleanup_sender``). A chunk that was
sent but is never read stays until the server exits (Python's ``resource_tracker`` then
unlinks the segment, warning of "leaked shared_memory objects"; the lock file stays for good).
Measured on the CPU server (issue 45, ``tests/lanes/soak.py``): a streamed request the client
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

The same sweeper is installed on :class:`~omni_cache.driver.streaming.StreamingPipeline`'s
``AsyncOmni`` (``omni-cache run``, the streaming tests, the benchmarks' streaming pipelines;
since 2026-11-28): there the stress test's requests, completed ones included, had left their
stage-0 chunks unread — segments until the engine exited and their empty lock files for good
(the streaming tests' requests left none). Not omni-cache's doing: the same seeded stress
workload (32 requests, a quarter aborted, then one more) left 715 unread segments on the
cache-off engine and 716 on omni-cache's (counted by each engine's sweeper, 2026-11-28); which
of vLLM-Omni's paths leaves them was not traced further.

A request's stream can end while its hand-offs are still being written: vLLM-Omni's chunk
adapter (``transfer_adapter/chunk_transfer_adapter.py``) hands each chunk to a background save
thread, which on a busy host lags the stage — the landing CI of ca53e73 (2026-11-30) found 45
entries of one request's stage-0 chunks 24 onwards, written after its sweep, the talker having
stopped reading at chunk 23. So a request is swept again :data:`SWEEP_AGAIN_S` seconds after
its first sweep, and again after each sweep that still found some of its entries (at most
:data:`MAX_SWEEPS` sweeps).

Not covered: realtime sessions (``DuplexOmni``'s session path does not go through
``generate`` per turn), the synchronous :class:`~omni_cache.driver.pipeline.OmniPipeline`
(vLLM-Omni's ``Omni``: no per-request ``generate`` stream to wrap), and requests of engines
this module is not installed on (plain ``vllm-omni serve``, vLLM-Omni's own ``Omni`` /
``AsyncOmni`` users): there the upstream behaviour above stands.
"""

from __future__ import annotations

import contextvars
import functools
import heapq
import logging
import os
import re
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

logger = logging.getLogger("omni_cache.server")  # the server-side logger (vLLM's handlers: http_errors)

#: seconds between a request's output stream ending and the unlinking of its hand-offs
SWEEP_AFTER_S = 5.0
#: seconds between a request's sweep and the next one (hand-offs its stages' save threads wrote late)
SWEEP_AGAIN_S = 30.0
#: sweeps of one request at most: the first, the one after, and more while a sweep still finds entries
MAX_SWEEPS = 4
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
    found = sweep_each(request_ids, shm_dir)
    return sum(n[0] for n in found.values()), sum(n[1] for n in found.values())


def sweep_each(request_ids: list[str], shm_dir: Path = SHM_DIR) -> dict[str, tuple[int, int]]:
    """:func:`sweep_requests`, counted per request: ``{request id: (segments, lock files)}``
    removed (one directory listing in all)."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return {rid: (0, 0) for rid in request_ids}
    found = {}
    for rid in request_ids:
        segs, lockfiles = request_entries(rid, names)
        segments = sum(unlink_segment(n, shm_dir) for n in segs)
        locks = 0
        for n in lockfiles:
            try:
                os.unlink(shm_dir / n)
                locks += 1
            except FileNotFoundError:
                pass
        found[rid] = (segments, locks)
    return found


class ShmSweeper:
    """Unlinks a request's hand-offs ``after_s`` seconds after :meth:`request_ended`, again
    ``again_s`` seconds after that sweep, and again after every sweep that still found some
    (``max_sweeps`` in all: a stage's save thread can write chunks after the request's stream
    ended), from a daemon thread that wakes every ``every_s`` seconds while requests are due
    (one directory listing per batch). Thread-safe; does not depend on the caller's event loop
    — a request's stream may be finalized late, outside any loop (a generator the client
    abandoned).

    Attributes:
        swept_segments / swept_lockfiles: totals removed so far (hand-offs a stage left unread).
        late_segments: of those, how many a sweep after a request's first one removed (written
            after its stream ended).
    """

    def __init__(self, after_s: float = SWEEP_AFTER_S, shm_dir: Path = SHM_DIR, every_s: float = 1.0,
                 again_s: float = SWEEP_AGAIN_S, max_sweeps: int = MAX_SWEEPS):
        if after_s < 0 or again_s <= 0 or every_s <= 0 or max_sweeps < 1:
            raise ValueError(f"ShmSweeper: after_s={after_s} must be >= 0, again_s={again_s} and "
                             f"every_s={every_s} > 0, max_sweeps={max_sweeps} >= 1")
        self.after_s = after_s
        self.again_s = again_s
        self.max_sweeps = max_sweeps
        self.shm_dir = shm_dir
        self.every_s = every_s
        #: a heap of (due time (time.monotonic() seconds), request id, sweeps done before this one)
        self.due: list[tuple[float, str, int]] = []
        self.swept_segments = 0
        self.swept_lockfiles = 0
        self.late_segments = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def request_ended(self, request_id: str) -> None:
        """Note that ``request_id``'s output stream ended (or it was aborted); its entries go
        ``after_s`` seconds later. Calling it twice for one id is harmless."""
        if not request_id:
            return
        with self._lock:
            heapq.heappush(self.due, (time.monotonic() + self.after_s, request_id, 0))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="omni-cache-shm-sweeper", daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.every_s)
            self._wake.clear()
            try:
                self.sweep_due()
            except Exception:  # noqa: BLE001 - never take the server down; say so once per batch
                logger.exception("omni-cache: shared-memory sweep failed")

    def sweep_due(self, now: float | None = None) -> list[str]:
        """Sweep the requests whose time has come; returns their ids (a request due twice, once).
        Each is due again ``again_s`` seconds after this sweep (:func:`time.monotonic`, whatever
        ``now`` says) if this was its first sweep or it found entries, up to ``max_sweeps``."""
        now = time.monotonic() if now is None else now
        ready: dict[str, int] = {}
        with self._lock:  # the daemon thread and a pipeline's close() may both sweep
            while self.due and self.due[0][0] <= now:
                _, rid, done = heapq.heappop(self.due)
                ready[rid] = max(done, ready.get(rid, 0))
        if not ready:
            return []
        found = sweep_each(sorted(ready), self.shm_dir)
        segments = sum(n[0] for n in found.values())
        self.swept_segments += segments
        self.swept_lockfiles += sum(n[1] for n in found.values())
        self.late_segments += sum(found[rid][0] for rid, done in ready.items() if done > 0)
        again = time.monotonic() + self.again_s
        with self._lock:
            for rid, done in ready.items():
                if done + 1 < self.max_sweeps and (done == 0 or any(found[rid])):
                    heapq.heappush(self.due, (again, rid, done + 1))
        if segments:
            logger.info("omni-cache: unlinked %d shared-memory hand-offs that no stage read (%d finished "
                        "requests; %d in all, %d written after their request ended)", segments, len(ready),
                        self.swept_segments, self.late_segments)
        return sorted(ready)


#: the internal request ids one ``generate`` call got (set by the wrapper around it)
_CALL_IDS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("omni_cache_call_ids", default=None)


def install_shm_sweeper(engine: Any, sweeper: ShmSweeper | None = None) -> ShmSweeper:
    """Tell :class:`ShmSweeper` the *internal* request id of every request the server's engine
    runs, when its stream ends or it is aborted. Wraps, on the instance (vLLM-Omni 0.30's
    ``AsyncOmni``):

    - ``_get_unique_request_id(external_id)`` — ``generate`` calls it first to make the id the
      stages and the hand-off segments carry (``<client id>-<8 hex>``); the wrapper notes it for
      the ``generate`` call it runs in (a context variable);
    - ``generate(prompt, sampling_params, request_id, ...)`` (an async generator): when the
      stream ends — finished, failed or closed — its internal ids are swept;
    - ``abort(request_id)`` (a coroutine, internal ids; the server calls it when a client goes
      away): those ids are swept too (an abandoned stream may be finalized much later).

    Returns the sweeper.

    Raises:
        TypeError: ``engine`` lacks one of the three (vLLM-Omni moved the seam).
    """
    sweeper = sweeper or ShmSweeper()
    missing = [n for n in ("generate", "abort", "_get_unique_request_id") if not hasattr(engine, n)]
    if missing:
        raise TypeError(f"{type(engine).__name__} has no {', '.join(missing)}: omni-cache cannot sweep its "
                        "shared-memory hand-offs (omni_cache/driver/shm_sweeper.py)")
    original = engine.generate
    if getattr(original, "_omni_cache_shm_sweeper", None) is not None:
        return original._omni_cache_shm_sweeper
    unique_id, abort = engine._get_unique_request_id, engine.abort

    def get_unique_request_id(external_request_id):
        internal = unique_id(external_request_id)
        ids = _CALL_IDS.get()
        if ids is not None:
            ids.append(str(internal))
        return internal

    async def generate(*args, **kwargs):
        ids: list[str] = []
        token = _CALL_IDS.set(ids)
        try:
            async for out in original(*args, **kwargs):
                yield out
        finally:
            try:
                _CALL_IDS.reset(token)
            except ValueError:  # finalized in another context: nothing to restore there
                pass
            for rid in ids:
                sweeper.request_ended(rid)

    @functools.wraps(abort)
    async def abort_and_sweep(request_id, *args, **kwargs):
        try:
            return await abort(request_id, *args, **kwargs)
        finally:
            for rid in ([request_id] if isinstance(request_id, str) else list(request_id or ())):
                sweeper.request_ended(str(rid))

    from omni_cache.driver.http_errors import install_log_filter

    install_log_filter()  # this module's lines go through vLLM's handlers, as the rejected-request lines
    generate._omni_cache_shm_sweeper = sweeper
    engine._get_unique_request_id = get_unique_request_id
    engine.generate = generate
    engine.abort = abort_and_sweep
    logger.info("omni-cache: shared-memory sweeper installed (unread hand-offs unlinked %.0f s after their "
                "request ends)", sweeper.after_s)
    return sweeper
