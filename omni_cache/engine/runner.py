"""omni-cache in vLLM-Omni's AR runner: the runner mixin that installs the stage manager.

vLLM-Omni's AR runner (``GPUARModelRunner``, through its ``PrefixCacheRunnerMixin``) builds a
prefix-cache manager in ``_ensure_omni_prefix_cache`` and calls it every step (the seam,
:mod:`omni_cache.engine.seam`). :class:`OmniCacheRunnerMixin` builds
:class:`~omni_cache.engine.stage_manager.OmniCacheStageManager` there instead and adapts the
runner where omni-cache needs more than vLLM-Omni allows (multi-group KV layouts, per-batch
fast-prefill fallback, resumed requests' hand-off rows). The concrete runner classes are
composed in :mod:`omni_cache.engine.workers_cpu` and :mod:`omni_cache.engine.workers_gpu`.
"""

from __future__ import annotations

import logging
import time

from omni_cache.engine.stage_manager import CACHED_BLOCKS_ATTR, OmniCacheStageManager

logger = logging.getLogger(__name__)


def full_attention_group(kv_cache_config) -> int:
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
      full-attention group instead (:func:`full_attention_group`).
    - per-batch fast-prefill eligibility: a step whose batch holds a request with prompt
      logprobs runs without KV-sharing fast prefill (vLLM would assert), so the request is
      served and the engine keeps running.
    """

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes) -> None:
        from vllm_omni.core.prefix_cache.interface import OmniPrefixCacheUnmatchError

        try:
            super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        except OmniPrefixCacheUnmatchError:
            # vLLM-Omni's gate runs after vLLM's metadata builders are set up; it refuses
            # every multi-group layout. Re-raise anything else it refuses.
            if len(getattr(kv_cache_config, "kv_cache_groups", ()) or ()) <= 1:
                raise
            self._omni_prefix_cache_cfg = _stage_multi_group_config(self, kv_cache_config)
        self._warm_up_step_writer()

    def _warm_up_step_writer(self) -> None:
        """At start-up (KV cache set up, before the engine reports ready): compile and check
        the fused step writer on this stage's GPU (:func:`omni_cache.core.fused.warm_up`), so
        no request pays its JIT. Only where this stage will cache hidden states on CUDA."""
        cfg = getattr(self, "_omni_prefix_cache_cfg", None)
        device = getattr(self, "device", None)
        if (cfg is None or device is None or getattr(device, "type", None) != "cuda"
                or getattr(self.model_config, "model_stage", None) == "talker"):
            return
        import time

        from omni_cache.core import fused

        t0 = time.perf_counter()
        ok = fused.warm_up(device, cfg.block_size)
        logger.info("omni-cache: fused step writer %s on %s in %.2f s", "compiled and checked" if ok
                    else "unavailable (pools' index_copy_ path)", device, time.perf_counter() - t0)

    def _step_times(self):
        """This runner's :class:`~omni_cache.engine.metrics.RunnerStepTimes` (built at the first
        step), or None when ``OMNI_CACHE_METRICS_DIR`` is unset: then nothing is timed."""
        if "_omni_step_times" not in self.__dict__:
            from omni_cache import settings
            from omni_cache.engine.metrics import RunnerStepTimes

            stage = getattr(getattr(self, "model_config", None), "model_stage", None)
            self.__dict__["_omni_step_times"] = RunnerStepTimes(stage) if settings.METRICS_DIR.get() else None
        return self.__dict__["_omni_step_times"]

    def execute_model(self, scheduler_output, *args, **kwargs):
        times = self._step_times()
        if times is None:
            return self._execute_model(scheduler_output, *args, **kwargs)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._execute_model(scheduler_output, *args, **kwargs)
        finally:
            times.add("execute_model", time.perf_counter() - t0, time.thread_time() - c0)

    def _execute_model(self, scheduler_output, *args, **kwargs):
        self._restart_resumed_payloads(scheduler_output)
        audit = self._talker_kv_audit()
        cc = self.cache_config
        if not (cc.kv_sharing_fast_prefill and _batch_needs_full_prefill(self, scheduler_output)):
            out = super().execute_model(scheduler_output, *args, **kwargs)
        else:
            logger.info("omni-cache: step without KV-sharing fast prefill (a request needs prompt logprobs "
                        "or opted out)")
            cc.kv_sharing_fast_prefill = False
            try:
                out = super().execute_model(scheduler_output, *args, **kwargs)
            finally:
                cc.kv_sharing_fast_prefill = True
        self._settle_ledger()
        if audit is not None:
            audit.after_step(self, scheduler_output)
        return out

    def _talker_kv_audit(self):
        """The talker's KV audit (:mod:`omni_cache.engine.talker_audit`; ``OMNI_CACHE_HIT_AUDIT``
        on the talker stage), built at the first step; None elsewhere."""
        if "_omni_talker_kv_audit" not in self.__dict__:
            from omni_cache.engine.talker_audit import TalkerKVAudit

            self.__dict__["_omni_talker_kv_audit"] = TalkerKVAudit.for_runner(self)
        return self.__dict__["_omni_talker_kv_audit"]

    def _build_omni_model_runner_output_from_snapshot(self, **kwargs):
        """vLLM-Omni's payload builder (on its async-output thread under async scheduling,
        else inline): before it materializes the step, hand the stage manager vLLM-Omni's own
        snapshot of the step's outputs (``hidden_states``, ``multimodal_outputs``: host copies
        under async output), from which the fresh hand-off rows are taken instead of a second
        copy of ours (``OMNI_CACHE_HANDOFF_STAGING=snapshot``, docs/gpu.md "Zero overhead").
        The built output carries the block ids the step cached (:data:`CACHED_BLOCKS_ATTR`) to
        the capped scheduler."""
        times = self._step_times()
        if times is None:
            return self._build_output_from_snapshot(**kwargs)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._build_output_from_snapshot(**kwargs)
        finally:
            times.add("output_builder", time.perf_counter() - t0, time.thread_time() - c0)

    def _build_output_from_snapshot(self, **kwargs):
        mgr = getattr(self, "omni_prefix_cache", None)
        step_id = kwargs.get("prefix_cache_step_id")
        cached = None
        if step_id is not None and isinstance(mgr, OmniCacheStageManager):
            cached = mgr.cached_blocks(step_id)
            mgr.attach_snapshot(step_id, kwargs.get("hidden_states"), kwargs.get("multimodal_outputs"))
        output = super()._build_omni_model_runner_output_from_snapshot(**kwargs)
        if cached is not None:
            # the step's cached blocks, for the capped scheduler (CACHED_BLOCKS_ATTR)
            setattr(output, CACHED_BLOCKS_ATTR, cached)
        return output

    def _settle_ledger(self) -> None:
        """Apply the ledger updates the step's writes deferred (``HiddenStateCache.settle``,
        docs/pool-gpu.md) now that the step's forward and writes are enqueued: on a GPU whose
        runner returns from ``execute_model`` before sampling waits for the device, this host
        work overlaps the forward instead of delaying the step's launch; elsewhere it is the
        same work the next lookup would do first."""
        mgr = getattr(self, "omni_prefix_cache", None)
        cache = getattr(mgr, "cache", None) if isinstance(mgr, OmniCacheStageManager) else None
        if cache is not None:
            cache.settle()

    def shutdown(self) -> None:
        """Stop the stage manager, then vLLM's runner teardown — with the heap frozen first in
        a stage's own process, which ends right after
        (:func:`omni_cache.engine.plugin.freeze_gc_for_process_teardown`: vLLM's full
        ``gc.collect()`` there took the thinker stage past vLLM's 5 s stop grace on a busy
        CPU)."""
        from omni_cache.engine.plugin import freeze_gc_for_process_teardown

        mgr = getattr(self, "omni_prefix_cache", None)
        if isinstance(mgr, OmniCacheStageManager):
            mgr.shutdown()
        times = self.__dict__.get("_omni_step_times")
        if times is not None:
            times.flush()
        freeze_gc_for_process_teardown()
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
        if not resumed:
            return
        pending = getattr(self, "_pending_full_payload_send", None)
        for rid in resumed:
            if pending is not None and pending.pop(rid, None) is not None:
                logger.debug("omni-cache: request %s resumed after preemption; hand-off rows restart", rid)
            self._drop_stashed_prompt_rows(rid)

    def _drop_stashed_prompt_rows(self, rid: str) -> None:
        """The streaming hand-off's counterpart of the above: until a request's first chunk
        goes to the talker, vLLM-Omni's ``thinker2talker_async_chunk`` stashes its prompt rows
        step by step in the connector runtime's send-side payloads (keyed by the external
        request id) and never resets them on preemption, so a request preempted during its
        chunked prefill and resumed handed the talker its stale rows followed by all its rows
        again (seen in the stress run: 867 prompt rows for a 484-token prompt). Its first step
        after the resume yields rows ``[0, end)``, so a stash whose first chunk is not sent yet
        is dropped here."""
        stash = getattr(self, "_send_side_request_payload", None)
        if not stash:
            return
        ext = (getattr(self, "_request_ids_mapping", None) or {}).get(rid, rid)
        if (getattr(self, "_put_req_chunk", None) or {}).get(ext, 0) == 0:
            for key in {rid, ext}:
                if stash.pop(key, None) is not None:
                    logger.debug("omni-cache: request %s resumed before its first chunk; stashed rows dropped", rid)

    def _ensure_omni_prefix_cache(self) -> None:
        from vllm.distributed.parallel_state import get_pp_group

        cfg = self._omni_prefix_cache_cfg
        self._omni_prefix_cache_cfg = None
        if cfg is None or not get_pp_group().is_last_rank:
            return
        if getattr(self.model_config, "model_stage", None) == "talker":
            # The talker hands code2wav only its decode rows (talker2code2wav_* take the
            # last len(output) rows): a prefix hit skips nothing a downstream stage reads,
            # so its prefix caching is KV only (blocks keyed by content:
            # omni_cache.engine.talker_scheduler) — no hidden-state tier, ours or vLLM-Omni's.
            self.omni_prefix_cache = None
            logger.info("omni-cache: talker prefix caching is KV only (no hidden-state tier)")
            return
        group = full_attention_group(self.kv_cache_config)
        self.omni_prefix_cache = OmniCacheStageManager(
            self, block_size=cfg.block_size, num_blocks=self.kv_cache_config.num_blocks, group_id=group
        )
        logger.info("omni-cache: hidden-state prefix cache active (KV group %d, block %d, %d blocks)",
                    group, cfg.block_size, self.kv_cache_config.num_blocks)


#: ``SamplingParams.extra_args`` key of a request whose steps run without KV-sharing fast
#: prefill (the whole batch of each step that schedules it, as for prompt logprobs): the slow
#: path's computation chosen per request, so one fast-prefill engine also gives its reference
#: (tests, audits)
NO_FAST_PREFILL = "omni_cache_no_fast_prefill"


def _batch_needs_full_prefill(runner, scheduler_output) -> bool:
    """Whether this step must run without fast prefill: a request pending prompt logprobs, or
    one scheduled with :data:`NO_FAST_PREFILL`."""
    return _batch_has_prompt_logprobs(runner, scheduler_output) or _batch_opted_out(runner, scheduler_output)


def _opted_out(sampling_params) -> bool:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return bool(extra.get(NO_FAST_PREFILL))


def _batch_opted_out(runner, scheduler_output) -> bool:
    if any(_opted_out(nr.sampling_params) for nr in scheduler_output.scheduled_new_reqs):
        return True
    states = getattr(runner, "requests", {}) or {}
    return any(_opted_out(getattr(states.get(rid), "sampling_params", None))
               for rid in scheduler_output.num_scheduled_tokens)


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
    g = full_attention_group(kv_cache_config)
    spec = groups[g].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
        raise OmniPrefixCacheUnmatchError(
            f"omni-cache mirrors a full-attention KV cache group; none among {len(groups)} groups "
            f"({[type(x.kv_cache_spec).__name__ for x in groups]}). Disable enable_prefix_caching on this stage")
    logger.info("omni-cache: %d KV cache groups; mirroring full-attention group %d", len(groups), g)
    return PrefixCacheConfig.from_vllm_config(num_blocks=kv_cache_config.num_blocks, block_size=spec.block_size,
                                              scheduler_config=runner.scheduler_config,
                                              model_config=runner.model_config)
