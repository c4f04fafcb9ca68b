"""The CUDA platform's ``OMNI_CACHE_JIT_WARMUP`` (omni_cache/engine/platform_cuda.py): vLLM's
config check runs first, then the setting turns vLLM's JIT kernel warm-up off; unset, vLLM's
default stays. The class itself imports only where vLLM's CUDA build is (the GPU lane's unit
group): there its method order is checked too."""

from __future__ import annotations

import types

import pytest

from omni_cache import settings
from omni_cache.engine import platform_cuda


class _VllmPlatform:
    """Stands in for vLLM's platform: records that its own check ran, and in which state."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        vllm_config.checked_with_warmup = vllm_config.kernel_config.enable_jit_warmup


class _Platform(platform_cuda.JitWarmupSetting, _VllmPlatform):
    pass


def _config():
    return types.SimpleNamespace(kernel_config=types.SimpleNamespace(enable_jit_warmup=True))


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False)])
def test_the_setting_turns_vllms_jit_warmup_off_after_vllms_own_check(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(settings.JIT_WARMUP.name, raising=False)
    else:
        monkeypatch.setenv(settings.JIT_WARMUP.name, value)
    cfg = _config()
    _Platform.check_and_update_config(cfg)
    assert cfg.checked_with_warmup is True  # vLLM's check saw its own default first
    assert cfg.kernel_config.enable_jit_warmup is expected


def test_a_bad_value_or_a_moved_field_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(settings.JIT_WARMUP.name, "off")
    with pytest.raises(settings.SettingError, match="OMNI_CACHE_JIT_WARMUP='off'"):
        platform_cuda.apply_jit_warmup_setting(_config())
    monkeypatch.setenv(settings.JIT_WARMUP.name, "0")
    with pytest.raises(RuntimeError, match="no kernel_config.enable_jit_warmup"):
        platform_cuda.apply_jit_warmup_setting(types.SimpleNamespace(kernel_config=types.SimpleNamespace()))


def test_the_cuda_platform_applies_it():
    """Where vLLM's CUDA platform imports: omni-cache's platform runs the mixin before it."""
    try:
        cls = platform_cuda.OmniCacheCudaOmniPlatform
    except ImportError as e:  # a CPU build of vLLM (no vllm._C_stable_libtorch)
        pytest.skip(f"vLLM's CUDA platform does not import here: {e}")
    mro = cls.__mro__
    assert mro.index(platform_cuda.JitWarmupSetting) < next(
        i for i, c in enumerate(mro) if c.__name__ == "CudaOmniPlatform")
