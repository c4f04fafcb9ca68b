"""The seam between vLLM-Omni's AR runner and a prefix-cache manager, written down.

vLLM-Omni 0.30's AR runner (``vllm_omni/core/prefix_cache/runner_mixin.py``
``PrefixCacheRunnerMixin`` and ``vllm_omni/worker/gpu_ar_model_runner.py``) builds its
``omni_prefix_cache`` manager in ``_ensure_omni_prefix_cache`` and calls these methods on it,
as its own ``OmniPrefixCacheManager`` (``core/prefix_cache/manager.py``) defines them:

=====================  ==========================================================  =============================
method                 arguments                                                   returns
=====================  ==========================================================  =============================
``new_step_starts``    ``scheduler_output`` (before ``_update_states``)            None
``save_outputs``       ``hidden_states, mm_outputs, *, num_tokens_unpadded,        step id (int), consumed once
                       num_tokens_padded`` (after the forward)
``materialize``        ``step_id, req_ids`` (the save-time snapshot)               ``(hidden_states, mm_outputs)``
                                                                                   (``StageCacheOutputs`` fields)
``discard_step``       ``step_id``                                                 None
``shutdown``           —                                                           None
=====================  ==========================================================  =============================

The talker keys' seam (:mod:`omni_cache.driver.talker_identity`): vLLM-Omni's
``extract_speaker_from_prompt`` / ``extract_language_from_prompt`` (:data:`TALKER_KEY_HELPERS`)
read the speaker and language that seed every talker block key; a helper that moved is a seam
failure (the keys would silently lose them), caught here and at start-up.

The talker seam (:mod:`omni_cache.engine.talker`): the runner's ``_talker_mtp_forward`` makes
a generator per request from ``extra_args["tts_local_seed"]`` and passes ``generator=`` /
``generators=`` (the latter only to a model declaring
``talker_mtp_accepts_per_row_generators``) to ``talker_mtp(input_ids, input_embeds,
last_talker_hidden, text_step, ...)``; Qwen3-Omni's talker calls ``self.code_predictor(...)``,
whose forward takes ``generator`` and ``generators``.

omni-cache's :class:`~omni_cache.engine.stage_manager.OmniCacheStageManager` implements them;
:class:`~omni_cache.engine.runner.OmniCacheRunnerMixin` overrides the runner hooks in
:data:`RUNNER_HOOKS`. :func:`check_seam` compares all of it with the installed vLLM-Omni
(``tests/unit/test_seam.py``), so a version bump that moves the seam fails loudly instead of
leaving the cache silently unused.
"""

from __future__ import annotations

import importlib
import inspect
import re

#: manager method → its parameters as vLLM-Omni's manager declares them: ``(positional names
#: after self, keyword-only names)``
MANAGER_METHODS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "new_step_starts": (("scheduler_output",), ()),
    "save_outputs": (("hidden_states", "mm_outputs"), ("num_tokens_unpadded", "num_tokens_padded")),
    "materialize": (("step_id", "req_ids"), ()),
    "discard_step": (("step_id",), ()),
    "shutdown": ((), ()),
}

#: fields of ``materialize``'s result (vLLM-Omni's ``StageCacheOutputs``)
HANDOFF_FIELDS = ("hidden_states", "mm_outputs")

#: vLLM-Omni runner methods that :class:`~omni_cache.engine.runner.OmniCacheRunnerMixin`
#: overrides → the runner class that defines them
RUNNER_HOOKS = ("_ensure_omni_prefix_cache", "initialize_metadata_builders", "execute_model", "shutdown",
                "_build_omni_model_runner_output_from_snapshot")

#: the payload builder's keyword parameters :class:`~omni_cache.engine.runner.OmniCacheRunnerMixin`
#: reads (vLLM-Omni's ``_build_omni_model_runner_output_from_snapshot``: the step's output
#: snapshot and its prefix-cache step id), and the method of it that calls ``materialize``
SNAPSHOT_BUILDER_PARAMS = ("hidden_states", "multimodal_outputs", "prefix_cache_step_id")
MATERIALIZE_CALLER = "_prepare_prefix_cache_pooler_payload_sources"

_CALL = re.compile(r"\bomni_prefix_cache\.(\w+)\(")


def _unwrap(fn, name: str):
    """The function behind a decorator, also one without ``functools.wraps`` (vLLM-Omni's
    ``_locked``): the closure cell holding a function of the same name."""
    fn = inspect.unwrap(fn)
    for cell in getattr(fn, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and inner.__name__ == name:
            return _unwrap(inner, name)
    return fn


def _params(fn) -> tuple[tuple[str, ...], tuple[str, ...]]:
    sig = inspect.signature(_unwrap(fn, fn.__name__))
    pos = tuple(p.name for p in sig.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self")
    kw = tuple(p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY)
    return pos, kw


def check_seam() -> list[str]:
    """Differences between the written-down seam and the installed vLLM-Omni / omni-cache.

    Checks: vLLM-Omni's manager has every method of :data:`MANAGER_METHODS` with those
    parameters; its runner code calls no manager method outside them; ``StageCacheOutputs``
    has :data:`HANDOFF_FIELDS`; the runner classes still define :data:`RUNNER_HOOKS`; and
    omni-cache's stage manager matches the same parameters.

    Returns:
        One line per difference; empty when the seam holds.
    """
    from vllm_omni.core.prefix_cache import runner_mixin
    from vllm_omni.core.prefix_cache.interface import StageCacheOutputs
    from vllm_omni.core.prefix_cache.manager import OmniPrefixCacheManager
    from vllm_omni.worker import gpu_ar_model_runner

    from omni_cache.engine.stage_manager import HandOff, OmniCacheStageManager

    problems = []
    for name, want in MANAGER_METHODS.items():
        for owner, cls in (("vLLM-Omni's OmniPrefixCacheManager", OmniPrefixCacheManager),
                           ("omni-cache's OmniCacheStageManager", OmniCacheStageManager)):
            fn = getattr(cls, name, None)
            if fn is None:
                problems.append(f"{owner} has no {name}()")
            elif _params(fn) != want:
                problems.append(f"{owner}.{name}{_params(fn)} != the seam's {want}")
    for mod in (runner_mixin, gpu_ar_model_runner):
        called = set(_CALL.findall(inspect.getsource(mod)))
        for name in sorted(called - MANAGER_METHODS.keys()):
            problems.append(f"{mod.__name__} calls omni_prefix_cache.{name}(), which the seam does not list")
    if tuple(StageCacheOutputs._fields) != HANDOFF_FIELDS:
        problems.append(f"StageCacheOutputs fields {StageCacheOutputs._fields} != {HANDOFF_FIELDS}")
    import dataclasses

    if tuple(f.name for f in dataclasses.fields(HandOff)) != HANDOFF_FIELDS:
        problems.append(f"HandOff fields differ from {HANDOFF_FIELDS}")
    runner_cls = gpu_ar_model_runner.GPUARModelRunner
    for hook in RUNNER_HOOKS:
        if not callable(getattr(runner_cls, hook, None)):
            problems.append(f"GPUARModelRunner has no {hook}() for OmniCacheRunnerMixin to override")
    problems += _check_snapshot_builder(runner_cls)
    return problems + check_talker_seam() + check_talker_keys_seam()


def _check_snapshot_builder(runner_cls) -> list[str]:
    """The snapshot hand-off's seam (``OMNI_CACHE_HANDOFF_STAGING=snapshot``): the payload
    builder takes the step's snapshot and step id as keyword parameters, and it is the only
    method that reaches ``materialize`` (through :data:`MATERIALIZE_CALLER`), so a step is
    never materialized before :meth:`~omni_cache.engine.stage_manager.OmniCacheStageManager.attach_snapshot`."""
    builder = getattr(runner_cls, "_build_omni_model_runner_output_from_snapshot", None)
    if builder is None:
        return []  # reported above
    problems = []
    _, kw = _params(builder)
    missing = [p for p in SNAPSHOT_BUILDER_PARAMS if p not in kw]
    if missing:
        problems.append(f"GPUARModelRunner._build_omni_model_runner_output_from_snapshot has no keyword "
                        f"parameters {missing}")
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.getmodule(runner_cls))))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            calls = {c.func.attr for c in ast.walk(node)
                     if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)}
            if ({MATERIALIZE_CALLER, "_prefix_cache_materialize"} & calls
                    and node.name not in ("_build_omni_model_runner_output_from_snapshot", MATERIALIZE_CALLER)):
                problems.append(f"{node.name}() reaches materialize outside the payload builder "
                                "(the snapshot hand-off would not see its snapshot)")
    return problems


#: what vLLM-Omni's ``_talker_mtp_forward`` must still say for the talker's generators to arrive
TALKER_RUNNER_NEEDS = ('"tts_local_seed"', '"talker_mtp_accepts_per_row_generators"',
                       'talker_kwargs["generator"]', 'talker_kwargs["generators"]')


#: module of vLLM-Omni's helpers whose results seed the talker block keys, and their names
TALKER_KEY_HELPERS_MODULE = "vllm_omni.model_executor.stage_input_processors.tts_utils"
TALKER_KEY_HELPERS = ("extract_speaker_from_prompt", "extract_language_from_prompt")


def talker_key_helpers() -> tuple:
    """vLLM-Omni's ``(extract_speaker_from_prompt, extract_language_from_prompt)``: each takes a
    prompt dict (or a list of them) and returns the speaker / language as a list, or ``None``.

    Raises:
        ImportError: the module or a helper moved (a seam failure).
    """
    module = importlib.import_module(TALKER_KEY_HELPERS_MODULE)
    missing = [name for name in TALKER_KEY_HELPERS if not callable(getattr(module, name, None))]
    if missing:
        raise ImportError(f"{TALKER_KEY_HELPERS_MODULE} has no {', '.join(missing)}")
    return tuple(getattr(module, name) for name in TALKER_KEY_HELPERS)


def check_talker_keys_seam() -> list[str]:
    """Differences between the talker keys' seam (module docstring) and the installed
    vLLM-Omni: :data:`TALKER_KEY_HELPERS` importable, each taking ``prompt`` first. Returns one
    line per difference."""
    try:
        helpers = talker_key_helpers()
    except ImportError as exc:
        return [f"the talker keys' speaker/language helpers moved: {exc}"]
    return [f"{fn.__name__}{_params(fn)} no longer takes the prompt first"
            for fn in helpers if _params(fn)[0][:1] != ("prompt",)]


def check_talker_seam() -> list[str]:
    """Differences between the talker seam (module docstring) and the installed vLLM-Omni:
    the runner's ``_talker_mtp_forward`` source names :data:`TALKER_RUNNER_NEEDS`;
    Qwen3-Omni's ``talker_mtp`` takes the four inputs positionally; its talker's
    ``code_predictor_forward`` calls ``self.code_predictor(``; the code predictor's forward
    takes ``generator`` and ``generators``. Returns one line per difference."""
    from vllm_omni.model_executor.models.common.qwen3_code_predictor import CodePredictorWrapper
    from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni import Qwen3OmniMoeForConditionalGeneration
    from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_talker import (
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )
    from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner

    problems = []
    runner_src = inspect.getsource(OmniGPUModelRunner._talker_mtp_forward)
    problems += [f"OmniGPUModelRunner._talker_mtp_forward no longer mentions {s}"
                 for s in TALKER_RUNNER_NEEDS if s not in runner_src]
    pos, _ = _params(Qwen3OmniMoeForConditionalGeneration.talker_mtp)
    if pos[:4] != ("input_ids", "input_embeds", "last_talker_hidden", "text_step"):
        problems.append(f"Qwen3OmniMoeForConditionalGeneration.talker_mtp{pos} changed")
    predictor_src = inspect.getsource(Qwen3OmniMoeTalkerForConditionalGeneration.code_predictor_forward)
    if "self.code_predictor(" not in predictor_src:
        problems.append("Qwen3-Omni's code_predictor_forward no longer calls self.code_predictor(")
    params = inspect.signature(CodePredictorWrapper.forward).parameters
    problems += [f"CodePredictorWrapper.forward has no {p!r} parameter"
                 for p in ("generator", "generators") if p not in params]
    return problems
