"""Prefix-aware routing over a stage's replicas (engine-free).

- :mod:`.policy` -- :class:`PrefixAwarePolicy`: the replica with the longest cached prefix
  (chained block hashes, media identifiers included), bounded by load; a per-replica LRU
  :class:`BlockRecord` of block hashes (capacity = the replica's KV blocks) fed by the
  router's own routing (approximate) and by vLLM KV-cache events (precise).
- :mod:`.baselines` -- vLLM-Omni's policies (random, round-robin, least-queue) with the
  same interface, for the simulation.

Import invariant: nothing here imports ``vllm`` / ``vllm_omni`` or omni-cache's adapter
packages (``tests/unit/test_layout.py``); the vLLM-Omni adapter is
:mod:`omni_cache.driver.routing`.
"""

from omni_cache.routing.baselines import LeastQueuePolicy, RandomPolicy, RoundRobinPolicy
from omni_cache.routing.policy import (
    BlockRecord,
    PrefixAwarePolicy,
    ReplicaKey,
    RouteDecision,
    RoutingConfig,
    RoutingConfigError,
    rendezvous_score,
    request_block_hashes,
)

__all__ = [
    "BlockRecord",
    "LeastQueuePolicy",
    "PrefixAwarePolicy",
    "RandomPolicy",
    "ReplicaKey",
    "RoundRobinPolicy",
    "RouteDecision",
    "RoutingConfig",
    "RoutingConfigError",
    "rendezvous_score",
    "request_block_hashes",
]
