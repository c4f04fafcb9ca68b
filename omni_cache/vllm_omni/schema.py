"""The deploy-YAML schema as vLLM-Omni 0.30 defines it: field names and declared types.

Read from vLLM-Omni's own dataclasses (``DeployConfig``, ``StageDeployConfig``) and its
engine arguments (``OmniEngineArgs``, which a stage's unknown keys pass through to as
``engine_extras``), so the validator in :mod:`omni_cache.config` follows a version bump.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any


def _field_types(cls) -> dict[str, Any]:
    """Dataclass field → resolved type (string annotations resolved where possible)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable forward ref: fall back to the raw annotations
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


@functools.cache
def deploy_fields() -> dict[str, Any]:
    """Top-level deploy YAML keys → declared type."""
    from vllm_omni.config.stage_config import DeployConfig

    return _field_types(DeployConfig)


@functools.cache
def stage_fields() -> dict[str, Any]:
    """Per-stage keys → declared type: ``StageDeployConfig`` fields plus the engine
    arguments a stage may pass through (``OmniEngineArgs``)."""
    from vllm_omni.config.stage_config import StageDeployConfig
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    out = _field_types(OmniEngineArgs)
    out.update(_field_types(StageDeployConfig))
    out.pop("engine_extras", None)
    return out
