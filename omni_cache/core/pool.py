"""One cached key's row storage, laid out like the KV cache's slots."""

from __future__ import annotations

import enum
import queue
import threading

import torch


class Tier(enum.Enum):
    """Where a pool's storage lives."""

    DEVICE = "device"  #: on ``device`` (e.g. the GPU running the model)
    PINNED_HOST = "pinned_host"  #: page-locked host memory (plain host memory without CUDA)
    HOST = "host"  #: pageable host memory


class HiddenPool:
    """Rows of one cached tensor key, indexed by KV slot id.

    Storage is ``[num_blocks, block_size, width]`` of ``dtype``; its flat view
    ``[num_blocks * block_size, width]`` has row ``slot_id`` = the KV slot of that token,
    so a request's block table addresses its rows exactly as it addresses its KV.

    Invariant: the pool never decides validity; :class:`~omni_cache.core.ledger.BlockLedger`
    says which rows may be served. The storage device is ``device`` for ``Tier.DEVICE`` and
    the CPU for host tiers.
    """

    def __init__(
        self,
        key: str,
        num_blocks: int,
        block_size: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tier: Tier = Tier.HOST,
    ) -> None:
        self.key = key
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.width = width
        self.dtype = dtype
        self.tier = tier
        self.device = torch.device(device) if tier is Tier.DEVICE else torch.device("cpu")
        pin = tier is Tier.PINNED_HOST and torch.cuda.is_available()
        self.storage = torch.zeros(
            (num_blocks, block_size, width), dtype=dtype, device=self.device, pin_memory=pin
        )
        self._flat = self.storage.view(num_blocks * block_size, width)
        self._committer: _HostCommitter | None = None

    @property
    def nbytes(self) -> int:
        """Storage size in bytes."""
        return self.storage.numel() * self.storage.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row (``width * itemsize``)."""
        return self.width * self.dtype.itemsize

    def _on_storage(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Non-blocking only towards a device: a CPU op right after a non-blocking
        # device->host copy could read the buffer before the copy lands.
        return t.to(self.device, dtype, non_blocking=self.device.type != "cpu")

    def write(self, slot_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` (``[n, width]``, any float dtype, cast to ``dtype``) at ``slot_ids``
        (int64 ``[n]``).

        Host -> device copies use ``non_blocking=True`` (stream-ordered, no host sync).
        A pinned-host pool fed from a CUDA device stages the rows with a non-blocking
        device -> host copy and returns; a committer thread scatters them once the copy has
        landed (:class:`_HostCommitter`; reads of those blocks wait for it). A pageable
        ``HOST`` pool fed from a device copies synchronously.

        Raises:
            ValueError: ``rows`` is not ``[len(slot_ids), width]``.
        """
        if rows.dim() != 2 or rows.shape[1] != self.width or rows.shape[0] != slot_ids.numel():
            raise ValueError(
                f"key {self.key!r}: rows of shape {tuple(rows.shape)} do not match "
                f"[{slot_ids.numel()}, {self.width}]"
            )
        if self._staged(rows):
            self._committer.submit(self._flat, slot_ids.to("cpu", torch.int64), rows.to(self.dtype),
                                   (slot_ids // self.block_size).tolist())
            return
        index = self._on_storage(slot_ids, torch.int64)
        self._flat.index_copy_(0, index, self._on_storage(rows, self.dtype))

    def write_blocks(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store whole blocks: ``rows`` ``[k * block_size, width]`` fill blocks ``block_ids``
        (int64 ``[k]``) in order. One slab copy per block instead of one row copy per token
        (the fast path for prefill steps and every prefix-hit read).

        Raises:
            ValueError: ``rows`` is not ``[len(block_ids) * block_size, width]``.
        """
        k = block_ids.numel()
        if rows.dim() != 2 or rows.shape != (k * self.block_size, self.width):
            raise ValueError(f"key {self.key!r}: rows of shape {tuple(rows.shape)} do not fill "
                             f"{k} blocks of [{self.block_size}, {self.width}]")
        if self._staged(rows):
            self._committer.submit(self.storage, block_ids.to("cpu", torch.int64),
                                   rows.to(self.dtype).view(k, self.block_size, self.width), block_ids.tolist())
            return
        index = self._on_storage(block_ids, torch.int64)
        src = self._on_storage(rows, self.dtype).view(k, self.block_size, self.width)
        self.storage.index_copy_(0, index, src)

    def _staged(self, rows: torch.Tensor) -> bool:
        """Whether a write of ``rows`` goes through the asynchronous device->host staging
        path (a pinned-host pool fed from a CUDA device)."""
        if rows.device.type != "cuda" or not self.storage.is_pinned():
            return False
        if self._committer is None:
            self._committer = _HostCommitter(self.key)
        return True

    def wait_pending(self, block_ids: list[int] | None = None) -> None:
        """Block until staged writes have landed in the storage: all of them, or only those
        touching ``block_ids`` (in practice: all writes up to the last one touching them).
        The only host wait of a pinned-host pool, needed only when a read hits blocks whose
        write is still in flight (e.g. a hit on rows written in the same step)."""
        if self._committer is not None:
            self._committer.wait(block_ids)

    def gather_blocks(self, block_ids: torch.Tensor, out_device: torch.device | str | None = None) -> torch.Tensor:
        """Rows of whole blocks ``block_ids`` (int64 ``[k]``) in order: ``[k * block_size,
        width]`` on ``out_device`` (pinned staging + non-blocking copy from a pinned pool)."""
        if self._committer is not None:
            self.wait_pending(block_ids.tolist())
        index = self._on_storage(block_ids, torch.int64)
        out_device = self.device if out_device is None else torch.device(out_device)
        shape = (index.numel(), self.block_size, self.width)
        if out_device.type == "cuda" and self.device.type == "cpu" and self.storage.is_pinned():
            out = torch.empty(shape, dtype=self.dtype, pin_memory=True)
            torch.index_select(self.storage, 0, index, out=out)
            return out.view(-1, self.width).to(out_device, non_blocking=True)
        return self.storage.index_select(0, index).view(-1, self.width).to(out_device)

    def gather(
        self, slot_ids: torch.Tensor, out_device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Copy of the rows at ``slot_ids`` (int64 ``[n]``): ``[n, width]`` of ``dtype`` on
        ``out_device`` (default: the storage device). Pinned-host pools gather into pinned
        memory so the move to a CUDA ``out_device`` is non-blocking."""
        if self._committer is not None:
            self.wait_pending((slot_ids // self.block_size).tolist())
        index = self._on_storage(slot_ids, torch.int64)
        out_device = self.device if out_device is None else torch.device(out_device)
        if out_device.type == "cuda" and self.device.type == "cpu" and self.storage.is_pinned():
            out = torch.empty((index.numel(), self.width), dtype=self.dtype, pin_memory=True)
            torch.index_select(self._flat, 0, index, out=out)
            return out.to(out_device, non_blocking=True)
        return self._flat.index_select(0, index).to(out_device)


class _HostCommitter:
    """Asynchronous device->host writes of one pinned-host pool.

    ``submit`` enqueues a non-blocking copy of the rows into a pinned staging buffer on the
    current CUDA stream, records an event and returns at once (no host synchronisation on the
    forward path). A daemon thread waits for each event in submission order and scatters the
    staging buffer into the pool's storage. Per block it counts the writes still in flight, so
    a read waits only when it touches one of them.

    Invariant: a block id is in ``_inflight`` iff a submitted write touching it has not yet
    been scattered into the storage.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._inflight: dict[int, int] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"omni-cache-commit-{key}", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, blocks: list[int]) -> None:
        staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        staging.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"key {self.key!r}: an earlier staged write failed") from self._error
            for b in blocks:
                self._inflight[b] = self._inflight.get(b, 0) + 1
        self._queue.put((dst, index, staging, event, blocks))

    def _run(self) -> None:
        while True:
            dst, index, staging, event, blocks = self._queue.get()
            try:
                event.synchronize()
                dst.index_copy_(0, index, staging)
            except BaseException as exc:  # surfaced to the next submit / wait
                with self._lock:
                    self._error = exc
            with self._lock:
                for b in blocks:
                    left = self._inflight[b] - 1
                    if left:
                        self._inflight[b] = left
                    else:
                        del self._inflight[b]
                self._lock.notify_all()

    def wait(self, blocks: list[int] | None = None) -> None:
        with self._lock:
            if blocks is None:
                self._lock.wait_for(lambda: not self._inflight or self._error is not None)
            else:
                self._lock.wait_for(lambda: self._error is not None
                                    or not any(b in self._inflight for b in blocks))
            if self._error is not None:
                raise RuntimeError(f"key {self.key!r}: a staged write failed") from self._error
