"""The deploy-YAML schema as vLLM-Omni 0.30 defines it: field names and declared types.

Read from vLLM-Omni's own dataclasses (``DeployConfig``, ``StageDeployConfig``) and its
engine arguments (``OmniEngineArgs``, which a stage's unknown keys pass through to as
``engine_extras``), so the validator in :mod:`omni_cache.driver.stage_config` follows a version bump.
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


def _owned_engine_fields() -> set[str] | None:
    """Engine arguments vLLM-Omni lets a deploy YAML set on LLM stages (it refuses the rest,
    e.g. ``worker_cls``, with "no structured config owner" at start-up). None if this
    vLLM-Omni version does not expose the table (then every engine argument is accepted)."""
    try:
        from vllm_omni.config.omni_config import _STAGE_ENGINE_FIELDS_BY_EXECUTION_TYPE as owned
        from vllm_omni.config.stage_config import StageExecutionType
    except ImportError:
        return None
    return set(owned[StageExecutionType.LLM_AR]) | set(owned[StageExecutionType.LLM_GENERATION])


@functools.cache
def stage_fields() -> dict[str, Any]:
    """Per-stage keys → declared type: ``StageDeployConfig`` fields plus the engine
    arguments a stage may pass through (``OmniEngineArgs``)."""
    from vllm_omni.config.stage_config import StageDeployConfig
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    engine = _field_types(OmniEngineArgs)
    owned = _owned_engine_fields()
    out = {k: v for k, v in engine.items() if owned is None or k in owned}
    out.update(_field_types(StageDeployConfig))
    out.pop("engine_extras", None)
    return out
