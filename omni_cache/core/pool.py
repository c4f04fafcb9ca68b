"""One cached key's row storage, laid out like the KV cache's slots."""

from __future__ import annotations

import ctypes
import enum
import queue
import threading
from collections.abc import Sequence

import numpy as np
import torch

from omni_cache.core.ledger import in_range


class Tier(enum.Enum):
    """Where a pool's storage lives."""

    DEVICE = "device"  #: on ``device`` (e.g. the GPU running the model)
    PINNED_HOST = "pinned_host"  #: page-locked host memory (plain host memory without CUDA)
    HOST = "host"  #: pageable host memory


class RowIndex:
    """int64 indices (slot ids or block ids) of one pool operation, kept on the host (numpy)
    and copied at most once to each device that uses them, so the keys of one step share a
    single host -> device copy of their indices.

    ``RowIndex(host)`` takes an int64 numpy array; :meth:`of` also takes a tensor (any device)
    or a sequence of ints; :meth:`split` cuts it into consecutive parts that share the parent's
    device copies. Host -> device copies go through pinned memory, non-blocking (stream
    ordered, never a host synchronisation).
    """

    __slots__ = ("host", "_dev", "_parent", "_offset", "_bound")

    def __init__(self, host: np.ndarray, _parent: RowIndex | None = None, _offset: int = 0) -> None:
        self.host = host
        self._dev: dict[torch.device, torch.Tensor] = {}
        self._parent, self._offset = _parent, _offset
        self._bound: int | None = None  # a limit all indices were checked to be under

    def check(self, limit: int, what: str) -> None:
        """Raise ``IndexError`` unless every index is in ``[0, limit)`` (checked once per
        index, before any device sees it: a bad index on a GPU is a device-side assert)."""
        if self._bound is None or self._bound > limit:
            if not in_range(self.host, limit):
                raise IndexError(f"{what} outside [0, {limit}): {self.host.tolist()[:8]}")
            self._bound = limit

    @classmethod
    def of(cls, index: RowIndex | torch.Tensor | np.ndarray | Sequence[int]) -> RowIndex:
        """``index`` as a :class:`RowIndex` (a device tensor is also kept as its copy there;
        reading it back to the host synchronises with its device)."""
        if isinstance(index, RowIndex):
            return index
        if isinstance(index, torch.Tensor):
            t = index.reshape(-1).to(torch.int64)
            ix = cls(t.cpu().numpy())
            if t.device.type != "cpu":
                ix._dev[t.device] = t
            return ix
        return cls(np.asarray(index, dtype=np.int64).reshape(-1))

    def __len__(self) -> int:
        return len(self.host)

    def split(self, sizes: Sequence[int]) -> list[RowIndex]:
        """Consecutive parts of ``sizes`` entries each."""
        parts, o = [], 0
        for n in sizes:
            parts.append(RowIndex(self.host[o:o + n], self, o))
            o += n
        return parts

    def on(self, device: torch.device) -> torch.Tensor:
        """The indices as an int64 tensor on ``device`` (a ``torch.device`` with its index)."""
        t = self._dev.get(device)
        if t is None:
            if self._parent is not None:
                t = self._parent.on(device)[self._offset:self._offset + len(self.host)]
            elif device.type == "cpu":
                t = torch.from_numpy(self.host)
            else:
                t = staging_ring(device).stage(self.host).to(device, non_blocking=True)
            self._dev[device] = t
        return t


class _StagingRing:
    """Pinned host memory for the indices of host -> device copies, reused in two halves.

    Allocating pinned memory per copy is slow (measured ~0.27 ms per ``torch.empty(...,
    pin_memory=True)`` on the H100 machine while copies are in flight) and can synchronise
    with the device. Instead indices are written one after the other into one half of a
    pinned buffer; moving on to the other half records a CUDA event on the current stream
    (every copy out of the half left is enqueued before it) and first waits for the event
    recorded when that other half was last left, normally long complete. Copies are assumed
    to be enqueued on the stream current at the switch (one stream per cache, as the engine
    uses). Index arrays longer than a half get a pinned buffer of their own.
    """

    def __init__(self, device: torch.device, entries: int = 1 << 19) -> None:
        self.device = device
        self.half = entries // 2
        self.buf = torch.empty(2 * self.half, dtype=torch.int64, pin_memory=True)
        self.np = self.buf.numpy()
        self.pos = 0
        self.left: list[torch.cuda.Event | None] = [None, None]
        self.lock = threading.Lock()
        self.dev_base: int | None | bool = False  # device address of buf (False: not looked up yet)

    def stage(self, host: np.ndarray) -> torch.Tensor:
        """A pinned int64 tensor holding a copy of ``host``, valid for copies enqueued now."""
        n = len(host)
        if n > self.half:
            return torch.from_numpy(host).pin_memory()
        a = self.reserve(n)
        self.np[a:a + n] = host
        return self.buf[a:a + n]

    def reserve(self, n: int) -> int:
        """Offset (in int64 entries) of ``n <= half`` consecutive entries of the ring, free
        for the caller to fill (``self.np[a:a + n]``) and for device work enqueued now on the
        current stream to read, by copy or in place (:meth:`device_address`)."""
        with self.lock:
            side = self.pos // self.half
            if self.pos + n > (side + 1) * self.half:  # move on to the other half
                with torch.cuda.device(self.device):
                    event = torch.cuda.Event()
                    event.record()
                self.left[side] = event
                side = 1 - side
                if self.left[side] is not None:
                    self.left[side].synchronize()
                self.pos = side * self.half
            a = self.pos
            self.pos += n
            return a

    def device_address(self, offset: int) -> int | None:
        """The address at which kernels on ``device`` read entry ``offset`` of the ring in
        place (pinned memory is mapped into the GPU's address space), or ``None`` where this
        is not available (see :func:`device_pointer`)."""
        if self.dev_base is False:
            self.dev_base = device_pointer(self.buf, self.device)
        return None if self.dev_base is None else self.dev_base + 8 * offset


_RINGS: dict[torch.device, _StagingRing] = {}


def staging_ring(device: torch.device) -> _StagingRing:
    """The process's pinned staging ring for host -> ``device`` (a CUDA device with its index)
    index data."""
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = _StagingRing(device)
    return ring


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[..., width]`` viewed as int64 words ``[..., width * itemsize / 8]`` (the same
    bytes), or ``t`` itself when that view does not exist (odd row bytes, strides, alignment).
    Row copies through int64 words are bit-exact and, for 2-byte dtypes, measured 1.9x faster
    for ``index_copy_`` on an H100 (``benchmarks/results/pool_gpu_h100.json``)."""
    if t.dtype == torch.int64:
        return t
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return t


def _index_copy(dst: torch.Tensor, dst_words: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` through int64 words where both sides have them;
    ``src`` is ``[n, width]`` rows, viewed as ``[len(index), *dst.shape[1:]]``."""
    if dst_words.dtype != dst.dtype:
        try:
            words = src.view(torch.int64)
        except RuntimeError:  # row bytes, strides or alignment do not allow int64 words
            words = None
        if words is not None:
            if dst_words.dim() > 2:
                words = words.view(-1, *dst_words.shape[1:])
            dst_words.index_copy_(0, index, words)
            return
    dst.index_copy_(0, index, src.view(-1, *dst.shape[1:]) if dst.dim() > 2 else src)


# -- UVA view of pinned host memory -------------------------------------------------------
# A DLPack capsule (the array interchange standard) describing the pinned pages as CUDA
# memory at their device address. Pinned memory from cudaHostAlloc (torch's pin_memory) is
# mapped into every device's address space under unified virtual addressing; the CUDA
# driver's cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER) gives that address.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DLDeleter)]
_DL_KCUDA, _DL_UINT = 2, 1
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
#: address of a live capsule's struct -> (struct, shape array, pinned tensor it aliases)
_UVA_LIVE: dict[int, tuple] = {}


@_DLDeleter
def _uva_release(managed) -> None:  # called by torch (GIL held) when the view's storage dies
    _UVA_LIVE.pop(ctypes.addressof(managed.contents), None)


def device_pointer(pinned: torch.Tensor, device: torch.device) -> int | None:
    """The address (an int) at which kernels on the CUDA ``device`` reach the first byte of
    the pinned host tensor ``pinned`` (``cuPointerGetAttribute``), or ``None`` where there is
    none (not pinned, ROCm, no CUDA driver library)."""
    if torch.version.hip is not None or not pinned.is_pinned():
        return None
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        get_attr = libcuda.cuPointerGetAttribute
    except (OSError, AttributeError):
        return None
    get_attr.restype = ctypes.c_int
    get_attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    dev_ptr = ctypes.c_uint64(0)
    with torch.cuda.device(device):
        rc = get_attr(ctypes.byref(dev_ptr), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER, pinned.data_ptr())
    return dev_ptr.value if rc == 0 and dev_ptr.value else None


def uva_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` aliasing the contiguous pinned host tensor ``pinned`` (same
    shape and dtype): kernels read and write it over PCIe, no copy engine, no host work.

    The view keeps ``pinned`` alive. Returns ``None`` where this is not available (no CUDA
    driver library, ROCm, memory the driver does not know as pinned).
    """
    if not pinned.is_contiguous():
        return None
    dev_ptr = device_pointer(pinned, device)
    if dev_ptr is None:
        return None
    shape = (ctypes.c_int64 * 1)(pinned.numel() * pinned.element_size())
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(dev_ptr, _DLDevice(_DL_KCUDA, device.index), 1,
                                  _DLDataType(_DL_UINT, 8, 1), shape, None, 0)
    managed.deleter = _uva_release
    _UVA_LIVE[ctypes.addressof(managed)] = (managed, shape, pinned)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    raw = torch.from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))
    return raw.view(pinned.dtype).view(pinned.shape)


class HiddenPool:
    """Rows of one cached tensor key, indexed by KV slot id.

    Storage is ``[num_blocks, block_size, width]`` of ``dtype``; its flat view
    ``[num_blocks * block_size, width]`` has row ``slot_id`` = the KV slot of that token,
    so a request's block table addresses its rows exactly as it addresses its KV.

    Invariant: the pool never decides validity; :class:`~omni_cache.core.ledger.BlockLedger`
    says which rows may be served. The storage device is ``device`` for ``Tier.DEVICE`` and
    the CPU for host tiers.

    A ``PINNED_HOST`` pool on a CUDA machine is also visible to the GPU ``device`` (default:
    the current CUDA device) through :func:`uva_view` (``zero_copy``: ``None`` = where
    available, ``False`` = never, ``True`` = required, else ``RuntimeError``): writes of rows
    that live on the GPU and reads towards the GPU are single kernels on the current stream
    that move only the touched rows over PCIe (no staging, no CPU copy, no host wait).
    Without it, writes from the GPU are staged and committed by a thread
    (:class:`_HostCommitter`) and reads copy runs of consecutive blocks host -> device.
    Host-side accesses (CPU rows written, rows read to the CPU) of blocks with GPU work still
    in flight wait for the device first (:meth:`wait_pending`).

    Index arguments (``slot_ids``, ``block_ids``) are int64 tensors (any device), numpy arrays,
    sequences of ints or :class:`RowIndex`.
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
        zero_copy: bool | None = None,
    ) -> None:
        self.key = key
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.width = width
        self.dtype = dtype
        self.tier = tier
        self.device = _with_index(device) if tier is Tier.DEVICE else torch.device("cpu")
        pin = tier is Tier.PINNED_HOST and torch.cuda.is_available()
        self.storage = torch.zeros(
            (num_blocks, block_size, width), dtype=dtype, device=self.device, pin_memory=pin
        )
        self._flat = self.storage.view(num_blocks * block_size, width)
        self._committer: _HostCommitter | None = None
        #: ``{flat?: (tensor, its int64-word view)}`` on the storage device
        self._dst = {False: (self.storage, _as_words(self.storage)), True: (self._flat, _as_words(self._flat))}
        #: ``{flat?: int64-word numpy view}`` of CPU storage (``None`` where there is none):
        #: CPU writes go through numpy, measured ~5x faster than ``index_copy_`` for 64 KiB blocks
        self._np_words = {f: (w.numpy() if w.device.type == "cpu" and w.dtype == torch.int64 else None)
                          for f, (_, w) in self._dst.items()}
        self._gpu_dst: dict[bool, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.gpu_device: torch.device | None = None  # the CUDA device of a pinned pool
        if pin:
            self.gpu_device = _with_index(device if torch.device(device).type == "cuda" else "cuda")
            view = None if zero_copy is False else uva_view(self.storage, self.gpu_device)
            if view is None and zero_copy:
                raise RuntimeError(f"key {key!r}: no zero-copy view of pinned memory on this machine")
            if view is not None:
                flat = view.view(num_blocks * block_size, width)
                self._gpu_dst = {False: (view, _as_words(view)), True: (flat, _as_words(flat))}
        # GPU work on pinned storage not yet known to be complete: sequence number of the last
        # kernel / copy touching each block, and the last number known complete on the host
        self._gpu_seq = np.zeros(num_blocks, dtype=np.int64) if pin else None
        self._seq = self._synced = 0
        #: ``(sequence number, block ids)`` of GPU work noted but not yet in ``_gpu_seq``
        #: (:meth:`_note_gpu` with ``owned``), oldest first
        self._gpu_notes: list[tuple[int, np.ndarray]] = []

    @property
    def zero_copy(self) -> bool:
        """Whether the GPU reads and writes this pinned pool directly (:func:`uva_view`)."""
        return self._gpu_dst is not None

    @property
    def nbytes(self) -> int:
        """Storage size in bytes."""
        return self.storage.numel() * self.storage.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row (``width * itemsize``)."""
        return self.width * self.dtype.itemsize

    # -- writes ----------------------------------------------------------------
    def write(self, slot_ids, rows: torch.Tensor) -> None:
        """Store ``rows`` (``[n, width]``, any float dtype, cast to ``dtype``) at ``slot_ids``
        (``[n]``).

        Host -> device copies use ``non_blocking=True`` (stream-ordered, no host sync). A
        pinned-host pool fed from a CUDA device is written by a kernel over PCIe (zero-copy),
        or else staged and committed by a thread (reads of those blocks wait for it). A
        pageable ``HOST`` pool fed from a device copies synchronously.

        Raises:
            ValueError: ``rows`` is not ``[len(slot_ids), width]``.
        """
        ix = RowIndex.of(slot_ids)
        if rows.shape != (len(ix.host), self.width):
            raise ValueError(
                f"key {self.key!r}: rows of shape {tuple(rows.shape)} do not match "
                f"[{len(ix)}, {self.width}]"
            )
        self._store(ix, rows, flat=True)

    def write_blocks(self, block_ids, rows: torch.Tensor) -> None:
        """Store whole blocks: ``rows`` ``[k * block_size, width]`` fill blocks ``block_ids``
        (``[k]``) in order. One slab per block instead of one row per token (the fast path for
        prefill steps and every prefix-hit read).

        Raises:
            ValueError: ``rows`` is not ``[len(block_ids) * block_size, width]``.
        """
        ix = RowIndex.of(block_ids)
        if rows.shape != (len(ix.host) * self.block_size, self.width):
            raise ValueError(f"key {self.key!r}: rows of shape {tuple(rows.shape)} do not fill "
                             f"{len(ix.host)} blocks of [{self.block_size}, {self.width}]")
        self._store(ix, rows, flat=False)

    def _blocks(self, ix: RowIndex, flat: bool) -> np.ndarray:
        return ix.host // self.block_size if flat else ix.host

    def _store(self, ix: RowIndex, rows: torch.Tensor, flat: bool) -> None:
        """``rows`` ``[n, width]`` into the slots (``flat``) or blocks of ``ix``."""
        ix.check(len(self._flat) if flat else self.num_blocks, "slot ids" if flat else "block ids")
        if rows.device.type == "cuda" and self._gpu_dst is not None:  # zero-copy from the GPU
            dst, words = self._gpu_dst[flat]
            self._note_gpu(self._blocks(ix, flat))
        elif self._staged(rows):
            dst = self._flat if flat else self.storage
            src = rows.to(self.dtype)
            self._committer.submit(dst, torch.from_numpy(ix.host.copy()), src.view(-1, *dst.shape[1:]),
                                   np.unique(self._blocks(ix, flat)).tolist())
            return
        else:
            if self._gpu_seq is not None:
                self.wait_pending(self._blocks(ix, flat))
            dst, words = self._dst[flat]
        device = dst.device
        src = rows if rows.dtype == self.dtype and rows.device == device else rows.to(
            device, self.dtype, non_blocking=device.type != "cpu")
        np_words = self._np_words[flat] if device.type == "cpu" else None
        if np_words is not None:  # CPU storage: numpy fancy assignment of int64 words
            try:
                src_words = src.detach().view(torch.int64)
            except RuntimeError:
                src_words = None
            if src_words is not None:
                np_words[ix.host] = src_words.numpy().reshape(len(ix.host), *np_words.shape[1:])
                return
        _index_copy(dst, words, ix.on(device), src)

    def _staged(self, rows: torch.Tensor) -> bool:
        """Whether a write of ``rows`` goes through the asynchronous device->host staging
        path (a pinned-host pool without zero-copy, fed from a CUDA device)."""
        if rows.device.type != "cuda" or self._gpu_seq is None:
            return False
        if self._committer is None:
            self._committer = _HostCommitter(self.key)
        return True

    # -- GPU work in flight on pinned storage ------------------------------------
    #: Owned notes kept before they are applied to ``_gpu_seq`` at once (bounds their memory).
    notes_max = 32

    def _note_gpu(self, blocks: np.ndarray, owned: bool = False) -> None:
        """GPU work on ``blocks`` (block ids) was just enqueued. ``owned``: ``blocks`` is an
        array the caller will not modify, kept as it is and applied to ``_gpu_seq`` only when
        :meth:`wait_pending` needs it (a list append instead of a scatter on the write's
        path); notes are applied in order, so ``_gpu_seq`` ends up the same."""
        self._seq += 1
        if owned and len(self._gpu_notes) < self.notes_max:
            self._gpu_notes.append((self._seq, blocks))
            return
        self._apply_notes()
        self._gpu_seq[blocks] = self._seq

    def _apply_notes(self) -> None:
        notes = self._gpu_notes
        if notes:
            if self._synced == self._seq:  # all of it complete: entries <= _synced never wait
                notes.clear()
                return
            for seq, blocks in notes:
                self._gpu_seq[blocks] = seq
            notes.clear()

    def wait_pending(self, block_ids=None) -> None:
        """Block until GPU work on this pool's pinned storage (zero-copy writes and reads,
        staged writes) has finished: all of it, or only that touching ``block_ids`` (in
        practice: up to the last such work). The only host wait of a pinned-host pool, needed
        only when the host itself touches blocks the GPU is still working on (rows read to
        the CPU, CPU rows written, e.g. a CPU read of rows written in the same step). Waiting
        for zero-copy work synchronises the GPU device. No-op for other tiers."""
        if self._committer is not None:
            self._committer.wait(None if block_ids is None else np.asarray(block_ids).tolist())
        if self._seq == self._synced:
            self._gpu_notes.clear()
            return
        if block_ids is not None:
            self._apply_notes()
            blocks = np.asarray(block_ids, dtype=np.int64)
            if not blocks.size or self._gpu_seq[blocks].max() <= self._synced:
                return
        torch.cuda.synchronize(self.gpu_device)
        self._synced = self._seq
        self._gpu_notes.clear()

    # -- reads -----------------------------------------------------------------
    def gather_blocks(self, block_ids, out_device: torch.device | str | None = None) -> torch.Tensor:
        """Rows of whole blocks ``block_ids`` (``[k]``) in order: ``[k * block_size, width]`` of
        ``dtype`` on ``out_device`` (default: the storage device). A pinned pool read to the GPU
        moves only these blocks, host -> device, without CPU work."""
        return self._load(RowIndex.of(block_ids), out_device, flat=False).view(-1, self.width)

    def gather(self, slot_ids, out_device: torch.device | str | None = None) -> torch.Tensor:
        """Copy of the rows at ``slot_ids`` (``[n]``): ``[n, width]`` of ``dtype`` on
        ``out_device`` (default: the storage device)."""
        return self._load(RowIndex.of(slot_ids), out_device, flat=True)

    def _load(self, ix: RowIndex, out_device, flat: bool) -> torch.Tensor:
        ix.check(len(self._flat) if flat else self.num_blocks, "slot ids" if flat else "block ids")
        if self._gpu_seq is None:  # DEVICE / HOST tier: read on the storage device
            out = self._dst[flat][0].index_select(0, ix.on(self.device))
            return out if out_device is None else out.to(_with_index(out_device))
        out_device = self.device if out_device is None else _with_index(out_device)
        if out_device.type == "cuda":  # pinned storage read by the GPU
            if self._committer is not None:
                self._committer.wait(np.unique(self._blocks(ix, flat)).tolist())
            if self._gpu_dst is not None:
                src = self._gpu_dst[flat][0]
                out = src.index_select(0, ix.on(src.device))
            else:
                out = self._copy_runs(ix, flat, out_device)
            self._note_gpu(self._blocks(ix, flat))
            return out.to(out_device)
        self.wait_pending(self._blocks(ix, flat))  # pinned storage read by the CPU
        return self._dst[flat][0].index_select(0, ix.on(self.device)).to(out_device)

    def _copy_runs(self, ix: RowIndex, flat: bool, out_device: torch.device) -> torch.Tensor:
        """Without zero-copy: one non-blocking host -> device copy per run of consecutive
        indices, straight from the pinned storage."""
        src = self._flat if flat else self.storage
        out = torch.empty((len(ix),) + tuple(src.shape[1:]), dtype=self.dtype, device=out_device)
        h = ix.host
        cuts = (np.flatnonzero(np.diff(h) != 1) + 1).tolist()
        for a, b in zip([0] + cuts, cuts + [len(h)]):
            out[a:b].copy_(src[int(h[a]):int(h[a]) + b - a], non_blocking=True)
        return out


def _with_index(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _HostCommitter:
    """Asynchronous device->host writes of one pinned-host pool without zero-copy.

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
