"""Prefix-aware choice of a replica, bounded by load.

A request is described by its chained block hashes (:func:`request_block_hashes`, built on
:func:`omni_cache.core.block_hashes.chained_block_hashes`: equal block hash = equal token prefix,
media identifiers included). The policy keeps, per replica, a :class:`BlockRecord`: the
block hashes it believes the replica's KV cache holds, a bounded LRU whose capacity is the
replica's number of KV blocks, so blocks the engine would have evicted are forgotten too.

Two sources feed a record:

- **approximate** (always on): :meth:`PrefixAwarePolicy.route` records the full blocks of the
  prompt it just routed (the replica computes or hits them, then caches them);
- **precise** (when available): :meth:`PrefixAwarePolicy.apply_kv_events` takes vLLM's
  KV-cache events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) of a replica:
  stored blocks (decode-filled answer blocks included) are added, removed ones forgotten.

Invariant: ``h in record(r)`` iff replica ``r`` is in ``holders[h]`` (the reverse index the
longest-prefix walk uses); a removed replica appears in neither.

Import rule: engine-free (standard library + :mod:`omni_cache.core.block_hashes`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from omni_cache.core.block_hashes import NONE_HASH, chained_block_hashes

#: A replica's identity: a vLLM-Omni input address (str) or a replica id (int).
ReplicaKey = Hashable


class RoutingConfigError(ValueError):
    """A routing setting is invalid (``field`` names it)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        super().__init__(f"routing {field}: {reason}")


@dataclass(frozen=True)
class RoutingConfig:
    """Knobs of :class:`PrefixAwarePolicy`.

    Attributes:
        load_margin: requests. A replica is eligible when its queue length is at most the
            shortest queue plus this margin; the request goes to the eligible replica with the
            longest cached prefix. 0 = pure least-queue among replicas with the longest hit
            of the least loaded ones.
        capacity_blocks: KV blocks of a replica whose capacity is not given explicitly
            (:meth:`PrefixAwarePolicy.add_replica`); the LRU bound of its record.
        min_hit_blocks: a cached prefix shorter than this (blocks) counts as none.
        shared_prefix_fanout: a routed block followed by at least this many distinct next
            blocks (in the prompts routed so far) ends a *shared* prefix — a system prompt
            that many conversations continue. A hit no longer than the request's shared
            prefix does not steer (the request goes by load, holders of the shared prefix
            first among equal queues), so a hot system prompt cannot pin the conversations
            that start with it to the few replicas that hold it. 0 = every hit steers.

    Raises:
        RoutingConfigError: a value is not an int, negative, or ``capacity_blocks < 1``.
    """

    load_margin: int = 4
    capacity_blocks: int = 4096
    min_hit_blocks: int = 1
    shared_prefix_fanout: int = 4

    def __post_init__(self) -> None:
        for name in ("load_margin", "capacity_blocks", "min_hit_blocks", "shared_prefix_fanout"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise RoutingConfigError(name, f"expected an int, got {type(v).__name__} {v!r}")
            if v < 0:
                raise RoutingConfigError(name, f"must be >= 0, got {v}")
        if self.capacity_blocks < 1:
            raise RoutingConfigError("capacity_blocks", f"must be >= 1, got {self.capacity_blocks}")
        if self.shared_prefix_fanout == 1:
            raise RoutingConfigError("shared_prefix_fanout", "must be 0 (off) or >= 2: with 1 every "
                                     "routed block ends a shared prefix and no hit ever steers")


def request_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    media: Sequence[tuple[int, int, object]] = (),
) -> list[int]:
    """The routing key of a request: one chained block hash per full block of its prompt.

    Args:
        token_ids: prompt token ids (list / numpy / CPU tensor).
        block_size: tokens per block (the stage's KV ``block_size``).
        media: ``(start, end, identifier)`` half-open token spans of multimodal items and
            their content identifiers (replica-independent: not vLLM-Omni's replica-scoped
            ``stage0:repK:`` uuids), so equal placeholder tokens with different media differ.

    Returns:
        ``len(token_ids) // block_size`` unsigned 64-bit block hashes
        (:func:`omni_cache.core.block_hashes.chained_block_hashes`).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return chained_block_hashes(token_ids, block_size, extra_keys=media)


class BlockRecord:
    """What the router believes one replica's KV cache holds: an LRU set of block hashes.

    Args:
        capacity_blocks: the replica's KV blocks; touching more evicts the least recently
            used (as the engine's free-block queue reuses the least recently freed block).

    Raises:
        RoutingConfigError: ``capacity_blocks < 1``.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise RoutingConfigError("capacity_blocks", f"must be an int >= 1, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self):
        return iter(self._lru)

    def touch(self, block_hashes: Iterable[int]) -> tuple[list[int], list[int]]:
        """Mark blocks as most recently used, in order (a prompt's blocks: first to last).

        Returns:
            ``(added, evicted)``: block hashes new to the record, and block hashes dropped
            to stay within capacity (never one of this call's blocks unless the call alone
            exceeds capacity, when the earliest of them go first).
        """
        added, evicted = [], []
        for h in block_hashes:
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
                added.append(h)
        while len(self._lru) > self.capacity_blocks:
            h, _ = self._lru.popitem(last=False)
            evicted.append(h)
        evicted_set = set(evicted)
        return [h for h in added if h not in evicted_set], evicted

    def remove(self, block_hashes: Iterable[int]) -> list[int]:
        """Forget blocks (evicted by the engine). Returns those that were recorded."""
        out = []
        for h in block_hashes:
            if self._lru.pop(h, 0) is None:
                out.append(h)
        return out

    def clear(self) -> list[int]:
        """Forget everything. Returns the block hashes that were recorded."""
        out = list(self._lru)
        self._lru.clear()
        return out


@dataclass(frozen=True)
class RouteDecision:
    """One routing choice.

    Attributes:
        replica: the chosen replica's key.
        hit_blocks: blocks of the request's prefix the chosen replica is believed to hold.
        best_hit_blocks: the longest such prefix over all candidates (> ``hit_blocks``
            when the load bound sent the request elsewhere).
        reason: ``"prefix"`` (the longest prefix), ``"load"`` (the longest prefix's replica
            was over the margin) or ``"least-queue"`` (no candidate holds a prefix).
    """

    replica: ReplicaKey
    hit_blocks: int
    best_hit_blocks: int
    reason: str


def _key_bytes(key: ReplicaKey) -> bytes:
    return repr(key).encode()  # str / int / tuples of them: stable across processes


def rendezvous_score(tie_key: int, replica: ReplicaKey) -> int:
    """Deterministic 64-bit score of ``replica`` for ``tie_key`` (highest-random-weight
    hashing): ties go to the highest score, so they spread evenly over replicas, do not
    depend on the order replicas are listed in, and move only the removed replica's share
    when one leaves."""
    h = blake2b(int(tie_key & (2**64 - 1)).to_bytes(8, "little"), digest_size=8)
    h.update(_key_bytes(replica))
    return int.from_bytes(h.digest(), "little")


class PrefixAwarePolicy:
    """Route to the replica holding the longest cached prefix, bounded by load.

    Choice for a request with block hashes ``H`` over candidates with queue lengths ``q``:

    1. ``hit(r)`` = the number of leading blocks of ``H`` in replica ``r``'s record (as
       vLLM's prefix cache, only the leading run counts); below ``min_hit_blocks`` it is 0;
    2. eligible = ``{r : q[r] <= min(q) + load_margin}``;
    3. the eligible replica with the largest ``hit``; ties: the shorter queue, then the
       highest :func:`rendezvous_score` of the request's ``tie_key`` (deterministic).

    So the best-prefix replica wins unless its queue exceeds the least loaded one's by more
    than ``load_margin``; then the request takes the longest prefix among the replicas
    within the margin (least-queue when none holds one), and that replica caches the prefix
    too: a hot prefix spreads over replicas instead of pinning one.

    Args:
        config: :class:`RoutingConfig`.

    Thread safety: none; the adapter serialises calls.
    """

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._records: dict[ReplicaKey, BlockRecord] = {}
        self._holders: dict[int, set[ReplicaKey]] = {}
        #: block hash -> distinct next block hashes seen in routed prompts (capped at the
        #: fan-out threshold); dropped with the block's last holder
        self._next: dict[int, set[int]] = {}
        #: events' engine block hash -> this router's block hash, per replica
        self._engine_to_router: dict[ReplicaKey, dict[Any, int]] = {}

    # ---- membership ----

    @property
    def replicas(self) -> list[ReplicaKey]:
        """Known replicas, in insertion order."""
        return list(self._records)

    def record_of(self, replica: ReplicaKey) -> BlockRecord:
        """The replica's :class:`BlockRecord`. Raises KeyError if unknown."""
        return self._records[replica]

    def add_replica(self, replica: ReplicaKey, capacity_blocks: int | None = None) -> None:
        """Register a replica with an empty record (no-op if known; a new capacity applies).

        Args:
            capacity_blocks: its KV blocks (default ``config.capacity_blocks``).

        Raises:
            RoutingConfigError: ``capacity_blocks < 1``.
        """
        cap = self.config.capacity_blocks if capacity_blocks is None else capacity_blocks
        rec = self._records.get(replica)
        if rec is None:
            self._records[replica] = BlockRecord(cap)
            self._engine_to_router[replica] = {}
        elif cap != rec.capacity_blocks:
            if not isinstance(cap, int) or cap < 1:
                raise RoutingConfigError("capacity_blocks", f"must be an int >= 1, got {cap!r}")
            rec.capacity_blocks = cap
            _, evicted = rec.touch(())
            self._unhold(replica, evicted)

    def remove_replica(self, replica: ReplicaKey) -> int:
        """Forget a dead or drained replica and everything it held.

        Returns:
            The number of block hashes forgotten (0 if the replica was unknown).
        """
        rec = self._records.pop(replica, None)
        self._engine_to_router.pop(replica, None)
        if rec is None:
            return 0
        forgotten = rec.clear()
        self._unhold(replica, forgotten)
        return len(forgotten)

    def sync_replicas(self, live: Iterable[ReplicaKey]) -> list[ReplicaKey]:
        """Make the known set equal ``live``: unknown live replicas are added, known ones not
        in ``live`` removed (their prefixes forgotten). Returns the removed keys."""
        live = list(live)
        live_set = set(live)
        gone = [r for r in self._records if r not in live_set]
        for r in gone:
            self.remove_replica(r)
        for r in live:
            if r not in self._records:
                self.add_replica(r)
        return gone

    # ---- records ----

    def _hold(self, replica: ReplicaKey, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._holders.setdefault(h, set()).add(replica)

    def _unhold(self, replica: ReplicaKey, hashes: Iterable[int]) -> None:
        for h in hashes:
            s = self._holders.get(h)
            if s is not None:
                s.discard(replica)
                if not s:
                    del self._holders[h]
                    self._next.pop(h, None)

    def record(self, replica: ReplicaKey, block_hashes: Sequence[int]) -> None:
        """The replica now holds these blocks (most recently used); the LRU forgets the
        oldest beyond its capacity. Registers an unknown replica."""
        if replica not in self._records:
            self.add_replica(replica)
        added, evicted = self._records[replica].touch(block_hashes)
        self._unhold(replica, evicted)
        self._hold(replica, added)

    def forget(self, replica: ReplicaKey, block_hashes: Iterable[int]) -> None:
        """The replica no longer holds these blocks (unknown replica: no-op)."""
        rec = self._records.get(replica)
        if rec is not None:
            self._unhold(replica, rec.remove(block_hashes))

    def prefix_hits(self, block_hashes: Sequence[int], candidates: Iterable[ReplicaKey]) -> dict[ReplicaKey, int]:
        """Leading blocks of ``block_hashes`` each candidate's record holds (0 for unknown
        replicas). Cost: O(hit length x replicas still matching)."""
        cands = list(candidates)
        return {**dict.fromkeys(cands, 0), **self._nonzero_hits(block_hashes, cands)}

    def _nonzero_hits(self, block_hashes: Sequence[int], candidates: Iterable[ReplicaKey]) -> dict[ReplicaKey, int]:
        hits: dict[ReplicaKey, int] = {}
        if not block_hashes or block_hashes[0] not in self._holders:
            return hits
        alive = self._holders[block_hashes[0]].intersection(candidates)
        depth = 1
        for h in block_hashes[1:]:
            holders = self._holders.get(h)
            if holders is None:
                break
            if not alive <= holders:
                for r in alive - holders:
                    hits[r] = depth
                alive &= holders
                if not alive:
                    break
            depth += 1
        for r in alive:
            hits[r] = depth
        return hits

    # ---- choice ----

    def choose(
        self,
        block_hashes: Sequence[int],
        queue_lengths: Mapping[ReplicaKey, int],
        tie_key: int | None = None,
    ) -> RouteDecision:
        """Pick a replica (records nothing; see :meth:`route`).

        Args:
            block_hashes: the request's chained block hashes (:func:`request_block_hashes`).
            queue_lengths: candidate replica -> requests queued or running there (>= 0).
                Unknown candidates are registered with the default capacity.
            tie_key: breaks ties deterministically (default: the first block hash, or 0).

        Returns:
            :class:`RouteDecision`.

        Raises:
            ValueError: no candidates, or a negative / non-int queue length.
        """
        if not queue_lengths:
            raise ValueError("no candidate replicas")
        for r, q in queue_lengths.items():
            if not isinstance(q, int) or isinstance(q, bool) or q < 0:
                raise ValueError(f"queue length of replica {r!r} must be an int >= 0, got {q!r}")
            if r not in self._records:
                self.add_replica(r)
        hits = self._nonzero_hits(block_hashes, queue_lengths)
        floor = max(self.config.min_hit_blocks, self.shared_prefix_blocks(block_hashes) + 1)
        steer = {r: h for r, h in hits.items() if h >= floor}
        best = max(steer.values(), default=0)
        limit = min(queue_lengths.values()) + self.config.load_margin
        eligible = [r for r, q in queue_lengths.items() if q <= limit]
        rank = {r: (steer.get(r, 0), -queue_lengths[r], hits.get(r, 0)) for r in eligible}
        top = max(rank.values())
        ties = [r for r in eligible if rank[r] == top]
        if len(ties) == 1:
            chosen = ties[0]
        else:
            tk = tie_key if tie_key is not None else (block_hashes[0] if len(block_hashes) else 0)
            chosen = max(ties, key=lambda r: rendezvous_score(tk, r))
        reason = "least-queue" if best == 0 else ("prefix" if steer.get(chosen, 0) == best else "load")
        return RouteDecision(chosen, hits.get(chosen, 0), max(hits.values(), default=0), reason)

    def route(
        self,
        block_hashes: Sequence[int],
        queue_lengths: Mapping[ReplicaKey, int],
        tie_key: int | None = None,
    ) -> RouteDecision:
        """:meth:`choose`, then record the request's blocks on the chosen replica (the
        approximate record: it will hold the prompt's full blocks once prefilled)."""
        d = self.choose(block_hashes, queue_lengths, tie_key)
        self.record(d.replica, block_hashes)
        cap = self.config.shared_prefix_fanout
        if cap:
            for a, b in zip(block_hashes, block_hashes[1:]):
                nxt = self._next.setdefault(a, set())
                if len(nxt) < cap:
                    nxt.add(b)
        return d

    def shared_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """Length (blocks) of the request's shared prefix: up to and including its deepest
        block with ``>= shared_prefix_fanout`` distinct next blocks; 0 if none (or off)."""
        cap = self.config.shared_prefix_fanout
        if not cap:
            return 0
        depth = 0
        for i, h in enumerate(block_hashes):
            nxt = self._next.get(h)
            if nxt is None:
                break
            if len(nxt) >= cap:
                depth = i + 1
        return depth

    # ---- precise: KV-cache events ----

    def apply_kv_events(
        self,
        replica: ReplicaKey,
        events: Iterable[Any],
        media_identifier: Callable[[Any], object] | None = None,
    ) -> None:
        """Apply a replica's KV-cache events (vLLM's ``vllm.distributed.kv_events``, duck-typed
        by class name so this module needs no vLLM).

        - ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, extra_keys)``:
          each stored block's router block hash is recomputed from its tokens, chained from
          its parent (``None`` = a prompt start; an unknown parent ends the chain: those blocks
          are skipped), and recorded. ``extra_keys[i]`` (multimodal identifiers of block i)
          become a block-wide span through ``media_identifier`` (default: skip such blocks —
          their router hash would not match :func:`request_block_hashes`' positioned spans).
        - ``BlockRemoved(block_hashes)``: forgotten.
        - ``AllBlocksCleared``: the replica's record is emptied.

        Engine block hashes are opaque (vLLM's hash function differs from the router's);
        only the per-replica engine -> router map relates them. Unknown replica: registered.
        """
        if replica not in self._records:
            self.add_replica(replica)
        table = self._engine_to_router[replica]
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                parent = ev.parent_block_hash
                prev = NONE_HASH if parent is None else table.get(parent)
                bs = int(ev.block_size)
                extras = getattr(ev, "extra_keys", None) or [None] * len(ev.block_hashes)
                new = []
                for i, eh in enumerate(ev.block_hashes):
                    if prev is None:
                        break
                    toks = ev.token_ids[i * bs:(i + 1) * bs]
                    if len(toks) < bs:
                        break
                    extra = extras[i] if i < len(extras) else None
                    spans: list[tuple[int, int, object]] = []
                    if extra:
                        if media_identifier is None:
                            break
                        spans = [(0, bs, media_identifier(extra))]
                    prev = chained_block_hashes(toks, bs, spans, parent=prev)[0]
                    table[eh] = prev
                    new.append(prev)
                if new:
                    self.record(replica, new)
            elif kind == "BlockRemoved":
                self.forget(replica, [table.pop(eh) for eh in ev.block_hashes if eh in table])
            elif kind == "AllBlocksCleared":
                rec = self._records[replica]
                self._unhold(replica, rec.clear())
                table.clear()
