"""One engine step's hidden-state rows written at once (:meth:`HiddenStateCache.write_step_rows
<omni_cache.core.cache.HiddenStateCache.write_step_rows>`).

Per request, a step write is the same :class:`~omni_cache.core.request_write.RequestWrite`
as :meth:`~omni_cache.core.cache.HiddenStateCache.write_request_rows` makes (normalised and
validated for every request before anything is written, then recorded in the ledger); the
rows of the whole step go to each key's pool with one slot index (one host → device copy)
and one write. Why: per request, a decode step of 16 requests cost 16 kernel launches and 16
index copies on the engine's host thread (measured on an H100, docs/gpu.md "Zero overhead").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_cache.core.fused import log as fused_log
from omni_cache.core.ledger_state import BlockWrite
from omni_cache.core.request_write import BlockHashes, RequestWrite, normalise_request_write, validate_request_write
from omni_cache.core.row_index import RowIndex
from omni_cache.core.slots import BlockIds


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request's part of a step write (:meth:`HiddenStateCache.write_step_rows`).

    Attributes:
        req_id: the request id (the ledger owner of the touched blocks).
        block_ids: its block table row (list, numpy int array or CPU int tensor).
        start: position of its first row this step (its ``num_computed_tokens``), tokens.
        num_tokens: its rows this step (tokens).
        block_hashes: as :meth:`HiddenStateCache.write_request_rows`' ``block_hashes``.
    """

    req_id: str
    block_ids: BlockIds
    start: int
    num_tokens: int
    block_hashes: BlockHashes


def step_slots(write: RequestWrite, block_size: int) -> np.ndarray:
    """The KV slot ids (int64 ``[n]``: ``block_id * block_size + offset``) of a normalised
    write's positions ``[start, start + n)``."""
    ids = np.asarray(write.blocks.block_ids, dtype=np.int64)
    if write.num_tokens == 1:
        return ids[:1] * block_size + write.start % block_size
    pos = np.arange(write.start, write.start + write.num_tokens, dtype=np.int64)
    return ids[pos // block_size - write.first_block] * block_size + pos % block_size


def write_step_rows(cache: Any, requests: Sequence[StepRequest],
                    rows: Mapping[str, torch.Tensor]) -> None:
    """Store one engine step's rows of every request of ``cache`` (a
    :class:`~omni_cache.core.cache.HiddenStateCache`; typed loosely: it imports this module) at once: the same result as
    one :meth:`HiddenStateCache.write_request_rows` per request with all of ``rows``' keys, with
    one index (host → device once) and one write per key for the whole step instead of per
    request.

    Args:
        requests: the step's requests in batch order (:class:`StepRequest`); request ``i``'s
            rows are the next ``num_tokens`` rows of every key.
        rows: key -> ``[sum of num_tokens, width]`` (the step's unpadded rows).

    Raises:
        ValueError: as :meth:`HiddenStateCache.write_request_rows` (checked for every request
            before anything is written); an unknown key; rows not ``[sum of num_tokens, width]``.
    """
    t0 = time.perf_counter()
    total = sum(r.num_tokens for r in requests)
    for key, t in rows.items():
        spec = cache.specs.get(key)
        if spec is None:
            raise ValueError(f"write_step_rows: unknown keys {sorted(set(rows) - cache.specs.keys())}")
        if t.dim() != 2 or t.shape[0] != total or t.shape[1] != spec.width:
            raise ValueError(f"write_step_rows: key {key!r} rows of shape {tuple(t.shape)} do not match "
                             f"[{total}, {spec.width}]")
    mask = cache.ledger.key_mask(rows)
    if total == len(requests) and rows:
        decode = _decode_slots(requests, cache.block_size, cache.num_blocks)
        if decode is not None:
            slots, blocks, completed = decode
            _write_pools(cache, slots, rows, total, lambda: blocks)
            if not cache.ledger.record_one_row_each(blocks, slots % cache.block_size,
                                                    [r.req_id for r in requests], mask):
                for r, b, slot in zip(requests, blocks.tolist(), slots.tolist(), strict=True):
                    o = slot % cache.block_size
                    cache.ledger.defer_request_write(BlockWrite([b], o, o + 1, [0], [False], mask, r.req_id))
            for j, block_hash in completed:  # rows complete their blocks: cached under their hashes
                cache.ledger.cache_full_blocks([int(blocks[j])], [block_hash], owner=requests[j].req_id)
            cache.metrics.seconds_write += time.perf_counter() - t0
            return
    writes = []
    for r in requests:
        w = normalise_request_write(r.req_id, r.block_ids, r.start, {}, r.num_tokens, r.block_hashes,
                                    cache.block_size, cache.num_blocks, mask, cache.ledger.scalar_max)
        validate_request_write(w, cache.block_size, cache.num_blocks)
        writes.append(w)
    if total and rows:
        slots = np.concatenate([step_slots(w, cache.block_size) for w in writes if w.num_tokens])
        _write_pools(cache, slots, rows, total,
                     lambda: np.concatenate([np.asarray(w.blocks.block_ids, dtype=np.int64)
                                             for w in writes if w.num_tokens]))
    for w in writes:  # as write_request_rows: touched blocks (deferred), blocks hashed on the side
        if w.num_tokens:
            cache.ledger.defer_request_write(w.blocks)
        if len(w.other_block_ids):
            cache.ledger.cache_full_blocks(w.other_block_ids, w.other_block_hashes, owner=w.req_id)
    cache.metrics.seconds_write += time.perf_counter() - t0


def _write_pools(cache: Any, slots: np.ndarray, rows: Mapping[str, torch.Tensor], total: int,
                 touched: Callable[[], np.ndarray]) -> None:
    """Every key's rows at ``slots`` (int64 ``[total]``): one launch for all keys where the
    fused writer covers the call (a CUDA cache, :func:`_write_fused_slots`), else
    one index for all keys and a write per key; a failed write invalidates the blocks
    ``touched()`` returns (int64) and re-raises.

    Raises:
        IndexError: a slot outside the pools (nothing written).
    """
    index = RowIndex(slots)
    try:
        if cache._fused_maybe:
            index.check(cache.num_blocks * cache.block_size, "slot mapping")  # (the kernel does not check)
            if _write_fused_slots(cache, slots, rows):
                return
        for key, t in rows.items():
            pool = cache.pools[key]
            pool.write(index, t)
            cache.metrics.bytes_written += total * pool.row_bytes
    except BaseException:
        cache.ledger.invalidate_blocks(touched())
        raise
    cache.metrics.rows_written += total * len(rows)


def _write_fused_slots(cache: Any, slots: np.ndarray, rows: Mapping[str, torch.Tensor]) -> bool:
    """A step's rows of all keys in one launch (:meth:`~omni_cache.core.fused.StepWriter.write_slots`)
    at ``slots`` (int64 ``[n]``, in range); ``False`` where that path does not cover the call
    (nothing written then; also where the cache's fused path is off or was turned off)."""
    if not cache._fused_maybe:
        return False
    writer = cache._writer or cache._step_writer()
    if writer is None:
        return False
    try:
        done = writer.write_slots(slots, rows)
    except Exception as exc:  # e.g. Triton cannot compile here: never try again
        fused_log.warning("omni-cache: fused step write failed (%r); using index_copy_ from now on", exc)
        cache._fused_maybe = False
        return False
    if done:
        n, row_bytes = len(slots), cache._row_bytes
        cache.metrics.bytes_written += n * (row_bytes[None] if len(rows) == len(row_bytes) - 1 else
                                            sum(row_bytes[k] for k in rows))
        cache.metrics.rows_written += n * len(rows)
    return done


def _decode_slots(requests: Sequence[StepRequest], block_size: int, num_blocks: int
                  ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]] | None:
    """For a decode step — every request writes one row, and caches at most the block that row
    completes — ``(slots, block ids, completed)`` (int64 ``[n]`` each; ``completed``: ``(index
    in requests, block hash)`` of the rows that complete their block) without a
    :class:`RequestWrite` per request; None where a request does not fit that (it then takes the
    general path, which also raises its errors). At 16 requests a block completes in most decode
    steps: before, one such row sent the whole step down the general path (docs/gpu.md,
    "Twenty-third session")."""
    ids, slots, completed = [], [], []
    for j, r in enumerate(requests):  # (plain ints: a dozen numpy calls cost more than this loop)
        hashes, start = r.block_hashes, r.start
        if r.num_tokens != 1 or type(hashes) is not dict or type(start) is not int or start < 0:
            return None
        b = start // block_size
        if hashes:  # only the hash of the block this row completes (an int, as validated below)
            h = hashes.get(b)
            if (len(hashes) != 1 or start % block_size != block_size - 1 or type(h) is not int
                    or not 0 <= h < 1 << 64):
                return None
            completed.append((j, h))
        table = r.block_ids
        if type(table) is not list or b >= len(table):
            return None
        block = table[b]
        if type(block) is not int or not 0 <= block < num_blocks:
            return None
        ids.append(block)
        slots.append(block * block_size + start % block_size)
    if not ids:
        return None
    return np.array(slots, dtype=np.int64), np.array(ids, dtype=np.int64), completed
