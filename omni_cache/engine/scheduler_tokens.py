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


def scheduler_requests(vllm_config: Any) -> Mapping[str, Any] | None:
    """The requests (request id → object with ``all_token_ids``) of the scheduler registered for
    this ``vllm_config`` object, or ``None`` (none in this process: the caller keeps input ids)."""
    scheduler = _SCHEDULERS.get(id(vllm_config)) if vllm_config is not None else None
    if scheduler is None or getattr(scheduler, "vllm_config", None) is not vllm_config:
        return None
    return getattr(scheduler, "requests", None)


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
