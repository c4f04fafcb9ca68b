"""The one writer of omni-cache's per-process counter files (``OMNI_CACHE_METRICS_DIR``).

Engine processes publish their counters as ``<dir>/<name>-<pid>.json`` (``metrics``: the
stage manager's cache counters; ``scheduler``: the capped scheduler's; ``yoco``: the KV-shared
thinker's forward counters; ``runner``: an AR runner's host time per step,
:class:`RunnerStepTimes`). Benchmarks and tests read them. Each file is written atomically
(temporary file + rename), at most once per :attr:`MetricsFile.min_interval_s` unless forced;
the engine step's writes are deferred to the file's writer thread (:meth:`MetricsFile.publish`).
Counters are best-effort: a write that fails is logged once and never raised into the engine —
the sixth GPU session's full-size engine death was two threads of one thinker (vLLM-Omni's
background output builder and the step) renaming the same temporary file (docs/gpu.md).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_cache import settings

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class MetricsFile:
    """``<OMNI_CACHE_METRICS_DIR>/<name>-<pid>.json``, rate-limited.

    Args:
        name: file stem (``metrics``, ``scheduler``, ``yoco``).
        min_interval_s: seconds between two unforced writes (a write costs ~0.8 ms on the CPU
            platform; a per-step write showed on short requests). 0: every call writes.
    """

    def __init__(self, name: str, min_interval_s: float = 0.0) -> None:
        self.name = name
        self.min_interval_s = min_interval_s
        self._last = float("-inf")
        self._lock = threading.Lock()  # the write schedule (_last, _pending): held for microseconds
        self._wake = threading.Condition(self._lock)  # the writer thread waits on it
        self._io_lock = threading.Lock()  # the file: a write (counters evaluated, JSON, rename) holds it
        self._warned = False
        self._pending: Mapping | Callable[[], Mapping] | None = None  # the pending deferred write's counters
        self._writer: threading.Thread | None = None  # the deferred writes' thread, started once
        self._writer_pid = 0  # the process that started it

    def path(self) -> Path | None:
        """The file this process writes, or None when ``OMNI_CACHE_METRICS_DIR`` is unset."""
        out = settings.METRICS_DIR.get()
        return Path(out) / f"{self.name}-{os.getpid()}.json" if out else None

    def publish(self, counters: Mapping | Callable[[], Mapping], *, force: bool = False,
                defer: bool = False) -> bool:
        """Write ``counters`` (a mapping, or a callable returning one, evaluated only when the
        file is written). Returns whether it wrote on this call. Thread-safe: a process's
        threads (the engine step, vLLM-Omni's background output builder, the save thread) may
        all publish; each write goes through its own temporary file under one lock. Never raises
        on a failed write (``OSError``: logged once per file, returns False).

        ``force``: write now (a pending deferred write is dropped: this one is newer).
        ``defer``: never write on the calling thread — the file's writer thread (one per file,
        started by the first deferred publish, then waiting on a condition) writes once the interval
        allows (at once if it already does), evaluating ``counters`` then; one pending write at a
        time, of the newest counters published. For the engine step: a write costs ~0.26 ms of a GPU
        step's host time (docs/gpu.md, "Fourteenth session"), which the step that served a hit used
        to pay so that a reader polling the file saw the hit at once; deferred, it still appears
        within :attr:`min_interval_s`. A deferred call never waits for a write in progress (the
        file's write holds its own lock, not the schedule's) and never starts a thread after the
        first: until 2026-11-30 each deferred write had its own ``threading.Timer``, and
        ``Thread.start()`` waits for the new thread to run — a GIL hand-over that can take vLLM's
        busy step thread a switch interval (5 ms) — once per interval: the full-size thinker's 0.08
        ms of publishing a step on an H200 (twenty-sixth session). With one busy Python thread
        beside it, a deferred call cost 109 µs before and 6.3 µs now on the CPU
        (``benchmarks/publish_overhead.py``, docs/benchmarks.md); not yet measured on a GPU."""
        if defer and not force and self._pending is not None:
            # a write is pending: it takes these newer counters (without the lock: if the writer
            # thread has just taken the pending ones, it finds these after its write, and writes
            # them once the interval allows; a stale None only takes the lock below)
            self._pending = counters
            return False
        path = self.path()
        if path is None:
            return False
        with self._lock:
            now = time.monotonic()
            if force:
                self._pending = None
            elif defer:
                if self._pending is None:
                    self._pending = counters
                    if self._writer is None or self._writer_pid != os.getpid():  # (a forked child has none)
                        self._writer, self._writer_pid = threading.Thread(
                            target=self._write_deferred, daemon=True, name=f"omni-cache-{self.name}-file"), os.getpid()
                        self._writer.start()
                    else:
                        self._wake.notify()
                return False
            elif now - self._last < self.min_interval_s:
                return False
            self._last = now
        with self._io_lock:
            return self._write(path, counters)

    def _write_deferred(self) -> None:
        """The writer thread (:meth:`publish` with ``defer``): waits for a pending write, then
        for the interval, then writes it; best-effort like every write. A forced write that
        takes the pending one meanwhile leaves it waiting again."""
        while True:
            with self._lock:
                if self._pending is None:
                    self._wake.wait()
                    continue
                wait = self._last + self.min_interval_s - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                counters, self._pending = self._pending, None
                if (path := self.path()) is None:
                    continue
                self._last = time.monotonic()
            with self._io_lock:  # (not the schedule's lock: a step's deferred publish never waits for this)
                try:
                    self._write(path, counters)
                except Exception as e:  # noqa: BLE001 - a counter never takes the engine down
                    logger.warning("omni-cache: deferred counters for %s failed (%s)", path, e)

    def _write(self, path: Path, counters: Mapping | Callable[[], Mapping]) -> bool:
        """One atomic write (own temporary file, then rename); the caller holds ``_io_lock``."""
        data = counters() if callable(counters) else counters
        tmp = path.with_name(f".{path.stem}-{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(dict(data)))
            tmp.replace(path)
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning("omni-cache: counters not written to %s (%s); the cache goes on", path, e)
            return False
        return True


class HitAudit:
    """``<OMNI_CACHE_HIT_AUDIT>/hits-<pid>.jsonl``: one JSON line per served prefix hit —
    ``{"request": <engine request id>, "hit_tokens": <tokens>, "writers": [<request id that
    wrote block i of the hit>, ...]}`` — for the exactness fuzzer's first oracle (a served row
    must equal the row its writer computed; :mod:`omni_cache.exactness.oracles`). Unset: the
    stage writes nothing and :meth:`log` costs one environment lookup per hit."""

    def __init__(self) -> None:
        out = settings.HIT_AUDIT.get()
        self.path = Path(out) / f"hits-{os.getpid()}.jsonl" if out else None

    def log(self, request_id: str, hit_tokens: int, writers: list) -> None:
        """Append one served hit (``writers``: one entry per block of the hit, in order)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"request": str(request_id), "hit_tokens": int(hit_tokens),
                                "writers": [None if w is None else str(w) for w in writers]}) + "\n")


def rows_digest(rows: torch.Tensor) -> str:
    """SHA-1 of a block's rows ``[block_size, width]`` as stored (their bytes, any dtype): the
    writer's digest in :class:`BlockDigestAudit` and the reader's in
    :func:`omni_cache.exactness.oracles.served_rows_mismatches` are computed by this one function."""
    import hashlib

    import torch

    t = rows.detach().to("cpu").contiguous()
    return hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()


class BlockDigestAudit:
    """``<OMNI_CACHE_HIT_AUDIT>/blocks-<pid>.jsonl``: one JSON line per block a request filled
    with rows its own forward computed — ``{"writer": <engine request id>, "block": <index in
    the request>, "digests": {<hand-off key>: <rows_digest>}}`` — from the rows the forward
    returned (not from the pool), so a served block has a writer's oracle even where the
    writer's recorded hand-off does not hold its rows: blocks filled while decoding (oracle
    (a), :mod:`omni_cache.exactness.oracles`). Audits only (the same setting as
    :class:`HitAudit`): it copies each step's hand-off rows to the host (a sync). Unset: nothing."""

    def __init__(self, block_size: int) -> None:
        out = settings.HIT_AUDIT.get()
        self.path = Path(out) / f"blocks-{os.getpid()}.jsonl" if out else None
        self.block_size = block_size
        self._rows: dict[str, dict[int, dict[str, Any]]] = {}  # request → position → key → row

    def add(self, request_id: str, start: int, rows: dict, full_blocks) -> None:
        """A step's rows of one request (key → ``[n, width]`` for positions ``[start, start+n)``);
        ``full_blocks``: indices of the request's blocks full after this step. Logs each full
        block whose every row this request computed; forgets the rest of those blocks."""
        if self.path is None:
            return
        pos = self._rows.setdefault(str(request_id), {})
        host = {k: v.detach().to("cpu") for k, v in rows.items()}
        n = next(iter(host.values())).shape[0] if host else 0
        for i in range(n):
            pos[start + i] = {k: v[i] for k, v in host.items()}
        lines = []
        for b in full_blocks:
            lo, hi = b * self.block_size, (b + 1) * self.block_size
            got = [pos.pop(p, None) for p in range(lo, hi)]
            if any(g is None for g in got):
                continue
            import torch

            keys = [k for k in got[0] if all(k in g for g in got)]  # a key every row of the block has
            lines.append({"writer": str(request_id), "block": int(b),
                          "digests": {k: rows_digest(torch.stack([g[k] for g in got])) for k in keys}})
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's rows of a block it never filled."""
        self._rows.pop(str(request_id), None)


class RunnerStepTimes:
    """Host time per engine step of an AR stage's runner, cache on or off — the attribution of
    a step-time difference between variants (issue 43's zero-overhead bar; docs/gpu.md,
    "Twenty-first session"). Published as ``runner-<pid>.json`` (``OMNI_CACHE_METRICS_DIR``).

    Counters (seconds, summed over the steps): ``execute_model`` — the runner's
    ``execute_model`` on the engine's thread (input preparation, the forward's launch, omni-cache's
    save); ``output_builder`` — vLLM-Omni's payload builder (on its async-output thread under
    async scheduling, else inline), with omni-cache's ``materialize``. Each as wall time and as
    the calling thread's CPU time (``time.thread_time``): wall minus CPU is time spent waiting —
    for the GIL held by another thread, or for the device.
    """

    FIELDS = ("execute_model", "output_builder")

    def __init__(self, stage: str | None) -> None:
        self.stage = stage
        self.counts = dict.fromkeys(self.FIELDS, 0)
        self.wall = dict.fromkeys(self.FIELDS, 0.0)
        self.cpu = dict.fromkeys(self.FIELDS, 0.0)
        self._file = MetricsFile("runner", min_interval_s=0.5)

    def add(self, field: str, wall_s: float, cpu_s: float) -> None:
        """Count one call of ``field`` (one of :attr:`FIELDS`) that took ``wall_s`` / ``cpu_s``
        seconds, and schedule a deferred write of the file (never on the calling thread)."""
        self.counts[field] += 1
        self.wall[field] += wall_s
        self.cpu[field] += cpu_s
        self._file.publish(self.snapshot, defer=True)

    def snapshot(self) -> dict:
        """The counters as written: ``stage``, and per field ``calls``, ``seconds_wall``,
        ``seconds_cpu``."""
        return {"stage": self.stage, **{f: {"calls": self.counts[f], "seconds_wall": self.wall[f],
                                            "seconds_cpu": self.cpu[f]} for f in self.FIELDS}}

    def flush(self) -> None:
        """Write the file now (shutdown)."""
        self._file.publish(self.snapshot, force=True)
