"""The scheduler's token ids, read by the worker of the same process (vLLM's ``uni`` executor:
one stage, one process, one thread for the scheduler and the model runner).

Under async scheduling the model runner's host-side ``output_token_ids`` hold placeholders
(``-1``) for sampled tokens whose values are still on the device, while the scheduler's
``Request.all_token_ids`` holds every token it has received (``update_from_output``, one step
behind the runner). The stage manager hashes a decode-filled block from those
(:meth:`omni_cache.engine.stage_manager.OmniCacheStageManager.block_hashes`) instead of keeping
every decode step's input ids with a device → host copy of its own (a copy, an event and
~0.1 ms of a decode step's host time on an H200's host, docs/gpu.md "Twenty-fourth session").
Where no scheduler of this process is known for the runner's config (vLLM's ``mp`` executor,
tensor parallelism: the worker runs in another process), the stage manager keeps the input ids
as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

#: ``id(vllm_config)`` → the scheduler built with that config, in this process (weakly held)
_SCHEDULERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def register(scheduler: Any) -> None:
    """Make ``scheduler``'s requests (``scheduler.requests``: request id → vLLM ``Request``)
    readable by a model runner of this process built with the same ``vllm_config`` object."""
    config = getattr(scheduler, "vllm_config", None)
    if config is not None:
        try:
            _SCHEDULERS[id(config)] = scheduler
        except TypeError:  # not weakly referable: its runner keeps input ids instead
            pass


def scheduler_of(vllm_config: Any) -> Any | None:
    """The scheduler registered for this ``vllm_config`` object in this process, or ``None``."""
    scheduler = _SCHEDULERS.get(id(vllm_config)) if vllm_config is not None else None
    if scheduler is None or getattr(scheduler, "vllm_config", None) is not vllm_config:
        return None
    return scheduler


def scheduler_requests(vllm_config: Any) -> Mapping[str, Any] | None:
    """The requests (request id → object with ``all_token_ids``) of the scheduler registered for
    this ``vllm_config`` object, or ``None`` (none in this process: the caller keeps input ids)."""
    scheduler = scheduler_of(vllm_config)
    return None if scheduler is None else getattr(scheduler, "requests", None)


def hash_blocks_per_block(scheduler: Any, block_size: int) -> int | None:
    """vLLM's block hashes per block of ``block_size`` tokens: ``block_size //
    scheduler.hash_block_size`` (the granularity of ``Request.block_hashes``), or ``None`` where
    the scheduler has no such hashes or they do not tile the block (the caller hashes itself)."""
    hbs = getattr(scheduler, "hash_block_size", None)
    if (type(hbs) is not int or hbs <= 0 or block_size % hbs
            or not getattr(getattr(scheduler, "cache_config", None), "enable_prefix_caching", False)):
        return None
    return block_size // hbs


def vllm_block_hashes(request: Any, per_block: int, first: int, end: int) -> list[int]:
    """64-bit block hashes of blocks ``[first, end)`` from vLLM's own chained hashes of the
    request (``Request.block_hashes``, ``per_block`` of them per block: a block's hash is the
    last one inside it, which identifies the whole prefix up to the block's end, multimodal
    content, LoRA and cache salt included — ``vllm/v1/core/kv_cache_utils.py``,
    ``hash_block_tokens``), its first 8 bytes little-endian; stops at the first block vLLM has
    not hashed yet (a token it has not received: under async scheduling, a step later).
    vLLM computes them for every request anyway: no hashing of ours (a 3,048-token prompt's
    190 blocks cost ~0.9 ms of the prefill step's host time on an H200's host, docs/gpu.md
    "Twenty-fourth session")."""
    hashes = getattr(request, "block_hashes", None) or ()
    out = []
    for j in range(first, end):
        i = (j + 1) * per_block - 1
        if i >= len(hashes):
            break
        h = hashes[i]
        out.append(h & 0xFFFFFFFFFFFFFFFF if type(h) is int else int.from_bytes(bytes(h)[:8], "little"))
    return out


def known_tokens(tokens: list[int], placeholder: int, request: Any, lo: int) -> bool:
    """Replace, in place, ``placeholder`` entries of ``tokens`` (the runner's token ids at
    positions ``[lo, lo + len(tokens))``) with the scheduler ``request``'s token at the same
    position, where it has one. Returns False, changing nothing, where the two disagree on a
    position both know (not the same request: the caller then trusts neither)."""
    theirs = request.all_token_ids[lo:lo + len(tokens)] if request is not None else []
    for i, t in enumerate(theirs):
        if tokens[i] != placeholder and tokens[i] != t:
            return False
    for i, t in enumerate(theirs):
        if tokens[i] == placeholder:
            tokens[i] = t
    return True
