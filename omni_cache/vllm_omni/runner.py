"""omni-cache in vLLM-Omni's runner: takes over the prefix-cache seam of the AR runner.

vLLM-Omni's AR runner calls three methods of ``PrefixCacheRunnerMixin`` (its runner mixin)
each step — ``_prefix_cache_step_begin(scheduler_output)`` before ``_update_states``,
``_prefix_cache_save_step(hidden, mm, ...) -> step_id`` after the forward, and
``_prefix_cache_materialize(step_id, req_ids)`` when it builds each request's hand-off to the
next stage — on an ``omni_prefix_cache`` manager object. :class:`OmniCacheStageManager`
is that object, built on :class:`omni_cache.core.HiddenStateCache`:

1. ``new_step_starts``: mirror the scheduler's view — each request's block table row of the
   mirrored KV cache group (full attention), its ``num_computed_tokens`` before this step,
   the tokens scheduled now; new and resumed requests with ``num_computed_tokens > 0`` are
   prefix hits.
2. ``save_outputs``: **write** every scheduled token's rows (prefill chunks and decode
   tokens) at their KV slot ids for every token-aligned key (final hidden ``hidden``, the
   captured layers and other per-token multimodal outputs), caching every block that became
   full with its chained block hash (token ids + multimodal identifiers, :func:`chained_block_hashes`);
   then **read** each hit's prefix rows (after all writes: same-step hits see this step's
   rows); keep ``prefix ++ fresh`` per request.
3. ``materialize``: hand the merged tensors to vLLM-Omni's payload builder.

A hit whose rows the ledger cannot vouch for raises :class:`StaleRowsError` naming the request
and block instead of serving a wrong row.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache.core import HiddenStateCache, KeySpec, StaleRowsError, Tier, chained_block_hashes

logger = logging.getLogger(__name__)

HIDDEN_KEY = "hidden"
ENV_METRICS_DIR = "OMNI_CACHE_METRICS_DIR"


@dataclass
class _ReqView:
    """The cache's view of one request (its mirrored-group block table row and block hashes)."""

    block_ids: list[int]
    num_computed_tokens: int  # before the current step
    hit_tokens: int = 0  # prefix hit to serve in the current step (0: none)
    block_hashes: list[int] = field(default_factory=list)


@dataclass
class _StepOutputs:
    hidden_states: dict[str, torch.Tensor] | None
    mm_outputs: dict[str, dict[str, Any]]


@dataclass
class _StepCtx:
    req_ids: list[str]
    spans: dict[str, tuple[int, int]]
    merged: dict[str, dict[str, torch.Tensor]]  # req -> key -> rows
    leftover: dict[str, Any]
    total: int


def _mm_extra_keys(req_state) -> list[tuple[int, int, object]]:
    keys = []
    for f in getattr(req_state, "mm_features", None) or []:
        pos = f.mm_position
        keys.append((int(pos.offset), int(pos.offset + pos.length), f.identifier))
    return keys


class OmniCacheStageManager:
    """Duck-types vLLM-Omni's ``OmniPrefixCacheManager`` for the AR runner's seam.

    Args:
        runner: the AR model runner (for ``requests`` — token ids, mm features).
        block_size: tokens per KV block of the mirrored group.
        num_blocks: KV blocks of the mirrored group (pool rows = ``num_blocks * block_size``).
        group_id: index of the mirrored (full-attention) KV cache group.
    """

    def __init__(self, runner, block_size: int, num_blocks: int, group_id: int = 0):
        self.runner = runner
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.group_id = group_id
        self.cache: HiddenStateCache | None = None  # built at the first save (widths known then)
        self.reqs: dict[str, _ReqView] = {}
        self._scheduled: dict[str, int] = {}
        self._steps: dict[int, _StepCtx] = {}
        self._step_ids = itertools.count()
        self._read_this_step = False  # a hit was read: publish the metrics at materialize
        self._last_publish = 0.0  # time.monotonic() of the last metrics file write

    # ---- 1. step begin -------------------------------------------------------------
    def new_step_starts(self, scheduler_output) -> None:
        """Mirror the scheduler output (before the runner's ``_update_states``)."""
        for rid in scheduler_output.finished_req_ids:
            self.reqs.pop(rid, None)
        for nr in scheduler_output.scheduled_new_reqs:
            self.reqs[nr.req_id] = _ReqView(
                block_ids=list(nr.block_ids[self.group_id]),
                num_computed_tokens=nr.num_computed_tokens,
                hit_tokens=nr.num_computed_tokens,
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            view = self.reqs.get(rid)
            new_ids = cached.new_block_ids[i]
            ncomp = cached.num_computed_tokens[i]
            if view is None or rid in resumed:
                # resumed after preemption: the block table is replaced, the prefix hit
                # (if any) is served again from the cache like a new request's.
                self.reqs[rid] = _ReqView(
                    block_ids=list(new_ids[self.group_id]) if new_ids is not None else [],
                    num_computed_tokens=ncomp, hit_tokens=ncomp,
                )
                continue
            if new_ids is not None:
                view.block_ids.extend(new_ids[self.group_id])
            view.num_computed_tokens = ncomp
            view.hit_tokens = 0
        self._scheduled = dict(scheduler_output.num_scheduled_tokens)
        if self.cache is not None:
            self.cache.begin_step()

    # ---- 2. save: write, then read ---------------------------------------------------
    def _ensure_cache(self, tensors: dict[str, torch.Tensor]) -> HiddenStateCache:
        if self.cache is None:
            specs = [KeySpec(k, int(t.shape[-1]), t.dtype) for k, t in sorted(tensors.items())]
            device = next(iter(tensors.values())).device
            # On an accelerator the pool lives next to the hidden states (no host sync on
            # the forward path); on the CPU platform it is plain host memory.
            tier = Tier.DEVICE if device.type != "cpu" else Tier.HOST
            self.cache = HiddenStateCache(self.num_blocks, self.block_size, specs, device=device, tier=tier)
            self.cache.begin_step()
            logger.info("omni-cache: %s", self.cache.describe().replace("\n", "; "))
        return self.cache

    def _tags(self, rid: str, view: _ReqView, upto_tokens: int) -> list[int]:
        """Chained block hashes of the request's first ``upto_tokens // block_size`` blocks; only
        blocks not hashed yet are hashed (continuing the chain from the last block hash)."""
        nfull = upto_tokens // self.block_size
        done = len(view.block_hashes)
        if done < nfull:
            st = self.runner.requests[rid]
            lo, hi = done * self.block_size, nfull * self.block_size
            n_prompt = len(st.prompt_token_ids or [])
            tokens = (list(st.prompt_token_ids or [])[lo:hi]
                      + list(st.output_token_ids or [])[max(lo - n_prompt, 0):max(hi - n_prompt, 0)])
            extra = [(a - lo, b - lo, ident) for a, b, ident in _mm_extra_keys(st) if b > lo and a < hi]
            view.block_hashes = view.block_hashes + chained_block_hashes(
                tokens, self.block_size, extra, parent=view.block_hashes[-1] if view.block_hashes else None)
        return view.block_hashes[:nfull]

    def save_outputs(
        self,
        hidden_states: torch.Tensor,
        multimodal_outputs: dict[str, Any],
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
    ) -> int:
        """Write this step's rows, read this step's hits. Returns the step id to
        materialize (or discard) exactly once."""
        t0 = time.perf_counter()
        n_tok = num_tokens_unpadded
        aligned: dict[str, torch.Tensor] = {HIDDEN_KEY: hidden_states[:n_tok]}
        leftover: dict[str, Any] = {}
        for k, v in (multimodal_outputs or {}).items():
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] in (n_tok, num_tokens_padded) and k != HIDDEN_KEY:
                aligned[k] = v[:n_tok].reshape(n_tok, -1)
            else:
                leftover[k] = v
        cache = self._ensure_cache(aligned)
        missing = set(cache.specs) - set(aligned)
        req_ids = [r for r in self.runner.input_batch.req_ids if r in self._scheduled]
        spans: dict[str, tuple[int, int]] = {}
        off = 0
        for rid in req_ids:
            n = self._scheduled[rid]
            spans[rid] = (off, off + n)
            off += n
        if off != n_tok:
            raise RuntimeError(f"omni-cache: batch spans {off} tokens but the forward produced {n_tok}")
        fresh: dict[str, dict[str, torch.Tensor]] = {}
        truncating = _fast_prefill_truncates(self.runner)
        for rid in req_ids:  # 2a. every write of the step ...
            view = self.reqs[rid]
            s, e = spans[rid]
            rows = {k: t[s:e] for k, t in aligned.items() if k in cache.specs}
            fresh[rid] = rows
            if truncating and e - s > 1:
                # KV-sharing fast prefill: the final hidden rows of a prefill chunk are the
                # self-decoder output, not the final layer's; they are never marked valid.
                rows = {k: v for k, v in rows.items() if k != HIDDEN_KEY}
            start = view.num_computed_tokens
            end = start + (e - s)
            block_hashes = self._tags(rid, view, end)
            first_new_full = start // self.block_size
            block_hashes = {b: block_hashes[b] for b in range(first_new_full, len(block_hashes))}
            cache.write_request_rows(rid, view.block_ids, start, rows, block_hashes, num_tokens=e - s)
        merged: dict[str, dict[str, torch.Tensor]] = {}
        # keys handed downstream (and needed on a hit): the final hidden states only for
        # models that hand them off (vLLM-Omni's ``omni_pooler_payload_include_hidden``)
        keys = [k for k in cache.specs if k not in missing and (k != HIDDEN_KEY or _hands_off_hidden(self.runner))]
        for rid in req_ids:  # 2b. ... before any read
            view = self.reqs[rid]
            if view.hit_tokens > 0:
                block_hashes = self._tags(rid, view, view.hit_tokens)
                prefix = cache.read_prefix(rid, view.block_ids, view.hit_tokens, block_hashes, keys)
                merged[rid] = cache.merge(prefix, {k: fresh[rid][k] for k in keys})
                view.hit_tokens = 0
                self._read_this_step = True
            else:
                merged[rid] = {k: fresh[rid][k] for k in keys}
        step_id = next(self._step_ids)
        self._steps[step_id] = _StepCtx(req_ids, spans, merged, leftover, n_tok)
        self.step_seconds = time.perf_counter() - t0  # whole save (block_hashes, writes, reads, merge)
        return step_id

    # ---- 3. hand-off ----------------------------------------------------------------
    def materialize(self, step_id: int, req_ids: list[str]) -> _StepOutputs:
        """Per-request merged tensors of a saved step (consumes the step)."""
        from vllm_omni.utils.mm_outputs import to_payload_element

        ctx = self._steps.pop(step_id)
        unknown = set(req_ids) - set(ctx.spans)
        if unknown:
            raise RuntimeError(f"omni-cache: materialize(step {step_id}) got unknown request ids {sorted(unknown)[:8]}")
        hidden = {rid: ctx.merged[rid][HIDDEN_KEY] for rid in req_ids if HIDDEN_KEY in ctx.merged[rid]}
        mm: dict[str, dict[str, Any]] = {}
        for rid in req_ids:
            for k, v in ctx.merged[rid].items():
                if k != HIDDEN_KEY:
                    mm.setdefault(k, {})[rid] = v
        for k, v in ctx.leftover.items():
            mm[k] = {
                rid: to_payload_element(v, ctx.req_ids.index(rid), start=ctx.spans[rid][0], end=ctx.spans[rid][1],
                                        pass_lists_through=True, seq_len=ctx.total)
                for rid in req_ids
            }
        self._publish_metrics(force=self._read_this_step)
        self._read_this_step = False
        return _StepOutputs(hidden_states=hidden or None, mm_outputs=mm)

    #: at most one metrics file write per this many seconds (plus every step that read a hit,
    #: and shutdown): a write costs ~0.8 ms, a per-step write showed on short requests
    PUBLISH_INTERVAL_S = 0.5

    def _publish_metrics(self, force: bool = False) -> None:
        """With ``OMNI_CACHE_METRICS_DIR`` set, write this stage's counters to
        ``<dir>/metrics-<pid>.json`` (benchmarks and tests read them): when ``force`` (a step
        that served a hit, shutdown), else at most every :attr:`PUBLISH_INTERVAL_S` seconds,
        so the hit counters are always current and the row/byte/time counters lag by at
        most that interval while the stage runs."""
        out = os.environ.get(ENV_METRICS_DIR)
        if not out or self.cache is None:
            return
        now = time.monotonic()
        if not force and now - self._last_publish < self.PUBLISH_INTERVAL_S:
            return
        self._last_publish = now
        path = Path(out) / f"metrics-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.cache.metrics.as_dict(),
                                   "last_save_seconds": getattr(self, "step_seconds", 0.0)}))
        tmp.replace(path)

    def discard_step(self, step_id: int) -> None:
        self._steps.pop(step_id)

    def shutdown(self) -> None:
        """Final metrics (log line and, with ``OMNI_CACHE_METRICS_DIR``, the file); called
        from the model runner's ``shutdown``."""
        if self.cache is not None:
            logger.info("omni-cache metrics: %s", self.cache.metrics.as_dict())
            self._publish_metrics(force=True)
        self._steps.clear()

    def metrics(self) -> dict[str, float]:
        """Counters of the hidden-state cache (rows, bytes, hits, seconds)."""
        return self.cache.metrics.as_dict() if self.cache is not None else {}


def _fast_prefill_truncates(runner) -> bool:
    """True if this step's forward runs KV-sharing fast prefill (cross-decoder on logit rows
    only): the engine setting is on (it is switched off for a step that falls back, see
    :meth:`OmniCacheRunnerMixin.execute_model`) and the model has KV-shared layers."""
    return bool(getattr(runner.cache_config, "kv_sharing_fast_prefill", False)
                and getattr(runner, "kv_sharing_fast_prefill_eligible_layers", None))


def _hands_off_hidden(runner) -> bool:
    return bool(getattr(getattr(runner, "model", None), "omni_pooler_payload_include_hidden", True))


def _full_attention_group(kv_cache_config) -> int:
    """Index of the KV cache group to mirror: the first full-attention group."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    for i, g in enumerate(groups):
        if isinstance(g.kv_cache_spec, FullAttentionSpec) and not getattr(g.kv_cache_spec, "sliding_window", None):
            return i
    return 0


class OmniCacheRunnerMixin:
    """Replaces vLLM-Omni's built-in prefix-cache manager with :class:`OmniCacheStageManager`.

    Also (KV-shared / hybrid models, docs/yoco.md):

    - multi-group KV layouts (sliding-window + full-attention groups) are accepted: vLLM-Omni's
      gate refuses them in ``initialize_metadata_builders``; omni-cache mirrors the first
      full-attention group instead (:func:`_full_attention_group`).
    - per-batch fast-prefill eligibility: a step whose batch holds a request with prompt
      logprobs runs without KV-sharing fast prefill (vLLM would assert), so the request is
      served and the engine keeps running.
    """

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes) -> None:
        from vllm_omni.core.prefix_cache.interface import OmniPrefixCacheUnmatchError

        try:
            super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
            return
        except OmniPrefixCacheUnmatchError:
            # vLLM-Omni's gate runs after vLLM's metadata builders are set up; it refuses
            # every multi-group layout. Re-raise anything else it refuses.
            if len(getattr(kv_cache_config, "kv_cache_groups", ()) or ()) <= 1:
                raise
        self._omni_prefix_cache_cfg = _stage_multi_group_config(self, kv_cache_config)

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._restart_resumed_payloads(scheduler_output)
        cc = self.cache_config
        if not (cc.kv_sharing_fast_prefill and _batch_has_prompt_logprobs(self, scheduler_output)):
            return super().execute_model(scheduler_output, *args, **kwargs)
        logger.info("omni-cache: step without KV-sharing fast prefill (a request needs prompt logprobs)")
        cc.kv_sharing_fast_prefill = False
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            cc.kv_sharing_fast_prefill = True

    def shutdown(self) -> None:
        mgr = getattr(self, "omni_prefix_cache", None)
        if isinstance(mgr, OmniCacheStageManager):
            mgr.shutdown()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()

    def _restart_resumed_payloads(self, scheduler_output) -> None:
        """A request resumed after preemption restarts its hand-off accumulation.

        vLLM-Omni accumulates a request's per-step hand-off rows (``hidden``, captured layers)
        across steps and never resets them on preemption, so a resumed request that
        recomputes its prompt would hand the talker some positions twice (seen in the stress
        run: 1,216 rows for a 617-token request). Under this runner a resumed request's first
        step always yields rows ``[0, end)``: omni-cache serves its re-hit prefix from the
        hidden-state cache (merged with the fresh rows), and without prefix caching it
        recomputes from position 0. So the rows accumulated before the preemption are
        dropped here, before the step's forward. (vLLM-Omni's built-in cache does not mirror
        a resume as a hit; it runs on the plain runner, unchanged.)
        """
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None)
        pending = getattr(self, "_pending_full_payload_send", None)
        if not resumed or pending is None:
            return
        for rid in resumed:
            if pending.pop(rid, None) is not None:
                logger.debug("omni-cache: request %s resumed after preemption; hand-off rows restart", rid)

    def _ensure_omni_prefix_cache(self) -> None:
        from vllm.distributed.parallel_state import get_pp_group

        cfg = self._omni_prefix_cache_cfg
        self._omni_prefix_cache_cfg = None
        if cfg is None or not get_pp_group().is_last_rank:
            return
        group = _full_attention_group(self.kv_cache_config)
        self.omni_prefix_cache = OmniCacheStageManager(
            self, block_size=cfg.block_size, num_blocks=self.kv_cache_config.num_blocks, group_id=group
        )
        logger.info("omni-cache: hidden-state prefix cache active (KV group %d, block %d, %d blocks)",
                    group, cfg.block_size, self.kv_cache_config.num_blocks)


def _batch_has_prompt_logprobs(runner, scheduler_output) -> bool:
    """Whether the runner will hold a request pending prompt logprobs in this step (vLLM's
    ``num_prompt_logprobs`` after ``_update_states``)."""
    finished = set(scheduler_output.finished_req_ids)
    if set(getattr(runner, "num_prompt_logprobs", {}) or {}) - finished:
        return True
    return any(getattr(nr.sampling_params, "prompt_logprobs", None) is not None
               for nr in scheduler_output.scheduled_new_reqs if nr.sampling_params is not None)


def _stage_multi_group_config(runner, kv_cache_config):
    """vLLM-Omni's prefix-cache staging for a multi-group KV layout: its other refusals
    (KV consumer, speculative decoding, sub-block hits) still apply; a layout without a
    full-attention group is refused (nothing to mirror).

    Raises:
        OmniPrefixCacheUnmatchError: as above.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_omni.core.prefix_cache.group_view import (
        check_prefix_cache_kv_transfer,
        check_prefix_cache_token_accounting,
    )
    from vllm_omni.core.prefix_cache.interface import OmniPrefixCacheUnmatchError, PrefixCacheConfig

    check_prefix_cache_kv_transfer(getattr(runner.vllm_config, "kv_transfer_config", None))
    check_prefix_cache_token_accounting(runner.cache_config, runner.speculative_config)
    groups = kv_cache_config.kv_cache_groups
    g = _full_attention_group(kv_cache_config)
    spec = groups[g].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
        raise OmniPrefixCacheUnmatchError(
            f"omni-cache mirrors a full-attention KV cache group; none among {len(groups)} groups "
            f"({[type(x.kv_cache_spec).__name__ for x in groups]}). Disable enable_prefix_caching on this stage")
    logger.info("omni-cache: %d KV cache groups; mirroring full-attention group %d", len(groups), g)
    return PrefixCacheConfig.from_vllm_config(num_blocks=kv_cache_config.num_blocks, block_size=spec.block_size,
                                              scheduler_config=runner.scheduler_config, model_config=runner.model_config)


def _cpu_runner_cls():
    from omni_cache.vllm_omni.workers_cpu import CPUARModelRunner

    class OmniCacheCPUARModelRunner(OmniCacheRunnerMixin, CPUARModelRunner):
        """CPU AR runner with omni-cache as the thinker's hidden-state prefix cache."""

    return OmniCacheCPUARModelRunner


def __getattr__(name: str):
    # The CPU runner class is built on first use so importing this module on a GPU
    # install does not import vLLM's CPU worker.
    if name == "OmniCacheCPUARModelRunner":
        cls = globals()[name] = _cpu_runner_cls()
        cls.__module__, cls.__qualname__ = __name__, name
        return cls
    raise AttributeError(name)


__all__ = ["OmniCacheCPUARModelRunner", "OmniCacheRunnerMixin", "OmniCacheStageManager", "StaleRowsError"]
