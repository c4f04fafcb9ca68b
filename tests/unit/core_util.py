"""Factories shared by the core's unit tests (one test module per core module)."""

from __future__ import annotations

import torch

from omni_cache.core import HiddenStateCache, KeySpec, chained_block_hashes

BS = 4
KEYS = ("hidden", "layer_0")


def make_cache(num_blocks=8, keys=KEYS, width=3):
    return HiddenStateCache(num_blocks, BS, [KeySpec(k, width, torch.float32) for k in keys])


def rows(n, width=3, seed=0):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def full_write(cache, req, blocks, tokens, seed=0):
    """Write rows for all keys for positions [0, len(tokens)), caching full blocks."""
    block_hashes = chained_block_hashes(tokens, BS)
    data = {k: rows(len(tokens), p.width, seed + i)
            for i, (k, p) in enumerate(cache.pools.items())}
    cache.write_request_rows(req, blocks, 0, data, dict(enumerate(block_hashes)))
    return block_hashes, data


def ledger_state(cache):
    """Per block: (block hash, owner, generation, fill per key), through the public views."""
    led = cache.ledger
    return [(led.block_hash[b], led.owner[b], led.generation[b], [led.filled(b, k) for k in led.keys])
            for b in range(led.num_blocks)]
