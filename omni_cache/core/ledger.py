"""Per-block integrity ledger: which pool rows may be served for which block tag."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

#: ``uncovered_key`` result when the block is not sealed with the asked-for tag.
TAG_MISMATCH = "<tag>"


class BlockLedger:
    """Per-block state ``(tag, owner, filled per key, generation)``.

    Invariant: rows of block ``b`` for key ``k`` may be served for tag ``t`` iff
    ``ledger.tag[b] == t and ledger.filled(b, k) == block_size``.

    - ``filled(b, k)`` counts the rows of key ``k`` written contiguously from in-block
      offset 0 during the block's current fill; a write that leaves a gap does not
      advance it, so a key skipped in some step can never reach ``block_size``.
    - ``owner[b]`` is the request (id) whose computation filled the block. vLLM frees and
      reallocates block ids, so any write by a different owner starts a new fill:
      ``tag=None``, every key's ``filled=0``, ``generation += 1``.
    - Within one owner, writes normally advance in offset order. A write starting at an
      offset already filled (recompute after preemption, rejected speculative tokens)
      truncates every key's fill to that offset before applying the write.
    - ``tag[b]`` is ``None`` while the block is partial; ``seal`` (or ``record_write`` with
      a tag) sets it once the block is full. A write to a sealed block under a different
      tag (``None`` included) resets it. Seals by non-owners are ignored.

    Owners must be unique for a request's lifetime (vLLM request ids are). Every physical
    write to a pool block must be recorded here, and one write per request per step must
    carry all of that step's keys (a second write at the same offsets is a recompute).
    Tags are opaque hashable values (``block_chain_tags`` ints or vLLM ``BlockHash``).
    """

    def __init__(self, num_blocks: int, block_size: int, keys: Sequence[str]) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = tuple(keys)
        self._key_index = {k: i for i, k in enumerate(self.keys)}
        self.tag: list[Hashable | None] = [None] * num_blocks
        self.owner: list[str | None] = [None] * num_blocks
        self.generation: list[int] = [0] * num_blocks
        self._filled: list[list[int]] = [[0] * len(self.keys) for _ in range(num_blocks)]

    def _indices(self, keys: Iterable[str]) -> list[int]:
        try:
            return [self._key_index[k] for k in keys]
        except KeyError as e:
            raise ValueError(f"unknown key {e.args[0]!r}; ledger keys are {self.keys}") from None

    def filled(self, block_id: int, key: str) -> int:
        """Rows of ``key`` written contiguously from offset 0 in the block's current fill."""
        return self._filled[block_id][self._key_index[key]]

    def _reset(self, block_id: int, owner: str | None) -> None:
        self.tag[block_id] = None
        self.owner[block_id] = owner
        self._filled[block_id] = [0] * len(self.keys)
        self.generation[block_id] += 1

    def invalidate(self, block_id: int) -> None:
        """Forget the block's contents: nothing in it is served until refilled and sealed."""
        self._reset(block_id, None)

    def record_write(
        self,
        block_id: int,
        tag: Hashable | None,
        start: int,
        end: int,
        keys: Iterable[str],
        *,
        owner: str,
    ) -> None:
        """Rows at in-block offsets ``[start, end)`` were written for ``keys`` by ``owner``.

        ``tag`` is the block's tag if the block is full after this write (then it is
        sealed with it), else ``None``.

        Raises:
            ValueError: bad offsets or an unknown key.
        """
        if not 0 <= start < end <= self.block_size:
            raise ValueError(f"block {block_id}: bad in-block range [{start}, {end})")
        indices = self._indices(keys)
        if owner != self.owner[block_id] or (
            self.tag[block_id] is not None and self.tag[block_id] != tag
        ):
            self._reset(block_id, owner)
        filled = self._filled[block_id]
        for i in range(len(filled)):
            filled[i] = min(filled[i], start)  # rows at >= start are being redefined
        for i in indices:
            if filled[i] == start:
                filled[i] = end
        if tag is not None:
            self.tag[block_id] = tag

    def seal(self, block_id: int, tag: Hashable, *, owner: str) -> None:
        """Mark the block full with ``tag`` (its chained hash) on behalf of ``owner``.

        Only the owner can seal: a seal by another owner (e.g. a request restating the
        tags of its prefix-hit blocks, possibly before the owner's write of the same step)
        is ignored, since that request wrote none of the rows. An owner re-sealing with a
        different tag resets the fill, so the block is not served until refilled.
        """
        if owner != self.owner[block_id] or self.tag[block_id] == tag:
            return
        if self.tag[block_id] is not None:
            self._reset(block_id, owner)
        self.tag[block_id] = tag

    def uncovered_key(self, block_id: int, tag: Hashable, keys: Iterable[str]) -> str | None:
        """``None`` if the block may be served for ``tag`` and all ``keys``; else the reason:
        :data:`TAG_MISMATCH` or the first key that is not fully filled."""
        if self.tag[block_id] is None or self.tag[block_id] != tag:
            return TAG_MISMATCH
        filled = self._filled[block_id]
        for i in self._indices(keys):
            if filled[i] != self.block_size:
                return self.keys[i]
        return None

    def covered_blocks(
        self, block_ids: Sequence[int], tags: Sequence[Hashable], keys: Iterable[str]
    ) -> int:
        """Length of the longest prefix of ``block_ids`` sealed with the matching ``tags``
        and fully filled for every key in ``keys``."""
        keys = tuple(keys)
        n = 0
        for block_id, tag in zip(block_ids, tags):
            if self.uncovered_key(int(block_id), tag, keys) is not None:
                break
            n += 1
        return n
