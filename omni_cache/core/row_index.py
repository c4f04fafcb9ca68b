"""Index arrays of pool operations (slot mapping or block ids) and the pinned staging ring
through which they reach the GPU.

Thread model: the ring is shared by every cache of the process writing to one device; its
reservations are serialised by a lock. Copies out of the ring are assumed to be enqueued on
the stream current when the ring moves to its other half (one stream per cache, as the
engine uses).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from omni_cache.core.pinned_view import device_pointer

#: entries (int64) of a process's staging ring per device: 4 MiB of pinned memory
STAGING_RING_ENTRIES = 1 << 19
#: arrays of at most this many entries are range-checked on Python ints (cheaper than numpy)
SMALL_ARRAY = 16


def in_range(values: np.ndarray, limit: int) -> bool:
    """Whether every entry of the int array ``values`` (``[n]``) is in ``[0, limit)`` (cheap
    for the few entries of a decode step as for the thousands of a long prefill)."""
    if values.size <= SMALL_ARRAY:
        v = values.tolist()
        return not v or (min(v) >= 0 and max(v) < limit)
    if values.dtype == np.int64:  # negative entries are huge as uint64: one reduction checks both ends
        return bool(values.view(np.uint64).max() < limit)
    return bool(values.min() >= 0 and values.max() < limit)


class RowIndex:
    """int64 indices (a slot mapping or block ids) of one pool operation, kept on the host
    (numpy) and copied at most once to each device that uses them, so the keys of one step
    share a single host -> device copy of their indices.

    ``RowIndex(host)`` takes an int64 numpy array ``[n]``; :meth:`of` also takes a tensor (any
    device) or a sequence of ints; :meth:`split` cuts it into consecutive parts that share the
    parent's device copies. Host -> device copies go through pinned memory, non-blocking
    (stream ordered, never a host synchronisation).
    """

    __slots__ = ("host", "_on_device", "_parent", "_offset", "_checked_limit")

    def __init__(self, host: np.ndarray, parent: RowIndex | None = None, offset: int = 0) -> None:
        self.host = host
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._parent, self._offset = parent, offset
        self._checked_limit: int | None = None  # a limit all indices were checked to be under

    def check(self, limit: int, what: str) -> None:
        """Raise ``IndexError`` unless every index is in ``[0, limit)`` (checked once per
        index, before any device sees it: a bad index on a GPU is a device-side assert)."""
        if self._checked_limit is None or self._checked_limit > limit:
            if not in_range(self.host, limit):
                raise IndexError(f"{what} outside [0, {limit}): {self.host.tolist()[:8]}")
            self._checked_limit = limit

    @classmethod
    def of(cls, index: IndexLike) -> RowIndex:
        """``index`` as a :class:`RowIndex` (a device tensor is also kept as its copy there;
        reading it back to the host synchronises with its device)."""
        if isinstance(index, RowIndex):
            return index
        if isinstance(index, torch.Tensor):
            t = index.reshape(-1).to(torch.int64)
            ix = cls(t.cpu().numpy())
            if t.device.type != "cpu":
                ix._on_device[t.device] = t
            return ix
        return cls(np.asarray(index, dtype=np.int64).reshape(-1))

    def __len__(self) -> int:
        return len(self.host)

    def split(self, sizes: Sequence[int]) -> list[RowIndex]:
        """Consecutive parts of ``sizes`` entries each."""
        parts, offset = [], 0
        for n in sizes:
            parts.append(RowIndex(self.host[offset:offset + n], self, offset))
            offset += n
        return parts

    def on(self, device: torch.device) -> torch.Tensor:
        """The indices as an int64 tensor ``[n]`` on ``device`` (a ``torch.device`` with its
        index)."""
        t = self._on_device.get(device)
        if t is None:
            if self._parent is not None:
                t = self._parent.on(device)[self._offset:self._offset + len(self.host)]
            elif device.type == "cpu":
                t = torch.from_numpy(self.host)
            else:
                t = staging_ring(device).stage(self.host).to(device, non_blocking=True)
            self._on_device[device] = t
        return t


#: an index argument: a :class:`RowIndex`, an int64 tensor (any device), a numpy int array or ints
IndexLike = RowIndex | torch.Tensor | np.ndarray | Sequence[int]


class StagingRing:
    """Pinned host memory for the indices of host -> device copies, reused in two halves.

    Allocating pinned memory per copy is slow (measured ~0.27 ms per ``torch.empty(...,
    pin_memory=True)`` on the H100 machine while copies are in flight) and can synchronise
    with the device. Instead indices are written one after the other into one half of a
    pinned buffer; moving on to the other half records a CUDA event on the current stream
    (every copy out of the half left is enqueued before it) and first waits for the event
    recorded when that other half was last left, normally long complete. Index arrays longer
    than a half get a pinned buffer of their own.

    Attributes:
        half: entries (int64) of one half.
        host: the ring as a numpy int64 array ``[2 * half]`` (the caller fills what it reserved).
    """

    def __init__(self, device: torch.device, entries: int = STAGING_RING_ENTRIES) -> None:
        self.device = device
        self.half = entries // 2
        self._pinned = torch.empty(2 * self.half, dtype=torch.int64, pin_memory=True)
        self.host = self._pinned.numpy()
        self._pos = 0
        self._left: list[torch.cuda.Event | None] = [None, None]  # event recorded on leaving each half
        self._lock = threading.Lock()
        self._device_base: int | None | bool = False  # device address of the ring (False: not looked up yet)

    def stage(self, host: np.ndarray) -> torch.Tensor:
        """A pinned int64 tensor ``[n]`` holding a copy of ``host`` (int64 ``[n]``), valid for
        copies enqueued now."""
        n = len(host)
        if n > self.half:
            return torch.from_numpy(host).pin_memory()
        a = self.reserve(n)
        self.host[a:a + n] = host
        return self._pinned[a:a + n]

    def reserve(self, n: int) -> int:
        """Offset (in int64 entries) of ``n <= half`` consecutive entries of the ring, free
        for the caller to fill (``self.host[a:a + n]``) and for device work enqueued now on the
        current stream to read, by copy or in place (:meth:`device_address`)."""
        with self._lock:
            side = self._pos // self.half
            if self._pos + n > (side + 1) * self.half:  # move on to the other half
                with torch.cuda.device(self.device):
                    event = torch.cuda.Event()
                    event.record()
                self._left[side] = event
                side = 1 - side
                if self._left[side] is not None:
                    self._left[side].synchronize()
                self._pos = side * self.half
            a = self._pos
            self._pos += n
            return a

    def device_address(self, offset: int) -> int | None:
        """The address at which kernels on ``device`` read entry ``offset`` of the ring in
        place (pinned memory is mapped into the GPU's address space), or ``None`` where this
        is not available (see :func:`~omni_cache.core.pinned_view.device_pointer`)."""
        if self._device_base is False:
            self._device_base = device_pointer(self._pinned, self.device)
        return None if self._device_base is None else self._device_base + self._pinned.element_size() * offset


_RINGS: dict[torch.device, StagingRing] = {}


def staging_ring(device: torch.device) -> StagingRing:
    """The process's pinned staging ring for host -> ``device`` (a CUDA device with its index)
    index data."""
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = StagingRing(device)
    return ring
