"""Opt-in CUDA ``OmniPlatform`` that gives AR stages omni-cache's runner on GPUs.

vLLM-Omni 0.30 picks a stage's worker class from the platform (a ``worker_cls`` stage key may
also be honoured — it is in vLLM-Omni's owned engine fields — but that was not verified
here), so on GPUs the way in is the platform: :class:`OmniCacheCudaOmniPlatform` is vLLM-Omni's own
``CudaOmniPlatform`` with ``get_omni_ar_worker_cls`` pointing at
:class:`omni_cache.engine.workers_gpu.OmniCacheGPUARWorker`. That worker picks the runner
per stage exactly like the CPU worker (``OMNI_CACHE_PREFIX_CACHE_BACKEND``), so ``builtin``
stays selectable.

Activation (entry point ``omni_cache_cuda`` of ``vllm_omni.platform_plugins``): only with
``OMNI_CACHE_CUDA_PLATFORM=1`` and a CUDA device — an out-of-tree platform wins over the
built-in one, so it is never on by default.

Status: run end to end on an H200 (vLLM 0.30.0 CUDA wheel, vLLM-Omni 0.30.0): the one-GPU
main job streams audio with thinker and talker hits; the GPU lane's state is in docs/gpu.md.
"""

from __future__ import annotations

from omni_cache import settings

PLATFORM_QUALNAME = "omni_cache.engine.platform_cuda.OmniCacheCudaOmniPlatform"


def cuda_omni_platform_plugin() -> str | None:
    """Entry point: the platform's qualified name when opted in (``OMNI_CACHE_CUDA_PLATFORM=1``)
    and CUDA is present.

    Raises:
        SettingError: ``OMNI_CACHE_CUDA_PLATFORM`` is set to something other than 0 / 1.
    """
    if settings.CUDA_PLATFORM.get() != "1":
        return None
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return PLATFORM_QUALNAME
    except Exception:  # pragma: no cover - detection must never raise
        pass
    return None


def __getattr__(name: str):
    # Import vLLM-Omni's CUDA platform only when the class is asked for (activation).
    if name == "OmniCacheCudaOmniPlatform":
        from vllm_omni.platforms.cuda.platform import CudaOmniPlatform

        class OmniCacheCudaOmniPlatform(CudaOmniPlatform):
            """vLLM-Omni's CUDA platform with omni-cache's AR worker."""

            @classmethod
            def get_omni_ar_worker_cls(cls) -> str:
                return "omni_cache.engine.workers_gpu.OmniCacheGPUARWorker"

        globals()[name] = OmniCacheCudaOmniPlatform
        return OmniCacheCudaOmniPlatform
    raise AttributeError(name)
