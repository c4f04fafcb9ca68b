"""Asynchronous device -> host writes of a pinned-host pool without zero-copy.

Thread model: :meth:`HostCommitter.submit` runs on the caller's thread (the model runner's)
and returns at once; one daemon thread per committer applies the writes in submission order;
a lock (a condition variable) guards the per-block count of writes in flight, on which
:meth:`HostCommitter.wait` blocks.
"""

from __future__ import annotations

import queue
import threading
from typing import NamedTuple

import torch


class _StagedWrite(NamedTuple):
    destination: torch.Tensor  #: the pool's storage (or its flat view)
    index: torch.Tensor  #: int64 ``[n]`` CPU rows of ``destination`` to write
    staging: torch.Tensor  #: pinned ``[n, ...]`` copy of the rows, valid once ``event`` completes
    event: torch.cuda.Event  #: recorded after the copy into ``staging``
    blocks: list[int]  #: block ids the write touches (distinct)


class HostCommitter:
    """Asynchronous device -> host writes of one pinned-host pool without zero-copy.

    :meth:`submit` enqueues a non-blocking copy of the rows into a pinned staging buffer on the
    current CUDA stream, records an event and returns at once (no host synchronisation on the
    forward path). A daemon thread waits for each event in submission order and scatters the
    staging buffer into the pool's storage. Per block it counts the writes still in flight, so
    a read waits only when it touches one of them.

    Invariant: a block id is in ``_inflight`` iff a submitted write touching it has not yet
    been scattered into the storage.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._queue: queue.Queue[_StagedWrite] = queue.Queue()
        self._lock = threading.Condition()
        self._inflight: dict[int, int] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"omni-cache-commit-{key}", daemon=True)
        self._thread.start()

    def submit(self, destination: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, blocks: list[int]) -> None:
        """Write ``rows`` (``[n, ...]`` on a CUDA device, ``destination``'s dtype and row shape)
        at rows ``index`` (int64 CPU ``[n]``) of ``destination`` (pinned host storage), which
        touch the distinct block ids ``blocks``; returns before the rows land.

        Raises:
            RuntimeError: an earlier staged write of this committer failed.
        """
        staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        staging.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"key {self.key!r}: an earlier staged write failed") from self._error
            for b in blocks:
                self._inflight[b] = self._inflight.get(b, 0) + 1
        self._queue.put(_StagedWrite(destination, index, staging, event, blocks))

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            try:
                write.event.synchronize()
                write.destination.index_copy_(0, write.index, write.staging)
            except BaseException as exc:  # surfaced to the next submit / wait
                with self._lock:
                    self._error = exc
            with self._lock:
                for b in write.blocks:
                    left = self._inflight[b] - 1
                    if left:
                        self._inflight[b] = left
                    else:
                        del self._inflight[b]
                self._lock.notify_all()

    def wait(self, blocks: list[int] | None = None) -> None:
        """Block until every submitted write (``None``), or every one touching ``blocks``
        (block ids), is in the storage.

        Raises:
            RuntimeError: a staged write failed.
        """
        with self._lock:
            if blocks is None:
                self._lock.wait_for(lambda: not self._inflight or self._error is not None)
            else:
                self._lock.wait_for(lambda: self._error is not None
                                    or not any(b in self._inflight for b in blocks))
            if self._error is not None:
                raise RuntimeError(f"key {self.key!r}: a staged write failed") from self._error
