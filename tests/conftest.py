"""Shared fixtures. One real vLLM-Omni pipeline per configuration per session (a start costs
~2-3 min on 2 CPU cores), built from the embedded tiny Qwen3-Omni."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from omni_cache.models import build_qwen3_omni, default_model_dir

    return build_qwen3_omni(default_model_dir("tiny"), "tiny")


def pytest_collection_modifyitems(session, config, items):
    """Engine-free unit tests (tests/unit) run before the pipeline tests (tests/pipeline),
    whatever the command line's order, so a break shows early."""
    items.sort(key=lambda item: 0 if "tests/unit/" in item.nodeid.replace("\\", "/") or
               item.nodeid.startswith("unit/") else 1)
