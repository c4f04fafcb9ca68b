"""The engine-free prefix-aware routing policy (omni_cache.routing): longest-prefix choice,
load bound, shared prefixes, forgetting (LRU, events, replica removal), tie-breaks, config."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_cache.routing import (
    BlockRecord,
    PrefixAwarePolicy,
    RoutingConfig,
    RoutingConfigError,
    request_block_hashes,
)

BS = 4


def conv(seed: int, n_blocks: int) -> list[int]:
    return request_block_hashes([seed * 1000 + i for i in range(n_blocks * BS)], BS)


def test_longest_prefix_wins():
    p = PrefixAwarePolicy(RoutingConfig(load_margin=10, shared_prefix_fanout=0))
    a, b = conv(1, 8), conv(2, 8)
    p.record("r0", a[:2])
    p.record("r1", a[:6])
    p.record("r2", b)
    d = p.choose(a, {"r0": 0, "r1": 0, "r2": 0})
    assert (d.replica, d.hit_blocks, d.best_hit_blocks, d.reason) == ("r1", 6, 6, "prefix")


def test_only_the_leading_run_counts():
    p = PrefixAwarePolicy(RoutingConfig(shared_prefix_fanout=0))
    a = conv(1, 6)
    p.record("r0", a[1:])           # everything but the first block: no prefix hit
    p.record("r1", a[:2])
    assert p.prefix_hits(a, ["r0", "r1"]) == {"r0": 0, "r1": 2}


def test_media_identifiers_split_block_hashes():
    toks = list(range(16))
    x = request_block_hashes(toks, BS, [(5, 6, "img-a")])
    y = request_block_hashes(toks, BS, [(5, 6, "img-b")])
    assert x[0] == y[0] and x[1] != y[1]


def test_load_bound_falls_back_within_margin():
    p = PrefixAwarePolicy(RoutingConfig(load_margin=2, shared_prefix_fanout=0))
    a = conv(1, 6)
    p.record("hot", a)
    p.record("warm", a[:3])
    assert p.choose(a, {"hot": 2, "warm": 0, "cold": 0}).replica == "hot"          # 2 <= 0 + 2
    d = p.choose(a, {"hot": 3, "warm": 0, "cold": 0})                               # 3 > 0 + 2
    assert (d.replica, d.hit_blocks, d.best_hit_blocks, d.reason) == ("warm", 3, 6, "load")
    d = p.choose(a, {"hot": 3, "warm": 3, "cold": 0})
    assert (d.replica, d.reason) == ("cold", "load")


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([f"r{i}" for i in range(6)]), st.integers(0, 20), min_size=1),
       st.integers(0, 5), st.integers(0, 6))
def test_never_chooses_a_replica_over_the_margin(queues, margin, holder_idx):
    p = PrefixAwarePolicy(RoutingConfig(load_margin=margin, shared_prefix_fanout=0))
    a = conv(7, 5)
    p.record(f"r{holder_idx}", a)
    d = p.choose(a, queues)
    assert d.replica in queues
    assert queues[d.replica] <= min(queues.values()) + margin
    holder = f"r{holder_idx}"
    if holder in queues and queues[holder] <= min(queues.values()) + margin:
        assert d.replica == holder and d.hit_blocks == 5


def test_shared_prefix_does_not_pin_new_conversations():
    p = PrefixAwarePolicy(RoutingConfig(load_margin=100, shared_prefix_fanout=3))
    system = list(range(8))                                  # 2 blocks every conversation shares
    first = request_block_hashes(system + [100] * 8, BS)
    assert p.route(first, {"r0": 0, "r1": 0}).replica in ("r0", "r1")
    holder = p.replicas[0] if len(p.record_of(p.replicas[0])) else p.replicas[1]
    other = "r1" if holder == "r0" else "r0"
    for c in range(1, 3):                                    # 3 distinct continuations of the system prompt
        p.record(holder, request_block_hashes(system + [100 + c] * 8, BS))
        p.route(request_block_hashes(system + [100 + c] * 8, BS), {holder: 0, other: 5})
    assert p.shared_prefix_blocks(request_block_hashes(system + [999] * 8, BS)) == 2
    # a new conversation (only the shared system prompt cached) goes by load...
    d = p.choose(request_block_hashes(system + [999] * 8, BS), {holder: 3, other: 0})
    assert d.replica == other and d.reason == "least-queue" and d.best_hit_blocks == 2
    # ...its next turn (its own prefix cached on `holder`) sticks.
    d = p.choose(first + conv(5, 2), {holder: 3, other: 0})
    assert d.replica == holder and d.reason == "prefix"


def test_lru_record_forgets_evicted_blocks():
    p = PrefixAwarePolicy(RoutingConfig(capacity_blocks=8, shared_prefix_fanout=0))
    p.add_replica("r0", capacity_blocks=8)
    a, b = conv(1, 6), conv(2, 6)
    p.record("r0", a)
    p.record("r0", b)                          # 12 blocks > 8: a's oldest 4 go
    assert len(p.record_of("r0")) == 8
    assert p.prefix_hits(a, ["r0"]) == {"r0": 0}
    assert p.prefix_hits(b, ["r0"]) == {"r0": 6}
    p.record("r0", a[:1])                      # touched: most recent, the oldest remaining (a[4]) goes
    assert a[0] in p.record_of("r0") and a[4] not in p.record_of("r0")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["r0", "r1", "r2"]), st.integers(0, 9), st.integers(1, 6)),
                max_size=40), st.integers(1, 12))
def test_record_and_index_stay_consistent(ops, cap):
    p = PrefixAwarePolicy(RoutingConfig(capacity_blocks=cap))
    for r, seed, n in ops:
        if seed == 9:
            p.remove_replica(r)
        else:
            p.record(r, conv(seed, n))
        for key in p.replicas:
            rec = p.record_of(key)
            assert len(rec) <= rec.capacity_blocks
            assert all(key in p._holders[h] for h in rec)
        assert all(h in p.record_of(k) for h, ks in p._holders.items() for k in ks)


def test_replica_removal_forgets_its_prefixes():
    p = PrefixAwarePolicy(RoutingConfig(shared_prefix_fanout=0))
    a = conv(1, 4)
    p.record("r0", a)
    assert p.remove_replica("r0") == 4
    assert "r0" not in p.replicas and not p._holders
    d = p.choose(a, {"r1": 0, "r2": 0})
    assert d.hit_blocks == 0 and d.reason == "least-queue"
    p.record("r1", a)
    assert p.sync_replicas(["r2", "r3"]) == ["r1"]          # drained
    assert p.replicas == ["r2", "r3"] and p.prefix_hits(a, ["r2", "r3"]) == {"r2": 0, "r3": 0}


def test_ties_are_deterministic_and_spread():
    chosen = []
    for seed in range(64):
        picks = {PrefixAwarePolicy().choose(conv(seed, 2), {f"r{i}": 0 for i in order}).replica
                 for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1])}
        assert len(picks) == 1                              # independent of the listing order
        chosen.append(picks.pop())
    assert len(set(chosen)) == 4                            # spread over replicas
    # equal hits: the shorter queue first
    p = PrefixAwarePolicy(RoutingConfig(shared_prefix_fanout=0))
    a = conv(1, 3)
    p.record("r0", a)
    p.record("r1", a)
    assert p.choose(a, {"r0": 2, "r1": 1}).replica == "r1"


def test_kv_events_add_and_remove_blocks():
    p = PrefixAwarePolicy(RoutingConfig(shared_prefix_fanout=0))
    toks = list(range(12))
    ours = request_block_hashes(toks, BS)
    BlockStored = type("BlockStored", (), {})
    BlockRemoved = type("BlockRemoved", (), {})
    AllBlocksCleared = type("AllBlocksCleared", (), {})

    def ev(cls, **kw):
        e = cls()
        e.__dict__.update(kw)
        return e

    p.apply_kv_events("r0", [ev(BlockStored, block_hashes=["e0", "e1"], parent_block_hash=None,
                                token_ids=toks[:8], block_size=BS, extra_keys=None),
                             ev(BlockStored, block_hashes=["e2"], parent_block_hash="e1",
                                token_ids=toks[8:], block_size=BS, extra_keys=None)])
    assert p.prefix_hits(ours, ["r0"]) == {"r0": 3}
    p.apply_kv_events("r0", [ev(BlockRemoved, block_hashes=["e1"])])
    assert p.prefix_hits(ours, ["r0"]) == {"r0": 1}
    p.apply_kv_events("r0", [ev(BlockStored, block_hashes=["x"], parent_block_hash="unknown",
                                token_ids=toks[:4], block_size=BS, extra_keys=None)])
    assert len(p.record_of("r0")) == 2                       # unknown parent: skipped
    p.apply_kv_events("r0", [ev(AllBlocksCleared)])
    assert len(p.record_of("r0")) == 0 and not p._holders


@pytest.mark.parametrize("kw, field", [
    ({"load_margin": -1}, "load_margin"), ({"load_margin": 1.5}, "load_margin"),
    ({"capacity_blocks": 0}, "capacity_blocks"), ({"min_hit_blocks": True}, "min_hit_blocks"),
    ({"shared_prefix_fanout": 1}, "shared_prefix_fanout"),
])
def test_bad_config_is_refused(kw, field):
    with pytest.raises(RoutingConfigError) as e:
        RoutingConfig(**kw)
    assert e.value.field == field and field in str(e.value)


def test_bad_inputs_are_refused():
    p = PrefixAwarePolicy()
    with pytest.raises(ValueError, match="no candidate"):
        p.choose(conv(1, 2), {})
    with pytest.raises(ValueError, match="queue length"):
        p.choose(conv(1, 2), {"r0": -1})
    with pytest.raises(RoutingConfigError):
        BlockRecord(0)
    with pytest.raises(ValueError, match="block_size"):
        request_block_hashes([1, 2], 0)
