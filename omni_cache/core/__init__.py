"""Engine-independent core of omni-cache: a hidden-state prefix cache that
mirrors vLLM's paged KV cache.

Import invariant: nothing under ``omni_cache.core`` imports ``vllm`` or
``vllm_omni`` -- only ``torch``, ``numpy`` and the standard library
(enforced by ``tests/unit/test_core_import.py``). Engine glue lives in
``omni_cache.engine`` and ``omni_cache.driver``.

One concept per module:

- :mod:`.slots`  -- block table -> slot id mapping, chained block hashes.
- :mod:`.pool`   -- :class:`HiddenPool`, one key's ``[num_blocks, block_size, width]`` storage
  (device, pinned host read/written by the GPU in place, or host).
- :mod:`.ledger` -- :class:`BlockLedger`, per-block integrity (block hash, owner, fill), as
  numpy arrays updated per step with vectorised operations.
- :mod:`.cache`  -- :class:`HiddenStateCache`, pools + ledger + metrics.
- :mod:`.fused`  -- one kernel launch for all keys' rows of a step (Triton, imported lazily
  and only for CUDA writes; optional: without it the pools' torch path runs).
"""

from omni_cache.core.cache import (
    CacheMetrics,
    HiddenStateCache,
    KeySpec,
    StaleRowsError,
)
from omni_cache.core.ledger import BLOCK_HASH_MISMATCH, BlockLedger, block_hash_array
from omni_cache.core.pool import HiddenPool, RowIndex, Tier
from omni_cache.core.slots import chained_block_hashes, num_full_blocks, slot_ids

__all__ = [
    "BlockLedger",
    "CacheMetrics",
    "HiddenPool",
    "HiddenStateCache",
    "KeySpec",
    "StaleRowsError",
    "BLOCK_HASH_MISMATCH",
    "RowIndex",
    "Tier",
    "block_hash_array",
    "chained_block_hashes",
    "num_full_blocks",
    "slot_ids",
]
