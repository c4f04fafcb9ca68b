"""vLLM's CPU attention without AMX kernels (``OMNI_CACHE_CPU_ATTENTION=vec``).

On an x86 CPU with AMX, vLLM's CPU attention (``vllm/v1/attention/backends/cpu_attn.py``,
``_get_attn_isa``) runs bf16 with block sizes that are multiples of 32 on its ``amx`` kernels;
elsewhere on its ``vec`` kernels (AVX-512 / AVX2). Measured on this project's 2-core AMX CI
machine (2026-11-26): with ``amx`` a prefix hit's suffix, computed over cached KV, differs in
the last bits from a whole-prompt prefill (and Gemma's fast prefill from its slow path), so the
CPU suite's bitwise cache-off oracle failed on 7 tests; with ``vec`` they are bitwise as on the
AVX2 machines the suite was written on (``tests/pipeline/test_yoco_pipeline.py::
test_gemma3n_fast_prefill_and_hits_equal_the_slow_path_bitwise`` failed with ``amx`` and passed
with AMX unavailable). The test suite pins ``vec`` (``tests/conftest.py``); the product keeps
vLLM's choice by default (``auto``), where the cache-off comparison holds to a stated precision
as on CUDA.

How: vLLM picks the kernels in one module-level function, called when an attention metadata
builder is made; :func:`apply` wraps it in the engine's process (from omni-cache's vLLM plugin,
:func:`omni_cache.engine.plugin.register_models`) so that an ``amx`` choice becomes ``vec``. A
runtime wrapper, no file of vLLM edited; the seam is checked here (a vLLM without the function
raises at start-up instead of silently keeping AMX).
"""

from __future__ import annotations

_APPLIED = [False]


def apply() -> bool:
    """With ``OMNI_CACHE_CPU_ATTENTION=vec``, make vLLM's CPU attention choose ``vec`` where it
    would choose ``amx`` (idempotent). Returns whether the wrapper is in place.

    Raises:
        RuntimeError: the setting asks for ``vec`` and vLLM has no ``cpu_attn._get_attn_isa``
            (the seam moved: fix it here).
    """
    from omni_cache import settings

    if settings.CPU_ATTENTION.get() != "vec":
        return False
    if _APPLIED[0]:
        return True
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:  # a vLLM build without CPU attention (a GPU wheel): nothing to do
        return False
    choose = getattr(cpu_attn, "_get_attn_isa", None)
    if choose is None:
        raise RuntimeError(f"{settings.CPU_ATTENTION.name}=vec: vLLM's cpu_attn._get_attn_isa is gone; "
                           "update omni_cache/engine/cpu_attention.py")

    def without_amx(*args, **kwargs):
        isa = choose(*args, **kwargs)
        return "vec" if isa == "amx" else isa

    cpu_attn._get_attn_isa = without_amx
    _APPLIED[0] = True
    return True
