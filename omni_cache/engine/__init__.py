"""Code that runs inside vLLM-Omni's stage engine processes (one half of the adapter to
vLLM / vLLM-Omni; the other half is :mod:`omni_cache.driver`).

Import rule: nothing here imports :mod:`omni_cache.driver`, :mod:`omni_cache.cli` or the
benchmarks (``tests/unit/test_layout.py``). Modules:

- ``platform_cpu`` / ``platform_cuda``: OmniPlatforms (entry-point group
  ``vllm_omni.platform_plugins``).
- ``workers_cpu`` / ``workers_gpu``: workers and the runner classes they build.
- ``runner``: :class:`~omni_cache.engine.runner.OmniCacheRunnerMixin`, which installs the
  stage manager in vLLM-Omni's AR runner.
- ``stage_manager``: :class:`~omni_cache.engine.stage_manager.OmniCacheStageManager`, the
  data path (one method per arrow); ``seam``: the calls vLLM-Omni makes on it.
- ``scheduler``: the AR scheduler that caps prefix hits to the hidden-state tier.
- ``gemma_thinker``, ``handoff``: a KV-shared thinker model and stage hand-off functions.
- ``plugin``: registers the pipeline variants and model classes (entry points).
- ``metrics``: the per-process counter files; ``talker_audit``: the talker's KV blocks logged
  at write and at prefix-hit read (audits only, ``OMNI_CACHE_HIT_AUDIT``).
"""
