"""Which AR runner a stage gets: vLLM-Omni's built-in prefix cache or omni-cache."""

from __future__ import annotations

import os

ENV_BACKEND = "OMNI_CACHE_PREFIX_CACHE_BACKEND"
BACKENDS = ("omni_cache", "builtin")
DEFAULT_BACKEND = "omni_cache"


def prefix_cache_backend() -> str:
    """The stage's prefix-cache backend from ``OMNI_CACHE_PREFIX_CACHE_BACKEND``.

    Raises:
        ValueError: the variable holds something other than ``omni_cache`` / ``builtin``.
    """
    value = os.environ.get(ENV_BACKEND, DEFAULT_BACKEND).strip()
    if value not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={value!r}: expected one of {BACKENDS}")
    return value


def ar_runner_cls(vllm_config) -> type:
    """The CPU AR runner class for this stage."""
    from omni_cache.vllm_omni.workers_cpu import CPUARModelRunner

    if prefix_cache_backend() == "builtin":
        return CPUARModelRunner
    from omni_cache.vllm_omni.runner import OmniCacheCPUARModelRunner

    return OmniCacheCPUARModelRunner
