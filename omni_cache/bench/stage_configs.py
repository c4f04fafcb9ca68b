"""Per-variant stage configs for the prefill benchmark, derived from the CPU stage config.

Variants differ only in the thinker's prefix cache: ``off`` (``enable_prefix_caching:
false``), ``builtin`` (vLLM-Omni's own hidden-state cache) and ``omni_cache``. Everything
else is the same for all three, including the memory settings below, which keep one
pipeline small enough that three fit in ~20 GiB (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

VARIANTS = ("off", "builtin", "omni_cache")
MiB = 1 << 20


@dataclass
class MemorySettings:
    """Stage-config knobs that set a pipeline's memory (bytes / tokens / sequences).

    ``thinker_kv_bytes`` must hold the shared prefixes of all workloads plus one request
    (KV per token of the bench model: layers × 2 × kv_heads × head_dim × 2 B); omni-cache's
    hidden-state pool is sized from the same block count, so it shrinks with it.
    """

    thinker_kv_bytes: int = 256 * MiB
    talker_kv_bytes: int = 32 * MiB
    code2wav_kv_bytes: int = 32 * MiB
    max_num_seqs: int = 2                 # requests are sent one at a time
    cpu_executor: str | None = "uni"      # distributed_executor_backend of every stage: "uni" runs the
                                          # worker inside the stage's engine-core process (vLLM's CPU
                                          # default "mp" adds one ~0.9 GiB process per stage); needs
                                          # VLLM_ENABLE_V1_MULTIPROCESSING=0 in the driver's environment
    malloc_arena_max: int | None = 2      # glibc MALLOC_ARENA_MAX in the worker's environment
                                          # (inherited by the stage processes; read at start)

    def to_dict(self) -> dict:
        return asdict(self)


def variant_stage_config(base: Path, out_dir: Path, variant: str, *, mem: MemorySettings,
                         thinker_max_tokens: int = 2, talker_max_tokens: int = 4,
                         omp_bind: str = "0-1") -> Path:
    """Write the stage config of ``variant`` (``off`` / ``builtin`` / ``omni_cache``) derived
    from ``base`` into ``out_dir`` and return its path.

    Raises:
        ValueError: unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    raw = yaml.safe_load(Path(base).read_text())
    stages = raw["stages"]
    s0, s1, s2 = stages[0], stages[1], stages[2]
    # thinker time = prefill + one decode step (max_tokens 1 breaks vLLM-Omni's talker
    # hand-off: "size of tensor a (8) must match b (9)")
    s0["default_sampling_params"]["max_tokens"] = thinker_max_tokens
    s1["default_sampling_params"]["max_tokens"] = talker_max_tokens
    # Thinker and talker take a whole prompt in one step (max_num_batched_tokens ≥
    # max_model_len): a talker prompt split into chunks fails on CPU in vLLM's seeded-sampling
    # bookkeeping ("CPU Generator does not use offset"), and an unchunked thinker prefill is
    # what is being measured. code2wav keeps its base settings (chunked prefill off).
    for s in (s0, s1):
        s["max_num_batched_tokens"] = max(int(s.get("max_num_batched_tokens", 0)), int(s.get("max_model_len", 8192)))
    for s, kv in ((s0, mem.thinker_kv_bytes), (s1, mem.talker_kv_bytes), (s2, mem.code2wav_kv_bytes)):
        s["kv_cache_memory_bytes"] = int(kv)
        s["max_num_seqs"] = int(mem.max_num_seqs)
        if mem.cpu_executor:
            s["distributed_executor_backend"] = mem.cpu_executor
        s.setdefault("env", {})["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    if variant == "off":
        s0["enable_prefix_caching"] = False
        s0["env"].pop("OMNI_CACHE_PREFIX_CACHE_BACKEND", None)
    else:
        s0["enable_prefix_caching"] = True
        s0["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] = variant
        s0["env"]["OMNI_CACHE_METRICS_DIR"] = str(Path(out_dir).resolve() / f"metrics_{variant}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / f"stage_config_{variant}.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p
