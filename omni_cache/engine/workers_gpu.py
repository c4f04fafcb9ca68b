"""GPU AR worker whose runner is chosen per stage (omni-cache or vLLM-Omni's built-in cache).

Same shape as :mod:`omni_cache.engine.workers_cpu`: vLLM-Omni's ``GPUARWorker`` builds its
runner from ``model_runner_cls`` in ``init_device``; this subclass sets the class per stage.
On GPU the hidden-state pool lives on the device (``Tier.DEVICE``: ``index_copy_`` /
``index_select`` on the stream, no host synchronisation on the forward path).
"""

from __future__ import annotations

from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_ar_worker import GPUARWorker
from vllm_omni.worker.gpu_generation_worker import GPUGenerationWorker

from omni_cache import settings
from omni_cache.engine.platform_cuda import apply_jit_warmup_setting
from omni_cache.engine.runner import OmniCacheRunnerMixin


class OmniCacheGPUARModelRunner(OmniCacheRunnerMixin, GPUARModelRunner):
    """vLLM-Omni's GPU AR runner with omni-cache as the hidden-state prefix cache."""


class OmniCacheGPUARWorker(GPUARWorker):
    """``GPUARWorker`` that builds :class:`OmniCacheGPUARModelRunner` unless the stage asks
    for the built-in cache (``OMNI_CACHE_PREFIX_CACHE_BACKEND=builtin``); applies
    ``OMNI_CACHE_JIT_WARMUP`` (:func:`~omni_cache.engine.platform_cuda.apply_jit_warmup_setting`)."""

    model_runner_cls = OmniCacheGPUARModelRunner

    def init_device(self):
        apply_jit_warmup_setting(self.vllm_config)
        if settings.PREFIX_CACHE_BACKEND.get() == "builtin":
            self.model_runner_cls = GPUARModelRunner
        return super().init_device()


class OmniCacheGPUGenerationWorker(GPUGenerationWorker):
    """vLLM-Omni's generation worker (code2wav) unchanged but for ``OMNI_CACHE_JIT_WARMUP``."""

    def init_device(self):
        apply_jit_warmup_setting(self.vllm_config)
        return super().init_device()
