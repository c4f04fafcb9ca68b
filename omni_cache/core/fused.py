"""One kernel launch for all keys' rows of a request's step (Triton, optional).

A step's write touches consecutive blocks of the request's block table (``units`` of them):
rows from in-block offset ``first_off`` of the first block to ``last_end`` of the last, whole
blocks between. :class:`StepWriter` copies them for every key of the step with one launch of
a Triton kernel (``grid = (blocks, keys)``, one program per (block, key): one contiguous run
of ``(hi - lo) * row_bytes`` bytes from the key's rows to its pool block), instead of an index
copy plus, per key, views and one or more ``index_copy_`` launches. Its arguments (a table of
the keys' source / destination addresses and row sizes, and the block ids) are written into
the pinned staging ring (:func:`~omni_cache.core.row_index.staging_ring`) and read by the kernel in
place over PCIe: no host -> device copy, no other launch. Bytes move as int64 words, so the
copy is bit-exact.

Triton is imported only when a CUDA write first asks for this path; where it is missing (or
``OMNI_CACHE_FUSED=0``, or a launch fails) the pools' torch path is used (same results).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from omni_cache import settings
from omni_cache.core.pool import HiddenPool, Tier
from omni_cache.core.row_index import staging_ring

log = logging.getLogger(__name__)

#: int64 words each program copies per loop iteration
CHUNK = 1024
#: warps per program
NUM_WARPS = 4
#: bytes of an int64 word: rows move as words, so row sizes and addresses are multiples of it
WORD_BYTES = 8
#: int64 entries of the kernel's argument table per key: (source, destination, row words)
TABLE_WORDS_PER_KEY = 3

_KERNEL: list = []  # [the JIT kernel or None], filled on first use
_SLOTS_KERNEL: list = []  # [the scatter kernel or None], filled on first use
_INTERPRET: list = []  # [whether TRITON_INTERPRET=1], read with the kernel (Triton reads it at import)
_WARMED: dict = {}  # device -> warm_up's result on it


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tab", "ids", "n_units", "first_off", "last_end", "block_size"])
    def write_step_rows(tab, ids, n_units, first_off, last_end, block_size, CHUNK: tl.constexpr):
        """Program (u, k): rows of key k for block unit u (see the module docstring).

        ``tab``: address of int64 ``[keys, 3]`` = (source address, destination address, row
        words) per key, the source ``[n, row_words]`` int64 words of the step's rows
        (contiguous), the destination the pool's ``[num_blocks * block_size, row_words]``;
        ``ids``: address of int64 ``[n_units]`` block ids. Addresses are device addresses.
        """
        u = tl.program_id(0)
        k = tl.program_id(1)
        t = tab.to(tl.pointer_type(tl.int64)) + 3 * k
        src = tl.load(t).to(tl.pointer_type(tl.int64))
        dst = tl.load(t + 1).to(tl.pointer_type(tl.int64))
        rw = tl.load(t + 2)
        blk = tl.load(ids.to(tl.pointer_type(tl.int64)) + u)
        lo = tl.where(u == 0, first_off, 0)
        hi = tl.where(u == n_units - 1, last_end, block_size)
        src = src + (u * block_size + lo - first_off).to(tl.int64) * rw
        dst = dst + (blk * block_size + lo) * rw
        total = (hi - lo).to(tl.int64) * rw
        for c in range(0, total, CHUNK):
            o = c + tl.arange(0, CHUNK)
            m = o < total
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)

    return write_step_rows


def _build_slots_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["tab", "slots", "n_rows"])
    def write_slot_rows(tab, slots, n_rows, CHUNK: tl.constexpr):
        """Program (r, k): row ``r`` of key ``k`` to the pool row at slot ``slots[r]``.

        ``tab``: as :func:`_build_kernel`'s (source, destination, row words per key);
        ``slots``: address of int64 ``[n_rows]`` slot ids (checked in range by the caller).
        """
        r = tl.program_id(0)
        k = tl.program_id(1)
        t = tab.to(tl.pointer_type(tl.int64)) + 3 * k
        src = tl.load(t).to(tl.pointer_type(tl.int64))
        dst = tl.load(t + 1).to(tl.pointer_type(tl.int64))
        rw = tl.load(t + 2)
        slot = tl.load(slots.to(tl.pointer_type(tl.int64)) + r)
        src = src + r.to(tl.int64) * rw
        dst = dst + slot * rw
        for c in range(0, rw, CHUNK):
            o = c + tl.arange(0, CHUNK)
            m = o < rw
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)

    return write_slot_rows


def slots_kernel():
    """The scatter kernel (one program per row and key: a decode step's rows, one per request,
    to their slots), or ``None`` as :func:`kernel`."""
    if not _SLOTS_KERNEL:
        k = None
        if kernel() is not None:
            try:
                k = _build_slots_kernel()
            except Exception as exc:
                log.info("omni-cache: fused slot writes unavailable (%s); using index_copy_", exc)
        _SLOTS_KERNEL.append(k)
    return _SLOTS_KERNEL[0]


def launch_slots(tab: int, slots: int, n_rows: int, n_keys: int, stream: int | None = None) -> None:
    """Enqueue :func:`slots_kernel` on ``stream`` (as :func:`launch`)."""
    k = slots_kernel()
    grid = (n_rows, n_keys)
    if stream is None or _INTERPRET[0]:
        k[grid](tab, slots, n_rows, CHUNK=CHUNK, num_warps=NUM_WARPS)
        return
    _Launcher.get(k).launch(grid, stream, tab, slots, n_rows)


def kernel():
    """The Triton kernel, or ``None`` where Triton cannot be imported or ``OMNI_CACHE_FUSED``
    is ``0``. Imports Triton on the first call only."""
    if not _KERNEL:
        k = None
        if settings.FUSED.get() != "0":
            try:
                k = _build_kernel()
            except Exception as exc:  # ImportError, or a Triton too old for this kernel
                log.info("omni-cache: fused step writes unavailable (%s); using index_copy_", exc)
        _KERNEL.append(k)
        _INTERPRET.append(os.environ.get("TRITON_INTERPRET") == "1")
    return _KERNEL[0]


def launch(tab: int, ids: int, n_units: int, first_off: int, last_end: int, block_size: int,
           n_keys: int, stream: int | None = None) -> None:
    """Enqueue the kernel on ``stream`` (a raw CUDA stream handle; default: the current
    stream of the current device). Addresses (ints) as in the kernel's docstring; also runs
    under ``TRITON_INTERPRET=1`` with CPU addresses (tests)."""
    k = kernel()
    grid = (n_units, n_keys)
    if stream is None or _INTERPRET[0]:
        k[grid](tab, ids, n_units, first_off, last_end, block_size, CHUNK=CHUNK, num_warps=NUM_WARPS)
        return
    _Launcher.get(k).launch(grid, stream, tab, ids, n_units, first_off, last_end, block_size)


def warm_up(device: torch.device | str, block_size: int = 16) -> bool:
    """Compile the kernel now and check it, instead of at the first step write (a request's
    TTFT): on a cold Triton cache the JIT took seconds on the first request on an H200
    (``docs/gpu.md``). Copies a known ``[3 * block_size, 3]`` int64 pattern (three keys of 3,
    1 and 2 words a row, a write that starts mid-block and ends mid-block over three blocks,
    one of them out of order) through the kernel on ``device``'s current stream, waits, and
    compares it word for word with the expected pool (oracle: torch indexing of the same slots).

    Idempotent per device. Returns True where the fused path is ready and exact; False where
    Triton is unavailable or ``OMNI_CACHE_FUSED=0`` — or where the check fails, which also
    turns the fused path off for this process (every later write takes the pools' own
    ``index_copy_`` path; logged as a warning): a wrong kernel must never write a served row.
    Runs on the CPU under ``TRITON_INTERPRET=1`` (tests)."""
    device = torch.device(device)
    if device in _WARMED:
        return _WARMED[device]
    k = kernel()
    ok = False
    if k is not None:
        bs = int(block_size)
        widths = (3, 1, 2)
        ids = torch.tensor([2, 0, 3], dtype=torch.int64, device=device)  # block ids, one out of order
        first_off, last_end = bs // 2, bs // 2 + 1  # mid-block start, mid-block end
        n = len(ids) * bs - first_off - (bs - last_end)
        gen = torch.Generator().manual_seed(0)
        rows = [torch.randint(-2**62, 2**62, (n, w), generator=gen).to(device) for w in widths]
        pools = [torch.zeros(4 * bs, w, dtype=torch.int64, device=device) for w in widths]
        slots = torch.cat([ids[j] * bs + torch.arange(first_off if j == 0 else 0, last_end if j == len(ids) - 1
                                                      else bs, device=device) for j in range(len(ids))])
        expect = [torch.zeros_like(p) for p in pools]
        for e, r in zip(expect, rows):
            e[slots] = r
        tab = torch.tensor([v for r, p, w in zip(rows, pools, widths) for v in (r.data_ptr(), p.data_ptr(), w)],
                           dtype=torch.int64, device=device)
        try:
            stream = torch._C._cuda_getCurrentRawStream(device.index or 0) if device.type == "cuda" else None
            launch(tab.data_ptr(), ids.data_ptr(), len(ids), first_off, last_end, bs, len(widths), stream)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok = all(torch.equal(p, e) for p, e in zip(pools, expect))
            why = "rows differ from the oracle's"
            if ok:
                ok, why = _check_slots_kernel(device, bs, gen, pools, expect, widths, stream), \
                    "the scatter kernel's rows differ from the oracle's"
        except Exception as exc:  # a compile or launch failure: the pools' path
            why = repr(exc)
        if not ok:
            log.warning("omni-cache: the fused step writer failed its start-up check on %s (%s); "
                        "step writes take the pools' index_copy_ path", device, why)
            _KERNEL[0] = None
            _SLOTS_KERNEL[:] = [None]
    _WARMED[device] = ok
    return ok


def _check_slots_kernel(device: torch.device, bs: int, gen: torch.Generator, pools: list, expect: list,
                        widths: tuple, stream: int | None) -> bool:
    """:func:`warm_up`'s check of the scatter kernel: rows to four slots in three blocks, out of
    order (a decode step's), onto ``pools`` (int64 ``[4 * bs, width]`` each) whose expected
    content so far is ``expect``; compared word for word with torch indexing (oracle)."""
    slots = torch.tensor([3 * bs + 1, 0, 2 * bs + bs - 1, 1], dtype=torch.int64, device=device)
    rows = [torch.randint(-2**62, 2**62, (len(slots), w), generator=gen).to(device) for w in widths]
    for e, r in zip(expect, rows):
        e[slots] = r
    tab = torch.tensor([v for r, p, w in zip(rows, pools, widths) for v in (r.data_ptr(), p.data_ptr(), w)],
                       dtype=torch.int64, device=device)
    launch_slots(tab.data_ptr(), slots.data_ptr(), len(slots), len(widths), stream)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return all(torch.equal(p, e) for p, e in zip(pools, expect))


class _Launcher:
    """Launches through the compiled kernel's own launcher (``CompiledKernel.run``, with the
    launch hooks and metadata the JIT would pass), skipping the JIT's per-call argument
    binding, specialisation and cache lookup (measured on the H100 VM: 15 µs a launch instead
    of 38 µs). The first launch goes through the JIT (which compiles); so does every launch
    after the direct call raised ``TypeError`` (a Triton whose launcher differs)."""

    _by_kernel: dict = {}

    def __init__(self, k) -> None:
        self.jit, self.compiled, self.direct = k, None, True
        self.why = ""  # why launches go through the JIT, where they do
        self.knobs = None

    @classmethod
    def get(cls, k) -> _Launcher:
        launcher = cls._by_kernel.get(k)
        if launcher is None:
            launcher = cls._by_kernel[k] = cls(k)
        return launcher

    def launch(self, grid, stream: int, *args) -> None:
        c = self.compiled
        if c is not None and self.direct:
            rt = self.knobs.runtime
            enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
            # Tritons whose hooks are chains (HookChain) pass them even when empty: the launch
            # then builds launch metadata and calls both; an empty chain calls nothing, so
            # passing None instead (what older Tritons pass without hooks) changes nothing
            if enter is not None and getattr(enter, "calls", None) == []:
                enter = None
            if leave is not None and getattr(leave, "calls", None) == []:
                leave = None
            try:
                md = None if enter is None else c.launch_metadata(grid, stream, *args, CHUNK)
                c.run(grid[0], grid[1], 1, stream, c.function, c.packed_metadata, md, enter, leave, *args, CHUNK)
                return
            except TypeError as exc:  # another Triton's launcher signature: the JIT from now on
                self.direct, self.why = False, repr(exc)
        c = self.jit[grid](*args, CHUNK=CHUNK, num_warps=NUM_WARPS)
        if self.compiled is None:
            self.compiled = c
            try:
                from triton import knobs

                self.knobs = knobs
                knobs.runtime.launch_enter_hook  # noqa: B018 (exists?)
            except Exception as exc:  # a Triton without knobs
                self.direct, self.why = False, repr(exc)


class _Destination(NamedTuple):
    """Where one key's rows go."""

    dtype: torch.dtype  #: the pool's dtype
    address: int  #: device address of the pool's storage (its first row)
    row_words: int  #: int64 words per row
    pinned_pool: HiddenPool | None  #: the pool, where pinned (its GPU work is noted there)


class StepWriter:
    """Writes one request's step rows of every key into its pool with one kernel launch.

    For a cache whose pools live on one CUDA device (``Tier.DEVICE``) or are pinned host
    memory the GPU writes in place (zero-copy ``Tier.PINNED_HOST``). Rows of another dtype
    than their pool's, or not contiguous, are converted first (one more launch per such key).
    :meth:`write` declines (returns ``False``, nothing done) calls it does not cover: rows not
    on that device or not 8-byte aligned; the caller then takes the pools' own path.
    """

    def __init__(self, pools: Sequence[HiddenPool], block_size: int, device: torch.device) -> None:
        self.device = device
        self.block_size = block_size
        self.ring = staging_ring(device)
        self.launches = 0  #: kernel launches so far
        #: key -> where its rows go
        self.destinations = {p.key: _Destination(p.dtype, p.gpu_storage.data_ptr(), p.row_bytes // WORD_BYTES,
                                                 p if p.tier is Tier.PINNED_HOST else None) for p in pools}
        self.pinned = any(p.tier is Tier.PINNED_HOST for p in pools)

    @staticmethod
    def covers(pools: Sequence[HiddenPool], device: torch.device) -> bool:
        """Whether every pool can be written by the kernel: storage on ``device`` (``DEVICE``)
        or zero-copy pinned for it, rows of a multiple of 8 bytes."""
        return bool(pools) and all(
            p.row_bytes % WORD_BYTES == 0 and (
                (p.tier is Tier.DEVICE and p.device == device)
                or (p.tier is Tier.PINNED_HOST and p.zero_copy and p.gpu_device == device))
            for p in pools)

    def write(self, ids: np.ndarray, first_off: int, last_end: int, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Rows of a step into blocks ``ids`` (int64 ``[u]``, checked in range by the caller):
        ``tensors`` key -> ``[n, width]`` rows, ``n = u * block_size - first_off - (block_size
        - last_end)``; in-block offsets ``[first_off, ...)`` of ``ids[0]`` to ``[..., last_end)``
        of ``ids[-1]``. Returns ``False`` (nothing written) where the call is not covered."""
        staged = self._stage_arguments(tensors, ids)
        if staged is None:
            return False
        table, table_words = staged
        launch(table, table + WORD_BYTES * table_words, len(ids), first_off, last_end, self.block_size,
               len(tensors), torch._C._cuda_getCurrentRawStream(self.device.index))
        self._launched(tensors, ids)  # ids: made for this call
        return True

    def write_slots(self, slots: np.ndarray, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Rows of a step into pool rows ``slots`` (int64 ``[n]`` KV slot ids, checked in range by
        the caller; any order, e.g. a decode step's one row per request): ``tensors`` key ->
        ``[n, width]`` rows, row ``i`` to slot ``slots[i]``; one launch of :func:`slots_kernel`,
        its arguments read in place from the staging ring (no host -> device copy). Returns
        ``False`` (nothing written) where the call is not covered, as :meth:`write`."""
        if slots_kernel() is None:
            return False
        staged = self._stage_arguments(tensors, slots)
        if staged is None:
            return False
        table, table_words = staged
        launch_slots(table, table + WORD_BYTES * table_words, len(slots), len(tensors),
                     torch._C._cuda_getCurrentRawStream(self.device.index))
        self._launched(tensors, slots // self.block_size)
        return True

    def _stage_arguments(self, tensors: Mapping[str, torch.Tensor], index: np.ndarray) -> tuple[int, int] | None:
        """The kernels' argument table (source address, destination address, row words per key
        of ``tensors``) followed by ``index`` (int64 ``[u]``: block ids or slots), written into the
        staging ring for the kernel to read in place: ``(device address of the table, its int64
        words)``, or ``None`` where the call is not covered (nothing reserved then)."""
        table_words = TABLE_WORDS_PER_KEY * len(tensors)
        if not len(index) or not tensors or table_words + len(index) > self.ring.half:
            return None
        table = []
        device = self.device
        for key, rows in tensors.items():
            destination = self.destinations[key]
            if rows.get_device() != device.index:  # (-1 on the CPU)
                return None
            if rows.dtype != destination.dtype or not rows.is_contiguous():
                # (a temporary: the caching allocator hands its memory only to work enqueued
                # later on this stream, so the kernel reads it first)
                rows = rows.to(destination.dtype).contiguous()
            ptr = rows.data_ptr()
            if ptr % WORD_BYTES:
                return None
            table += (ptr, destination.address, destination.row_words)
        ring = self.ring
        offset = ring.reserve(table_words + len(index))
        table_address = ring.device_address(offset)
        if table_address is None:
            return None
        struct.pack_into(f"{table_words}q", ring.host, WORD_BYTES * offset, *table)
        ring.host[offset + table_words:offset + table_words + len(index)] = index
        return table_address, table_words

    def _launched(self, tensors: Mapping[str, torch.Tensor], blocks: np.ndarray) -> None:
        """Count a launch; pinned pools note its GPU work on ``blocks`` (int64, owned: made for the call)."""
        self.launches += 1
        if self.pinned:
            for key in tensors:
                self.destinations[key].pinned_pool.note_gpu_work(blocks, owned=True)
