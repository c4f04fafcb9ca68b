"""Scheduler-side coverage of the hidden-state tier: which KV blocks have complete rows.

The scheduler (vLLM's engine core) and the pool (the model runner's worker process) live in
different processes, so the scheduler keeps its own record of what the runner writes: every
token it schedules on a stage with omni-cache is written for every cached key, so a block
whose tokens were all scheduled by one request since it was allocated has complete rows,
identified by the block's content hash at that moment. A later prefix hit is capped to the
longest leading run of blocks whose current hash still equals the recorded one — a block
that was evicted and refilled, never completed, or never written carries another hash (or
none) and ends the run. Source of the idea: LMCache #3221's note that a consistent hit
"needs the scheduler to cap the hit at what both tiers cover".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class WrittenBlocks:
    """block id → content hash of the block when its rows were completed.

    Invariant: ``covered(...)`` counts a block only if its current content hash equals the
    hash recorded when its rows were completed.
    """

    def __init__(self) -> None:
        self._hash: dict[int, Hashable] = {}

    def record(self, block_id: int, block_hash: Hashable | None) -> None:
        """Rows of ``block_id`` are complete for content ``block_hash`` (None: forget)."""
        if block_hash is None:
            self._hash.pop(block_id, None)
        else:
            self._hash[block_id] = block_hash

    def forget(self, block_id: int) -> None:
        self._hash.pop(block_id, None)

    def covered(self, blocks: Sequence[tuple[int, Hashable | None]]) -> int:
        """Number of leading ``(block_id, current_hash)`` pairs whose rows are complete."""
        n = 0
        for block_id, h in blocks:
            if h is None or self._hash.get(block_id) != h:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._hash)
