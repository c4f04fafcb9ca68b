"""Baseline routing policies with :class:`~omni_cache.routing.policy.PrefixAwarePolicy`'s
interface, for the simulation (``benchmarks/routing_sim.py``) and tests: the policies
vLLM-Omni 0.30 ships (``random``, ``round-robin``, ``least-queue-length``), re-implemented
engine-free with a seeded generator so a run is reproducible.

Import rule: engine-free (standard library only).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from omni_cache.routing.policy import ReplicaKey, RouteDecision


def _check(queue_lengths: Mapping[ReplicaKey, int]) -> None:
    if not queue_lengths:
        raise ValueError("no candidate replicas")
    for r, q in queue_lengths.items():
        if not isinstance(q, int) or q < 0:
            raise ValueError(f"queue length of replica {r!r} must be an int >= 0, got {q!r}")


class RandomPolicy:
    """Uniformly random replica (vLLM-Omni's default ``random``). ``seed``: the generator's."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, block_hashes: Sequence[int], queue_lengths: Mapping[ReplicaKey, int],
              tie_key: int | None = None) -> RouteDecision:
        _check(queue_lengths)
        return RouteDecision(self._rng.choice(list(queue_lengths)), 0, 0, "random")


class RoundRobinPolicy:
    """Replicas in turn, over the candidates' order (vLLM-Omni's ``round-robin`` and the
    in-process ``StagePool.select_replica_id``)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, block_hashes: Sequence[int], queue_lengths: Mapping[ReplicaKey, int],
              tie_key: int | None = None) -> RouteDecision:
        _check(queue_lengths)
        cands = list(queue_lengths)
        r = cands[self._next % len(cands)]
        self._next = (self._next + 1) % len(cands)
        return RouteDecision(r, 0, 0, "round-robin")


class LeastQueuePolicy:
    """Shortest queue, random among ties (vLLM-Omni's ``least-queue-length``)."""

    name = "least-queue"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, block_hashes: Sequence[int], queue_lengths: Mapping[ReplicaKey, int],
              tie_key: int | None = None) -> RouteDecision:
        _check(queue_lengths)
        q_min = min(queue_lengths.values())
        return RouteDecision(self._rng.choice([r for r, q in queue_lengths.items() if q == q_min]),
                             0, 0, "least-queue")
