"""Stage-config variants: one helper (:func:`derive_stage_config`) derives a stage config
from a base YAML for benchmarks and tests; :func:`variant_stage_config` is the prefill
benchmark's per-variant config built on it.

Benchmark variants differ only in the thinker's prefix cache: ``off`` (``enable_prefix_caching:
false``), ``builtin`` (vLLM-Omni's own hidden-state cache) and ``omni_cache``. Everything
else is the same for all three, including the memory settings below, which keep one
pipeline small enough that three fit in ~20 GiB (see ``docs/benchmarks.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from omni_cache import settings

VARIANTS = ("off", "builtin", "omni_cache")
#: a KV-shared (YOCO) thinker's variants: {fast prefill off/on} x {cache off/on}. On a base
#: config whose thinker sets ``kv_sharing_fast_prefill``, ``off`` and ``omni_cache`` run with it
#: off (the slow path and the cache alone); ``fast`` / ``fast+omni_cache`` with it on.
YOCO_VARIANTS = ("off", "fast", "omni_cache", "fast+omni_cache")
MiB = 1 << 20


def derive_stage_config(
    base: str | Path,
    out_path: str | Path,
    *,
    pipeline: str | None = None,
    top: Mapping[str, Any] | None = None,
    stages: Mapping[int, Mapping[str, Any]] | None = None,
    env: Mapping[int, Mapping[str, str | None]] | None = None,
    sampling: Mapping[int, Mapping[str, Any]] | None = None,
) -> Path:
    """Write a variant of the stage config ``base`` to ``out_path`` and return that path.

    Args:
        base: the stage config (vLLM-Omni deploy YAML) to start from.
        out_path: where to write the variant (parent directories are created).
        pipeline: a new top-level ``pipeline:`` name.
        top: other top-level keys to set (e.g. ``async_chunk``; None removes the key).
        stages: stage id → stage keys to set (a value of None removes the key).
        env: stage id → ``env:`` variables to set (None removes the variable).
        sampling: stage id → ``default_sampling_params`` keys to set.

    Raises:
        ValueError: a stage id that ``base`` does not have (the message names the file).
    """
    raw = yaml.safe_load(Path(base).read_text())
    by_id = {s["stage_id"]: s for s in raw["stages"]}
    if pipeline is not None:
        raw["pipeline"] = pipeline
    _set_keys(raw, top or {})
    for changes, apply in ((stages, _set_keys), (env, _set_env), (sampling, _set_sampling)):
        for sid, values in (changes or {}).items():
            if sid not in by_id:
                raise ValueError(f"{base}: no stage {sid} (stages: {sorted(by_id)})")
            apply(by_id[sid], values)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def _set_keys(mapping: dict, values: Mapping[str, Any]) -> None:
    for k, v in values.items():
        if v is None:
            mapping.pop(k, None)
        else:
            mapping[k] = v


def _set_env(stage: dict, values: Mapping[str, str | None]) -> None:
    _set_keys(stage.setdefault("env", {}), values)


def _set_sampling(stage: dict, values: Mapping[str, Any]) -> None:
    _set_keys(stage.setdefault("default_sampling_params", {}), values)


@dataclass
class MemorySettings:
    """Stage-config knobs that set a pipeline's memory (bytes / tokens / sequences).

    ``thinker_kv_bytes`` must hold the shared prefixes of all workloads plus one request
    (KV per token of the bench model: layers × 2 × kv_heads × head_dim × 2 B); omni-cache's
    hidden-state pool is sized from the same block count, so it shrinks with it.
    """

    thinker_kv_bytes: int | None = 256 * MiB   # None: the base stage config's (GPU hosts)
    talker_kv_bytes: int | None = 32 * MiB
    code2wav_kv_bytes: int | None = 32 * MiB
    max_num_seqs: int | None = 2          # requests are sent one at a time; None: the base stage
                                          # config's (GPU hosts: vLLM sizes the CUDA-graph capture range
                                          # from it, min(2 x max_num_seqs, 512) tokens, so a smaller
                                          # value runs prefills above it without graphs)
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
                         omp_bind: str = "0-1", async_chunk: bool | None = None,
                         talker_prefix_caching: bool = False) -> Path:
    """Write the stage config of ``variant`` (``off`` / ``builtin`` / ``omni_cache``, or for a
    KV-shared thinker one of :data:`YOCO_VARIANTS`) derived from ``base`` into ``out_dir`` and
    return its path.

    ``async_chunk``: set the streaming hand-off on (True) or off (False); None keeps ``base``'s.
    ``talker_prefix_caching``: the talker's content-keyed prefix cache (off by default, so a
    variant compares thinker caches alone; the voice-chat benchmark turns it on).
    ``talker_max_tokens`` = 4 is the first streamed codec chunk of the bundled configs
    (``initial_codec_chunk_frames: 4``), so a request's audio is exactly its first packet.

    Raises:
        ValueError: unknown variant, or a ``fast`` variant of a base without
            ``kv_sharing_fast_prefill`` on its thinker.
    """
    if variant not in VARIANTS + YOCO_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS + YOCO_VARIANTS}")
    raw = yaml.safe_load(Path(base).read_text())
    by_id = {s["stage_id"]: s for s in raw["stages"]}
    fast = variant.startswith("fast")
    if fast and "kv_sharing_fast_prefill" not in by_id[0]:
        raise ValueError(f"variant {variant!r} needs a KV-shared thinker: {base} sets no kv_sharing_fast_prefill")
    cache = variant.removeprefix("fast+") if variant != "fast" else "off"
    # Thinker and talker take a whole prompt in one step (max_num_batched_tokens ≥
    # max_model_len): a talker prompt split into chunks fails on CPU in vLLM's seeded-sampling
    # bookkeeping ("CPU Generator does not use offset"), and an unchunked thinker prefill is
    # what is being measured. code2wav keeps its base settings (chunked prefill off).
    unchunked = {sid: max(int(by_id[sid].get("max_num_batched_tokens", 0)),
                          int(by_id[sid].get("max_model_len", 8192))) for sid in (0, 1)}
    stage_keys = {
        sid: {**({"kv_cache_memory_bytes": int(kv)} if kv is not None else {}),
              **({"max_num_seqs": int(mem.max_num_seqs)} if mem.max_num_seqs is not None else {}),
              **({"distributed_executor_backend": mem.cpu_executor} if mem.cpu_executor else {}),
              **({"max_num_batched_tokens": unchunked[sid]} if sid in unchunked else {})}
        for sid, kv in ((0, mem.thinker_kv_bytes), (1, mem.talker_kv_bytes), (2, mem.code2wav_kv_bytes))}
    stage_keys[0]["enable_prefix_caching"] = cache != "off"
    if "kv_sharing_fast_prefill" in by_id[0]:
        stage_keys[0]["kv_sharing_fast_prefill"] = fast
    stage_keys[1]["enable_prefix_caching"] = bool(talker_prefix_caching)
    env = {sid: {"VLLM_CPU_OMP_THREADS_BIND": omp_bind} for sid in (0, 1, 2)}
    env[0].update({
        settings.PREFIX_CACHE_BACKEND.name: None if cache == "off" else cache,
        # every variant, cache off too: the runner's host time per step (runner-<pid>.json) is
        # compared across variants (benchmarks.prefill.summary.step_host_times)
        settings.METRICS_DIR.name: str(Path(out_dir).resolve() / f"metrics_{variant}")})
    # thinker time = prefill + one decode step (max_tokens 1 breaks vLLM-Omni's talker
    # hand-off: "size of tensor a (8) must match b (9)")
    sampling = {0: {"max_tokens": thinker_max_tokens}, 1: {"max_tokens": talker_max_tokens}}
    top = {} if async_chunk is None else {"async_chunk": bool(async_chunk)}
    return derive_stage_config(base, Path(out_dir) / f"stage_config_{variant}.yaml",
                               top=top, stages=stage_keys, env=env, sampling=sampling)
