"""Shared fixtures. One real vLLM-Omni pipeline per configuration per session (a start costs
~2-3 min on 2 CPU cores), built from the embedded tiny Qwen3-Omni."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_STAGE_CONFIG = REPO / "stage_configs" / "qwen3_omni_cpu.yaml"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from omni_cache.models import build_qwen3_omni, default_model_dir

    return build_qwen3_omni(default_model_dir("tiny"), "tiny")


@pytest.fixture(scope="session")
def pipeline(tiny_model_dir):
    """The real thinker → talker → code2wav pipeline on the CPU platform."""
    if os.environ.get("OMNI_CACHE_SKIP_PIPELINE") == "1":
        pytest.skip("OMNI_CACHE_SKIP_PIPELINE=1")
    from omni_cache.vllm_omni.pipeline import OmniPipeline

    pipe = OmniPipeline(tiny_model_dir, CPU_STAGE_CONFIG)
    yield pipe
    pipe.close()
