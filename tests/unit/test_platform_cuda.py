"""``OMNI_CACHE_JIT_WARMUP`` on the CUDA platform (omni_cache/engine/platform_cuda.py,
workers_gpu.py): with ``0`` both of omni-cache's GPU workers (AR: thinker, talker; generation:
code2wav) turn vLLM's JIT kernel warm-up off in their config before vLLM-Omni's
``init_device``; unset, vLLM's default stays. The platform class itself imports only where
vLLM's CUDA build is (the GPU lane's unit group): there its worker classes are checked too."""

from __future__ import annotations

import types

import pytest

from omni_cache import settings
from omni_cache.engine import platform_cuda, workers_gpu


def _config():
    return types.SimpleNamespace(kernel_config=types.SimpleNamespace(enable_jit_warmup=True))


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False)])
@pytest.mark.parametrize("worker_cls, parent", [
    (workers_gpu.OmniCacheGPUARWorker, workers_gpu.GPUARWorker),
    (workers_gpu.OmniCacheGPUGenerationWorker, workers_gpu.GPUGenerationWorker)])
def test_the_workers_apply_it_before_vllm_omnis_init_device(monkeypatch, value, expected, worker_cls, parent):
    if value is None:
        monkeypatch.delenv(settings.JIT_WARMUP.name, raising=False)
    else:
        monkeypatch.setenv(settings.JIT_WARMUP.name, value)
    seen = []
    monkeypatch.setattr(parent, "init_device",
                        lambda self: seen.append(self.vllm_config.kernel_config.enable_jit_warmup))
    worker = object.__new__(worker_cls)  # no engine: only the method under test runs
    worker.vllm_config = _config()
    worker.init_device()
    assert seen == [expected]  # vLLM-Omni's init_device (and vLLM's kernel_warmup after it) sees it


def test_a_bad_value_or_a_moved_field_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(settings.JIT_WARMUP.name, "off")
    with pytest.raises(settings.SettingError, match="OMNI_CACHE_JIT_WARMUP='off'"):
        platform_cuda.apply_jit_warmup_setting(_config())
    monkeypatch.setenv(settings.JIT_WARMUP.name, "0")
    with pytest.raises(RuntimeError, match="no kernel_config.enable_jit_warmup"):
        platform_cuda.apply_jit_warmup_setting(types.SimpleNamespace(kernel_config=types.SimpleNamespace()))


def test_the_cuda_platform_names_the_workers(monkeypatch):
    """Where vLLM's CUDA platform imports: omni-cache's AR worker always; code2wav's generation
    worker is omni-cache's only with the setting at 0 (vLLM-Omni's own otherwise)."""
    try:
        cls = platform_cuda.OmniCacheCudaOmniPlatform
    except ImportError as e:  # a CPU build of vLLM (no vllm._C_stable_libtorch)
        pytest.skip(f"vLLM's CUDA platform does not import here: {e}")
    assert cls.get_omni_ar_worker_cls() == "omni_cache.engine.workers_gpu.OmniCacheGPUARWorker"
    monkeypatch.delenv(settings.JIT_WARMUP.name, raising=False)
    assert cls.get_omni_generation_worker_cls() == "vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker"
    monkeypatch.setenv(settings.JIT_WARMUP.name, "0")
    assert cls.get_omni_generation_worker_cls() == "omni_cache.engine.workers_gpu.OmniCacheGPUGenerationWorker"
