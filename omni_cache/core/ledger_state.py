"""The ledger's per-block state as numpy arrays, and its updates on checked arguments.

:class:`~omni_cache.core.ledger.BlockLedger` checks arguments, interns owners, defers and
chooses between a block-by-block and a vectorised update; :class:`BlockStates` holds the arrays
and applies both kinds. :class:`BlockWrite` is the typed form of one request's step write as
the ledger records (or defers) it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

#: owner id of a block nobody owns (fresh or invalidated)
NO_OWNER = -1
#: owner id of an owner that owns no block (never equal to a block's owner)
UNKNOWN_OWNER = -2
#: key masks memoised per ledger (distinct key sets a cache asks for; more are built each time)
MAX_MEMOISED_MASKS = 64


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """The blocks one request's step wrote, as the ledger records them.

    Attributes:
        block_ids: int ``[u]`` (numpy int64 or a list): consecutive entries of the request's
            block table, each in ``[0, num_blocks)`` (the caller checks).
        first_start: in-block offset of the write's first row in ``block_ids[0]`` (tokens).
        last_end: in-block end of the write's last row in ``block_ids[-1]`` (tokens); the
            blocks between are written whole.
        block_hashes: uint64 ``[u]`` (numpy or a list of ints): the hash each block is cached
            with where ``hashed``.
        hashed: bool ``[u]`` (numpy or a list), or ``True`` for all: whether the block is full
            after this write (then cached with its hash).
        key_mask: bool ``[len(ledger keys)]``: the keys written
            (:meth:`~omni_cache.core.ledger.BlockLedger.key_mask`).
        owner: the writer (the request id).

    Handed over: once passed to the ledger, its arrays must not be modified (a deferred
    write keeps them).
    """

    block_ids: np.ndarray | list[int]
    first_start: int
    last_end: int
    block_hashes: np.ndarray | list[int]
    hashed: np.ndarray | list[bool] | bool
    key_mask: np.ndarray
    owner: Hashable


class BlockStates:
    """Per block: ``block_hash`` (uint64, meaningful where ``cached``), ``cached`` (bool),
    ``owner`` (int64 interned owner id, :data:`NO_OWNER` if nobody's), ``generation`` (int64,
    fills reset so far) and ``filled`` (int64 ``[keys, num_blocks]``, key-major so a step sets
    each key's fills with one scatter).

    Every method takes checked arguments: block ids in range, owner ids, block hashes as
    unsigned 64-bit values, key masks over the current keys.
    """

    def __init__(self, num_blocks: int, block_size: int, num_keys: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.block_hash = np.zeros(num_blocks, dtype=np.uint64)
        self.cached = np.zeros(num_blocks, dtype=bool)
        self.owner = np.full(num_blocks, NO_OWNER, dtype=np.int64)
        self.generation = np.zeros(num_blocks, dtype=np.int64)
        self.filled = np.zeros((num_keys, num_blocks), dtype=np.int64)
        self._mark = np.zeros(num_blocks, dtype=np.int64)  # scratch of the distinct-blocks check
        self._order = np.arange(num_blocks, dtype=np.int64)

    def add_key(self) -> None:
        """One more key, filled nowhere."""
        self.filled = np.concatenate([self.filled, np.zeros((1, self.num_blocks), dtype=np.int64)])

    def distinct(self, ids: np.ndarray) -> bool:
        """Whether the int64 block ids ``ids`` (``[n]``) are pairwise distinct."""
        if ids.size < 2:
            return True
        order = self._order[:ids.size]
        self._mark[ids] = order
        return not np.count_nonzero(self._mark.take(ids) != order)

    def reset(self, ids: np.ndarray, owner_id: int) -> None:
        """Start a new fill of blocks ``ids`` (int64 ``[n]``, distinct) owned by ``owner_id``."""
        self.cached[ids] = False
        self.owner[ids] = owner_id
        for row in self.filled:
            row[ids] = 0
        self.generation[ids] += 1

    def reset_one(self, b: int, owner_id: int) -> None:
        """:meth:`reset` of one block."""
        self.cached[b] = False
        self.owner[b] = owner_id
        self.filled[:, b] = 0
        self.generation[b] += 1

    # -- block by block ---------------------------------------------------------
    def write_one(self, b: int, start: int, end: int, block_hash: int | None, key_mask: list[bool],
                  owner_id: int) -> None:
        """Rows ``[start, end)`` of block ``b`` written for the keys of ``key_mask``;
        ``block_hash``: the block is full and cached with it (``None``: not hashed)."""
        if self.owner.item(b) != owner_id or (self.cached.item(b) and self.block_hash.item(b) != block_hash):
            self.reset_one(b, owner_id)
        filled = self.filled
        for i, written in enumerate(key_mask):
            v = filled.item(i, b)
            if written and v >= start:  # rows at >= start are being redefined, then extended
                filled[i, b] = end
            elif v > start:
                filled[i, b] = start
        if block_hash is not None:
            self.block_hash[b] = block_hash
            self.cached[b] = True

    def cache_one(self, b: int, block_hash: int, owner_id: int) -> None:
        """Block ``b`` is full with ``block_hash``, says ``owner_id`` (ignored from a non-owner)."""
        if self.owner.item(b) != owner_id or (self.cached.item(b) and self.block_hash.item(b) == block_hash):
            return
        if self.cached.item(b):
            self.reset_one(b, owner_id)
        self.block_hash[b] = block_hash
        self.cached[b] = True

    def write_request_few(self, write: BlockWrite, owner_id: int) -> None:
        """A request's step write (:class:`BlockWrite`), block by block."""
        n, bs = len(write.block_ids), self.block_size
        mask = write.key_mask.tolist()
        hashed = [True] * n if write.hashed is True else write.hashed
        ids, hashes, full = (x if isinstance(x, list) else x.tolist()
                             for x in (write.block_ids, write.block_hashes, hashed))
        for j in range(n):
            self.write_one(ids[j], write.first_start if j == 0 else 0, write.last_end if j == n - 1 else bs,
                           hashes[j] if full[j] else None, mask, owner_id)

    def first_uncovered_few(self, ids: list[int], hashes: list[int | None], need: list[int]) -> int:
        """Index of the first block of ``ids`` not cached with its ``hashes`` entry or not
        full for a key index of ``need``; ``len(ids)`` if none."""
        bs, filled = self.block_size, self.filled
        for j, b in enumerate(ids):
            if not self.cached.item(b) or self.block_hash.item(b) != hashes[j]:
                return j
            for i in need:
                if filled.item(i, b) != bs:
                    return j
        return len(ids)

    # -- vectorised (distinct block ids) -------------------------------------------
    def write_blocks(self, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, block_hashes: np.ndarray,
                     hashed: np.ndarray, key_mask: np.ndarray, owner_id: int) -> None:
        """Rows ``[starts[j], ends[j])`` of distinct blocks ``ids`` (int64 ``[n]``) written
        for the keys of ``key_mask``; ``hashed`` (bool ``[n]``) blocks cached with their
        ``block_hashes`` (uint64 ``[n]``)."""
        # a write by another owner, or under another block hash than the cached one, starts a new fill
        reset = (self.owner.take(ids) != owner_id) | (
            self.cached.take(ids) & ~(hashed & (self.block_hash.take(ids) == block_hashes)))
        if np.count_nonzero(reset):
            self.reset(ids[reset], owner_id)
        for i, written in enumerate(key_mask.tolist()):
            f = np.minimum(self.filled[i].take(ids), starts)  # rows at >= start are being redefined
            self.filled[i][ids] = np.where(f == starts, ends, f) if written else f
        if np.count_nonzero(hashed):
            h = ids[hashed]
            self.block_hash[h] = block_hashes[hashed]
            self.cached[h] = True

    def write_one_row_each(self, ids: np.ndarray, starts: np.ndarray, owner_ids: np.ndarray,
                           key_mask: np.ndarray) -> bool:
        """Row ``starts[j]`` (int64 ``[n]``, in-block offsets) of blocks ``ids`` (int64 ``[n]``)
        written by owner ``owner_ids[j]`` for the keys of ``key_mask``, no block hashed: what
        ``write_one(ids[j], starts[j], starts[j] + 1, None, key_mask, owner_ids[j])`` does for
        every ``j`` (a decode step's writes, one row per request), vectorised. Returns False,
        changing nothing, where that equivalence is not given here: repeated block ids, an owner
        id below 0 (never seen: :meth:`OwnerIds.known_ids`)."""
        if np.count_nonzero(owner_ids < 0) or not self.distinct(ids):
            return False
        reset = (self.owner.take(ids) != owner_ids) | self.cached.take(ids)
        if np.count_nonzero(reset):
            r = ids[reset]
            self.cached[r] = False
            self.owner[r] = owner_ids[reset]
            self.filled[:, r] = 0
            self.generation[r] += 1
        ends = starts + 1
        for i, written in enumerate(key_mask.tolist()):
            f = np.minimum(self.filled[i].take(ids), starts)  # rows at >= start are being redefined
            self.filled[i][ids] = np.where(f == starts, ends, f) if written else f
        return True

    def write_one_row_each_few(self, ids: list[int], starts: list[int], owner_ids: list[int],
                               key_mask: list[bool]) -> bool:
        """:meth:`write_one_row_each` block by block (:meth:`write_one`; one or two requests:
        cheaper than a dozen array operations), with the same refusals."""
        if owner_ids and (min(owner_ids) < 0 or len(set(ids)) != len(ids)):
            return False
        for b, o, owner_id in zip(ids, starts, owner_ids, strict=True):
            self.write_one(b, o, o + 1, None, key_mask, owner_id)
        return True

    def write_request_many(self, write: BlockWrite, ids: np.ndarray, owner_id: int) -> None:
        """A request's step write (:class:`BlockWrite`) over distinct blocks ``ids`` (its
        ``block_ids`` as int64 ``[n]``), vectorised.

        Whole blocks (all but maybe the first and the last) end up filled to ``block_size``
        for the written keys and 0 for the others, whatever they held; the last block to
        ``last_end``; only a first block written from ``first_start > 0`` depends on its old
        fill."""
        n, bs, first_start, last_end = ids.size, self.block_size, write.first_start, write.last_end
        hashes = np.asarray(write.block_hashes, dtype=np.uint64)
        all_hashed = write.hashed is True or np.count_nonzero(write.hashed) == n
        current = self.block_hash.take(ids)
        cached = self.cached.take(ids)
        hashed = None if write.hashed is True else np.asarray(write.hashed, dtype=bool)
        if all_hashed:  # a cached block under another hash starts a new fill
            cached_other = cached & (current != hashes)
        else:
            cached_other = cached & ~(hashed & (current == hashes))
        reset = (self.owner.take(ids) != owner_id) | cached_other
        first, last = ids.item(0), ids.item(-1)
        old_first = 0 if reset.item(0) else None  # the first block's fill before this write
        if first_start and old_first is None:
            old_first = self.filled[:, first].tolist()
        self.owner[ids] = owner_id
        self.generation[ids] += reset
        end_of_first = last_end if n == 1 else bs
        for i, written in enumerate(write.key_mask.tolist()):
            row = self.filled[i]
            row[ids] = bs if written else 0
            row[last] = last_end if written else 0
            if first_start:
                f = min(0 if old_first == 0 else old_first[i], first_start)
                row[first] = end_of_first if written and f == first_start else f
        if all_hashed:
            self.block_hash[ids] = hashes
            self.cached[ids] = True
        else:
            self.block_hash[ids] = np.where(hashed, hashes, current)
            self.cached[ids] = hashed | (cached & ~reset)

    def cache_blocks(self, ids: np.ndarray, block_hashes: np.ndarray, owner_id: int) -> None:
        """:meth:`cache_one` for distinct blocks ``ids`` (int64 ``[n]``) with ``block_hashes``
        (uint64 ``[n]``)."""
        already = self.cached.take(ids) & (self.block_hash.take(ids) == block_hashes)
        changes = (self.owner.take(ids) == owner_id) & ~already
        if not np.count_nonzero(changes):
            return
        changed = ids[changes]
        was_cached = self.cached.take(changed)
        if np.count_nonzero(was_cached):
            self.reset(changed[was_cached], owner_id)
        self.block_hash[changed] = block_hashes[changes]
        self.cached[changed] = True

    def first_uncovered_many(self, ids: np.ndarray, hashes: np.ndarray, valid: np.ndarray | None,
                             need: list[int]) -> int:
        """:meth:`first_uncovered_few` over int64 ``ids`` ``[n]`` and uint64 ``hashes`` ``[n]``
        (``valid``: bool ``[n]``, entries that are block hashes; ``None``: all)."""
        ok = self.cached.take(ids) & (self.block_hash.take(ids) == hashes)
        if valid is not None:
            ok &= valid
        for i in need:
            ok &= self.filled[i].take(ids) == self.block_size
        i = int(ok.argmin())
        return i if not ok[i] else ids.size


class OwnerIds:
    """Owners (request ids, any hashable) interned as int64 ids for :class:`BlockStates`.

    Interned owners are pruned (those owning no block dropped) when their number reaches
    ``max(floor, 2 x the owners kept at the last pruning)``: amortised O(1) per owner. Ids are
    never reused, so an owner that comes back after a pruning gets a new id, which, like the
    old one, owns no block.
    """

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self._ids: dict[Hashable, int] = {}
        self._names: dict[int, Hashable] = {}
        self._next = 0
        self._limit = floor

    def known_ids(self, owners) -> np.ndarray:
        """The ids (int64 ``[n]``) of ``owners`` (a sequence), :data:`UNKNOWN_OWNER` for one not
        interned and :data:`NO_OWNER` for ``None``; interns nothing."""
        ids = self._ids
        return np.fromiter((NO_OWNER if o is None else ids.get(o, UNKNOWN_OWNER) for o in owners),
                           dtype=np.int64, count=len(owners))

    def known_id(self, owner: Hashable | None) -> int:
        """:meth:`known_ids` of one owner."""
        return NO_OWNER if owner is None else self._ids.get(owner, UNKNOWN_OWNER)

    def id_of(self, owner: Hashable | None, create: bool, block_owners: np.ndarray) -> int:
        """The id of ``owner``: :data:`NO_OWNER` for ``None``; for an owner not interned, a new
        id (``create``; pruning first by ``block_owners``, int64 ``[num_blocks]``, the owner id
        of each block) or :data:`UNKNOWN_OWNER`."""
        if owner is None:
            return NO_OWNER
        owner_id = self._ids.get(owner)
        if owner_id is None:
            if not create:
                return UNKNOWN_OWNER
            if len(self._ids) >= self._limit:
                self._forget_idle(block_owners)
            owner_id = self._next
            self._next += 1
            self._ids[owner] = owner_id
            self._names[owner_id] = owner
        return owner_id

    def name_of(self, owner_id: int) -> Hashable | None:
        """The owner interned as ``owner_id``; ``None`` for :data:`NO_OWNER`."""
        return self._names.get(owner_id)

    def _forget_idle(self, block_owners: np.ndarray) -> None:
        live = set(np.unique(block_owners[block_owners >= 0]).tolist())
        self._ids = {o: i for o, i in self._ids.items() if i in live}
        self._names = {i: o for o, i in self._ids.items()}
        self._limit = max(self.floor, 2 * len(self._ids))


class KeyMasks:
    """The ledger's keys in order, and masks over them (bool ``[len(keys)]``), memoised."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.index = {k: i for i, k in enumerate(keys)}
        self._masks: dict[tuple[str, ...], np.ndarray] = {}
        self._needs: dict[bytes, list[int]] = {}

    def add(self, key: str) -> None:
        """One more key, last."""
        self.index[key] = len(self.keys)
        self.keys = (*self.keys, key)
        self._masks.clear()  # masks are over the keys
        self._needs.clear()

    def mask(self, keys: tuple[str, ...]) -> np.ndarray:
        """Read-only bool ``[len(self.keys)]``: which keys are in ``keys``.

        Raises:
            ValueError: an unknown key.
        """
        mask = self._masks.get(keys)
        if mask is None:
            mask = np.zeros(len(self.keys), dtype=bool)
            try:
                for k in keys:
                    mask[self.index[k]] = True
            except KeyError as e:
                raise ValueError(f"unknown key {e.args[0]!r}; ledger keys are {self.keys}") from None
            mask.flags.writeable = False
            if len(self._masks) < MAX_MEMOISED_MASKS:
                self._masks[keys] = mask
        return mask

    def need(self, key_mask: np.ndarray) -> list[int]:
        """Indices of the keys set in ``key_mask``."""
        k = key_mask.tobytes()
        need = self._needs.get(k)
        if need is None:
            need = self._needs[k] = np.flatnonzero(key_mask).tolist()
        return need


class PerBlock(Sequence):
    """Read-only per-block view of one field of a :class:`~omni_cache.core.ledger.BlockLedger`
    (``view[block_id]``), its deferred writes settled first."""

    def __init__(self, ledger, get) -> None:
        self._ledger, self._get = ledger, get

    def __len__(self) -> int:
        return self._ledger.num_blocks

    def __getitem__(self, block_id):
        if isinstance(block_id, slice):
            return [self[b] for b in range(*block_id.indices(len(self)))]
        if self._ledger._pending:
            self._ledger.settle()
        return self._get(self._ledger._states, int(block_id))
