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

from collections.abc import Hashable, Iterable, Mapping, Sequence


#: ``keys`` value meaning "every cached key" (the default: a normal forward writes all keys).
ALL_KEYS = None


class WrittenBlocks:
    """block id → content hash of the block when its rows were completed, and which keys
    those rows are valid for.

    Invariant: ``covered(blocks, keys)`` counts a block only if its current content hash
    equals the hash recorded when its rows were completed, and every key in ``keys`` was
    valid in every write into it. Per-key validity: under KV-sharing fast prefill the final
    hidden rows of a prefill chunk are wrong, so such a block is recorded valid for the
    captured keys only (``keys=frozenset({...})``) and a hit that needs the final hidden
    states is capped before it (docs/yoco.md).
    """

    def __init__(self) -> None:
        self._hash: dict[int, Hashable] = {}
        self._keys: dict[int, frozenset[str] | None] = {}

    def record(self, block_id: int, block_hash: Hashable | None,
               keys: frozenset[str] | None = ALL_KEYS) -> None:
        """Rows of ``block_id`` are complete for content ``block_hash`` (None: forget),
        valid for ``keys`` (:data:`ALL_KEYS`: every key)."""
        if block_hash is None:
            self.forget(block_id)
        else:
            self._hash[block_id] = block_hash
            self._keys[block_id] = None if keys is ALL_KEYS else frozenset(keys)

    def forget(self, block_id: int) -> None:
        self._hash.pop(block_id, None)
        self._keys.pop(block_id, None)

    def covered(self, blocks: Sequence[tuple[int, Hashable | None]],
                keys: Iterable[str] | None = ALL_KEYS,
                pending: Mapping[int, tuple[Hashable, frozenset[str] | None]] | None = None) -> int:
        """Number of leading ``(block_id, current_hash)`` pairs whose rows are complete and
        valid for every key in ``keys`` (:data:`ALL_KEYS`: valid for all keys).

        ``pending``: block id → ``(hash, keys)`` of blocks that requests already scheduled in
        the current step complete in that step (their rows are written before any hit of the
        step is read); such a block counts as if recorded.
        """
        need = None if keys is ALL_KEYS else frozenset(keys)
        n = 0
        for block_id, h in blocks:
            if h is None:
                break
            if self._hash.get(block_id) == h:
                have = self._keys.get(block_id)
            elif pending is not None and block_id in pending and pending[block_id][0] == h:
                have = pending[block_id][1]
            else:
                break
            if have is not None and (need is None or not need <= have):
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._hash)


def spans_overlap(spans: Iterable[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether any ``[a, b)`` in ``spans`` overlaps ``[lo, hi)`` (token positions)."""
    return any(a < hi and lo < b for a, b in spans)
