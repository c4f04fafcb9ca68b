"""The cache's interface types: the keys it caches, its metrics, its one error.

Fail-fast: a prefix hit the ledger cannot vouch for raises :class:`StaleRowsError`; the cache
never serves rows it cannot vouch for, and never degrades to other rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from omni_cache.core.ledger import BLOCK_HASH_MISMATCH


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
    ``rows * width * itemsize``; seconds are host wall time (``time.perf_counter``) spent in
    cache writes / reads; ``seconds_save`` / ``seconds_materialize`` are the stage manager's
    whole per-step host time in the runner's save and hand-off calls (block hashes, writes,
    reads, staging; set by :class:`omni_cache.engine.stage_manager.OmniCacheStageManager`).
    Parts of them, to place a step's host time without a profiler (docs/gpu.md, "Zero
    overhead"): ``seconds_plan`` (classify the outputs, plan the step, keep async-scheduling
    ids), ``seconds_stage`` (stage or merge the hand-off rows), ``seconds_handoff_wait`` (in
    ``materialize``, waiting for the staged copies), ``seconds_publish`` (writing the counter
    file, ``OMNI_CACHE_METRICS_DIR``; counted up to the write before the one that carries it).
    The decode step's share, which the 2 % no-hit bar is about (docs/benchmarks.md, "The bar
    at full size"): ``decode_steps`` / ``seconds_save_decode`` (saves of steps where every
    scheduled request ran one token and none had a hit: a no-hit decode step) and
    ``fresh_handoffs`` / ``seconds_materialize_fresh`` (hand-offs of steps without a hit or
    truncated rows, the path that leaves the multimodal outputs to vLLM-Omni).
    ``hits_refused`` counts ``read_prefix`` calls refused as stale or uncovered."""

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
    seconds_save: float = 0.0
    seconds_materialize: float = 0.0
    seconds_plan: float = 0.0
    seconds_stage: float = 0.0
    seconds_handoff_wait: float = 0.0
    seconds_publish: float = 0.0
    decode_steps: int = 0
    seconds_save_decode: float = 0.0
    fresh_handoffs: int = 0
    seconds_materialize_fresh: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """Counter name -> value."""
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
