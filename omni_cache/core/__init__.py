"""Engine-independent core of omni-cache: a hidden-state prefix cache that
mirrors vLLM's paged KV cache.

Import invariant: nothing under ``omni_cache.core`` imports ``vllm`` or
``vllm_omni`` -- only ``torch``, ``numpy`` and the standard library
(enforced by ``tests/unit/test_core_import.py``). Engine glue lives in
``omni_cache.engine`` and ``omni_cache.driver``.

One concept per module:

- :mod:`.slots`         -- block table -> slot mapping (vLLM's addressing of a token's KV).
- :mod:`.block_hashes`  -- chained block hashes, and the checks of block hash values.
- :mod:`.row_index`     -- the index of a pool operation, copied once per device through a
  pinned staging ring.
- :mod:`.pinned_view`   -- the zero-copy (DLPack) view of pinned host memory from the GPU.
- :mod:`.committer`     -- the thread that commits staged device -> host writes.
- :mod:`.pool`          -- :class:`HiddenPool`, one key's ``[num_blocks, block_size, width]``
  storage (device, pinned host read/written by the GPU in place, or host).
- :mod:`.ledger_state`  -- the ledger's per-block numpy arrays and their updates.
- :mod:`.ledger`        -- :class:`BlockLedger`, per-block integrity (block hash, owner, fill).
- :mod:`.request_write` -- :class:`~.request_write.RequestWrite`, one request's step write,
  typed at the cache's boundary.
- :mod:`.interface`     -- :class:`KeySpec`, :class:`CacheMetrics`, :class:`StaleRowsError`.
- :mod:`.cache`         -- :class:`HiddenStateCache`, pools + ledger + metrics.
- :mod:`.step_write`    -- a whole engine step's rows of every request written at once.
- :mod:`.staging`       -- a step's hand-off rows (and async decode ids) staged device ->
  pinned host without a host sync.
- :mod:`.fused`         -- one kernel launch for all keys' rows of a request's write (Triton,
  imported lazily and only for CUDA writes; optional: without it the pools' torch path runs).
- :mod:`.slot_write`    -- rows to the slot mapping's slots as one torch custom op (the in-graph
  save's write; not wired into the engine yet).
- :mod:`.coverage`, :mod:`.talker_keys` -- the scheduler's record of written blocks, the
  talker's block keys.
"""

from omni_cache.core.block_hashes import chained_block_hashes
from omni_cache.core.cache import HiddenStateCache
from omni_cache.core.interface import CacheMetrics, KeySpec, StaleRowsError
from omni_cache.core.ledger import BLOCK_HASH_MISMATCH, BlockLedger
from omni_cache.core.pool import HiddenPool, Tier

__all__ = [
    "BLOCK_HASH_MISMATCH",
    "BlockLedger",
    "CacheMetrics",
    "HiddenPool",
    "HiddenStateCache",
    "KeySpec",
    "StaleRowsError",
    "Tier",
    "chained_block_hashes",
]
