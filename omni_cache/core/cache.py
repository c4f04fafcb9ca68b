"""HiddenStateCache: per-key pools mirroring the KV block table, guarded by a ledger."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from omni_cache.core.block_hashes import hash_list
from omni_cache.core.fused import StepWriter
from omni_cache.core.fused import kernel as fused_kernel
from omni_cache.core.fused import log as fused_log
from omni_cache.core.interface import CacheMetrics, KeySpec, StaleRowsError
from omni_cache.core.ledger import BlockLedger
from omni_cache.core.pool import HiddenPool, Tier
from omni_cache.core.request_write import (
    BlockHashes,
    RequestWrite,
    normalise_request_write,
    table_entries,
    validate_request_write,
)
from omni_cache.core.row_index import RowIndex
from omni_cache.core.slots import BlockIds
from omni_cache.core.step_write import StepRequest, write_step_rows


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
    :func:`~omni_cache.core.block_hashes.block_hash_array`).

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
            if (device is None or device.type != "cuda" or not StepWriter.covers(pools, device)
                    or fused_kernel() is None):
                self._fused_maybe = False
                return None
            self._writer = StepWriter(pools, self.block_size, device)
        return self._writer

    @property
    def nbytes(self) -> int:
        """Total pool storage in bytes."""
        return sum(p.nbytes for p in self.pools.values())

    @property
    def pinned_nbytes(self) -> int:
        """Pool storage in page-locked (pinned) host memory, bytes (0 unless ``PINNED_HOST``
        on a CUDA machine)."""
        return sum(p.nbytes for p in self.pools.values() if p.pinned)

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
        write = self._normalise(req_id, block_ids, start, tensors, block_hashes, num_tokens)
        validate_request_write(write, self.block_size, self.num_blocks)
        self._store_rows(write)
        self._update_ledger(write)
        self.metrics.seconds_write += time.perf_counter() - t0

    def write_step_rows(self, requests: Sequence[StepRequest], rows: Mapping[str, torch.Tensor]) -> None:
        """Store one engine step's rows of every request at once
        (:func:`omni_cache.core.step_write.write_step_rows`: one index and one write per key
        for the whole step; the same result as one :meth:`write_request_rows` per request).

        Raises:
            ValueError: as :meth:`write_request_rows`; rows not ``[sum of num_tokens, width]``.
        """
        write_step_rows(self, requests, rows)

    def _normalise(self, req_id: str, block_ids: BlockIds, start: int, tensors: Mapping[str, torch.Tensor],
                   block_hashes: BlockHashes, num_tokens: int | None) -> RequestWrite:
        """:meth:`write_request_rows`' arguments as a :class:`RequestWrite` (rows checked)."""
        n = -1
        for key, rows in tensors.items():  # the usual case in one pass; anything else: _row_count
            spec, shape = self.specs.get(key), rows.shape
            if spec is None or len(shape) != 2 or shape[1] != spec.width or (n >= 0 and shape[0] != n):
                n = -2
                break
            n = shape[0]
        if n < 0 or (num_tokens is not None and n != num_tokens):
            n = self._row_count(req_id, tensors, num_tokens)
        return normalise_request_write(req_id, block_ids, start, tensors, n, block_hashes, self.block_size,
                                       self.num_blocks, self.ledger.key_mask(tensors), self.ledger.scalar_max)

    def _store_rows(self, write: RequestWrite) -> None:
        """The rows of ``write`` into the pools (one launch where the fused writer covers the
        call, else per key); a failure leaves the touched blocks invalidated (rows of unknown
        state are never served) and is raised."""
        if not write.num_tokens:
            return
        ids = write.blocks.block_ids
        if type(ids) is list:
            ids = np.asarray(ids, dtype=np.int64)
        try:
            if not (self._fused_maybe and self._write_fused(ids, write)):
                self._write_pools(ids, write)
        except BaseException:
            self.ledger.invalidate_blocks(ids)
            raise

    def _update_ledger(self, write: RequestWrite) -> None:
        """Record ``write`` in the ledger: its touched blocks (deferred where large), and the
        blocks it hashed without touching them (cached if ``req_id`` owns them)."""
        if write.num_tokens:
            self.ledger.defer_request_write(write.blocks)  # (its arrays were made for this call)
        if len(write.other_block_ids):
            self.ledger.cache_full_blocks(write.other_block_ids, write.other_block_hashes, owner=write.req_id)

    def settle(self) -> None:
        """Apply the ledger updates that writes deferred (:meth:`BlockLedger.settle`), e.g.
        while the host waits for the GPU anyway. Optional: every lookup applies them first."""
        self.ledger.settle()

    def _row_count(self, req_id: str, tensors: Mapping[str, torch.Tensor], num_tokens: int | None) -> int:
        """The rows' length (``num_tokens`` or 0 without rows), checked: every key known, rows
        ``[n, width]`` of equal ``n``, equal to ``num_tokens`` if given.

        Raises:
            ValueError: the first of these that fails.
        """
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

    def _write_fused(self, ids: np.ndarray, write: RequestWrite) -> bool:
        """All keys' rows in one launch (:class:`~omni_cache.core.fused.StepWriter`) into blocks
        ``ids`` (int64 ``[u]``, in range); ``False`` where that path does not cover the call
        (nothing written then)."""
        writer = self._writer or self._step_writer()
        if writer is None:
            return False
        rows, n = write.rows, write.num_tokens
        try:
            done = writer.write(ids, write.blocks.first_start, write.blocks.last_end, rows)
        except Exception as exc:  # e.g. Triton cannot compile here: never try again
            fused_log.warning("omni-cache: fused step write failed (%r); using index_copy_ from now on", exc)
            self._fused_maybe = False
            return False
        if done:
            row_bytes = self._row_bytes
            self.metrics.bytes_written += n * (row_bytes[None] if len(rows) == len(row_bytes) - 1 else
                                               sum(row_bytes[k] for k in rows))
            self.metrics.rows_written += n * len(rows)
        return done

    def _write_pools(self, ids: np.ndarray, write: RequestWrite) -> None:
        """Rows ``[start, start + n)`` into every key's pool at blocks ``ids`` (int64 ``[u]``,
        in range): whole blocks as slabs, the partial head / tail blocks row by row; one index
        for all keys."""
        bs, start, n, first = self.block_size, write.start, write.num_tokens, write.first_block
        whole_lo = min(-(-start // bs) * bs, start + n)  # positions of the whole blocks: [whole_lo, whole_hi)
        whole_hi = max(((start + n) // bs) * bs, whole_lo)
        whole_first, whole_end = whole_lo // bs - first, whole_hi // bs - first  # their entries in ids
        head, tail = whole_lo - start, start + n - whole_hi  # rows before / after them
        host, sizes = [], []
        if whole_end > whole_first:
            host.append(ids[whole_first:whole_end])
            sizes.append(whole_end - whole_first)
        if head:
            offset = start - first * bs
            host.append(ids[0] * bs + np.arange(offset, offset + head, dtype=np.int64))
            sizes.append(head)
        if tail:
            offset = whole_hi - (first + len(ids) - 1) * bs
            host.append(ids[-1] * bs + np.arange(offset, offset + tail, dtype=np.int64))
            sizes.append(tail)
        parts = [RowIndex(host[0])] if len(host) == 1 else RowIndex(np.concatenate(host)).split(sizes)
        for key, rows in write.rows.items():
            pool, i = self.pools[key], 0
            if whole_end > whole_first:
                pool.write_blocks(parts[0], rows if head == tail == 0 else rows[head: n - tail])
                i = 1
            if head:
                pool.write(parts[i], rows[:head])
                i += 1
            if tail:
                pool.write(parts[i], rows[n - tail:])
            self.metrics.bytes_written += n * pool.row_bytes
        self.metrics.rows_written += n * len(write.rows)

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
        ids = table_entries(block_ids, slice(0, nb))
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
