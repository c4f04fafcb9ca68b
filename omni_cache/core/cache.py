"""HiddenStateCache: per-key pools mirroring the KV block table, guarded by a ledger."""

from __future__ import annotations

import dataclasses
import operator
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from omni_cache.core.fused import StepWriter, kernel as fused_kernel, log as fused_log
from omni_cache.core.ledger import BLOCK_HASH_MISMATCH, BlockLedger, _hash_value, block_hash_array, hash_list, in_range
from omni_cache.core.pool import HiddenPool, RowIndex, Tier

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


@dataclass
class KeySpec:
    """A cached per-token tensor: ``name`` (e.g. ``"hidden"``, ``"layer_24"``), row
    ``width`` (elements per token) and storage ``dtype``."""

    name: str
    width: int
    dtype: torch.dtype


@dataclass
class CacheMetrics:
    """Counters since construction. Rows count one token of one key; bytes are
    ``rows * width * itemsize``; seconds are wall time (``time.perf_counter``) spent in
    cache writes / reads. ``hits_refused`` counts ``read_prefix`` calls refused as stale
    or uncovered."""

    steps: int = 0
    rows_written: int = 0
    rows_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    hit_tokens: int = 0
    hits_served: int = 0
    hits_refused: int = 0
    seconds_write: float = 0.0
    seconds_read: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)


class StaleRowsError(RuntimeError):
    """A prefix hit asked for rows the ledger cannot vouch for: ``req_id``, the
    ``block_index`` (in the request's block table) of the first such block, and the
    ``key`` not fully written there (``BLOCK_HASH_MISMATCH`` if the block's hash differs)."""

    def __init__(self, req_id: str, block_index: int, key: str) -> None:
        self.req_id, self.block_index, self.key = req_id, block_index, key
        what = "block_hash mismatch" if key == BLOCK_HASH_MISMATCH else f"key {key!r} not fully written"
        super().__init__(
            f"request {req_id!r}: block {block_index} of its prefix hit is stale ({what})"
        )


BlockHashes = Mapping[int, int] | tuple[int, Sequence[int] | np.ndarray | torch.Tensor]


_RANGE = np.arange(1024, dtype=np.int64)
_RANGE.flags.writeable = False


def _arange(n: int) -> np.ndarray:
    """``arange(n)`` int64, read-only, shared (no allocation per call)."""
    global _RANGE
    if n > _RANGE.size:
        _RANGE = np.arange(max(n, 2 * _RANGE.size), dtype=np.int64)
        _RANGE.flags.writeable = False
    return _RANGE[:n]


def _int64s(values) -> np.ndarray:
    """The ints of the iterable ``values`` (a list, a dict's keys) as int64 ``[n]``, packed by
    ``struct`` (measured 2x faster than ``array('q')`` for 512 ints); writable.

    Raises:
        struct.error: an entry is not an integer (no ``__index__``) or not in int64's range.
    """
    out = np.empty(len(values), dtype=np.int64)
    if out.size:
        struct.pack_into(f"{out.size}q", out, 0, *values)
    return out


def _step_arrays(block_ids: BlockIds, b0: int, b1: int, block_hashes: BlockHashes, limit: int
                 ) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray, bool]:
    """``_hashed_blocks(block_hashes) + _table_part(block_ids, b0, b1, limit)``, for the
    engine's usual arguments (a list block table and a ``{block index: hash}`` dict) with one
    ``struct`` call into one buffer (block ids as unsigned, block indices, hashes as unsigned);
    where that cannot pack, or a block id is out of range, the two calls (and their errors)."""
    if type(block_hashes) is dict and type(block_ids) is list and b1 > b0:
        u, m = b1 - b0, len(block_hashes)
        buf = np.empty(u + 2 * m, dtype=np.uint64)
        try:
            struct.pack_into(f"{u}Q{m}q{m}Q", buf, 0, *block_ids[b0:b1], *block_hashes, *block_hashes.values())
        except struct.error:
            pass
        else:
            ids = buf[:u]
            if ids.max() < limit:
                return buf[u:u + m].view(np.int64), buf[u + m:], False, ids.view(np.int64), True
    return (*_hashed_blocks(block_hashes), *_table_part(block_ids, b0, b1, limit))


def _table_part(block_ids: BlockIds, b0: int, b1: int, limit: int) -> tuple[np.ndarray, bool]:
    """``(entries [b0, b1) of a block table as int64, whether all are in [0, limit))``: for a
    list, packed by ``struct`` as unsigned ints (a negative entry cannot pack) so that one
    reduction checks the range; anything else, or out of range, the general conversion."""
    if type(block_ids) is list:
        out = np.empty(b1 - b0, dtype=np.uint64)
        try:
            struct.pack_into(f"{b1 - b0}Q", out, 0, *block_ids[b0:b1])
        except struct.error:
            pass
        else:
            if not out.size or out.max() < limit:
                return out.view(np.int64), True
    ids = _take(block_ids, slice(b0, b1))  # (and errors exactly as before)
    return ids, in_range(ids, limit)


def _take(block_ids: BlockIds, idx: slice | np.ndarray) -> np.ndarray:
    """Entries ``idx`` of a block table (list, numpy array or tensor) as int64 ``[k]``."""
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.cpu().numpy()
    if isinstance(block_ids, np.ndarray):
        return block_ids.reshape(-1)[idx].astype(np.int64)
    if isinstance(idx, slice):
        part = block_ids[idx]
        try:
            return _int64s(part)
        except struct.error:  # e.g. numpy ints beyond int64
            return np.array(part, dtype=np.int64)
    return np.array([block_ids[i] for i in idx.tolist()], dtype=np.int64)


def _hash_pairs(block_hashes: BlockHashes, nblk: int, req_id: str) -> list[tuple[int, int]]:
    """``[(block index, block hash)]`` of a write's few ``block_hashes``, checked: indices in
    ``[0, nblk)``, hashes unsigned 64-bit ints."""
    if isinstance(block_hashes, Mapping):
        pairs = list(block_hashes.items())
    else:
        first, hashes = block_hashes
        hashes = block_hash_array(hashes, strict=True)[0].tolist()
        pairs = [(int(first) + j, h) for j, h in enumerate(hashes)]
    for j, (b, h) in enumerate(pairs):
        if type(b) is not int:
            try:
                b = operator.index(b)
            except TypeError:
                raise ValueError(f"block hash keys are block indices (ints), got {b!r}") from None
        if not 0 <= b < nblk:
            raise ValueError(f"request {req_id!r}: block hashes for block indices outside a block "
                             f"table of {nblk} blocks: {b!r}")
        if type(h) is not int or not 0 <= h < 2**64:
            h = _hash_value(h)
            if h is None:
                raise ValueError(f"block hashes are ints in [0, 2**64); got {pairs[j][1]!r}")
        pairs[j] = (b, h)
    return pairs


def _hashed_blocks(block_hashes: BlockHashes) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(block indices int64 [m], block hashes uint64 [m], whether the indices are
    ascending consecutive)`` of a write's ``block_hashes``."""
    if type(block_hashes) is dict or isinstance(block_hashes, Mapping):
        m = len(block_hashes)
        if not m:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64), True
        try:  # integers only
            idx = _int64s(block_hashes)
        except struct.error:
            raise ValueError(f"block hash keys are block indices (ints), got {list(block_hashes)[:8]}") from None
        try:  # struct's Q takes only ints in [0, 2**64): the usual case, checked at once
            hashes = np.empty(m, dtype=np.uint64)
            struct.pack_into(f"{m}Q", hashes, 0, *block_hashes.values())
        except struct.error:
            hashes = block_hash_array(list(block_hashes.values()), strict=True)[0]
        return idx, hashes, False
    first, hashes = block_hashes
    vals = block_hash_array(hashes, strict=True)[0]
    if isinstance(hashes, (np.ndarray, torch.Tensor)):
        vals = vals.copy()  # not a view of the caller's array: the ledger may keep it (deferred)
    return np.arange(int(first), int(first) + vals.size, dtype=np.int64), vals, True


class HiddenStateCache:
    """Hidden-state prefix cache mirroring vLLM's paged KV cache.

    One :class:`HiddenPool` ``[num_blocks, block_size, width]`` per :class:`KeySpec`,
    addressed by KV slot id, plus one :class:`BlockLedger`. Rows are served for a prefix
    hit only if the ledger vouches for every block (block hash and full fill for every key).

    Same-step semantics: in each engine step the runner first calls
    :meth:`write_request_rows` for every scheduled request, then :meth:`read_prefix`
    for every prefix hit, then :meth:`merge` per request. A request may therefore hit
    blocks that another request computes in the same step (vLLM caches a block when it
    is scheduled) and still get that request's rows.

    ``block_ids`` arguments are a request's block table row (list, numpy int array or CPU
    int tensor). Block hashes are unsigned 64-bit ints (see
    :func:`~omni_cache.core.ledger.block_hash_array`).

    Cost per call: one vectorised ledger update or check over the call's blocks (numpy), one
    host -> device copy of the call's indices shared by all keys, and one or two index
    kernels per key (``index_copy_`` / ``index_select`` through int64 words), or, for a write
    on a CUDA device, one kernel launch for all keys (:mod:`omni_cache.core.fused`); no host
    synchronisation on ``DEVICE`` and zero-copy ``PINNED_HOST`` pools
    (``benchmarks/pool_gpu_bench.py``, ``docs/pool-gpu.md``). The ledger update of a write of
    more than a few blocks is deferred to the next ledger access (lookups see exactly the same
    state; :meth:`settle` applies it earlier, e.g. while the host waits for the GPU).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        keys: Sequence[KeySpec],
        device: torch.device | str = "cpu",
        tier: Tier = Tier.HOST,
        zero_copy: bool | None = None,
        fused: bool = True,
    ) -> None:
        """``zero_copy`` applies to ``PINNED_HOST`` pools (see :class:`HiddenPool`). ``fused``:
        write a step's rows of all keys with one kernel launch where available (pools on a
        CUDA device or zero-copy pinned, Triton importable: :mod:`omni_cache.core.fused`);
        ``False``: always the pools' own path (per key ``index_copy_``). Same results.

        Raises:
            ValueError: duplicate key names.
        """
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate key names in {names}")
        self.num_blocks, self.block_size, self.tier = num_blocks, block_size, tier
        self.device = torch.device(device)
        self.zero_copy = zero_copy
        self.specs: dict[str, KeySpec] = {}  # key name -> KeySpec, in the order keys were added
        self.pools: dict[str, HiddenPool] = {}
        self.ledger = BlockLedger(num_blocks, block_size, [])
        self.metrics = CacheMetrics()
        self.fused = fused
        self._writer: StepWriter | None = None  # the one-launch writer, once built
        self._fused_maybe = False  # whether a CUDA write should try the one-launch writer
        self.add_keys(keys)

    def add_keys(self, keys: Sequence[KeySpec]) -> None:
        """Start caching more keys (e.g. a per-token output that first appears in a later
        step). A new key's rows exist only from its first write on: every block written
        before is uncovered for it, so a hit that needs it is refused, never served stale.

        Raises:
            ValueError: a key of that name is already cached, or duplicate names.
        """
        names = [k.name for k in keys]
        if len(set(names)) != len(names) or set(names) & self.specs.keys():
            raise ValueError(f"keys {names}: duplicate or already cached ({sorted(self.specs)})")
        for k in keys:
            self.pools[k.name] = HiddenPool(k.name, self.num_blocks, self.block_size, k.width,
                                            k.dtype, self.device, self.tier, self.zero_copy)
            self.specs[k.name] = k
            self.ledger.add_key(k.name)
        #: key -> bytes of its row, and None -> of all keys' rows (the metrics' bytes_written)
        self._row_bytes = {k: p.row_bytes for k, p in self.pools.items()}
        self._row_bytes[None] = sum(p.row_bytes for p in self.pools.values())
        self._writer = None  # rebuilt over the new set of pools at the next CUDA write
        self._fused_maybe = self.fused and self.tier is not Tier.HOST and torch.cuda.is_available()

    def _step_writer(self) -> StepWriter | None:
        """The one-launch writer over all pools, built on first use; ``None`` (and never tried
        again) where the pools or the machine do not allow it."""
        if self._writer is None:
            pools = list(self.pools.values())
            device = None if not pools else pools[0].device if self.tier is Tier.DEVICE else pools[0].gpu_device
            if device is None or device.type != "cuda" or not StepWriter.covers(pools, device) or fused_kernel() is None:
                self._fused_maybe = False
                return None
            self._writer = StepWriter(pools, self.block_size, device)
        return self._writer

    @property
    def nbytes(self) -> int:
        """Total pool storage in bytes."""
        return sum(p.nbytes for p in self.pools.values())

    def describe(self) -> str:
        """Human-readable memory layout: MiB per key and in total."""
        lines = [f"HiddenStateCache {self.num_blocks} blocks x {self.block_size} tokens, "
                 f"tier={self.tier.name}"]
        for p in self.pools.values():
            where = f"{p.device}" + (" (zero-copy from the GPU)" if p.zero_copy else "")
            lines.append(f"  {p.key}: width {p.width} {p.dtype} on {where}: "
                         f"{p.nbytes / 2**20:.2f} MiB")
        lines.append(f"  total: {self.nbytes / 2**20:.2f} MiB")
        return "\n".join(lines)

    def begin_step(self) -> None:
        """Mark the start of an engine step (writes, then reads); counts ``steps``."""
        self.metrics.steps += 1

    def write_request_rows(
        self,
        req_id: str,
        block_ids: BlockIds,
        start: int,
        tensors: Mapping[str, torch.Tensor],
        block_hashes: BlockHashes,
        num_tokens: int | None = None,
    ) -> None:
        """Store the rows request ``req_id`` computed this step for positions
        ``[start, start + n)``.

        Args:
            req_id: the request id, used as the ledger owner of every touched block.
            block_ids: the request's block table row.
            start: position of the first row (the request's ``num_computed_tokens``
                before this step).
            tensors: key -> ``[n, width]`` rows (any float dtype; cast to the key's
                dtype). Keys absent here are not marked filled for these positions, so a
                key missing in a step makes the touched blocks uncovered for that key.
                Call once per request per step with all of the step's keys.
            block_hashes: block index in the request -> block hash, for every block that is
                FULL after this write; those blocks are cached. Blocks already cached with the
                same block hash (e.g. prefix-hit blocks) are left as they are. Also accepted,
                cheaper for many blocks: ``(first, hashes)`` = the hashes of blocks ``first,
                first + 1, ...`` (a sequence of ints, a uint64/int64 numpy array or CPU tensor).
            num_tokens: ``n``, the tokens computed this step; required when ``tensors`` is
                empty (every key missing) so the ledger still learns that ``req_id`` took
                over the touched blocks; must match the rows' length otherwise.

        Raises:
            ValueError: unknown key, rows of differing lengths or widths or not
                ``num_tokens`` long, positions outside the block table, a block hash given for
                a touched block left partial or for a block index outside the block table, or
                a block hash that is not an unsigned 64-bit int.
        """
        t0 = time.perf_counter()
        specs, n = self.specs, -1
        for key, rows in tensors.items():  # the usual case in one pass; anything else below
            spec, sh = specs.get(key), rows.shape
            if spec is None or len(sh) != 2 or sh[1] != spec.width or (n >= 0 and sh[0] != n):
                n = -2
                break
            n = sh[0]
        if n < 0 or (num_tokens is not None and n != num_tokens):  # no rows, or some error
            n = self._check_rows(req_id, tensors, num_tokens)
        bs, nblk = self.block_size, len(block_ids)
        if start < 0 or (n and (start + n - 1) // bs >= nblk):
            raise ValueError(f"request {req_id!r}: positions [{start}, {start + n}) fall outside a "
                             f"block table of {nblk} blocks x {bs} tokens")
        b0 = start // bs
        b1 = (start + n - 1) // bs + 1 if n else b0
        last_end = start + n - (b1 - 1) * bs  # in-block end of the write in its last block
        is_map = type(block_hashes) is dict or isinstance(block_hashes, Mapping)
        m = len(block_hashes) if is_map else len(block_hashes[1])
        if b1 - b0 <= self.ledger.scalar_max and m <= self.ledger.scalar_max:
            # a few blocks (decode steps, small chunks): Python lists beat array operations
            pairs = _hash_pairs(block_hashes, nblk, req_id)
            touched = _take(block_ids, slice(b0, b1)).tolist()
            th = [0] * (b1 - b0)
            hashed = [False] * (b1 - b0)
            others = []
            for b, h in pairs:
                if b0 <= b < b1:
                    th[b - b0], hashed[b - b0] = h, True
                else:
                    others.append((b, h))
            if n and hashed[-1] and last_end != bs:
                raise ValueError(f"request {req_id!r}: block {b1 - 1} is hashed but only "
                                 f"filled to offset {last_end} of {bs}")
            other_ids = [int(block_ids[b]) for b, _ in others]
            other_hashes = [h for _, h in others]
        else:
            hk, hv, ordered, touched, ids_ok = _step_arrays(block_ids, b0, b1, block_hashes, self.num_blocks)
            m, u = hk.size, b1 - b0
            # the hashed blocks are the touched ones (a prefill's)? Block indices are distinct
            # (dict keys, or first + range), so m of them in [b0, b1) are exactly [b0, b1)
            if ordered:
                rel = None
                prefill = m == u and m and hk.item(0) == b0
            elif m == u and m and hk.tobytes() == _arange(b1)[b0:].tobytes():
                rel = None  # in order: [b0, b1), the engine's usual mapping
                prefill = True
            else:
                rel = hk - b0
                prefill = m == u and m and rel.view(np.uint64).max() < u  # (negative: huge)
            if prefill:
                if n and last_end != bs:
                    raise ValueError(f"request {req_id!r}: block {b1 - 1} is hashed but only "
                                     f"filled to offset {last_end} of {bs}")
                if rel is None:
                    th = hv
                else:
                    th = np.empty(m, dtype=np.uint64)
                    th[rel] = hv
                hashed, other_ids, other_hashes = True, (), ()
            else:
                if m and not in_range(hk, nblk):
                    raise ValueError(f"request {req_id!r}: block hashes for block indices outside a block "
                                     f"table of {nblk} blocks: {hk[(hk < 0) | (hk >= nblk)].tolist()[:8]}")
                th = np.zeros(b1 - b0, dtype=np.uint64)
                hashed = np.zeros(b1 - b0, dtype=bool)
                inside = (hk >= b0) & (hk < b1)
                th[hk[inside] - b0] = hv[inside]
                hashed[hk[inside] - b0] = True
                if n and hashed[-1] and last_end != bs:
                    raise ValueError(f"request {req_id!r}: block {b1 - 1} is hashed but only "
                                     f"filled to offset {last_end} of {bs}")
                other_ids = _take(block_ids, hk[~inside])
                other_hashes = hv[~inside]
        if n:
            if type(touched) is list:
                ids = np.asarray(touched, dtype=np.int64)
                ids_ok = in_range(ids, self.num_blocks)
            else:
                ids = touched
            if not ids_ok:
                raise ValueError(f"request {req_id!r}: block ids outside [0, {self.num_blocks}) in "
                                 f"{ids.tolist()[:8]}")
            try:
                if not (self._fused_maybe and self._write_fused(ids, start - b0 * bs, last_end, n, tensors)):
                    self._write_pools(ids, start, n, b0, b1, tensors)
            except BaseException:
                self.ledger.invalidate_blocks(ids)  # rows of unknown state: never served
                raise
            # (touched, th and hashed were made for this call: the ledger may keep them)
            self.ledger.defer_request_write(touched, start - b0 * bs, last_end, th, hashed,
                                            self.ledger.key_mask(tensors), owner=req_id)
        if len(other_ids):
            self.ledger.cache_full_blocks(other_ids, other_hashes, owner=req_id)
        self.metrics.seconds_write += time.perf_counter() - t0

    def settle(self) -> None:
        """Apply the ledger updates that writes deferred (:meth:`BlockLedger.settle`), e.g.
        while the host waits for the GPU anyway. Optional: every lookup applies them first."""
        self.ledger.settle()

    def _check_rows(self, req_id: str, tensors: Mapping[str, torch.Tensor], num_tokens: int | None) -> int:
        """The rows' length (``num_tokens`` or 0 without rows), else the error
        :meth:`write_request_rows` raises."""
        lengths = {t.shape[0] for t in tensors.values()}
        if len(lengths) > 1:
            raise ValueError(f"request {req_id!r}: keys carry different row counts {lengths}")
        n = lengths.pop() if lengths else num_tokens or 0
        if num_tokens is not None and n != num_tokens:
            raise ValueError(f"request {req_id!r}: {n} rows but num_tokens={num_tokens}")
        for key, rows in tensors.items():
            spec = self.specs.get(key)
            if spec is None:
                raise ValueError(f"request {req_id!r}: unknown keys {sorted(set(tensors) - self.specs.keys())}")
            if rows.dim() != 2 or rows.shape[1] != spec.width:
                raise ValueError(f"key {key!r}: rows of shape {tuple(rows.shape)} do not match "
                                 f"[{n}, {spec.width}]")
        return n

    def _write_fused(self, ids: np.ndarray, first_off: int, last_end: int, n: int,
                     tensors: Mapping[str, torch.Tensor]) -> bool:
        """All keys' rows in one launch (:class:`~omni_cache.core.fused.StepWriter`); ``False``
        where that path does not cover the call (nothing written then)."""
        w = self._writer or self._step_writer()
        if w is None:
            return False
        try:
            done = w.write(ids, first_off, last_end, tensors)
        except Exception as exc:  # e.g. Triton cannot compile here: never try again
            fused_log.warning("omni-cache: fused step write failed (%r); using index_copy_ from now on", exc)
            self._fused_maybe = False
            return False
        if done:
            rb = self._row_bytes
            self.metrics.bytes_written += n * (rb[None] if len(tensors) == len(rb) - 1 else
                                               sum(rb[k] for k in tensors))
            self.metrics.rows_written += n * len(tensors)
        return done

    def _write_pools(self, touched: np.ndarray, start: int, n: int, b0: int, b1: int,
                     tensors: Mapping[str, torch.Tensor]) -> None:
        """Rows ``[start, start + n)`` into every key's pool: whole blocks as slabs, the
        partial head / tail blocks row by row; one index array for all keys."""
        bs = self.block_size
        lo_full = min(-(-start // bs) * bs, start + n)
        hi_full = max(((start + n) // bs) * bs, lo_full)
        f0, f1 = lo_full // bs - b0, hi_full // bs - b0
        head, tail = lo_full - start, start + n - hi_full
        host, sizes = [], []
        if f1 > f0:
            host.append(touched[f0:f1])
            sizes.append(f1 - f0)
        if head:
            o = start - b0 * bs
            host.append(touched[0] * bs + np.arange(o, o + head, dtype=np.int64))
            sizes.append(head)
        if tail:
            o = hi_full - (b1 - 1) * bs
            host.append(touched[-1] * bs + np.arange(o, o + tail, dtype=np.int64))
            sizes.append(tail)
        parts = RowIndex(host[0]) if len(host) == 1 else RowIndex(np.concatenate(host))
        parts = [parts] if len(host) == 1 else parts.split(sizes)
        for key, rows in tensors.items():
            pool, i = self.pools[key], 0
            if f1 > f0:
                pool.write_blocks(parts[0], rows if head == tail == 0 else rows[head: head + (f1 - f0) * bs])
                i = 1
            if head:
                pool.write(parts[i], rows[:head])
                i += 1
            if tail:
                pool.write(parts[i], rows[n - tail:])
            self.metrics.bytes_written += n * pool.row_bytes
        self.metrics.rows_written += n * len(tensors)

    def covered_prefix_tokens(
        self, block_ids: BlockIds, block_hashes: Sequence[int], keys: Iterable[str]
    ) -> int:
        """Tokens of the longest prefix of ``block_ids`` (block hashes ``block_hashes``: a
        sequence of ints, uint64/int64 numpy array or CPU tensor) whose rows may be served for
        all ``keys``: ``covered_blocks * block_size``.

        Raises:
            ValueError: an unknown key.
        """
        return self.ledger.covered_blocks(block_ids, block_hashes, keys) * self.block_size

    def read_prefix(
        self,
        req_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        block_hashes: Sequence[int],
        keys: Iterable[str],
        out_device: torch.device | str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Rows of a prefix hit: key -> ``[num_tokens, width]`` (key's dtype) for positions
        ``[0, num_tokens)`` on ``out_device`` (default: the pools' storage device), copied out
        of the pools (later writes do not alias them).

        ``num_tokens`` is the hit's ``num_computed_tokens``; ``block_hashes`` are the request's
        block hashes (at least ``num_tokens // block_size`` of them; a sequence of ints, or a
        uint64/int64 numpy array or CPU tensor). A ``PINNED_HOST`` pool read with a CUDA
        ``out_device`` moves only the hit's blocks host -> device, on the current stream.

        Raises:
            ValueError: ``num_tokens`` is not a multiple of ``block_size`` or exceeds the
                block table / block hashes; an unknown key.
            StaleRowsError: some block of the hit is not covered for some key; no rows are
                returned in that case.
        """
        t0 = time.perf_counter()
        keys = tuple(keys)
        bs = self.block_size
        nb, rem = divmod(num_tokens, bs)
        if rem or nb > len(block_ids) or nb > len(block_hashes):
            raise ValueError(f"request {req_id!r}: hit of {num_tokens} tokens is not whole "
                             f"blocks of {bs} within {len(block_ids)} blocks / {len(block_hashes)} block hashes")
        mask = self.ledger.key_mask(keys)
        ids = _take(block_ids, slice(0, nb))
        i = self.ledger.first_uncovered(ids, block_hashes[:nb], mask)
        if i < nb:
            self.metrics.hits_refused += 1
            h = hash_list(block_hashes[i:i + 1])[0]
            raise StaleRowsError(req_id, i, self.ledger.uncovered_reason(int(ids[i]), h, mask))
        index = RowIndex(ids)
        out = {k: self.pools[k].gather_blocks(index, out_device) for k in keys}
        self.metrics.rows_read += num_tokens * len(keys)
        self.metrics.bytes_read += sum(t.numel() * t.element_size() for t in out.values())
        if num_tokens:
            self.metrics.hit_tokens += num_tokens
            self.metrics.hits_served += 1
        self.metrics.seconds_read += time.perf_counter() - t0
        return out

    @staticmethod
    def merge(prefix: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
        """Per key, ``cat([prefix rows, fresh rows])`` along dim 0 (prompt order). Prefix rows
        are moved/cast to the fresh rows' device and dtype.

        Raises:
            ValueError: the two sides carry different keys.
        """
        if prefix.keys() != fresh.keys():
            raise ValueError(f"merge: prefix keys {sorted(prefix)} != fresh keys {sorted(fresh)}")
        return {
            k: torch.cat([prefix[k].to(f.device, f.dtype, non_blocking=f.device.type != "cpu"), f])
            for k, f in fresh.items()
        }
