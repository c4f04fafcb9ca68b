"""Per-block integrity ledger: which pool rows may be served for which block hash.

The state (:class:`~omni_cache.core.ledger_state.BlockStates`) is held in numpy arrays, one
entry per KV block, and updated with vectorised operations over the blocks a request touches
in a step, so a step's bookkeeping costs a few array operations rather than a Python loop per
block. Calls over a few blocks run block by block instead (cheaper); both give the same state.

Call order: a request's step write may be deferred (:meth:`BlockLedger.defer_request_write`);
every other method applies the deferred writes first, in call order, so each sees exactly the
state of applying every write at its call. Not thread-safe: one thread (the model runner's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from omni_cache.core.block_hashes import U64_END, HashesLike, block_hash_array, hash_list, hash_value
from omni_cache.core.ledger_state import NO_OWNER, BlockStates, BlockWrite, KeyMasks, OwnerIds, PerBlock
from omni_cache.core.row_index import in_range
from omni_cache.core.slots import BlockIds

#: ``uncovered_key`` result when the block is not cached with the asked-for block hash.
BLOCK_HASH_MISMATCH = "<block hash>"
#: default :class:`~omni_cache.core.ledger_state.OwnerIds` floor: owners interned before a pruning
OWNER_FLOOR = 1024


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
    - ``block_hash[b]`` is ``None`` while the block is partial; ``cache_full_block`` (or
      ``record_write`` with a block hash) sets it once the block is full. A write to a cached
      block under a different block hash (``None`` included) resets it. Caching calls by
      non-owners are ignored.

    Owners must be unique for a request's lifetime (vLLM request ids are). Every physical
    write to a pool block must be recorded here, and one write per request per step must
    carry all of that step's keys (a second write at the same offsets is a recompute).

    Block hashes are unsigned 64-bit ints (``chained_block_hashes``' values; see
    :func:`~omni_cache.core.block_hashes.block_hash_array` for the accepted forms). Recording a
    write with anything else raises ``ValueError``; looking one up never matches.

    The batched methods :meth:`record_writes`, :meth:`record_request_write`,
    :meth:`cache_full_blocks` and :meth:`first_uncovered` update or read all of a step's
    blocks with a few array operations; :meth:`record_write`, :meth:`cache_full_block` and
    :meth:`uncovered_key` are their one-block forms, with identical results (tested against a
    per-block reference in ``tests/unit/test_core_properties.py``).
    """

    #: Calls over at most this many blocks run block by block (a few numpy scalar accesses
    #: per block beat a dozen array operations); larger ones run vectorised. Both give the
    #: same results: the property tests run with it at 0 too.
    scalar_max = 4
    #: The same for :meth:`first_uncovered` (a block costs less to check than to write).
    scalar_max_read = 16
    #: Whether :meth:`defer_request_write` may defer (see there); ``False``: it applies at once.
    defer = True
    #: Deferred writes kept at most (then applied): bounds their memory where nothing looks up.
    pending_max = 64

    def __init__(self, num_blocks: int, block_size: int, keys: Sequence[str], *,
                 owner_floor: int = OWNER_FLOOR) -> None:
        """``owner_floor``: see :class:`~omni_cache.core.ledger_state.OwnerIds`."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self._keys = KeyMasks(tuple(keys))
        self._states = BlockStates(num_blocks, block_size, len(self._keys.keys))
        self._owners = OwnerIds(owner_floor)
        self._pending: deque[BlockWrite] = deque()  # deferred writes, oldest first
        #: ``block_hash[b]``: the block's hash (int) while cached, else ``None``.
        self.block_hash = PerBlock(self, lambda s, b: int(s.block_hash[b]) if s.cached[b] else None)
        #: ``owner[b]``: the owner whose fill the block holds, ``None`` if nobody's.
        self.owner = PerBlock(self, lambda s, b: self._owners.name_of(int(s.owner[b])))
        #: ``generation[b]``: how many times the block's fill was reset.
        self.generation = PerBlock(self, lambda s, b: int(s.generation[b]))

    # -- deferred writes -------------------------------------------------------
    def settle(self) -> None:
        """Apply the deferred writes (:meth:`defer_request_write`), in order. Called by every
        method that reads or changes the state; also callable when the host has time to spare
        (e.g. while it waits for the GPU), so that the next lookup finds nothing to apply."""
        pending = self._pending
        while pending:
            self._apply_request_write(pending.popleft())

    @property
    def pending_writes(self) -> int:
        """Deferred writes not applied yet."""
        return len(self._pending)

    def add_key(self, key: str) -> None:
        """Track a new key. No block is filled for it yet, so no block is covered for it
        until a later write fills it (whatever the other keys' fill).

        Raises:
            ValueError: the key is already tracked.
        """
        if key in self._keys.index:
            raise ValueError(f"key {key!r} is already tracked")
        self.settle()
        self._keys.add(key)
        self._states.add_key()

    @property
    def keys(self) -> tuple[str, ...]:
        """The tracked keys, in the order they were added."""
        return self._keys.keys

    # -- helpers ---------------------------------------------------------------
    def key_mask(self, keys: Iterable[str]) -> np.ndarray:
        """bool ``[len(self.keys)]`` (read-only): which ledger keys are in ``keys``.

        Raises:
            ValueError: an unknown key.
        """
        return self._keys.mask(tuple(keys))

    def _owner_id(self, owner: Hashable | None, *, create: bool) -> int:
        return self._owners.id_of(owner, create, self._states.owner)

    def _block_ids(self, block_ids: BlockIds) -> np.ndarray:
        """``block_ids`` as int64 ``[n]``, each in ``[0, num_blocks)``, else ``ValueError``."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if not in_range(ids, self.num_blocks):
            raise ValueError(f"block ids outside [0, {self.num_blocks}): {ids.tolist()[:8]}")
        return ids

    # -- one block -------------------------------------------------------------
    def filled(self, block_id: int, key: str) -> int:
        """Rows (tokens) of ``key`` written contiguously from offset 0 in the block's current fill.

        Raises:
            KeyError: an unknown key.
        """
        if self._pending:
            self.settle()
        return int(self._states.filled[self._keys.index[key], block_id])

    def invalidate(self, block_id: int) -> None:
        """Forget the block's contents: nothing in it is served until refilled and cached."""
        self.invalidate_blocks([block_id])

    def invalidate_blocks(self, block_ids: BlockIds) -> None:
        """:meth:`invalidate` for every block of ``block_ids`` (int ``[n]``).

        Raises:
            ValueError: a block id outside ``[0, num_blocks)``.
        """
        if self._pending:
            self.settle()
        self._states.reset(np.unique(self._block_ids(block_ids)), NO_OWNER)

    def record_write(self, block_id: int, block_hash: int | None, start: int, end: int, keys: Iterable[str], *,
                     owner: Hashable) -> None:
        """Rows at in-block offsets ``[start, end)`` were written for ``keys`` by ``owner``.

        ``block_hash`` is the block's hash if the block is full after this write (then it is
        cached with it), else ``None``.

        Raises:
            ValueError: bad offsets, block id (outside ``[0, num_blocks)``), block hash or an
                unknown key.
        """
        b = int(self._block_ids([block_id])[0])
        if not 0 <= start < end <= self.block_size:
            raise ValueError(f"block {block_id}: bad in-block range [{start}, {end})")
        h = None if block_hash is None else hash_value(block_hash)
        if block_hash is not None and h is None:
            raise ValueError(f"block hashes are ints in [0, 2**64); got {block_hash!r}")
        if self._pending:
            self.settle()
        self._states.write_one(b, start, end, h, self.key_mask(keys).tolist(), self._owner_id(owner, create=True))

    def cache_full_block(self, block_id: int, block_hash: int, *, owner: Hashable) -> None:
        """Mark the block full with ``block_hash`` (its chained hash) on behalf of ``owner``.

        Only the owner can cache a block: a call by another owner (e.g. a request restating the
        block hashes of its prefix-hit blocks, possibly before the owner's write of the same
        step) is ignored, since that request wrote none of the rows. An owner re-caching with a
        different block hash resets the fill, so the block is not served until refilled.

        Raises:
            ValueError: a bad block id or block hash.
        """
        self.cache_full_blocks([block_id], block_hash_array([block_hash], strict=True)[0], owner=owner)

    def uncovered_key(self, block_id: int, block_hash: object, keys: Iterable[str]) -> str | None:
        """``None`` if the block may be served for ``block_hash`` and all ``keys``; else the reason:
        :data:`BLOCK_HASH_MISMATCH` or the first key that is not fully filled."""
        return self.uncovered_reason(block_id, hash_value(block_hash), self.key_mask(keys))

    def uncovered_reason(self, block_id: int, block_hash: int | None, key_mask: np.ndarray) -> str | None:
        """:meth:`uncovered_key` for a block hash already converted (``None``: not a block
        hash) and keys as a :meth:`key_mask`."""
        if self._pending:
            self.settle()
        states = self._states
        if block_hash is None or not states.cached[block_id] or states.block_hash.item(block_id) != block_hash:
            return BLOCK_HASH_MISMATCH
        short = key_mask & (states.filled[:, block_id] != self.block_size)
        return self.keys[int(np.argmax(short))] if short.any() else None

    # -- many blocks -----------------------------------------------------------
    def record_writes(self, block_ids: BlockIds, starts: np.ndarray | int, ends: np.ndarray | int,
                      block_hashes: np.ndarray | int, hashed: np.ndarray | bool, key_mask: np.ndarray, *,
                      owner: Hashable) -> None:
        """:meth:`record_write` for every block of ``block_ids`` at once.

        Args:
            block_ids: int ``[n]`` block ids.
            starts, ends: int ``[n]`` (or scalars): in-block ``[start, end)`` written in each.
            block_hashes: uint64 ``[n]`` (or a scalar): the hash each block is cached with
                where ``hashed`` (e.g. from :func:`~omni_cache.core.block_hashes.block_hash_array`).
            hashed: bool ``[n]`` (or a scalar): whether the block is full after this write
                (then cached).
            key_mask: bool ``[len(keys)]`` (:meth:`key_mask`): the keys written.
            owner: the writer.

        Blocks are expected distinct (a request's block table never repeats a block it
        writes); if some repeat, they are applied one after the other in order, as
        :meth:`record_write` would.

        Raises:
            ValueError: bad offsets or block ids.
        """
        ids = self._block_ids(block_ids)
        n = ids.size
        starts = np.broadcast_to(np.asarray(starts, dtype=np.int64), (n,))
        ends = np.broadcast_to(np.asarray(ends, dtype=np.int64), (n,))
        bad = (starts < 0) | (starts >= ends) | (ends > self.block_size)
        if np.count_nonzero(bad):
            j = int(np.argmax(bad))
            raise ValueError(f"block {int(ids[j])}: bad in-block range [{int(starts[j])}, {int(ends[j])})")
        if self._pending:
            self.settle()
        self._write_blocks(ids, starts, ends, np.broadcast_to(np.asarray(block_hashes, dtype=np.uint64), (n,)),
                           np.broadcast_to(np.asarray(hashed, dtype=bool), (n,)), key_mask,
                           self._owner_id(owner, create=True))

    def _write_blocks(self, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, block_hashes: np.ndarray,
                      hashed: np.ndarray, key_mask: np.ndarray, owner_id: int) -> None:
        """:meth:`record_writes` on checked arrays of equal length ``[n]`` and an owner id."""
        if ids.size <= self.scalar_max or not self._states.distinct(ids):  # one after the other, in order
            mask = key_mask.tolist()
            for b, s, e, h, c in zip(ids.tolist(), starts.tolist(), ends.tolist(), block_hashes.tolist(),
                                     hashed.tolist()):
                self._states.write_one(b, s, e, h if c else None, mask, owner_id)
            return
        self._states.write_blocks(ids, starts, ends, block_hashes, hashed, key_mask, owner_id)

    def _offsets_ok(self, write: BlockWrite, n: int) -> bool:
        """``True`` if the offsets of ``write`` (over ``n > 0`` blocks) are possible, else ``ValueError``."""
        bs, first_start, last_end = self.block_size, write.first_start, write.last_end
        if 0 <= first_start < bs and 0 < last_end <= bs and (n > 1 or first_start < last_end):
            return True
        raise ValueError(f"blocks {list(write.block_ids)[:8]}: bad in-block range [{first_start}, {last_end})")

    def record_request_write(self, write: BlockWrite) -> None:
        """:meth:`record_writes` for one request's step (:class:`BlockWrite`: consecutive
        blocks of its block table, written from in-block offset ``first_start`` in the first
        to ``last_end`` in the last, whole blocks between). Its arrays may be numpy arrays or,
        cheaper for a few blocks, lists.

        Raises:
            ValueError: bad offsets.
        """
        n = len(write.block_ids)
        if not (n and self._offsets_ok(write, n)):
            return
        if self._pending:
            self.settle()
        self._apply_request_write(write)

    def defer_request_write(self, write: BlockWrite) -> None:
        """:meth:`record_request_write`, whose update may be deferred: calls over more than
        :attr:`scalar_max` blocks (or made while others are deferred) are queued and applied in
        call order by :meth:`settle`, which every method that reads or changes the state calls
        first, so no lookup can tell the difference; the write's caller saves the update's host
        time (it is spent at the next lookup or :meth:`settle` instead). ``write`` is handed
        over: the caller must not modify its arrays afterwards (the cache passes arrays it made
        for the call).

        Raises:
            ValueError: bad offsets (at once, whether deferred or not).
        """
        n = len(write.block_ids)
        if not (n and self._offsets_ok(write, n)):
            return
        if self.defer and (n > self.scalar_max or self._pending):
            if len(self._pending) >= self.pending_max:
                self.settle()
            self._pending.append(write)
            return
        self._apply_request_write(write)

    def record_one_row_each(self, block_ids: np.ndarray, offsets: np.ndarray, owners: Sequence[Hashable],
                            key_mask: np.ndarray) -> bool:
        """A decode step's writes at once, as one :meth:`defer_request_write` per request would
        record them (:meth:`BlockStates.write_one_row_each`); False, nothing changed, where the
        caller must record them one by one (writes still deferred, among others); at most
        :attr:`scalar_max` rows block by block."""
        if self._pending:
            return False
        if len(block_ids) > self.scalar_max:
            return self._states.write_one_row_each(block_ids, offsets, self._owners.known_ids(owners), key_mask)
        return self._states.write_one_row_each_few(block_ids.tolist(), offsets.tolist(),
                                                   [self._owners.known_id(o) for o in owners], key_mask.tolist())

    def _apply_request_write(self, write: BlockWrite) -> None:
        """:meth:`record_request_write` on a checked write, nothing deferred."""
        owner_id = self._owners.id_of(write.owner, True, self._states.owner)
        n = len(write.block_ids)
        if n <= self.scalar_max:
            self._states.write_request_few(write, owner_id)
            return
        ids = np.asarray(write.block_ids, dtype=np.int64)
        if self._states.distinct(ids):
            self._states.write_request_many(write, ids, owner_id)
            return
        starts = np.zeros(n, dtype=np.int64)
        starts[0] = write.first_start
        ends = np.full(n, self.block_size, dtype=np.int64)
        ends[-1] = write.last_end
        self._write_blocks(ids, starts, ends, np.asarray(write.block_hashes, dtype=np.uint64),
                           np.broadcast_to(np.asarray(write.hashed, dtype=bool), (n,)), write.key_mask, owner_id)

    def cache_full_blocks(self, block_ids: BlockIds, block_hashes: np.ndarray | list[int], *,
                          owner: Hashable) -> None:
        """:meth:`cache_full_block` for every block of ``block_ids`` (int ``[n]``) with
        ``block_hashes`` (uint64 ``[n]``: checked unsigned 64-bit values, e.g. from
        :func:`~omni_cache.core.block_hashes.block_hash_array`), arrays or lists. Repeated
        blocks are applied in order.

        Raises:
            ValueError: bad block ids.
        """
        if self._pending:
            self.settle()
        owner_id = self._owner_id(owner, create=False)
        if isinstance(block_ids, list) and isinstance(block_hashes, list) and len(block_ids) <= self.scalar_max:
            if len(block_hashes) != len(block_ids) or any(
                    type(b) is not int or not 0 <= b < self.num_blocks or type(h) is not int or not 0 <= h < U64_END
                    for b, h in zip(block_ids, block_hashes)):
                raise ValueError(f"bad block ids {block_ids} for block hashes {block_hashes}")
            for b, h in zip(block_ids, block_hashes):
                self._states.cache_one(b, h, owner_id)
            return
        ids = self._block_ids(block_ids)
        hashes = np.broadcast_to(np.asarray(block_hashes, dtype=np.uint64), (ids.size,))
        if ids.size <= self.scalar_max or not self._states.distinct(ids):
            for b, h in zip(ids.tolist(), hashes.tolist()):
                self._states.cache_one(b, h, owner_id)
            return
        self._states.cache_blocks(ids, hashes, owner_id)

    def first_uncovered(self, block_ids: BlockIds, block_hashes: HashesLike, key_mask: np.ndarray) -> int:
        """Index of the first block of ``block_ids`` (int ``[n]``: list, numpy array or CPU
        tensor) not cached with its ``block_hashes`` entry (any form of
        :func:`~omni_cache.core.block_hashes.block_hash_array`; entries that are not block
        hashes match nothing) or not fully filled for some key of ``key_mask``
        (:meth:`key_mask`); ``n`` if all are covered. Reads only; no check of the block ids
        beyond numpy indexing."""
        if self._pending:
            self.settle()
        if len(block_ids) <= self.scalar_max_read:  # a few blocks: cheaper one by one
            ids = block_ids if isinstance(block_ids, list) else np.asarray(block_ids).reshape(-1).tolist()
            return self._states.first_uncovered_few(ids, hash_list(block_hashes), self._keys.need(key_mask))
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        hashes, valid = block_hash_array(block_hashes, strict=False)
        return self._states.first_uncovered_many(ids, hashes, valid, self._keys.need(key_mask))

    def covered_blocks(self, block_ids: BlockIds, block_hashes: HashesLike, keys: Iterable[str]) -> int:
        """Length of the longest prefix of ``block_ids`` (list, numpy array or CPU tensor)
        cached with the matching ``block_hashes`` and fully filled for every key in ``keys``.

        Raises:
            ValueError: an unknown key.
        """
        n = min(len(block_ids), len(block_hashes))
        return self.first_uncovered(block_ids[:n], block_hashes[:n], self.key_mask(keys))
