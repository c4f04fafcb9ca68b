"""Opt-in CUDA ``OmniPlatform`` that gives AR stages omni-cache's runner on GPUs.

vLLM-Omni 0.30 picks a stage's worker class from the platform (a ``worker_cls`` stage key may
also be honoured — it is in vLLM-Omni's owned engine fields — but that was not verified
here), so on GPUs the way in is the platform: :class:`OmniCacheCudaOmniPlatform` is vLLM-Omni's own
``CudaOmniPlatform`` with ``get_omni_ar_worker_cls`` pointing at
:class:`omni_cache.engine.workers_gpu.OmniCacheGPUARWorker`. That worker picks the runner
per stage exactly like the CPU worker (``OMNI_CACHE_PREFIX_CACHE_BACKEND``), so ``builtin``
stays selectable. With ``OMNI_CACHE_JIT_WARMUP=0``, ``get_omni_generation_worker_cls`` (code2wav)
points at vLLM-Omni's generation worker with that one change (:func:`apply_jit_warmup_setting`;
the AR worker applies it too); unset, code2wav keeps vLLM-Omni's own worker.

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


def apply_jit_warmup_setting(vllm_config) -> bool:
    """Turn vLLM's JIT kernel warm-up off in ``vllm_config`` when ``OMNI_CACHE_JIT_WARMUP=0``.

    vLLM 0.30 runs it in every stage's start (``kernel_warmup``: 113 Triton compile keys of its
    input-prep kernels, 110–114 s per stage on a cold H200, and on one card the stages take
    their turn under vLLM-Omni's exclusive phase lock; docs/gpu.md, "Eighteenth session"). A deploy
    YAML cannot set ``kernel_config`` (vLLM-Omni refuses engine fields it does not own), so the
    workers apply it (:mod:`omni_cache.engine.workers_gpu`, in ``init_device``: vLLM's
    ``kernel_warmup`` reads the worker's config later, in ``compile_or_warm_up_model``). The
    platform's own ``check_and_update_config`` would not do: vLLM builds ``VllmConfig`` with its
    own ``current_platform`` (vLLM's CUDA platform, not vLLM-Omni's). Skipped, those kernels
    compile at their first use instead.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (its ``kernel_config.enable_jit_warmup``, a bool).

    Returns:
        True when it turned the warm-up off.

    Raises:
        SettingError: ``OMNI_CACHE_JIT_WARMUP`` is not 0 / 1.
        RuntimeError: the setting is 0 and this vLLM has no ``kernel_config.enable_jit_warmup``.
    """
    if settings.JIT_WARMUP.get() != "0":
        return False
    kernel_config = getattr(vllm_config, "kernel_config", None)
    if kernel_config is None or not hasattr(kernel_config, "enable_jit_warmup"):
        raise RuntimeError(f"{settings.JIT_WARMUP.name}=0: this vLLM's config has no "
                           "kernel_config.enable_jit_warmup (omni_cache/engine/platform_cuda.py)")
    kernel_config.enable_jit_warmup = False
    return True


def __getattr__(name: str):
    # Import vLLM-Omni's CUDA platform only when the class is asked for (activation).
    if name == "OmniCacheCudaOmniPlatform":
        from vllm_omni.platforms.cuda.platform import CudaOmniPlatform

        class OmniCacheCudaOmniPlatform(CudaOmniPlatform):
            """vLLM-Omni's CUDA platform with omni-cache's AR worker; with
            ``OMNI_CACHE_JIT_WARMUP=0``, a generation worker (code2wav) that only applies it."""

            @classmethod
            def get_omni_ar_worker_cls(cls) -> str:
                return "omni_cache.engine.workers_gpu.OmniCacheGPUARWorker"

            @classmethod
            def get_omni_generation_worker_cls(cls) -> str:
                # vLLM-Omni's own worker unless the setting asks for a change
                if settings.JIT_WARMUP.get() == "0":
                    return "omni_cache.engine.workers_gpu.OmniCacheGPUGenerationWorker"
                return super().get_omni_generation_worker_cls()

        globals()[name] = OmniCacheCudaOmniPlatform
        return OmniCacheCudaOmniPlatform
    raise AttributeError(name)
