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

import enum
from collections.abc import Hashable, Iterable, Mapping, Sequence


class RowValidity(enum.Enum):
    """Which cached keys a write's rows are valid for.

    ``ALL_KEYS`` covers ``CAPTURED_ONLY`` (a block valid for every key serves a hit that needs
    only the captured layers), not the other way round.
    """

    ALL_KEYS = "all keys"
    #: every key but the final hidden states: under KV-sharing fast prefill a prefill chunk's
    #: final hidden rows are the self-decoder output (docs/yoco.md)
    CAPTURED_ONLY = "captured layers only"

    def serves(self, need: RowValidity) -> bool:
        """Whether rows valid for ``self`` serve a hit that needs ``need``."""
        return self is RowValidity.ALL_KEYS or need is RowValidity.CAPTURED_ONLY


class WrittenBlocks:
    """block id → content hash of the block when its rows were completed, and which keys
    those rows are valid for (:class:`RowValidity`).

    Invariant: ``covered(blocks, need)`` counts a block only if its current content hash
    equals the hash recorded when its rows were completed, and the rows of every write into
    it were valid for ``need`` (a block written under KV-sharing fast prefill is recorded
    ``CAPTURED_ONLY`` and a hit that needs the final hidden states is capped before it).
    """

    def __init__(self) -> None:
        self._hash: dict[int, Hashable] = {}
        self._validity: dict[int, RowValidity] = {}

    def record(self, block_id: int, block_hash: Hashable | None,
               validity: RowValidity = RowValidity.ALL_KEYS) -> None:
        """Rows of ``block_id`` are complete for content ``block_hash`` (None: forget),
        valid for ``validity``."""
        if block_hash is None:
            self.forget(block_id)
        else:
            self._hash[block_id] = block_hash
            self._validity[block_id] = validity

    def forget(self, block_id: int) -> None:
        """Nothing is known about ``block_id``'s rows any more."""
        self._hash.pop(block_id, None)
        self._validity.pop(block_id, None)

    def covered(self, blocks: Sequence[tuple[int, Hashable | None]],
                need: RowValidity = RowValidity.ALL_KEYS,
                pending: Mapping[int, tuple[Hashable, RowValidity]] | None = None) -> int:
        """Number of leading ``(block_id, current_hash)`` pairs whose rows are complete and
        serve ``need``.

        ``pending``: block id → ``(hash, validity)`` of blocks that requests already
        scheduled in the current step complete in that step (their rows are written before
        any hit of the step is read); such a block counts as if recorded.
        """
        n = 0
        for block_id, h in blocks:
            if h is None:
                break
            if self._hash.get(block_id) == h:
                have = self._validity[block_id]
            elif pending is not None and block_id in pending and pending[block_id][0] == h:
                have = pending[block_id][1]
            else:
                break
            if not have.serves(need):
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._hash)


def spans_overlap(spans: Iterable[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether any ``[a, b)`` in ``spans`` overlaps ``[lo, hi)`` (token positions)."""
    return any(a < hi and lo < b for a, b in spans)
