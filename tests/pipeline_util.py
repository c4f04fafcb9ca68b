"""Helpers for tests that drive the real pipeline with a variant of the CPU stage config."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CPU_STAGE_CONFIG = REPO / "stage_configs" / "qwen3_omni_cpu.yaml"


def variant_stage_config(out_dir: Path, variant: str) -> Path:
    """The CPU stage config with the thinker's prefix cache ``off`` / ``builtin`` /
    ``omni_cache``, hand-off recording into ``out_dir/handoff`` and cache metrics into
    ``out_dir/metrics``. Returns the written YAML path."""
    from omni_cache.vllm_omni.handoff import register_recording_pipeline

    raw = yaml.safe_load(CPU_STAGE_CONFIG.read_text())
    raw["pipeline"] = register_recording_pipeline()
    s0 = raw["stages"][0]
    s0["env"]["OMNI_CACHE_HANDOFF_DUMP"] = str(out_dir / "handoff")
    s0["env"]["OMNI_CACHE_METRICS_DIR"] = str(out_dir / "metrics")
    if variant == "off":
        s0["enable_prefix_caching"] = False
    elif variant == "omni_cache_forget":  # fault injection: the first request's rows are "lost"
        s0["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] = "omni_cache"
        s0["env"]["OMNI_CACHE_TEST_FORGET_FIRST_N_REQUESTS"] = "1"
    else:
        s0["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] = variant
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"stage_config_{variant}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path
