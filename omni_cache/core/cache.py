"""HiddenStateCache: per-key pools mirroring the KV block table, guarded by a ledger."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from omni_cache.core.ledger import BLOCK_HASH_MISMATCH, BlockLedger
from omni_cache.core.pool import HiddenPool, Tier
from omni_cache.core.slots import slot_ids

BlockIds = Sequence[int] | torch.Tensor


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


def _block_list(block_ids: BlockIds) -> list[int]:
    return block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)


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

    ``block_ids`` arguments are a request's block table row (list or CPU int tensor).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        keys: Sequence[KeySpec],
        device: torch.device | str = "cpu",
        tier: Tier = Tier.HOST,
    ) -> None:
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate key names in {names}")
        self.num_blocks, self.block_size, self.tier = num_blocks, block_size, tier
        self.device = torch.device(device)
        self.specs: dict[str, KeySpec] = {}  # key name -> KeySpec, in the order keys were added
        self.pools: dict[str, HiddenPool] = {}
        self.ledger = BlockLedger(num_blocks, block_size, [])
        self.metrics = CacheMetrics()
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
                                            k.dtype, self.device, self.tier)
            self.specs[k.name] = k
            self.ledger.add_key(k.name)

    @property
    def nbytes(self) -> int:
        """Total pool storage in bytes."""
        return sum(p.nbytes for p in self.pools.values())

    def describe(self) -> str:
        """Human-readable memory layout: MiB per key and in total."""
        lines = [f"HiddenStateCache {self.num_blocks} blocks x {self.block_size} tokens, "
                 f"tier={self.tier.name}"]
        for p in self.pools.values():
            lines.append(f"  {p.key}: width {p.width} {p.dtype} on {p.device}: "
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
        block_hashes: Mapping[int, Hashable],
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
            block_hashes: block index in the request -> block hash, for every block that is FULL
                after this write; those blocks are cached. Blocks already cached with the
                same block hash (e.g. prefix-hit blocks) are left as they are.
            num_tokens: ``n``, the tokens computed this step; required when ``tensors`` is
                empty (every key missing) so the ledger still learns that ``req_id`` took
                over the touched blocks; must match the rows' length otherwise.

        Raises:
            ValueError: unknown key, rows of differing lengths or widths or not
                ``num_tokens`` long, positions outside the block table, or a block hash given for a
                touched block left partial.
        """
        t0 = time.perf_counter()
        lengths = {t.shape[0] for t in tensors.values()}
        if len(lengths) > 1:
            raise ValueError(f"request {req_id!r}: keys carry different row counts {lengths}")
        n = lengths.pop() if lengths else num_tokens or 0
        if num_tokens is not None and n != num_tokens:
            raise ValueError(f"request {req_id!r}: {n} rows but num_tokens={num_tokens}")
        unknown = set(tensors) - self.pools.keys()
        if unknown:
            raise ValueError(f"request {req_id!r}: unknown keys {sorted(unknown)}")
        blocks, bs = _block_list(block_ids), self.block_size
        touched = {  # block index -> in-block [lo, hi) written this step
            b: (max(start - b * bs, 0), min(start + n - b * bs, bs))
            for b in range(start // bs, (start + n - 1) // bs + 1 if n else 0)
        }
        for b, (_, hi) in touched.items():
            if b in block_hashes and hi != bs:
                raise ValueError(f"request {req_id!r}: block {b} is hashed but only "
                                 f"filled to offset {hi} of {bs}")
        if n:
            # head / tail partial blocks row by row, whole blocks as slabs
            lo_full = min(-(-start // bs) * bs, start + n)
            hi_full = max(((start + n) // bs) * bs, lo_full)
            parts = [(a, b) for a, b in ((start, lo_full), (hi_full, start + n)) if b > a]
            slots = (slot_ids(torch.tensor(blocks, dtype=torch.int64),
                              torch.cat([torch.arange(a, b) for a, b in parts]), bs) if parts else None)
            full = torch.tensor(blocks[lo_full // bs: hi_full // bs], dtype=torch.int64)
            for key, rows in tensors.items():
                pool = self.pools[key]
                if full.numel():
                    pool.write_blocks(full, rows[lo_full - start: hi_full - start])
                if slots is not None:
                    pool.write(slots, torch.cat([rows[a - start: b - start] for a, b in parts]))
                self.metrics.bytes_written += n * self.pools[key].row_bytes
            self.metrics.rows_written += n * len(tensors)
        for b, (lo, hi) in touched.items():
            self.ledger.record_write(blocks[b], block_hashes.get(b), lo, hi, tensors.keys(),
                                     owner=req_id)
        for b, block_hash in block_hashes.items():
            if b not in touched:
                self.ledger.cache_full_block(blocks[b], block_hash, owner=req_id)
        self.metrics.seconds_write += time.perf_counter() - t0

    def covered_prefix_tokens(
        self, block_ids: BlockIds, block_hashes: Sequence[Hashable], keys: Iterable[str]
    ) -> int:
        """Tokens of the longest prefix of ``block_ids`` (block hashes ``block_hashes``) whose rows may be
        served for all ``keys``: ``covered_blocks * block_size``."""
        return self.ledger.covered_blocks(_block_list(block_ids), block_hashes, keys) * self.block_size

    def read_prefix(
        self,
        req_id: str,
        block_ids: BlockIds,
        num_tokens: int,
        block_hashes: Sequence[Hashable],
        keys: Iterable[str],
        out_device: torch.device | str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Rows of a prefix hit: key -> ``[num_tokens, width]`` (key's dtype) for positions
        ``[0, num_tokens)``, copied out of the pools (later writes do not alias them).

        ``num_tokens`` is the hit's ``num_computed_tokens``; ``block_hashes`` are the request's block
        hashes (at least ``num_tokens // block_size`` of them).

        Raises:
            ValueError: ``num_tokens`` is not a multiple of ``block_size`` or exceeds the
                block table / block hashes.
            StaleRowsError: some block of the hit is not covered for some key; no rows are
                returned in that case.
        """
        t0 = time.perf_counter()
        keys = tuple(keys)
        bs = self.block_size
        nb, rem = divmod(num_tokens, bs)
        blocks = _block_list(block_ids)
        if rem or nb > len(blocks) or nb > len(block_hashes):
            raise ValueError(f"request {req_id!r}: hit of {num_tokens} tokens is not whole "
                             f"blocks of {bs} within {len(blocks)} blocks / {len(block_hashes)} block hashes")
        for i in range(nb):
            key = self.ledger.uncovered_key(blocks[i], block_hashes[i], keys)
            if key is not None:
                self.metrics.hits_refused += 1
                raise StaleRowsError(req_id, i, key)
        idx = torch.tensor(blocks[:nb], dtype=torch.int64)
        out = {k: self.pools[k].gather_blocks(idx, out_device) for k in keys}
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
