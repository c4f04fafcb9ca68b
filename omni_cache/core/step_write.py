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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
    writes = []
    for r in requests:
        w = normalise_request_write(r.req_id, r.block_ids, r.start, {}, r.num_tokens, r.block_hashes,
                                    cache.block_size, cache.num_blocks, mask, cache.ledger.scalar_max)
        validate_request_write(w, cache.block_size, cache.num_blocks)
        writes.append(w)
    if total and rows:
        slots = np.concatenate([step_slots(w, cache.block_size) for w in writes if w.num_tokens])
        index = RowIndex(slots)
        try:
            for key, t in rows.items():
                pool = cache.pools[key]
                pool.write(index, t)
                cache.metrics.bytes_written += total * pool.row_bytes
        except BaseException:
            for w in writes:
                if w.num_tokens:
                    cache.ledger.invalidate_blocks(np.asarray(w.blocks.block_ids, dtype=np.int64))
            raise
        cache.metrics.rows_written += total * len(rows)
    for w in writes:  # as write_request_rows: touched blocks (deferred), blocks hashed on the side
        if w.num_tokens:
            cache.ledger.defer_request_write(w.blocks)
        if len(w.other_block_ids):
            cache.ledger.cache_full_blocks(w.other_block_ids, w.other_block_hashes, owner=w.req_id)
    cache.metrics.seconds_write += time.perf_counter() - t0
