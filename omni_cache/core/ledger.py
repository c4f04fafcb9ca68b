"""Per-block integrity ledger: which pool rows may be served for which block hash."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

#: ``uncovered_key`` result when the block is not cached with the asked-for block hash.
BLOCK_HASH_MISMATCH = "<block hash>"


class BlockLedger:
    """Per-block state ``(block_hash, owner, filled per key, generation)``.

    Invariant: rows of block ``b`` for key ``k`` may be served for block hash ``t`` iff
    ``ledger.block_hash[b] == t and ledger.filled(b, k) == block_size``.

    - ``filled(b, k)`` counts the rows of key ``k`` written contiguously from in-block
      offset 0 during the block's current fill; a write that leaves a gap does not
      advance it, so a key skipped in some step can never reach ``block_size``.
    - ``owner[b]`` is the request (id) whose computation filled the block. vLLM frees and
      reallocates block ids, so any write by a different owner starts a new fill:
      ``block_hash=None``, every key's ``filled=0``, ``generation += 1``.
    - Within one owner, writes normally advance in offset order. A write starting at an
      offset already filled (recompute after preemption, rejected speculative tokens)
      truncates every key's fill to that offset before applying the write.
    - ``block_hash[b]`` is ``None`` while the block is partial; ``cache_full_block`` (or ``record_write`` with
      a block hash) sets it once the block is full. A write to a cached block under a different
      block hash (``None`` included) resets it. Caching calls by non-owners are ignored.

    Owners must be unique for a request's lifetime (vLLM request ids are). Every physical
    write to a pool block must be recorded here, and one write per request per step must
    carry all of that step's keys (a second write at the same offsets is a recompute).
    Block hashes are opaque hashable values (``chained_block_hashes`` ints or vLLM ``BlockHash``).
    """

    def __init__(self, num_blocks: int, block_size: int, keys: Sequence[str]) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = tuple(keys)
        self._key_index = {k: i for i, k in enumerate(self.keys)}
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self.owner: list[str | None] = [None] * num_blocks
        self.generation: list[int] = [0] * num_blocks
        self._filled: list[list[int]] = [[0] * len(self.keys) for _ in range(num_blocks)]

    def add_key(self, key: str) -> None:
        """Track a new key. No block is filled for it yet, so no block is covered for it
        until a later write fills it (whatever the other keys' fill).

        Raises:
            ValueError: the key is already tracked.
        """
        if key in self._key_index:
            raise ValueError(f"key {key!r} is already tracked")
        self._key_index[key] = len(self.keys)
        self.keys = (*self.keys, key)
        for filled in self._filled:
            filled.append(0)

    def _indices(self, keys: Iterable[str]) -> list[int]:
        try:
            return [self._key_index[k] for k in keys]
        except KeyError as e:
            raise ValueError(f"unknown key {e.args[0]!r}; ledger keys are {self.keys}") from None

    def filled(self, block_id: int, key: str) -> int:
        """Rows of ``key`` written contiguously from offset 0 in the block's current fill."""
        return self._filled[block_id][self._key_index[key]]

    def _reset(self, block_id: int, owner: str | None) -> None:
        self.block_hash[block_id] = None
        self.owner[block_id] = owner
        self._filled[block_id] = [0] * len(self.keys)
        self.generation[block_id] += 1

    def invalidate(self, block_id: int) -> None:
        """Forget the block's contents: nothing in it is served until refilled and cached."""
        self._reset(block_id, None)

    def record_write(
        self,
        block_id: int,
        block_hash: Hashable | None,
        start: int,
        end: int,
        keys: Iterable[str],
        *,
        owner: str,
    ) -> None:
        """Rows at in-block offsets ``[start, end)`` were written for ``keys`` by ``owner``.

        ``block_hash`` is the block's hash if the block is full after this write (then it is
        cached with it), else ``None``.

        Raises:
            ValueError: bad offsets or an unknown key.
        """
        if not 0 <= start < end <= self.block_size:
            raise ValueError(f"block {block_id}: bad in-block range [{start}, {end})")
        indices = self._indices(keys)
        if owner != self.owner[block_id] or (
            self.block_hash[block_id] is not None and self.block_hash[block_id] != block_hash
        ):
            self._reset(block_id, owner)
        filled = self._filled[block_id]
        for i in range(len(filled)):
            filled[i] = min(filled[i], start)  # rows at >= start are being redefined
        for i in indices:
            if filled[i] == start:
                filled[i] = end
        if block_hash is not None:
            self.block_hash[block_id] = block_hash

    def cache_full_block(self, block_id: int, block_hash: Hashable, *, owner: str) -> None:
        """Mark the block full with ``block_hash`` (its chained hash) on behalf of ``owner``.

        Only the owner can cache a block: a call by another owner (e.g. a request restating the
        block hashes of its prefix-hit blocks, possibly before the owner's write of the same step)
        is ignored, since that request wrote none of the rows. An owner re-caching with a
        different block hash resets the fill, so the block is not served until refilled.
        """
        if owner != self.owner[block_id] or self.block_hash[block_id] == block_hash:
            return
        if self.block_hash[block_id] is not None:
            self._reset(block_id, owner)
        self.block_hash[block_id] = block_hash

    def uncovered_key(self, block_id: int, block_hash: Hashable, keys: Iterable[str]) -> str | None:
        """``None`` if the block may be served for ``block_hash`` and all ``keys``; else the reason:
        :data:`BLOCK_HASH_MISMATCH` or the first key that is not fully filled."""
        if self.block_hash[block_id] is None or self.block_hash[block_id] != block_hash:
            return BLOCK_HASH_MISMATCH
        filled = self._filled[block_id]
        for i in self._indices(keys):
            if filled[i] != self.block_size:
                return self.keys[i]
        return None

    def covered_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[Hashable], keys: Iterable[str]
    ) -> int:
        """Length of the longest prefix of ``block_ids`` cached with the matching ``block_hashes``
        and fully filled for every key in ``keys``."""
        keys = tuple(keys)
        n = 0
        for block_id, block_hash in zip(block_ids, block_hashes):
            if self.uncovered_key(int(block_id), block_hash, keys) is not None:
                break
            n += 1
        return n
