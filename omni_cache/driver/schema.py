"""The deploy-YAML schema as vLLM-Omni 0.30 defines it: field names and declared types.

Read from vLLM-Omni's own dataclasses (``DeployConfig``, ``StageDeployConfig``) and its
engine arguments (``OmniEngineArgs``, which a stage's unknown keys pass through to as
``engine_extras``), so the validator in :mod:`omni_cache.driver.stage_config` follows a version bump.

A stage's ``default_sampling_params`` are checked against vLLM's ``SamplingParams``
(:func:`sampling_problems`): its field names and declared types read from the msgspec Struct,
and the value ranges its ``_verify_args`` enforces (:data:`SAMPLING_RANGES`, a table kept by
hand from vLLM 0.30's vllm/sampling_params.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
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


# --- a stage's ``default_sampling_params`` ---------------------------------------------------------
#
# vLLM-Omni builds each LLM stage's default ``vllm.SamplingParams(**default_sampling_params)``
# while the orchestrator starts (vllm_omni/engine/stage_init_utils.py). SamplingParams is a
# msgspec Struct: its constructor checks neither names' values nor types, and its
# ``_verify_args`` then compares whatever it got (``'lots' < 1``: "'<' not supported between
# instances of 'str' and 'int'", naming no stage and no key). The checks below run first.

#: The ranges ``SamplingParams._verify_args`` (vLLM 0.30, vllm/sampling_params.py) enforces,
#: per field: (accepts the value, what it must be). Applied to values of the declared type only.
SAMPLING_RANGES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "n": (lambda v: v >= 1, "must be at least 1"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    "repetition_penalty": (lambda v: math.isfinite(v) and v > 0.0, "must be a finite number greater than 0"),
    "temperature": (lambda v: math.isfinite(v) and 0.0 <= v <= 2.0, "must be in [0, 2]"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    "top_k": (lambda v: v >= -1, "must be 0 or -1 (off) or at least 1"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
    "max_tokens": (lambda v: v >= 1, "must be at least 1"),
    "min_tokens": (lambda v: v >= 0, "must be at least 0"),
    "stream_interval": (lambda v: v >= 1, "must be at least 1"),
    "logprobs": (lambda v: v >= -1, "must be at least 0, or -1 (all)"),
    "prompt_logprobs": (lambda v: v >= -1, "must be at least 0, or -1 (all)"),
    "thinking_token_budget": (lambda v: v >= -1, "must be at least 0, or -1 (unlimited)"),
    "stop": (lambda v: all(v) if isinstance(v, list) else bool(v), "cannot contain an empty string"),
    "bad_words": (lambda v: all(v), "cannot contain an empty string"),
    "extra_args": (lambda v: _ints_fit_int64(v), "integers must be between -2**63 and 2**64 - 1"),
}


def _ints_fit_int64(value: Any) -> bool:
    """vLLM's ``_verify_extra_args``: the engine's MessagePack transport carries 64-bit integers only."""
    if isinstance(value, dict):
        return all(_ints_fit_int64(k) and _ints_fit_int64(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_ints_fit_int64(v) for v in value)
    return not isinstance(value, int) or -(2**63) <= value < 2**64


@functools.cache
def sampling_fields() -> dict[str, tuple[Any, Any]]:
    """``SamplingParams`` keys a stage's ``default_sampling_params`` may set → (declared type,
    default), read from vLLM's msgspec Struct (``msgspec.structs.fields``); fields named
    ``_…`` are vLLM's own bookkeeping and not settable."""
    import msgspec
    from vllm.sampling_params import SamplingParams

    out = {}
    for f in msgspec.structs.fields(SamplingParams):
        if not f.name.startswith("_"):
            out[f.name] = (f.type, None if f.default is msgspec.NODEFAULT else f.default)
    return out


@functools.cache
def diffusion_stages(pipeline: str | None) -> frozenset[int]:
    """Stage ids that ``pipeline`` (a vLLM-Omni registry key) runs as diffusion stages, whose
    ``default_sampling_params`` are vLLM-Omni's ``OmniDiffusionSamplingParams``, not vLLM's.
    Empty when the pipeline is not registered here or is resolved per model (its stages are
    then checked as LLM stages: every omni-cache pipeline is)."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES
    from vllm_omni.config.stage_config import StageExecutionType

    p = OMNI_PIPELINES.get(str(pipeline)) if pipeline else None
    stages = getattr(p, "stages", None) or ()
    return frozenset(s.stage_id for s in stages if s.execution_type == StageExecutionType.DIFFUSION)


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def _matches(value: Any, tp: Any) -> bool:
    """Whether a YAML value is of the declared type ``tp`` (strict: a bool is no int, an int
    is a float, list/dict items are checked; enums and nested dataclasses never match: vLLM
    does not convert a YAML value into one)."""
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple, set, typing.Sequence):
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            return False
        return not args or all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    return False


_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _describe(tp: Any) -> str:
    """``tp`` in words, null left out (``list[int] | None`` → "a list of integers")."""
    if tp in _WORDS:
        return _WORDS[tp]
    if tp is Any:
        return "anything"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None) or len(args) == 1)
    if origin in (list, tuple, set, typing.Sequence):
        inner = _describe(args[0]) if args else "anything"
        return "a list of " + {"an integer": "integers", "a string": "strings", "a number": "numbers"}.get(inner, inner)
    if origin is dict or tp is dict:
        if args and args[0] is int:
            return f"a mapping of integers to {_describe(args[1]).removeprefix('a ')}s"
        return "a mapping"
    return f"a {getattr(tp, '__name__', tp)} (vLLM does not convert a YAML value into one)"


def sampling_problems(params: dict[str, Any]) -> list[tuple[str, str]]:
    """Every problem of one stage's ``default_sampling_params`` as (key, reason), before
    vLLM builds ``SamplingParams(**params)`` from them: keys that are not ``SamplingParams``
    fields (with the closest one), values not of the field's declared type (vLLM's own
    annotations, :func:`sampling_fields`), values outside what ``SamplingParams._verify_args``
    accepts (:data:`SAMPLING_RANGES`), and its cross-field rules (``min_tokens <= max_tokens``,
    greedy sampling with ``n: 1``, ``stop`` needs ``detokenize``). The key of a cross-field
    problem is the field named first."""
    import difflib

    fields = sampling_fields()
    out: list[tuple[str, str]] = []
    good: dict[str, Any] = {}
    for key, value in params.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            out.append((key, f"unknown sampling parameter{hint}"))
            continue
        tp = fields[key][0]
        if not _matches(value, tp):
            hint = ""
            if isinstance(value, str) and tp is not str and _is_number(value):
                hint = " (YAML reads a number without a '.' such as 1e-5 as a string: write 1.0e-5)"
            out.append((key, f"{_show(value)} is not {_describe(tp)}{hint}"))
            continue
        good[key] = value
        rule = SAMPLING_RANGES.get(key)
        if rule is not None and value is not None and not rule[0](value):
            out.append((key, f"{_show(value)} is out of range: {rule[1]}"))
            good.pop(key)
    eff = {k: d for k, (_, d) in fields.items()} | good  # what SamplingParams would hold
    if all(k not in params or k in good for k in ("min_tokens", "max_tokens")) and (
            "min_tokens" in params or "max_tokens" in params):
        if isinstance(eff["max_tokens"], int) and eff["min_tokens"] > eff["max_tokens"]:
            out.append(("min_tokens", f"{eff['min_tokens']} is more than max_tokens ({eff['max_tokens']}"
                        + ("" if "max_tokens" in params else ", vLLM's default") + ")"))
    if "n" in good and eff["n"] > 1 and isinstance(eff["temperature"], (int, float)) and eff["temperature"] < 1e-5:
        out.append(("n", f"{eff['n']} needs sampling: with temperature 0 (greedy) vLLM requires n: 1"))
    if good.get("stop") and eff["detokenize"] is False:
        out.append(("stop", "stop strings need detokenize: true"))
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
