"""The talker's scheduler: vLLM-Omni's AR scheduler whose requests' block hashes come from the
content they were built from, not from their placeholder prompt ids.

vLLM hashes a request's blocks when the engine core builds its ``Request``
(``Request.from_engine_core_request(request, request_block_hasher)``; vLLM 0.30
``v1/engine/core.py``) from the prompt token ids — for the talker, placeholders ``[0] * n``.
:class:`TalkerIdentitySchedulerMixin` replaces each new request's block hasher in
``add_request`` (before any prefix-cache lookup) with :func:`talker_block_hashes`: block ``j``
is hashed with vLLM's own ``hash_block_tokens`` and hash function, chained as vLLM chains,
with the extra key ``(SCHEME, keys[j])`` for the leading blocks the orchestrator keyed
(:mod:`omni_cache.driver.talker_identity`, :mod:`omni_cache.core.talker_keys`) and
``(SCHEME + "/private", nonce)`` — a random per-request nonce — from the first unkeyed block
on (the assistant rows, decoded codec tokens, or every block of a request that came without
keys). So a talker block is shared only between requests whose thinker content up to that
block's last row is the same; the model then serves the talker's input rows from
``num_computed_tokens`` on (vLLM-Omni's ``talker_preprocess`` slices its prefill rows from
``_omni_num_computed_tokens``).

Selected through the pipeline topology (``scheduler_cls`` of stage 1 in omni-cache's
pipelines, :mod:`omni_cache.engine.plugin`); :func:`talker_ar_scheduler` builds the
synchronous or asynchronous variant from the stage's ``async_scheduling``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler

from omni_cache import settings
from omni_cache.core.talker_keys import SCHEME, TALKER_KEYS_ARG, verified_keys
from omni_cache.engine.metrics import MetricsFile
from omni_cache.engine.sched_stats import PrefixStatsFlushMixin

_KEEP_REQUESTS = 256  # per-request prefill records kept in the metrics file

logger = logging.getLogger(__name__)


def talker_block_hashes(request: Any, *, keys: Sequence[str], nonce: bytes,
                        hash_fn: Callable[[Any], bytes], block_size: int) -> list:
    """vLLM block hasher (``Request._block_hasher``) for one talker request: the hashes of its
    new full blocks (from ``len(request.block_hashes)`` on), chained on the last one.

    Args:
        request: vLLM's ``Request`` (``block_hashes``, ``num_tokens``, ``all_token_ids``).
        keys: hex content keys of its leading shareable blocks.
        nonce: random bytes of this request: the extra key of every later block.
        hash_fn: the engine's prefix-caching hash function (``cache_config.prefix_caching_hash_algo``).
        block_size: the hash block size (tokens).

    Returns:
        ``list[BlockHash]`` for the blocks that became full.
    """
    start = len(request.block_hashes) * block_size
    parent = request.block_hashes[-1] if request.block_hashes else None
    out = []
    while start + block_size <= request.num_tokens:
        j = start // block_size
        extra = (SCHEME, keys[j]) if j < len(keys) else (SCHEME + "/private", nonce)
        parent = hash_block_tokens(hash_fn, parent, request.all_token_ids[start:start + block_size], extra)
        out.append(parent)
        start += block_size
    return out


class TalkerIdentitySchedulerMixin:
    """Hashes every new talker request's blocks from its content keys (see the module
    docstring). Counters (``talker_identity_counters``): ``keyed`` requests with keys,
    ``unkeyed`` without, ``keyed_blocks`` keyed blocks, ``prompt_tokens`` and ``hit_tokens``
    of admitted requests. With ``OMNI_CACHE_METRICS_DIR`` set they are published to
    ``talker-<pid>.json`` with, per request (the last 256), ``prompt_tokens``,
    ``cached_tokens`` and ``prefill_s`` — seconds from the ``schedule()`` that admitted it to
    the ``update_from_output()`` that brought its first token (its prefill step's forward and
    sampling; wall time, so a step shared with other requests counts whole)."""

    def _talker_state(self) -> tuple[dict, OrderedDict, dict]:
        st = self.__dict__.get("_talker_state_")
        if st is None:
            st = self.__dict__["_talker_state_"] = (
                self.__dict__.setdefault("talker_identity_counters",
                                         {"keyed": 0, "unkeyed": 0, "keyed_blocks": 0}),
                OrderedDict(), {})
            st[0].setdefault("prompt_tokens", 0)
            st[0].setdefault("hit_tokens", 0)
        return st

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        counters, _, started = self._talker_state()
        now = time.perf_counter()
        for new in out.scheduled_new_reqs:
            req = self.requests.get(new.req_id)
            if req is None:
                continue
            started[new.req_id] = (now, req.num_prompt_tokens, int(new.num_computed_tokens))
            counters["prompt_tokens"] += req.num_prompt_tokens
            counters["hit_tokens"] += int(new.num_computed_tokens)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        result = super().update_from_output(scheduler_output, model_runner_output)
        counters, records, started = self._talker_state()
        if started:
            now = time.perf_counter()
            added = False
            for rid in list(getattr(model_runner_output, "req_ids", None) or ()):
                s = started.pop(rid, None)
                if s is not None:
                    added = True
                    records[rid] = {"prompt_tokens": s[1], "cached_tokens": s[2], "prefill_s": now - s[0]}
                    while len(records) > _KEEP_REQUESTS:
                        records.popitem(last=False)
            if added:  # a request's first token came: its record is written (not every step before it)
                self._publish_talker_metrics(force=False)
        return result

    def _publish_talker_metrics(self, force: bool) -> None:
        """``talker-<pid>.json`` (with ``OMNI_CACHE_METRICS_DIR``): deferred to the file's writer
        thread, which writes it at once (no interval) — off the scheduler's thread, whose step
        is the request's first audio packet's path (a forced write of 256 records cost ~0.46 ms
        there on the CPU, 2026-11-30); ``force``: now, on this thread (shutdown)."""
        counters, records, _ = self._talker_state()
        mf = self.__dict__.setdefault("_talker_metrics_file", MetricsFile("talker"))
        mf.publish(lambda: {**counters, "requests": dict(records)}, force=force, defer=not force)

    def shutdown(self) -> None:
        if "_talker_metrics_file" in self.__dict__:  # the last records, whatever the writer thread did
            self._publish_talker_metrics(force=True)
        super().shutdown()

    def _talker_identity_hasher(self, request: Any) -> Callable | None:
        if request.request_id in self.requests or getattr(request, "_block_hasher", None) is None:
            return None  # a streaming update of a known request, or prefix caching off
        from vllm.utils.hashing import get_hash_fn_by_name

        counters = self._talker_state()[0]
        entry = ((request.sampling_params.extra_args or {}).get(TALKER_KEYS_ARG)
                 if request.sampling_params is not None else None)
        keys = verified_keys(entry, self.hash_block_size, settings.TALKER_KEYS_SECRET.get())
        if keys is not None:
            counters["keyed"] += 1
            counters["keyed_blocks"] += len(keys)
        else:
            keys = []
            if entry is not None:
                logger.warning("talker request %s: its content keys are not for %d-token blocks or not signed "
                               "by this deployment's driver (%s); its blocks are not shared", request.request_id,
                               self.hash_block_size, settings.TALKER_KEYS_SECRET.name)
            counters["unkeyed"] += 1
            if counters["unkeyed"] == 1:
                logger.warning("talker prefix caching: request %s came without content keys (omni-cache's "
                               "orchestrator hook is installed by omni-cache run/serve and OmniPipeline); "
                               "requests without keys share no talker blocks", request.request_id)
        hash_fn = get_hash_fn_by_name(self.cache_config.prefix_caching_hash_algo)
        return functools.partial(talker_block_hashes, keys=keys, nonce=os.urandom(16), hash_fn=hash_fn,
                                 block_size=self.hash_block_size)

    def add_request(self, request: Any) -> None:
        hasher = self._talker_identity_hasher(request)
        if hasher is not None:
            request._block_hasher = hasher
            request.block_hashes = []
            request.update_block_hashes()
        super().add_request(request)


class TalkerARScheduler(TalkerIdentitySchedulerMixin, PrefixStatsFlushMixin, OmniARScheduler):
    """vLLM-Omni's synchronous AR scheduler with content-keyed talker blocks."""


class TalkerARAsyncScheduler(TalkerIdentitySchedulerMixin, PrefixStatsFlushMixin, OmniARAsyncScheduler):
    """vLLM-Omni's asynchronous AR scheduler (its default) with content-keyed talker blocks."""


def talker_ar_scheduler(*args, vllm_config, **kwargs):
    """:class:`TalkerARAsyncScheduler` when the stage schedules asynchronously
    (``scheduler_config.async_scheduling``), else :class:`TalkerARScheduler` (the talker
    stage's ``scheduler_cls`` in omni-cache's pipelines)."""
    from omni_cache.engine.scheduler import pick_ar_scheduler

    return pick_ar_scheduler(TalkerARScheduler, TalkerARAsyncScheduler, *args, vllm_config=vllm_config, **kwargs)
