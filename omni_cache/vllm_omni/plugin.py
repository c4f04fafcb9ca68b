"""vLLM-Omni general plugin (entry-point group ``vllm_omni.general_plugins``), loaded in every
vLLM-Omni process: registers omni-cache's pipeline variants (idempotent).

``qwen3_omni_moe_omni_cache``
    Qwen3-Omni-MoE with :class:`~omni_cache.vllm_omni.scheduler.OmniCacheARScheduler` on the
    thinker (prefix hits capped to the hidden-state tier's coverage).
``qwen3_omni_moe_omni_cache_recorded``
    the same, plus the thinker→talker hand-off recorded
    (:mod:`omni_cache.vllm_omni.handoff`), for tests and audits.
"""

from __future__ import annotations

import dataclasses

CAPPED_PIPELINE = "qwen3_omni_moe_omni_cache"
RECORDING_PIPELINE = "qwen3_omni_moe_omni_cache_recorded"
SCHEDULER = "omni_cache.vllm_omni.scheduler.OmniCacheARScheduler"
RECORDER = "omni_cache.vllm_omni.handoff.record_thinker2talker_full_payload"


def _variant(name: str, **stage0_changes):
    from vllm_omni.model_executor.models.qwen3_omni.pipeline import QWEN3_OMNI_PIPELINE

    stages = tuple(dataclasses.replace(s, **stage0_changes) if s.stage_id == 0 else s
                   for s in QWEN3_OMNI_PIPELINE.stages)
    return dataclasses.replace(QWEN3_OMNI_PIPELINE, model_type=name, stages=stages)


def register() -> None:
    """Register the pipeline variants with vLLM-Omni's pipeline registry."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline

    if CAPPED_PIPELINE not in OMNI_PIPELINES:
        register_pipeline(_variant(CAPPED_PIPELINE, scheduler_cls=SCHEDULER))
    if RECORDING_PIPELINE not in OMNI_PIPELINES:
        register_pipeline(_variant(RECORDING_PIPELINE, scheduler_cls=SCHEDULER,
                                   custom_process_next_stage_input_func=RECORDER))
