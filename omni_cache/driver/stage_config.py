"""Stage-config (vLLM-Omni deploy YAML) loading and validation, before any engine starts.

A stage config is vLLM-Omni's deploy YAML (``stages:`` list, ``platforms:``, pipeline-wide
keys). vLLM-Omni passes unknown stage keys silently through to the engine, so a typo such
as ``enable_prefix_cache`` is lost without a word; :func:`load_stage_config` refuses it.
It checks the whole file and raises one :class:`StageConfigError` listing **every** problem
(:class:`StageConfigProblem`: file, line where the YAML loader gives it, stage, key, reason),
so a user fixes them in one pass. Only a file that cannot be read as a YAML mapping with a
``stages:`` list stops the checks early. A stage's ``default_sampling_params`` are checked
against vLLM's ``SamplingParams`` (names, declared types, the ranges it enforces:
:func:`omni_cache.driver.schema.sampling_problems`), so a value vLLM would refuse only while
the orchestrator starts is reported here, with its stage and key.

omni-cache's own per-stage settings live in the stage's ``env:`` mapping (the schema's
channel into the stage process, so the same YAML works with ``vllm-omni serve``); which
``OMNI_CACHE_*`` variables a stage may set, and their values, come from
:data:`omni_cache.settings.SETTINGS`.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_cache import settings


def bundled_stage_config(name: str) -> Path | None:
    """A bundled stage config by file name (e.g. ``qwen3_omni_cpu.yaml``): the package
    ``omni_cache.stage_configs`` (the repository's ``stage_configs/``, shipped in the wheel;
    run from a source checkout on ``PYTHONPATH``, the checkout's ``stage_configs/``), or None
    if there is none of that name."""
    from importlib import resources

    try:
        f = resources.files("omni_cache.stage_configs") / name
        if f.is_file():
            return Path(str(f))
    except ModuleNotFoundError:  # a source checkout (the package maps to ../stage_configs) or no data
        pass
    tree = Path(__file__).resolve().parents[2] / "stage_configs" / name
    return tree if (tree.parent.parent / "pyproject.toml").is_file() and tree.is_file() else None


@dataclass(frozen=True)
class StageConfigProblem:
    """One problem in a stage config: ``path`` (the file), ``line`` (1-based, of the key or
    item at fault; None where the YAML gives none), ``stage_id`` (None: pipeline-wide),
    ``key`` (dotted for ``env.<NAME>``; None: the whole file) and ``reason``."""

    path: str
    reason: str
    stage_id: int | None = None
    key: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        if self.stage_id is not None:
            where += f": stage {self.stage_id}"
        if self.key is not None:
            where += f": key {self.key!r}"
        return f"{where}: {self.reason}"


class StageConfigError(ValueError):
    """A stage config is invalid. ``problems`` lists every :class:`StageConfigProblem` found
    (at least one), one per line of the message; ``path``, ``stage_id``, ``key`` and ``line``
    are the first problem's."""

    def __init__(self, path: str | Path, reason: str | None = None, *, stage_id: int | None = None,
                 key: str | None = None, line: int | None = None,
                 problems: typing.Sequence[StageConfigProblem] = ()):
        problems = list(problems)
        if reason is not None:
            problems.insert(0, StageConfigProblem(str(path), reason, stage_id, key, line))
        assert problems, "a StageConfigError needs at least one problem"
        self.problems = problems
        first = problems[0]
        self.path, self.stage_id, self.key, self.line = first.path, first.stage_id, first.key, first.line
        super().__init__("\n".join(str(p) for p in problems))


class _Problems:
    """Collects :class:`StageConfigProblem` s of one file; lines come from the composed YAML
    (:func:`_key_lines`), looked up by the item's path in the document."""

    def __init__(self, path: Path, lines: dict[tuple, int]):
        self.path, self.lines, self.found = path, lines, []
        self.stage_index: dict[int, int] = {}  # stage_id -> index in ``stages``

    def add(self, reason: str, *, stage_id: int | None = None, key: str | None = None,
            at: tuple = ()) -> None:
        """Record a problem; ``at``: its path in the document (e.g. ``("stages", 0, "env",
        "OMNI_CACHE_X")``), for the line (the nearest enclosing item that has one)."""
        line = None
        for n in range(len(at), 0, -1):
            if at[:n] in self.lines:
                line = self.lines[at[:n]]
                break
        self.found.append(StageConfigProblem(str(self.path), reason, stage_id, key, line))

    def at_stage(self, stage_id: int, *rest) -> tuple:
        """The document path of ``rest`` inside the stage with ``stage_id``."""
        i = self.stage_index.get(stage_id)
        return () if i is None else ("stages", i, *rest)

    def raise_if_any(self) -> None:
        if self.found:
            raise StageConfigError(self.path, problems=self.found)


def _key_lines(text: str) -> dict[tuple, int]:
    """1-based line of every mapping key and sequence item of the YAML document ``text``, by
    its path (``("stages", 0, "env", "NAME")``); {} if it cannot be composed."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[tuple, int] = {}

    def walk(node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else None
                out[(*path, key)] = k.start_mark.line + 1
                walk(v, (*path, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[(*path, i)] = v.start_mark.line + 1
                walk(v, (*path, i))

    if root is not None:
        walk(root, ())
    return out


@dataclass
class StageConfig:
    """A validated stage config: the parsed YAML plus facts omni-cache needs."""

    path: Path
    raw: dict[str, Any]
    stage_ids: list[int] = field(default_factory=list)
    #: checks that did not run and why (printed by ``omni-cache validate``)
    notes: list[str] = field(default_factory=list)

    def stage(self, stage_id: int) -> dict[str, Any]:
        """The raw mapping of ``stage_id``. Raises KeyError if absent."""
        for s in self.raw.get("stages", []):
            if s.get("stage_id") == stage_id:
                return s
        raise KeyError(stage_id)

    @property
    def thinker_family(self) -> str:
        """The thinker's model family as the prompt format needs it (``gemma4`` for the
        ``gemma4_omni_cache`` pipeline, else ``qwen3-omni``): a key of
        :data:`omni_cache.driver.inputs.PLACEHOLDERS`."""
        from omni_cache.engine.plugin import GEMMA4_PIPELINE

        return "gemma4" if self.raw.get("pipeline") == GEMMA4_PIPELINE else "qwen3-omni"

    def prefix_caching(self, stage_id: int) -> bool:
        """Whether ``stage_id`` runs with ``enable_prefix_caching`` (its own, else the top level)."""
        return bool(self.stage(stage_id).get("enable_prefix_caching", self.raw.get("enable_prefix_caching")))

    @property
    def in_process_workers(self) -> bool:
        """Whether every stage asks for vLLM's ``uni`` executor (``distributed_executor_backend:
        uni``: the worker runs inside the stage's engine-core process). vLLM's CPU platform
        turns ``uni`` into ``mp`` unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set while the
        stage configs are resolved (``vllm/platforms/cpu.py``); see
        :func:`omni_cache.driver.pipeline.engine_start_environment`."""
        stages = self.raw.get("stages") or []
        return bool(stages) and all(s.get("distributed_executor_backend") == "uni" for s in stages)

    def prefix_cache_backend(self, stage_id: int = 0) -> str | None:
        """``omni_cache`` / ``builtin`` for a thinker (stage 0) with prefix caching on,
        ``talker`` for a later stage with prefix caching on (KV only, content-keyed blocks:
        :mod:`omni_cache.engine.talker_scheduler`), else None."""
        if not self.prefix_caching(stage_id):
            return None
        if stage_id != 0:
            return "talker"
        env = self.stage(stage_id).get("env")
        return settings.PREFIX_CACHE_BACKEND.get({k: str(v) for k, v in env.items()} if isinstance(env, dict) else {})


def _type_ok(value: Any, tp: Any) -> bool:
    """Loose isinstance for the declared field types YAML can express."""
    if tp is Any or isinstance(tp, str) or tp is None:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    base = origin or tp
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base in (list, tuple, typing.Sequence):
        return isinstance(value, (list, tuple))
    if base in (dict, typing.Mapping):
        return isinstance(value, dict)
    if isinstance(base, type):
        if base in (bool, str):
            return isinstance(value, base)
        return True  # dataclasses / enums: vLLM-Omni converts them itself
    return True


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_keys(problems: _Problems, mapping: dict, schema: dict[str, Any], stage_id: int | None,
                at: tuple = ()) -> None:
    """Unknown keys (with the closest known one) and values of the wrong declared type."""
    for key, value in mapping.items():
        if key not in schema:
            close = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.add(f"unknown key{hint}", stage_id=stage_id, key=key, at=(*at, key))
        elif not _type_ok(value, schema[key]):
            problems.add(f"expected {_type_name(schema[key])}, got {type(value).__name__} {value!r}",
                         stage_id=stage_id, key=key, at=(*at, key))


def _check_env(problems: _Problems, env: Any, stage_id: int, at: tuple) -> None:
    """The ``OMNI_CACHE_*`` variables of a stage's ``env:``: known, per-stage, valid values."""
    if env is None:
        return
    if not isinstance(env, dict):
        problems.add(f"expected a mapping, got {type(env).__name__}", stage_id=stage_id, key="env", at=at)
        return
    for name, value in env.items():
        if not str(name).startswith(settings.PREFIX):
            continue
        setting = settings.SETTINGS.get(name)
        if setting is None or not setting.stage_env:
            stage_names = [n for n, st in settings.SETTINGS.items() if st.stage_env]
            close = difflib.get_close_matches(name, stage_names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            what = "unknown omni-cache setting" if setting is None else "not a per-stage setting"
            problems.add(f"{what}{hint}", stage_id=stage_id, key=f"env.{name}", at=(*at, name))
            continue
        try:
            setting.check(str(value))
        except settings.SettingError:
            problems.add(f"expected {setting.kind.value}" + (f" {setting.choices}" if setting.choices else "")
                         + f", got {value!r}", stage_id=stage_id, key=f"env.{name}", at=(*at, name))


def _check_sampling(problems: _Problems, raw: dict, stage: dict, stage_id: int, at: tuple,
                    base: Any = None) -> None:
    """A stage's ``default_sampling_params`` against vLLM's ``SamplingParams``
    (:func:`omni_cache.driver.schema.sampling_problems`: names, declared types, the ranges
    ``SamplingParams._verify_args`` enforces), reported as ``default_sampling_params.<key>``.
    Under ``platforms:`` (``base``: the stage's own mapping) the overlay is checked merged
    onto the stage's, as vLLM-Omni merges it, and only problems of the overlay's keys are
    reported here (with those the merge makes). Skipped for pooling stages (``runner: pooling``) and diffusion stages of
    a registered pipeline, whose defaults are other classes."""
    from omni_cache.driver.schema import diffusion_stages, sampling_problems

    params = stage.get("default_sampling_params")
    if not isinstance(params, dict):
        return  # absent, or not a mapping (the key's type check reports that)
    if str(stage.get("runner", "")).lower() == "pooling" or stage_id in diffusion_stages(raw.get("pipeline")):
        return
    merged, seen = params, set()
    if isinstance(base, dict):
        merged, seen = {**base, **params}, set(sampling_problems(base))
    for key, reason in sampling_problems(merged):
        if key not in params and (key, reason) in seen:
            continue  # the stage's own problem: reported with the stage
        problems.add(reason, stage_id=stage_id, key=f"default_sampling_params.{key}",
                     at=(*at, "default_sampling_params", key if key in params else None))


def load_stage_config(path: str | Path, *, model_dir: str | Path | None = None) -> StageConfig:
    """Load and validate a vLLM-Omni deploy YAML, reporting every problem at once.

    Args:
        path: the YAML file.
        model_dir: if given, must be a directory with a ``config.json``.

    Returns:
        The validated :class:`StageConfig`.

    Raises:
        StageConfigError: with every problem found (``.problems``, one line each in the
            message: file, line, stage, key, reason): unknown top-level or stage keys (with a
            suggestion), wrong value types, a stage's ``default_sampling_params`` that vLLM's
            ``SamplingParams`` would refuse (unknown names, types, ranges:
            :func:`omni_cache.driver.schema.sampling_problems`), duplicate or missing ``stage_id``, bad omni-cache
            settings, cross-stage rules (capped scheduler, talker identity, routing, KV-shared
            layers), a missing model directory. A missing or unreadable file, a YAML syntax
            error, or a document that is not a mapping with a ``stages:`` list is reported
            alone (nothing else can be checked).
    """
    from omni_cache.driver.schema import deploy_fields, stage_fields

    p = Path(path)
    if not p.is_file():
        raise StageConfigError(p, "file not found")
    try:
        text = p.read_text()
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise StageConfigError(p, f"not valid YAML: {exc}", line=None if mark is None else mark.line + 1) from exc
    except OSError as exc:
        raise StageConfigError(p, f"cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise StageConfigError(p, "expected a mapping at the top level")
    problems = _Problems(p, _key_lines(text))
    _check_keys(problems, {k: v for k, v in raw.items() if k not in ("stages", "platforms")}, deploy_fields(), None)
    stages = raw.get("stages")
    if not isinstance(stages, list) or not stages:
        problems.add("expected a non-empty list", key="stages", at=("stages",))
        problems.raise_if_any()
    schema = stage_fields()
    seen: list[int] = []
    good: list[dict] = []  # the stages with a usable stage_id, for the cross-stage checks
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            problems.add(f"stages[{i}] is not a mapping", key="stages", at=("stages", i))
            continue
        sid = s.get("stage_id")
        if not isinstance(sid, int) or isinstance(sid, bool):
            problems.add(f"stages[{i}] needs an integer stage_id", key="stage_id", at=("stages", i, "stage_id"))
            continue
        if sid in seen:
            problems.add("duplicate stage_id", stage_id=sid, key="stage_id", at=("stages", i, "stage_id"))
            continue
        seen.append(sid)
        good.append(s)
        problems.stage_index[sid] = i
        _check_keys(problems, s, schema, sid, at=("stages", i))
        _check_env(problems, s.get("env"), sid, at=("stages", i, "env"))
        _check_sampling(problems, raw, s, sid, at=("stages", i))
    platforms = raw.get("platforms") or {}
    if not isinstance(platforms, dict):
        problems.add("expected a mapping", key="platforms", at=("platforms",))
        platforms = {}
    for name, section in platforms.items():
        for j, s in enumerate((section or {}).get("stages", []) or []):
            at = ("platforms", name, "stages", j)
            sid = s.get("stage_id")
            if sid not in seen:
                problems.add(f"platforms.{name} names stage {sid!r}, which is not in stages", key="stage_id",
                             at=(*at, "stage_id"))
                continue
            _check_keys(problems, dict(s), schema, sid, at=at)
            base = next(g for g in good if g["stage_id"] == sid)
            _check_sampling(problems, raw, s, sid, at=at, base=base.get("default_sampling_params"))
    cfg = StageConfig(path=p, raw={**raw, "stages": good}, stage_ids=seen)
    _check_capped_scheduler(cfg, problems)
    _check_talker_identity(cfg, problems)
    _check_routing(cfg, problems)
    _check_shared_device_kv(cfg, problems)
    if model_dir is not None:
        md = Path(model_dir)
        if not (md / "config.json").is_file():
            problems.add(f"model directory {str(md)!r} has no config.json (run 'omni-cache make-model')",
                         key="model")
        else:
            _check_yoco(problems, raw, good, md)
    else:
        cfg.notes.extend(f"stage {s['stage_id']}: KV-shared (YOCO) check skipped: it reads the model's config, "
                         "pass --model DIR" for s in good if _is_yoco_stage(s))
    problems.raise_if_any()
    cfg.raw = raw
    return cfg


def _check_shared_device_kv(cfg: StageConfig, problems: _Problems) -> None:
    """Stages that share a device and size their KV by ``gpu_memory_utilization`` alone.

    vLLM-Omni's worker sizes such a stage's KV as its share of the card minus what it measures
    on the whole device between its start and its profiling run
    (``OmniGPUWorkerBase.determine_available_memory``). With the stages started together
    (``OMNI_CACHE_PARALLEL_STAGE_INIT=1``), another stage's KV and CUDA graphs allocated in that
    window count as this one's, and it stops with vLLM's "No available memory for the cache
    blocks" — seen on an H200 (2026-11-27: the talker of ``qwen3_omni_30b_a3b_h200_dummy.yaml``,
    0.0 GiB after the thinker's 16.75 GiB KV) and in the GPU lane's main job.
    ``kv_cache_memory_bytes`` skips that measurement. A problem when the setting is on in this
    process's environment, else a note."""
    stages = cfg.raw["stages"]
    parallel = settings.PARALLEL_STAGE_INIT.get() == "1"
    for s in stages:
        dev, sid = s.get("devices"), s["stage_id"]
        if dev is None or s.get("kv_cache_memory_bytes") is not None:
            continue
        if not any(o is not s and str(o.get("devices")) == str(dev) for o in stages):
            continue
        reason = (f"shares device {str(dev)!r} with another stage and has no kv_cache_memory_bytes: started "
                  f"together ({settings.PARALLEL_STAGE_INIT.name}=1) it can count the other stage's memory "
                  f"as its own and stop with no KV cache blocks; set kv_cache_memory_bytes")
        if parallel:
            problems.add(reason, stage_id=sid, key="kv_cache_memory_bytes", at=problems.at_stage(sid))
        else:
            cfg.notes.append(f"stage {sid}: {reason}")


def _check_capped_scheduler(cfg: StageConfig, problems: _Problems) -> None:
    """A stage with omni-cache as its prefix-cache backend must run the capped scheduler
    (registered pipelines, :data:`omni_cache.engine.plugin.CAPPED_STAGES`): without it a hit
    whose rows are not covered would stop the model runner instead of being recomputed."""
    from omni_cache.engine.plugin import CAPPED_PIPELINE, CAPPED_STAGES

    pipeline = cfg.raw.get("pipeline")
    for sid in cfg.stage_ids:
        try:
            backend = cfg.prefix_cache_backend(sid)
        except settings.SettingError:
            continue  # reported by _check_env
        if backend != "omni_cache" or sid in CAPPED_STAGES.get(str(pipeline), ()):
            continue
        hint = f"set `pipeline: {CAPPED_PIPELINE}` (Qwen3-Omni) or another omni-cache pipeline"
        problems.add(
            f"prefix cache backend omni_cache needs omni-cache's capped scheduler, which pipeline "
            f"{pipeline!r} does not run on this stage; {hint}, or set "
            f"{settings.PREFIX_CACHE_BACKEND.name}: builtin", stage_id=sid, key="pipeline", at=("pipeline",))


def _check_talker_identity(cfg: StageConfig, problems: _Problems) -> None:
    """Prefix caching on a stage after the thinker needs content identity for its blocks:
    vLLM-Omni gives the talker placeholder prompt ids (``[0] * n``), so without omni-cache's
    talker scheduler (:data:`omni_cache.engine.plugin.TALKER_IDENTITY_STAGES`) two
    conversations of equal lengths would share talker KV."""
    from omni_cache.engine.plugin import CAPPED_PIPELINE, TALKER_IDENTITY_STAGES

    pipeline = cfg.raw.get("pipeline")
    for sid in cfg.stage_ids:
        if sid == 0 or not cfg.prefix_caching(sid) or sid in TALKER_IDENTITY_STAGES.get(str(pipeline), ()):
            continue
        problems.add(
            f"prefix caching here needs content identity for the stage's blocks (vLLM-Omni hands "
            f"the talker placeholder prompt ids: two conversations of equal lengths would share KV), and "
            f"pipeline {pipeline!r} does not give it on this stage; omni-cache gives it on the talker "
            f"(stage 1) of `pipeline: {CAPPED_PIPELINE}` (Qwen3-Omni) — or set enable_prefix_caching: false",
            stage_id=sid, key="enable_prefix_caching", at=problems.at_stage(sid, "enable_prefix_caching"))


_ROUTING_KNOBS = (settings.ROUTING_LOAD_MARGIN, settings.ROUTING_CAPACITY_BLOCKS)


def _check_routing(cfg: StageConfig, problems: _Problems) -> None:
    """Prefix routing (``OMNI_CACHE_ROUTING: prefix``, docs/routing.md) routes the thinker's
    replicas only: talker and code2wav keep vLLM-Omni's routing (their requests follow the
    thinker's through the orchestrator). Its knobs without it are a mistake, not a no-op."""
    for sid in cfg.stage_ids:
        env = cfg.stage(sid).get("env")
        env = {k: str(v) for k, v in env.items()} if isinstance(env, dict) else {}
        try:
            mode = settings.ROUTING.get(env)
        except settings.SettingError:
            continue  # reported by _check_env
        if sid != 0 and (settings.ROUTING.name in env or any(k.name in env for k in _ROUTING_KNOBS)):
            key = settings.ROUTING.name if settings.ROUTING.name in env else next(
                k.name for k in _ROUTING_KNOBS if k.name in env)
            problems.add("omni-cache routes the thinker's (stage 0) replicas only; "
                         "talker and code2wav keep vLLM-Omni's routing — move it to stage 0",
                         stage_id=sid, key=f"env.{key}", at=problems.at_stage(sid, "env", key))
            continue
        if mode != "prefix":
            for k in _ROUTING_KNOBS:
                if k.name in env:
                    problems.add(f"has no effect without {settings.ROUTING.name}: prefix",
                                 stage_id=sid, key=f"env.{k.name}", at=problems.at_stage(sid, "env", k.name))
            continue
        s = cfg.stage(sid)
        replicas = (s.get("runtime") or {}).get("num_replicas", s.get("num_replicas", 1))
        if not isinstance(replicas, int) or replicas <= 1:
            cfg.notes.append(f"stage {sid}: {settings.ROUTING.name}: prefix with num_replicas {replicas!r}: "
                             "nothing to route on this host (distributed replicas may still register)")
        enabled = s.get("enable_prefix_caching", cfg.raw.get("enable_prefix_caching"))
        if not enabled:
            problems.add("prefix routing sends a request where its prefix is cached, "
                         "which needs enable_prefix_caching: true on the thinker",
                         stage_id=sid, key=f"env.{settings.ROUTING.name}",
                         at=problems.at_stage(sid, "env", settings.ROUTING.name))


def _is_yoco_stage(stage: dict) -> bool:
    env = stage.get("env") if isinstance(stage.get("env"), dict) else {}
    return bool(stage.get("kv_sharing_fast_prefill", False)) or bool(
        env.keys() & {settings.YOCO_ACCEPT_LAYER.name, settings.YOCO_CAPTURE_LAYERS.name})


def _check_yoco(problems: _Problems, raw: dict, stages: list[dict], model_dir: Path) -> None:
    """KV-shared (YOCO) thinkers: refuse a stage whose hand-off needs rows that
    ``kv_sharing_fast_prefill`` truncates (rule: captured layers must be full-length; the
    final hidden states are not) — at start-up, not as silent wrong data. See docs/yoco.md."""
    import json

    from omni_cache.engine.plugin import STAGE_MODEL_SUBDIRS
    from omni_cache.yoco import YocoConfigError, stage_plan

    p = problems.path
    subdirs = STAGE_MODEL_SUBDIRS.get(str(raw.get("pipeline", "")), {})
    for s in stages:
        sid, env = s["stage_id"], s.get("env") if isinstance(s.get("env"), dict) else {}
        fast = bool(s.get("kv_sharing_fast_prefill", False))
        if not _is_yoco_stage(s):
            continue
        at = problems.at_stage(sid, "kv_sharing_fast_prefill")
        cfg_dir = Path(s["model"]) if s.get("model") else model_dir / subdirs.get(sid, "")
        try:
            hf = json.loads((cfg_dir / "config.json").read_text())
        except (OSError, ValueError) as exc:
            problems.add(f"cannot read the stage's model config {str(cfg_dir / 'config.json')!r}: {exc}",
                         stage_id=sid, key="kv_sharing_fast_prefill", at=at)
            continue
        try:
            stage_plan(hf, fast, {k: str(v) for k, v in env.items()})[0].check(where=f"{p}: stage {sid}")
        except YocoConfigError as exc:
            problems.add(str(exc).replace(f"{p}: stage {sid}: ", ""), stage_id=sid,
                         key="kv_sharing_fast_prefill", at=at)
