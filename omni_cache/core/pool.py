"""One cached key's row storage, laid out like the KV cache's slots: :class:`HiddenPool`.

Thread model: a pool is used from one thread (the model runner's); GPU work on its storage is
enqueued on the current CUDA stream; only a pinned-host pool without zero-copy hands writes to
a thread of its own (:class:`~omni_cache.core.committer.HostCommitter`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import torch

from omni_cache.core.committer import HostCommitter
from omni_cache.core.pinned_view import uva_view
from omni_cache.core.row_index import IndexLike, RowIndex


class Tier(enum.Enum):
    """Where a pool's storage lives."""

    DEVICE = "device"  #: on ``device`` (e.g. the GPU running the model)
    PINNED_HOST = "pinned_host"  #: page-locked host memory (plain host memory without CUDA)
    HOST = "host"  #: pageable host memory


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
    (:class:`HostCommitter`) and reads copy runs of consecutive blocks host -> device.
    Host-side accesses (CPU rows written, rows read to the CPU) of blocks with GPU work still
    in flight wait for the device first (:meth:`wait_pending`).

    Index arguments (``slot_mapping``, ``block_ids``) are int64 tensors (any device), numpy arrays,
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
        self.pinned = pin  #: whether the storage is page-locked (pinned) host memory
        self.storage = torch.zeros(
            (num_blocks, block_size, width), dtype=dtype, device=self.device, pin_memory=pin
        )
        self._flat = self.storage.view(num_blocks * block_size, width)
        self._committer: HostCommitter | None = None
        #: ``{flat?: (tensor, its int64-word view)}`` on the storage device
        self._views = {False: (self.storage, _as_words(self.storage)), True: (self._flat, _as_words(self._flat))}
        #: ``{flat?: int64-word numpy view}`` of CPU storage (``None`` where there is none):
        #: CPU writes go through numpy, measured ~5x faster than ``index_copy_`` for 64 KiB blocks
        self._numpy_words = {f: (w.numpy() if w.device.type == "cpu" and w.dtype == torch.int64 else None)
                             for f, (_, w) in self._views.items()}
        self._gpu_views: dict[bool, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.gpu_device: torch.device | None = None  # the CUDA device of a pinned pool
        if pin:
            self.gpu_device = _with_index(device if torch.device(device).type == "cuda" else "cuda")
            view = None if zero_copy is False else uva_view(self.storage, self.gpu_device)
            if view is None and zero_copy:
                raise RuntimeError(f"key {key!r}: no zero-copy view of pinned memory on this machine")
            if view is not None:
                flat = view.view(num_blocks * block_size, width)
                self._gpu_views = {False: (view, _as_words(view)), True: (flat, _as_words(flat))}
        # GPU work on pinned storage not yet known to be complete: sequence number of the last
        # kernel / copy touching each block, and the last number known complete on the host
        self._gpu_work_seq = np.zeros(num_blocks, dtype=np.int64) if pin else None
        self._work_seq = self._synced_seq = 0
        #: ``(sequence number, block ids)`` of GPU work noted but not yet in ``_gpu_work_seq``
        #: (:meth:`note_gpu_work` with ``owned``), oldest first
        self._gpu_notes: list[tuple[int, np.ndarray]] = []

    @property
    def zero_copy(self) -> bool:
        """Whether the GPU reads and writes this pinned pool directly (:func:`uva_view`)."""
        return self._gpu_views is not None

    @property
    def gpu_storage(self) -> torch.Tensor | None:
        """The storage ``[num_blocks, block_size, width]`` as the GPU sees it: the storage itself
        for ``Tier.DEVICE``, its zero-copy view on ``gpu_device`` for a zero-copy pinned pool,
        else ``None``."""
        if self.tier is Tier.DEVICE:
            return self.storage
        return None if self._gpu_views is None else self._gpu_views[False][0]

    @property
    def nbytes(self) -> int:
        """Storage size in bytes."""
        return self.storage.numel() * self.storage.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row (``width * itemsize``)."""
        return self.width * self.dtype.itemsize

    # -- writes ----------------------------------------------------------------
    def write(self, slot_mapping: IndexLike, rows: torch.Tensor) -> None:
        """Store ``rows`` (``[n, width]``, any float dtype, cast to ``dtype``) at ``slot_mapping``
        (``[n]``).

        Host -> device copies use ``non_blocking=True`` (stream-ordered, no host sync). A
        pinned-host pool fed from a CUDA device is written by a kernel over PCIe (zero-copy),
        or else staged and committed by a thread (reads of those blocks wait for it). A
        pageable ``HOST`` pool fed from a device copies synchronously.

        Raises:
            ValueError: ``rows`` is not ``[len(slot_mapping), width]``.
            IndexError: a slot outside ``[0, num_blocks * block_size)`` (nothing written).
            RuntimeError: an earlier staged write of this pool failed.
        """
        ix = RowIndex.of(slot_mapping)
        if rows.shape != (len(ix.host), self.width):
            raise ValueError(
                f"key {self.key!r}: rows of shape {tuple(rows.shape)} do not match "
                f"[{len(ix)}, {self.width}]"
            )
        self._store(ix, rows, flat=True)

    def write_blocks(self, block_ids: IndexLike, rows: torch.Tensor) -> None:
        """Store whole blocks: ``rows`` ``[k * block_size, width]`` fill blocks ``block_ids``
        (``[k]``) in order. One slab per block instead of one row per token (the fast path for
        prefill steps and every prefix-hit read).

        Raises:
            ValueError: ``rows`` is not ``[len(block_ids) * block_size, width]``.
            IndexError: a block id outside ``[0, num_blocks)`` (nothing written).
            RuntimeError: an earlier staged write of this pool failed.
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
        ix.check(len(self._flat) if flat else self.num_blocks, "slot mapping" if flat else "block ids")
        pinned = self._gpu_work_seq is not None
        if pinned and rows.device.type == "cuda":  # pinned storage fed from the GPU
            if self._gpu_views is None:
                self._stage(ix, rows, flat)
                return
            dst, words = self._gpu_views[flat]  # zero-copy
            self.note_gpu_work(self._blocks(ix, flat))
        else:
            if pinned:
                self.wait_pending(self._blocks(ix, flat))
            dst, words = self._views[flat]
        device = dst.device
        src = rows if rows.dtype == self.dtype and rows.device == device else rows.to(
            device, self.dtype, non_blocking=device.type != "cpu")
        numpy_words = self._numpy_words[flat] if device.type == "cpu" else None
        if numpy_words is not None:  # CPU storage: numpy fancy assignment of int64 words
            try:
                src_words = src.detach().view(torch.int64)
            except RuntimeError:
                src_words = None
            if src_words is not None:
                numpy_words[ix.host] = src_words.numpy().reshape(len(ix.host), *numpy_words.shape[1:])
                return
        _index_copy(dst, words, ix.on(device), src)

    def _stage(self, ix: RowIndex, rows: torch.Tensor, flat: bool) -> None:
        """``rows`` (on a CUDA device) into this pinned pool without zero-copy: staged and
        committed by a thread (:class:`~omni_cache.core.committer.HostCommitter`)."""
        if self._committer is None:
            self._committer = HostCommitter(self.key)
        dst = self._flat if flat else self.storage
        src = rows.to(self.dtype)
        self._committer.submit(dst, torch.from_numpy(ix.host.copy()), src.view(-1, *dst.shape[1:]),
                               np.unique(self._blocks(ix, flat)).tolist())

    # -- GPU work in flight on pinned storage ------------------------------------
    #: Owned notes kept before they are applied to ``_gpu_work_seq`` at once (bounds their memory).
    notes_max = 32

    def note_gpu_work(self, blocks: np.ndarray, owned: bool = False) -> None:
        """GPU work on ``blocks`` (block ids, int64 ``[k]``) of this pinned pool's storage was
        just enqueued (by the pool, or by a kernel that writes :attr:`gpu_storage`).

        ``owned``: ``blocks`` is an array the caller will not modify, kept as it is and applied
        to ``_gpu_work_seq`` only when :meth:`wait_pending` needs it (a list append instead of a
        scatter on the write's path); notes are applied in order, so ``_gpu_work_seq`` ends up
        the same."""
        self._work_seq += 1
        if owned and len(self._gpu_notes) < self.notes_max:
            self._gpu_notes.append((self._work_seq, blocks))
            return
        self._apply_notes()
        self._gpu_work_seq[blocks] = self._work_seq

    def _apply_notes(self) -> None:
        notes = self._gpu_notes
        if notes:
            if self._synced_seq == self._work_seq:  # all of it complete: entries <= _synced_seq never wait
                notes.clear()
                return
            for seq, blocks in notes:
                self._gpu_work_seq[blocks] = seq
            notes.clear()

    def wait_pending(self, block_ids: np.ndarray | Sequence[int] | None = None) -> None:
        """Block until GPU work on this pool's pinned storage (zero-copy writes and reads,
        staged writes) has finished: all of it, or only that touching ``block_ids`` (in
        practice: up to the last such work). The only host wait of a pinned-host pool, needed
        only when the host itself touches blocks the GPU is still working on (rows read to
        the CPU, CPU rows written, e.g. a CPU read of rows written in the same step). Waiting
        for zero-copy work synchronises the GPU device. No-op for other tiers.

        Raises:
            RuntimeError: a staged write of this pool failed.
        """
        if self._committer is not None:
            self._committer.wait(None if block_ids is None else np.asarray(block_ids).tolist())
        if self._work_seq == self._synced_seq:
            self._gpu_notes.clear()
            return
        if block_ids is not None:
            self._apply_notes()
            blocks = np.asarray(block_ids, dtype=np.int64)
            if not blocks.size or self._gpu_work_seq[blocks].max() <= self._synced_seq:
                return
        torch.cuda.synchronize(self.gpu_device)
        self._synced_seq = self._work_seq
        self._gpu_notes.clear()

    # -- reads -----------------------------------------------------------------
    def gather_blocks(self, block_ids: IndexLike, out_device: torch.device | str | None = None) -> torch.Tensor:
        """Rows of whole blocks ``block_ids`` (``[k]``) in order: ``[k * block_size, width]`` of
        ``dtype`` on ``out_device`` (default: the storage device). A pinned pool read to the GPU
        moves only these blocks, host -> device, without CPU work.

        Raises:
            IndexError: a block id outside ``[0, num_blocks)``.
            RuntimeError: a staged write of this pool failed.
        """
        return self._load(RowIndex.of(block_ids), out_device, flat=False).view(-1, self.width)

    def gather(self, slot_mapping: IndexLike, out_device: torch.device | str | None = None) -> torch.Tensor:
        """Copy of the rows at ``slot_mapping`` (``[n]``): ``[n, width]`` of ``dtype`` on
        ``out_device`` (default: the storage device).

        Raises:
            IndexError: a slot outside ``[0, num_blocks * block_size)``.
            RuntimeError: a staged write of this pool failed.
        """
        return self._load(RowIndex.of(slot_mapping), out_device, flat=True)

    def _load(self, ix: RowIndex, out_device, flat: bool) -> torch.Tensor:
        ix.check(len(self._flat) if flat else self.num_blocks, "slot mapping" if flat else "block ids")
        if self._gpu_work_seq is None:  # DEVICE / HOST tier: read on the storage device
            out = self._views[flat][0].index_select(0, ix.on(self.device))
            return out if out_device is None else out.to(_with_index(out_device))
        out_device = self.device if out_device is None else _with_index(out_device)
        if out_device.type == "cuda":  # pinned storage read by the GPU
            if self._committer is not None:
                self._committer.wait(np.unique(self._blocks(ix, flat)).tolist())
            if self._gpu_views is not None:
                src = self._gpu_views[flat][0]
                out = src.index_select(0, ix.on(src.device))
            else:
                out = self._copy_runs(ix, flat, out_device)
            self.note_gpu_work(self._blocks(ix, flat))
            return out.to(out_device)
        self.wait_pending(self._blocks(ix, flat))  # pinned storage read by the CPU
        return self._views[flat][0].index_select(0, ix.on(self.device)).to(out_device)

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
