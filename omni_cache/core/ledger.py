"""Per-block integrity ledger: which pool rows may be served for which block hash.

The state is held in numpy arrays (one entry per KV block) and updated with vectorised
operations over the blocks a request touches in a step, so a step's bookkeeping costs a few
array operations rather than a Python loop per block.
"""

from __future__ import annotations

import array
from collections import deque
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch

#: ``uncovered_key`` result when the block is not cached with the asked-for block hash.
BLOCK_HASH_MISMATCH = "<block hash>"

_NO_OWNER = -1  # owner id of a block nobody owns (fresh or invalidated)
_UNKNOWN_OWNER = -2  # owner id of an owner that owns no block (never equal to a block's owner)
_U64_END = 2**64


def _hash_value(block_hash: object) -> int | None:
    """``block_hash`` as an unsigned 64-bit int, or ``None`` if it is not one (see
    :func:`block_hash_array`)."""
    try:
        v = int(np.uint64(block_hash))
    except (TypeError, ValueError, OverflowError):
        return None
    return v if v == block_hash else None


def block_hash_array(block_hashes, *, strict: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Block hashes as ``uint64 [n]``, plus a validity mask (``None``: all valid).

    Accepted forms: a sequence of ints in ``[0, 2**64)`` (what :func:`chained_block_hashes`
    returns; ``-1``, ``"12"``, ``None`` are not block hashes; a value equal to such an int,
    e.g. ``5.0``, stands for it, as Python's ``==`` has it), a numpy array or CPU tensor of
    ``uint64``/``int64`` (int64 is reinterpreted bit for bit as uint64: ``-1`` is
    ``2**64 - 1``).

    Raises:
        ValueError: ``strict`` and some entry is not a block hash (with ``strict=False`` the
            entry is marked invalid instead: it matches no cached block).
        TypeError: an array or tensor of another dtype.
    """
    if isinstance(block_hashes, torch.Tensor):
        block_hashes = block_hashes.detach().cpu().numpy()
    if isinstance(block_hashes, np.ndarray):
        if block_hashes.dtype == np.uint64:
            return block_hashes.reshape(-1), None
        if block_hashes.dtype == np.int64:
            return block_hashes.reshape(-1).view(np.uint64), None
        raise TypeError(f"block hash arrays are uint64 or int64, not {block_hashes.dtype}")
    seq = block_hashes if isinstance(block_hashes, list) else list(block_hashes)
    try:  # array('Q') takes only integers in [0, 2**64) (no floats, strings, negatives)
        return np.frombuffer(array.array("Q", seq), dtype=np.uint64), None
    except (TypeError, ValueError, OverflowError):
        pass
    vals = [_hash_value(h) for h in seq]
    arr = np.array([v or 0 for v in vals], dtype=np.uint64)
    if all(v is not None for v in vals):
        return arr, None
    if strict:
        bad = next(h for h, v in zip(seq, vals) if v is None)
        raise ValueError(f"block hashes are ints in [0, 2**64); got {bad!r}")
    return arr, np.array([v is not None for v in vals], dtype=bool)


class _PerBlock(Sequence):
    """Read-only per-block view of one ledger field (``view[block_id]``)."""

    def __init__(self, get, n: int) -> None:
        self._get, self._n = get, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, block_id):
        if isinstance(block_id, slice):
            return [self._get(b) for b in range(*block_id.indices(self._n))]
        return self._get(int(block_id))


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
    :func:`block_hash_array` for the accepted forms). Recording a write with anything else
    raises ``ValueError``; looking one up never matches.

    Storage: numpy arrays over ``num_blocks`` (``block_hash`` uint64 + a cached flag, owner as
    an int64 id interned per owner, ``generation`` int64, ``filled`` int64
    ``[len(keys), num_blocks]``, key-major so a step sets each key's fills with one scatter). The batched methods :meth:`record_writes`,
    :meth:`cache_full_blocks` and :meth:`first_uncovered` update or read all of a step's blocks
    with a few array operations; :meth:`record_write`, :meth:`cache_full_block` and
    :meth:`uncovered_key` are their one-block forms, with identical results (tested against a
    per-block reference in ``tests/test_core_properties.py``).
    """

    #: Calls over at most this many blocks run block by block (a few numpy scalar accesses
    #: per block beat a dozen array operations); larger ones run vectorised. Both give the
    #: same results: the property tests run with it at 0 too.
    scalar_max = 4
    #: The same for :meth:`first_uncovered` (a block costs less to check than to write).
    scalar_max_read = 16
    #: Interned owners are pruned (those owning no block dropped) when their number reaches
    #: ``max(owner_floor, 2 x the owners kept at the last pruning)``: amortised O(1) per owner.
    owner_floor = 1024
    #: Whether :meth:`defer_request_write` may defer (see there); ``False``: it applies at once.
    defer = True
    #: Deferred writes kept at most (then applied): bounds their memory where nothing looks up.
    pending_max = 64

    def __init__(self, num_blocks: int, block_size: int, keys: Sequence[str]) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = tuple(keys)
        self._key_index = {k: i for i, k in enumerate(self.keys)}
        self._masks: dict[tuple[str, ...], np.ndarray] = {}  # key_mask's memo
        self._needs: dict[bytes, list[int]] = {}  # _need's memo
        self._bh = np.zeros(num_blocks, dtype=np.uint64)
        self._bc = np.zeros(num_blocks, dtype=bool)
        self._bo = np.full(num_blocks, _NO_OWNER, dtype=np.int64)
        self._bg = np.zeros(num_blocks, dtype=np.int64)
        self._bf = np.zeros((len(self.keys), num_blocks), dtype=np.int64)  # key-major
        self._mark = np.zeros(num_blocks, dtype=np.int64)  # scratch of the distinct-blocks check
        self._order = np.arange(num_blocks, dtype=np.int64)
        self._owner_ids: dict[Hashable, int] = {}
        self._owner_names: dict[int, Hashable] = {}
        self._next_owner = 0
        self._owner_limit = self.owner_floor
        #: deferred :meth:`defer_request_write` calls (their arguments), oldest first
        self._pending: deque[tuple] = deque()
        #: ``block_hash[b]``: the block's hash (int) while cached, else ``None``.
        self.block_hash = _PerBlock(self._block_hash_of, num_blocks)
        #: ``owner[b]``: the owner whose fill the block holds, ``None`` if nobody's.
        self.owner = _PerBlock(self._owner_of, num_blocks)
        #: ``generation[b]``: how many times the block's fill was reset.
        self.generation = _PerBlock(self._generation_of, num_blocks)

    # -- deferred writes -------------------------------------------------------
    # State: _bh (block hash, uint64), _bc (cached, bool), _bo (owner id, int64), _bg
    # (generation, int64), _bf (fill, int64 [keys, num_blocks]), plus the deferred writes of
    # _pending, applied in order by settle() before anything reads or changes the state: every
    # public method but defer_request_write and key_mask settles first, so each sees exactly
    # the state of applying every write at its call. The _hash, _cached, _owner, _generation and
    # _filled properties are that state, settled.

    def settle(self) -> None:
        """Apply the deferred writes (:meth:`defer_request_write`), in order. Called by every
        method that reads or changes the state; also callable when the host has time to spare
        (e.g. while it waits for the GPU), so that the next lookup finds nothing to apply."""
        pending = self._pending
        while pending:
            self._apply_request_write(*pending.popleft())

    @property
    def pending_writes(self) -> int:
        """Deferred writes not applied yet."""
        return len(self._pending)

    @property
    def _hash(self) -> np.ndarray:
        self.settle()
        return self._bh

    @property
    def _cached(self) -> np.ndarray:
        self.settle()
        return self._bc

    @property
    def _owner(self) -> np.ndarray:
        self.settle()
        return self._bo

    @property
    def _generation(self) -> np.ndarray:
        self.settle()
        return self._bg

    @property
    def _filled(self) -> np.ndarray:
        self.settle()
        return self._bf

    def _block_hash_of(self, b: int) -> int | None:
        if self._pending:
            self.settle()
        return int(self._bh[b]) if self._bc[b] else None

    def _owner_of(self, b: int) -> Hashable | None:
        if self._pending:
            self.settle()
        return self._owner_names.get(int(self._bo[b]))

    def _generation_of(self, b: int) -> int:
        if self._pending:
            self.settle()
        return int(self._bg[b])

    def add_key(self, key: str) -> None:
        """Track a new key. No block is filled for it yet, so no block is covered for it
        until a later write fills it (whatever the other keys' fill).

        Raises:
            ValueError: the key is already tracked.
        """
        if key in self._key_index:
            raise ValueError(f"key {key!r} is already tracked")
        self.settle()
        self._key_index[key] = len(self.keys)
        self.keys = (*self.keys, key)
        self._bf = np.concatenate([self._bf, np.zeros((1, self.num_blocks), dtype=np.int64)])
        self._masks.clear()  # masks are over the keys
        self._needs.clear()

    # -- helpers ---------------------------------------------------------------
    def key_mask(self, keys: Iterable[str]) -> np.ndarray:
        """bool ``[len(self.keys)]``: which ledger keys are in ``keys``.

        Raises:
            ValueError: an unknown key.
        """
        keys = tuple(keys)
        mask = self._masks.get(keys)
        if mask is None:
            mask = np.zeros(len(self.keys), dtype=bool)
            try:
                for k in keys:
                    mask[self._key_index[k]] = True
            except KeyError as e:
                raise ValueError(f"unknown key {e.args[0]!r}; ledger keys are {self.keys}") from None
            mask.flags.writeable = False
            if len(self._masks) < 64:
                self._masks[keys] = mask
        return mask

    def _owner_id(self, owner: Hashable | None, *, create: bool) -> int:
        if owner is None:
            return _NO_OWNER
        oid = self._owner_ids.get(owner)
        if oid is None:
            if not create:
                return _UNKNOWN_OWNER
            if len(self._owner_ids) >= self._owner_limit:
                self._forget_idle_owners()
            oid = self._next_owner
            self._next_owner += 1
            self._owner_ids[owner] = oid
            self._owner_names[oid] = owner
        return oid

    def _forget_idle_owners(self) -> None:
        """Drop interned owners that own no block (ids are never reused, so an owner that
        comes back gets a new id, which, like the old one, owns no block)."""
        live = set(np.unique(self._bo[self._bo >= 0]).tolist())
        self._owner_ids = {o: i for o, i in self._owner_ids.items() if i in live}
        self._owner_names = {i: o for o, i in self._owner_ids.items()}
        self._owner_limit = max(self.owner_floor, 2 * len(self._owner_ids))

    def _block_ids(self, block_ids) -> np.ndarray:
        """``block_ids`` as int64 ``[n]``, each in ``[0, num_blocks)``, else ``ValueError``."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if not in_range(ids, self.num_blocks):
            raise ValueError(f"block ids outside [0, {self.num_blocks}): {ids.tolist()[:8]}")
        return ids

    def _distinct(self, ids: np.ndarray) -> bool:
        """Whether the int64 block ids ``ids`` (in range) are pairwise distinct."""
        if ids.size < 2:
            return True
        order = self._order[:ids.size]
        self._mark[ids] = order
        return not np.count_nonzero(self._mark.take(ids) != order)

    def _reset(self, ids: np.ndarray, oid: int) -> None:
        self._bc[ids] = False
        self._bo[ids] = oid
        for row in self._bf:
            row[ids] = 0
        self._bg[ids] += 1

    def _reset_one(self, b: int, oid: int) -> None:
        self._bc[b] = False
        self._bo[b] = oid
        self._bf[:, b] = 0
        self._bg[b] += 1

    # -- one block -------------------------------------------------------------
    def filled(self, block_id: int, key: str) -> int:
        """Rows of ``key`` written contiguously from offset 0 in the block's current fill."""
        if self._pending:
            self.settle()
        return int(self._bf[self._key_index[key], block_id])

    def invalidate(self, block_id: int) -> None:
        """Forget the block's contents: nothing in it is served until refilled and cached."""
        self.invalidate_blocks([block_id])

    def invalidate_blocks(self, block_ids) -> None:
        """:meth:`invalidate` for every block of ``block_ids`` (int ``[n]``).

        Raises:
            ValueError: a block id outside ``[0, num_blocks)``.
        """
        if self._pending:
            self.settle()
        self._reset(np.unique(self._block_ids(block_ids)), _NO_OWNER)

    def record_write(
        self,
        block_id: int,
        block_hash: int | None,
        start: int,
        end: int,
        keys: Iterable[str],
        *,
        owner: Hashable,
    ) -> None:
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
        h = None if block_hash is None else _hash_value(block_hash)
        if block_hash is not None and h is None:
            raise ValueError(f"block hashes are ints in [0, 2**64); got {block_hash!r}")
        if self._pending:
            self.settle()
        self._write_one(b, start, end, h, self.key_mask(keys).tolist(), self._owner_id(owner, create=True))

    def _write_one(self, b: int, start: int, end: int, h: int | None, key_mask: list[bool], oid: int) -> None:
        """:meth:`record_write` on checked scalars (``h``: block hash or ``None``)."""
        if self._bo.item(b) != oid or (self._bc.item(b) and self._bh.item(b) != h):
            self._reset_one(b, oid)
        filled = self._bf
        for i, written in enumerate(key_mask):
            v = filled.item(i, b)
            if written and v >= start:  # rows at >= start are being redefined, then extended
                filled[i, b] = end
            elif v > start:
                filled[i, b] = start
        if h is not None:
            self._bh[b] = h
            self._bc[b] = True

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

    def _cache_one(self, b: int, h: int, oid: int) -> None:
        if self._bo.item(b) != oid or (self._bc.item(b) and self._bh.item(b) == h):
            return
        if self._bc.item(b):
            self._reset_one(b, oid)
        self._bh[b] = h
        self._bc[b] = True

    def uncovered_key(self, block_id: int, block_hash: object, keys: Iterable[str]) -> str | None:
        """``None`` if the block may be served for ``block_hash`` and all ``keys``; else the reason:
        :data:`BLOCK_HASH_MISMATCH` or the first key that is not fully filled."""
        return self.uncovered_reason(block_id, _hash_value(block_hash), self.key_mask(keys))

    def uncovered_reason(self, block_id: int, block_hash: int | None, key_mask: np.ndarray) -> str | None:
        """:meth:`uncovered_key` for a block hash already converted (``None``: not a block
        hash) and keys as a :meth:`key_mask`."""
        if self._pending:
            self.settle()
        if block_hash is None or not self._bc[block_id] or self._bh.item(block_id) != block_hash:
            return BLOCK_HASH_MISMATCH
        short = key_mask & (self._bf[:, block_id] != self.block_size)
        return self.keys[int(np.argmax(short))] if short.any() else None

    # -- many blocks -----------------------------------------------------------
    def record_writes(
        self,
        block_ids,
        starts,
        ends,
        block_hashes,
        hashed,
        key_mask: np.ndarray,
        *,
        owner: Hashable,
    ) -> None:
        """:meth:`record_write` for every block of ``block_ids`` at once.

        Args:
            block_ids: int ``[n]`` block ids.
            starts, ends: int ``[n]`` (or scalars): in-block ``[start, end)`` written in each.
            block_hashes: uint64 ``[n]`` (or a scalar): the hash each block is cached with
                where ``hashed`` (e.g. from :func:`block_hash_array`).
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
        self._write_many(ids, starts, ends, np.broadcast_to(np.asarray(block_hashes, dtype=np.uint64), (n,)),
                         np.broadcast_to(np.asarray(hashed, dtype=bool), (n,)), key_mask,
                         self._owner_id(owner, create=True))

    def record_request_write(self, block_ids, first_start: int, last_end: int, block_hashes, hashed,
                             key_mask: np.ndarray, *, owner: Hashable) -> None:
        """:meth:`record_writes` for one request's step (what
        :meth:`~omni_cache.core.cache.HiddenStateCache.write_request_rows` calls):
        ``block_ids`` (int ``[n]``, each in ``[0, num_blocks)``: the caller checks) are
        consecutive blocks of its block table, written from in-block offset ``first_start`` in
        the first to ``last_end`` in the last, whole blocks between; ``block_hashes`` (uint64
        ``[n]``) and ``hashed`` (bool ``[n]``) as in :meth:`record_writes`. Each of the three is
        a numpy array or, cheaper for a few blocks, a list.

        Raises:
            ValueError: bad offsets.
        """
        n, bs = len(block_ids), self.block_size
        if not n:
            return
        if not (0 <= first_start < bs and 0 < last_end <= bs and (n > 1 or first_start < last_end)):
            raise ValueError(f"blocks {list(block_ids)[:8]}: bad in-block range [{first_start}, {last_end})")
        if self._pending:
            self.settle()
        self._apply_request_write(block_ids, first_start, last_end, block_hashes, hashed, key_mask, owner)

    def defer_request_write(self, block_ids, first_start: int, last_end: int, block_hashes, hashed,
                            key_mask: np.ndarray, *, owner: Hashable) -> None:
        """:meth:`record_request_write`, whose update may be deferred: calls over more than
        :attr:`scalar_max` blocks (or made while others are deferred) are queued and applied in
        call order by :meth:`settle`, which every method that reads or changes the state calls
        first, so no lookup can tell the difference; the write's caller saves the update's host
        time (it is spent at the next lookup or :meth:`settle` instead). The arguments are
        handed over: the caller must not modify them afterwards (the cache passes arrays it
        made for the call).

        Raises:
            ValueError: bad offsets (at once, whether deferred or not).
        """
        n, bs = len(block_ids), self.block_size
        if not n:
            return
        if not (0 <= first_start < bs and 0 < last_end <= bs and (n > 1 or first_start < last_end)):
            raise ValueError(f"blocks {list(block_ids)[:8]}: bad in-block range [{first_start}, {last_end})")
        if self.defer and (n > self.scalar_max or self._pending):
            if len(self._pending) >= self.pending_max:
                self.settle()
            self._pending.append((block_ids, first_start, last_end, block_hashes, hashed, key_mask, owner))
            return
        self._apply_request_write(block_ids, first_start, last_end, block_hashes, hashed, key_mask, owner)

    def _apply_request_write(self, block_ids, first_start: int, last_end: int, block_hashes, hashed,
                             key_mask: np.ndarray, owner: Hashable) -> None:
        """:meth:`record_request_write` on checked arguments, nothing deferred."""
        n, bs = len(block_ids), self.block_size
        oid = self._owner_id(owner, create=True)
        if n <= self.scalar_max:
            mask = key_mask.tolist()
            if hashed is True:
                hashed = [True] * n
            ids, hs, cs = (x if isinstance(x, list) else x.tolist() for x in (block_ids, block_hashes, hashed))
            for j in range(n):
                self._write_one(ids[j], first_start if j == 0 else 0, last_end if j == n - 1 else bs,
                                hs[j] if cs[j] else None, mask, oid)
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        hs = np.asarray(block_hashes, dtype=np.uint64)
        if not self._distinct(ids):
            starts = np.zeros(n, dtype=np.int64)
            starts[0] = first_start
            ends = np.full(n, bs, dtype=np.int64)
            ends[-1] = last_end
            self._write_many(ids, starts, ends, hs, np.broadcast_to(np.asarray(hashed, dtype=bool), (n,)),
                             key_mask, oid)
            return
        # Whole blocks (all but maybe the first and the last) end up filled to block_size for
        # the written keys and 0 for the others, whatever they held; the last block to
        # last_end; only a first block written from first_start > 0 depends on its old fill.
        all_hashed = hashed is True or np.count_nonzero(hashed) == n
        cur = self._bh.take(ids)
        cached = self._bc.take(ids)
        if all_hashed:  # a cached block under another hash starts a new fill
            cached_other = cached & (cur != hs)
        else:
            cached_other = cached & ~(np.asarray(hashed, dtype=bool) & (cur == hs))
        reset = (self._bo.take(ids) != oid) | cached_other
        last = ids.item(-1)
        old_first = 0 if reset.item(0) else None  # the first block's fill before this write
        if first_start and old_first is None:
            old_first = self._bf[:, ids.item(0)].tolist()
        self._bo[ids] = oid
        self._bg[ids] += reset
        end0 = last_end if n == 1 else bs
        for i, written in enumerate(key_mask.tolist()):
            row = self._bf[i]
            row[ids] = bs if written else 0
            row[last] = last_end if written else 0
            if first_start:
                f = min(0 if old_first == 0 else old_first[i], first_start)
                row[ids.item(0)] = end0 if written and f == first_start else f
        if all_hashed:
            self._bh[ids] = hs
            self._bc[ids] = True
        else:
            hashed = np.asarray(hashed, dtype=bool)
            self._bh[ids] = np.where(hashed, hs, cur)
            self._bc[ids] = hashed | (cached & ~reset)

    def _write_many(self, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, block_hashes: np.ndarray,
                    hashed: np.ndarray, key_mask: np.ndarray, oid: int) -> None:
        """:meth:`record_writes` on checked arrays of equal length ``[n]`` and an owner id."""
        if ids.size <= self.scalar_max or not self._distinct(ids):  # one after the other, in order
            mask = key_mask.tolist()
            for b, s, e, h, c in zip(ids.tolist(), starts.tolist(), ends.tolist(), block_hashes.tolist(),
                                     hashed.tolist()):
                self._write_one(b, s, e, h if c else None, mask, oid)
            return
        # a write by another owner, or under another block hash than the cached one, starts a new fill
        reset = (self._bo.take(ids) != oid) | (
            self._bc.take(ids) & ~(hashed & (self._bh.take(ids) == block_hashes)))
        if np.count_nonzero(reset):
            self._reset(ids[reset], oid)
        s = starts[:, None]
        for i, written in enumerate(key_mask.tolist()):
            f = np.minimum(self._bf[i].take(ids), starts)  # rows at >= start are being redefined
            self._bf[i][ids] = np.where(f == starts, ends, f) if written else f
        if np.count_nonzero(hashed):
            h = ids[hashed]
            self._bh[h] = block_hashes[hashed]
            self._bc[h] = True

    def cache_full_blocks(self, block_ids, block_hashes, *, owner: Hashable) -> None:
        """:meth:`cache_full_block` for every block of ``block_ids`` (int ``[n]``) with
        ``block_hashes`` (uint64 ``[n]``: checked unsigned 64-bit values, e.g. from
        :func:`block_hash_array`), arrays or lists. Repeated blocks are applied in order.

        Raises:
            ValueError: bad block ids.
        """
        if self._pending:
            self.settle()
        oid = self._owner_id(owner, create=False)
        if isinstance(block_ids, list) and isinstance(block_hashes, list) and len(block_ids) <= self.scalar_max:
            if len(block_hashes) != len(block_ids) or any(
                    type(b) is not int or not 0 <= b < self.num_blocks or type(h) is not int or not 0 <= h < _U64_END
                    for b, h in zip(block_ids, block_hashes)):
                raise ValueError(f"bad block ids {block_ids} for block hashes {block_hashes}")
            for b, h in zip(block_ids, block_hashes):
                self._cache_one(b, h, oid)
            return
        ids = self._block_ids(block_ids)
        hs = np.broadcast_to(np.asarray(block_hashes, dtype=np.uint64), (ids.size,))
        if ids.size <= self.scalar_max or not self._distinct(ids):
            for b, h in zip(ids.tolist(), hs.tolist()):
                self._cache_one(b, h, oid)
            return
        act = (self._bo.take(ids) == oid) & ~(self._bc.take(ids) & (self._bh.take(ids) == hs))
        if not np.count_nonzero(act):
            return
        a = ids[act]
        was_cached = self._bc.take(a)
        if np.count_nonzero(was_cached):
            self._reset(a[was_cached], oid)
        self._bh[a] = hs[act]
        self._bc[a] = True

    def first_uncovered(self, block_ids, block_hashes, key_mask: np.ndarray) -> int:
        """Index of the first block of ``block_ids`` (int ``[n]``: list, numpy array or CPU
        tensor) not cached with its ``block_hashes`` entry (any form of
        :func:`block_hash_array`; entries that are not block hashes match nothing) or not
        fully filled for some key of ``key_mask`` (:meth:`key_mask`); ``n`` if all are
        covered. Reads only; no check of the block ids beyond numpy indexing."""
        if self._pending:
            self.settle()
        n = len(block_ids)
        if n <= self.scalar_max_read:  # a few blocks: cheaper one by one
            ids = block_ids if isinstance(block_ids, list) else np.asarray(block_ids).reshape(-1).tolist()
            hashes = hash_list(block_hashes)
            need, bs, filled = self._need(key_mask), self.block_size, self._bf
            for j, b in enumerate(ids):
                if not self._bc.item(b) or self._bh.item(b) != hashes[j]:
                    return j
                for i in need:
                    if filled.item(i, b) != bs:
                        return j
            return n
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        hs, valid = block_hash_array(block_hashes, strict=False)
        ok = self._bc.take(ids) & (self._bh.take(ids) == hs)
        if valid is not None:
            ok &= valid
        for i in self._need(key_mask):
            ok &= self._bf[i].take(ids) == self.block_size
        i = int(ok.argmin())
        return i if not ok[i] else n

    def _need(self, key_mask: np.ndarray) -> list[int]:
        """Indices of the keys set in ``key_mask`` (memoised)."""
        k = key_mask.tobytes()
        need = self._needs.get(k)
        if need is None:
            need = self._needs[k] = np.flatnonzero(key_mask).tolist()
        return need

    def covered_blocks(self, block_ids, block_hashes, keys: Iterable[str]) -> int:
        """Length of the longest prefix of ``block_ids`` (list, numpy array or CPU tensor)
        cached with the matching ``block_hashes`` and fully filled for every key in ``keys``.

        Raises:
            ValueError: an unknown key.
        """
        n = min(len(block_ids), len(block_hashes))
        return self.first_uncovered(block_ids[:n], block_hashes[:n], self.key_mask(keys))


def hash_list(block_hashes) -> list[int | None]:
    """Block hashes (any form of :func:`block_hash_array`) as Python ints, ``None`` for
    entries that are not block hashes (cheap for a few)."""
    if isinstance(block_hashes, (np.ndarray, torch.Tensor)):
        vals, valid = block_hash_array(block_hashes, strict=False)
        return vals.tolist()
    return [h if type(h) is int and 0 <= h < _U64_END else _hash_value(h) for h in block_hashes]


def in_range(values: np.ndarray, limit: int) -> bool:
    """Whether every entry of the int array ``values`` is in ``[0, limit)`` (cheap for the few
    entries of a decode step as for the thousands of a long prefill)."""
    if values.size <= 16:
        v = values.tolist()
        return not v or (min(v) >= 0 and max(v) < limit)
    if values.dtype == np.int64:  # negative entries are huge as uint64: one reduction checks both ends
        return bool(values.view(np.uint64).max() < limit)
    return bool(values.min() >= 0 and values.max() < limit)
