"""Helpers for tests that drive the real pipeline with a variant of the CPU stage config."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CPU_STAGE_CONFIG = REPO / "stage_configs" / "qwen3_omni_cpu.yaml"


def variant_stage_config(out_dir: Path, variant: str, thinker: dict | None = None) -> Path:
    """The CPU stage config with the thinker's prefix cache ``off`` / ``builtin`` /
    ``omni_cache``, hand-off recording into ``out_dir/handoff`` and cache metrics into
    ``out_dir/metrics``; ``thinker``: stage-0 keys to override (e.g.
    ``max_num_batched_tokens``). Returns the written YAML path."""
    from omni_cache.vllm_omni.handoff import register_recording_pipeline

    raw = yaml.safe_load(CPU_STAGE_CONFIG.read_text())
    raw["pipeline"] = register_recording_pipeline()
    s0 = raw["stages"][0]
    s0.update(thinker or {})
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


def assert_handoff_equal(got: dict, ref: dict, name: str) -> None:
    """Two recorded thinker→talker hand-offs (tensor name → tensor) are bitwise equal.

    ``embed.tts_*`` hold one ``[1, 1, hidden]`` row per thinker step (vLLM-Omni accumulates
    the per-step side outputs), so their count follows the number of steps (chunks, hits);
    the talker reads one row (``_get_tts_embed``): every row of ``got`` must equal ``ref``'s
    first row. Every other tensor is token-aligned: same shape, same bits.
    """
    import torch

    assert set(got) == set(ref), (name, sorted(ref), sorted(got))
    for k in ref:
        if k.startswith("embed.tts_"):
            assert all(torch.equal(got[k][i], ref[k][0]) for i in range(got[k].shape[0])), (name, k)
            continue
        assert got[k].shape == ref[k].shape and torch.equal(got[k], ref[k]), (name, k)
