"""vLLM-Omni general plugin (entry-point group ``vllm_omni.general_plugins``), loaded in every
vLLM-Omni process: registers omni-cache's pipeline variants (idempotent).

``qwen3_omni_moe_omni_cache``
    Qwen3-Omni-MoE with the capped scheduler
    (:func:`~omni_cache.engine.scheduler.capped_ar_scheduler`: sync or async) on the thinker
    (prefix hits capped to the hidden-state tier's coverage).
``qwen3_omni_moe_omni_cache_recorded``
    the same, plus the thinker→talker and talker→code2wav hand-offs recorded
    (:mod:`omni_cache.engine.handoff`), for tests and audits.
``gemma4_omni_cache``
    a KV-shared (YOCO) multimodal Gemma-4 thinker (``OmniCacheGemma4Thinker``: vision and audio
    towers; model, tokenizer and Gemma 4's processor from the model directory's ``thinker/``)
    feeding the Qwen3-Omni talker and code2wav through the stage-input adapters (whole payload
    or streamed), capped scheduler on the thinker.
``gemma3n_omni_cache``
    a KV-shared (YOCO) Gemma-3n text thinker (:mod:`omni_cache.engine.gemma_thinker`, loaded
    from the model directory's ``thinker/``) feeding the Qwen3-Omni talker and code2wav
    through the stage-input adapter, with the capped scheduler on the thinker. The thinker
    architecture ``OmniCacheGemma3nThinker`` is registered with vLLM's ``ModelRegistry``.

In all of them the talker (stage 1) runs as ``OmniCacheQwen3OmniMoeForConditionalGeneration``
(:mod:`omni_cache.engine.talker`): vLLM-Omni's Qwen3-Omni model whose residual-codebook
sampling honours the runner's per-request generators (``tts_local_seed``), scheduled by
:func:`~omni_cache.engine.talker_scheduler.talker_ar_scheduler` (talker blocks hashed from
their content keys, so talker prefix caching is safe).
"""

from __future__ import annotations

import dataclasses

CAPPED_PIPELINE = "qwen3_omni_moe_omni_cache"
RECORDING_PIPELINE = "qwen3_omni_moe_omni_cache_recorded"
SCHEDULER = "omni_cache.engine.scheduler.capped_ar_scheduler"

#: the streaming thinker → talker hand-off: vLLM-Omni's, keeping a resumed request's decode row
HANDOFF_ASYNC = "omni_cache.engine.handoff.thinker2talker_async_chunk"
RECORDER = "omni_cache.engine.handoff.record_thinker2talker_full_payload"
RECORDER_ASYNC = "omni_cache.engine.handoff.record_thinker2talker_async_chunk"
TALKER_RECORDER = "omni_cache.engine.handoff.record_talker2code2wav_full_payload"
TALKER_RECORDER_ASYNC = "omni_cache.engine.handoff.record_talker2code2wav_async_chunk"
GEMMA_PIPELINE = "gemma3n_omni_cache"
GEMMA_ARCH = "OmniCacheGemma3nThinker"
GEMMA_ADAPTER = "omni_cache.engine.gemma_thinker.gemma_thinker2talker_full_payload"
GEMMA_ADAPTER_ASYNC = "omni_cache.engine.gemma_thinker.gemma_thinker2talker_async_chunk"
GEMMA4_PIPELINE = "gemma4_omni_cache"
GEMMA4_ARCH = "OmniCacheGemma4Thinker"
#: registered thinker architectures → classes
THINKER_CLASSES = {GEMMA_ARCH: "omni_cache.engine.gemma_thinker:OmniCacheGemma3nThinker",
                   GEMMA4_ARCH: "omni_cache.engine.gemma_thinker:OmniCacheGemma4Thinker"}
#: architecture name of the talker stage in omni-cache's pipelines
TALKER_ARCH = "OmniCacheQwen3OmniMoeForConditionalGeneration"
TALKER_CLASS = "omni_cache.engine.talker:OmniCacheQwen3OmniMoeForConditionalGeneration"
#: the talker stage's scheduler: block hashes from content keys (talker prefix caching)
TALKER_SCHEDULER = "omni_cache.engine.talker_scheduler.talker_ar_scheduler"
#: pipeline → stage ids that run the capped scheduler (the omni_cache backend needs it there)
CAPPED_STAGES = {CAPPED_PIPELINE: {0}, RECORDING_PIPELINE: {0}, GEMMA_PIPELINE: {0}, GEMMA4_PIPELINE: {0}}
#: pipeline → stage ids whose blocks omni-cache hashes from content keys (talker prefix caching,
#: :mod:`omni_cache.engine.talker_scheduler`): the Qwen3-Omni talker, whose prompt layout the
#: keys follow (:mod:`omni_cache.core.talker_keys`)
#: the realtime (duplex) plugin of omni-cache's Qwen3-Omni pipelines: vLLM-Omni's, with a
#: conversation window that keeps the prompt's prefix stable (:mod:`omni_cache.engine.duplex`)
DUPLEX_PLUGIN = "omni_cache.engine.duplex.CacheAwareQwen3OmniDuplexPlugin"
TALKER_IDENTITY_STAGES = {CAPPED_PIPELINE: {1}, RECORDING_PIPELINE: {1}}
#: model subdirectory per stage of omni-cache's pipelines (read by the stage-config check)
STAGE_MODEL_SUBDIRS = {GEMMA_PIPELINE: {0: "thinker"}, GEMMA4_PIPELINE: {0: "thinker"}}


def _variant(name: str, talker_changes: dict | None = None, **stage0_changes):
    from vllm_omni.model_executor.models.qwen3_omni.pipeline import QWEN3_OMNI_PIPELINE

    stages = tuple(dataclasses.replace(s, **stage0_changes) if s.stage_id == 0
                   else dataclasses.replace(_talker(s), **(talker_changes or {})) if s.stage_id == 1 else s
                   for s in QWEN3_OMNI_PIPELINE.stages)
    return dataclasses.replace(QWEN3_OMNI_PIPELINE, model_type=name, stages=stages, duplex_plugin=DUPLEX_PLUGIN)


def _talker(stage):
    """Stage 1 (the talker) as :data:`TALKER_ARCH` with :data:`TALKER_SCHEDULER`; other stages
    unchanged."""
    if stage.stage_id != 1:
        return stage
    return dataclasses.replace(stage, model_arch=TALKER_ARCH, scheduler_cls=TALKER_SCHEDULER)


def _gemma_pipeline(name: str = GEMMA_PIPELINE, arch: str = GEMMA_ARCH, multimodal: bool = False):
    """Qwen3-Omni's pipeline with a KV-shared thinker of ``arch`` on stage 0 (model — and, for
    a multimodal thinker, tokenizer and processor — from ``thinker/``) and the adapters."""
    from vllm_omni.model_executor.models.qwen3_omni.pipeline import QWEN3_OMNI_PIPELINE

    def stage(s):
        if s.stage_id != 0:
            return _talker(s)
        return dataclasses.replace(
            s, model_arch=arch, model_subdir="thinker", tokenizer_subdir="thinker" if multimodal else None,
            hf_config_name=None, requires_multimodal_data=multimodal, scheduler_cls=SCHEDULER,
            custom_process_next_stage_input_func=GEMMA_ADAPTER,
            async_chunk_process_next_stage_input_func=GEMMA_ADAPTER_ASYNC)

    return dataclasses.replace(QWEN3_OMNI_PIPELINE, model_type=name, duplex_plugin=None,
                               stages=tuple(stage(s) for s in QWEN3_OMNI_PIPELINE.stages))


_EXIT_GC_FROZEN = [False]


def freeze_gc_at_exit() -> bool:
    """Let a vLLM process that is exiting skip the interpreter's final garbage collections
    (``atexit`` → ``gc.freeze()``; idempotent). Returns True the first time it registers.

    Why: vLLM-Omni stops the stages one after another, each with vLLM's 5 s grace
    (``vllm.v1.utils.shutdown``), then force-kills ("[shutdown] Process manager: force killing
    remaining process StageEngineCoreProc_stageN"), ~15 s in all. Profiled (py-spy, this
    CPU): a stage's worker and engine core spend their shutdown in ``gc_collect_main`` — vLLM's
    own ``gc.collect()`` in the runner's and the engine's cleanup (kept), then the
    interpreter's collections at finalization (~0.4 s a pass over ~0.8 M objects on an idle
    core, seconds on a busy one). Freezing the heap at ``atexit`` (which runs before those
    collections) leaves nothing for them to scan; the process exits in time. What it skips:
    collecting cyclic garbage of a process that is ending (its memory goes back to the OS
    anyway); ``atexit`` handlers, ``weakref.finalize`` callbacks and reference-counted frees
    still run."""
    import atexit
    import gc

    if _EXIT_GC_FROZEN[0]:
        return False
    atexit.register(gc.freeze)
    _EXIT_GC_FROZEN[0] = True
    return True


def freeze_gc_for_process_teardown() -> bool:
    """Freeze the garbage collector's heap (``gc.freeze()``) when this is a vLLM child process
    (a stage's engine core or worker: ``multiprocessing.parent_process()`` is set) that is
    tearing its model runner down; do nothing in a main process. Returns True when it froze.

    Why: vLLM's ``GPUModelRunner.shutdown`` → ``_cleanup_profiling_kv_cache`` runs a full
    ``gc.collect()`` over the worker's heap (~0.86 M tracked objects in a CPU thinker worker).
    Stopped by SIGTERM during a request on this 2-core CPU with two busy-loop processes beside
    it, the thinker stage overran vLLM's 5 s grace and was force-killed
    (``vllm.v1.utils.shutdown``; the CI failure of ``tests/pipeline/test_run.py`` on
    2026-11-28), and py-spy put most of the worker's stop in that line. Frozen first, the
    collection scans only what the teardown itself drops (~120 objects; still ~0.5 s on that
    host, measured with a ``gc.callbacks`` timer: their freeing, not the scan). The
    process ends right after its teardown, so scanning objects that live until then frees
    nothing it still needs.
    Not in a main process: an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
    tests' in-process engines) keeps running after the teardown, and that collection is what
    frees a previous engine's memory for the next one."""
    import gc
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return False
    gc.freeze()
    return True


def register_models() -> None:
    """Register omni-cache's model classes (lazy, idempotent) with vLLM's ``ModelRegistry``
    and with vLLM-Omni's ``OmniModelRegistry`` (a separate registry instance that vLLM-Omni's
    stage model configs resolve architectures with); and :func:`freeze_gc_at_exit` (this
    plugin loads in every vLLM process: engine cores and workers)."""
    from vllm import ModelRegistry

    from omni_cache.engine import cpu_attention

    freeze_gc_at_exit()
    cpu_attention.apply()

    registries = [ModelRegistry]
    try:
        from vllm_omni.model_executor.models.registry import OmniModelRegistry

        registries.append(OmniModelRegistry)
    except ImportError:  # plain vLLM install
        pass
    for reg in registries:
        for arch, cls in THINKER_CLASSES.items():
            if arch not in reg.get_supported_archs():
                reg.register_model(arch, cls)
        if TALKER_ARCH not in reg.get_supported_archs():
            reg.register_model(TALKER_ARCH, TALKER_CLASS)


def register() -> None:
    """Register the pipeline variants with vLLM-Omni's pipeline registry and omni-cache's
    model classes with vLLM's."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline

    register_models()
    if GEMMA_PIPELINE not in OMNI_PIPELINES:
        register_pipeline(_gemma_pipeline())
    if GEMMA4_PIPELINE not in OMNI_PIPELINES:
        register_pipeline(_gemma_pipeline(GEMMA4_PIPELINE, GEMMA4_ARCH, multimodal=True))

    if CAPPED_PIPELINE not in OMNI_PIPELINES:
        register_pipeline(_variant(CAPPED_PIPELINE, scheduler_cls=SCHEDULER,
                                   async_chunk_process_next_stage_input_func=HANDOFF_ASYNC))
    if RECORDING_PIPELINE not in OMNI_PIPELINES:
        register_pipeline(_variant(RECORDING_PIPELINE,
                                   {"custom_process_next_stage_input_func": TALKER_RECORDER,
                                    "async_chunk_process_next_stage_input_func": TALKER_RECORDER_ASYNC},
                                   scheduler_cls=SCHEDULER,
                                   custom_process_next_stage_input_func=RECORDER,
                                   async_chunk_process_next_stage_input_func=RECORDER_ASYNC))
