"""The pipeline tests' shared engines: one per configuration, started lazily, each with its own
folder for hand-off records and metrics (see ``tests/pipeline/conftest.py`` for when they
start and stop).

| engine | API | thinker cache | streaming | used by |
|---|---|---|---|---|
| ``sync_omni`` | ``Omni`` | omni-cache (+ talker cache) | no | test_cache_equality |
| ``stream_off`` | ``AsyncOmni`` | off (talker too): a real cache-off engine | yes | streaming, stress, fuzz |
| ``stream_omni`` | ``AsyncOmni`` | omni-cache (+ talker cache) | yes | streaming, fuzz |
| ``stream_builtin`` | ``AsyncOmni`` | vLLM-Omni's built-in (talker cache off) | yes | streaming, fuzz |
| ``stress_omni`` | ``AsyncOmni`` | omni-cache, 512 KiB KV pool | yes | test_stress |
| ``gemma4`` | ``Omni`` | omni-cache, fast prefill on | yes | test_yoco_pipeline |
| ``gemma3n`` | ``Omni`` | omni-cache, fast prefill on | no | test_yoco_pipeline |

Cache-off and slow-path references inside a cache-on engine are chosen per request
(:func:`reference_params`): vLLM's ``skip_reading_prefix_cache`` on the thinker and the talker
(no prefix-cache read: every prompt row computed) and omni-cache's per-request opt-out of fast
prefill. ``stream_off`` is a real cache-off engine on the production streaming path: a defect
that corrupts every request while caching is on would be invisible to a same-engine reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import count_pipeline_start
from tests.device import device_stage_config
from tests.pipeline.workloads import STEP_BUDGET  # the equality engines' thinker budget per step
from tests.util import REPO, in_process_stages, variant_stage_config

#: the YOCO engines' budget: long prompts are prefilled in chunks
YOCO_STEP_BUDGET = 512
G4_CONFIG = REPO / "stage_configs" / "gemma4_yoco_cpu.yaml"
G3N_CONFIG = REPO / "stage_configs" / "gemma3n_yoco_cpu.yaml"


@dataclass
class Engine:
    """A started shared engine.

    Attributes:
        name: its configuration's name (the fixture's).
        pipe: the running :class:`~omni_cache.driver.pipeline.OmniPipeline` or
            :class:`~omni_cache.driver.streaming.StreamingPipeline`.
        dir: its folder: ``handoff/`` and ``codec/`` (recorded hand-offs), ``metrics/``,
            ``audit/`` (served hits, ``OMNI_CACHE_HIT_AUDIT``).
        model_dir: the model it runs.
        start_s: seconds its start took.
    """

    name: str
    pipe: Any
    dir: Path
    model_dir: Path
    start_s: float


def _small_pool(cfg: Path) -> Path:
    """The stress engine: a thinker KV pool small enough to force eviction and preemption."""
    from omni_cache.driver.variants import derive_stage_config

    return derive_stage_config(cfg, cfg, stages={0: {
        "kv_cache_memory_bytes": 1 << 19,  # 512 KiB: 1,024 tokens (32 blocks) of the tiny thinker's KV
        "max_model_len": 960,
        "max_num_batched_tokens": 256,  # chunked prefill
    }}, sampling={0: {"max_tokens": 48}})  # decode grows blocks -> preemption


def yoco_config(config: Path, out_dir: Path, **stage0) -> Path:
    """``config`` (a KV-shared thinker's) with fast prefill and prefix caching + omni-cache on,
    chunked prefill (:data:`YOCO_STEP_BUDGET`), hand-off recording, metrics and the hit audit
    into ``out_dir``; ``stage0``: more thinker keys."""
    from omni_cache import settings
    from omni_cache.driver.variants import derive_stage_config

    return derive_stage_config(
        config, out_dir / "stage_config_fast-on_cache-on.yaml",
        stages={0: {"kv_sharing_fast_prefill": True, "enable_prefix_caching": True,
                    "max_num_batched_tokens": YOCO_STEP_BUDGET, **stage0}},
        env={0: {settings.HANDOFF_DUMP.name: str(out_dir / "handoff"),
                 settings.METRICS_DIR.name: str(out_dir / "metrics"),
                 settings.HIT_AUDIT.name: str(out_dir / "audit")}},
        sampling={0: {"max_tokens": 12}, 1: {"max_tokens": 12}})


def _qwen(variant: str, *, streaming: bool, small_pool: bool = False):
    def config(d: Path, model_dir: Path) -> Path:
        thinker = {} if small_pool else {"max_num_batched_tokens": STEP_BUDGET}
        cfg = variant_stage_config(d, variant, thinker=thinker, streaming=streaming)
        return _small_pool(cfg) if small_pool else cfg

    return config


def _gemma(family: str):
    def model() -> Path:
        from omni_cache.models.gemma import build_gemma_omni, default_gemma_dir

        kw = {"family": family} if family == "gemma4" else {}
        return build_gemma_omni(default_gemma_dir("tiny", **kw), "tiny", **kw)

    def config(d: Path, model_dir: Path) -> Path:
        if family == "gemma4":
            # the workload's most media per prompt (start-up profiles the limit)
            return yoco_config(G4_CONFIG, d, limit_mm_per_prompt={"image": 2, "audio": 2, "video": 0})
        return yoco_config(G3N_CONFIG, d)

    return model, config


@dataclass(frozen=True)
class EngineSpec:
    """How to start one shared engine: its stage config (from its folder and model), whether
    it is driven through ``AsyncOmni`` (:class:`~omni_cache.driver.streaming.StreamingPipeline`),
    and its model (None: the tiny Qwen3-Omni)."""

    config: Callable[[Path, Path], Path]
    streaming_api: bool
    model: Callable[[], Path] | None = None
    #: vLLM's ``uni`` executor on every stage (False: vLLM's default, ``mp``)
    in_process: bool = True


ENGINES: dict[str, EngineSpec] = {
    "sync_omni": EngineSpec(_qwen("omni_cache", streaming=False), streaming_api=False),
    "stream_off": EngineSpec(_qwen("off", streaming=True), streaming_api=True),
    "stream_omni": EngineSpec(_qwen("omni_cache", streaming=True), streaming_api=True),
    "stream_builtin": EngineSpec(_qwen("builtin", streaming=True), streaming_api=True),
    "stress_omni": EngineSpec(_qwen("omni_cache", streaming=True, small_pool=True), streaming_api=True),
    "gemma4": EngineSpec(_gemma("gemma4")[1], streaming_api=False, model=_gemma("gemma4")[0]),
    "gemma3n": EngineSpec(_gemma("gemma3n")[1], streaming_api=False, model=_gemma("gemma3n")[0]),
}


class EngineRegistry:
    """The session's shared engines, started on first use (:meth:`get`), stopped on request
    (:meth:`close`) or at the end (:meth:`close_all`). At most one engine per name is ever
    started: a closed engine is not started again (a second start would break the session's
    start budget silently; it raises instead)."""

    def __init__(self, tmp_path_factory, tiny_model_dir: Path):
        self._tmp = tmp_path_factory
        self._tiny = Path(tiny_model_dir)
        self._running: dict[str, Engine] = {}
        self._closed: set[str] = set()

    def started(self, name: str) -> bool:
        return name in self._running

    def get(self, name: str) -> Engine:
        """The running engine ``name``; started now if it is the first use.

        Raises:
            KeyError: unknown engine. RuntimeError: the engine was already stopped (a test
            ordered after its last user, see conftest).
        """
        if name in self._running:
            return self._running[name]
        if name in self._closed:
            raise RuntimeError(f"engine {name!r} was already stopped: a test that needs it ran after its last user")
        spec = ENGINES[name]
        d = self._tmp.mktemp(f"engine-{name}")
        model_dir = spec.model() if spec.model is not None else self._tiny
        cfg = spec.config(d, model_dir)
        if spec.in_process:
            cfg = in_process_stages(cfg)
        cfg = device_stage_config(cfg)  # the GPU lane: a CUDA variant (tests/device.py)
        if spec.streaming_api:
            from omni_cache.driver.streaming import StreamingPipeline as Pipeline
        else:
            from omni_cache.driver.pipeline import OmniPipeline as Pipeline
        pipe = Pipeline(model_dir, cfg)
        count_pipeline_start()
        print(f"\n[engines] {name} started in {pipe.start_s:.1f} s")
        engine = self._running[name] = Engine(name, pipe, d, model_dir, pipe.start_s)
        return engine

    def close(self, name: str) -> None:
        engine = self._running.pop(name, None)
        if engine is not None:
            self._closed.add(name)
            engine.pipe.close()

    def close_all(self) -> None:
        for name in list(self._running):
            self.close(name)


def reference_params(pipe, *, thinker_extra: dict | None = None, **thinker) -> list:
    """Per-stage sampling params (the stage config's defaults) for a cache-off reference
    request inside a cache-on engine: ``skip_reading_prefix_cache`` on the thinker and the
    talker (vLLM reads no prefix-cache block for it, so every prompt row is computed; it
    still writes its blocks). ``thinker``: more thinker fields (e.g. ``prompt_logprobs=1``);
    ``thinker_extra``: entries for the thinker's ``extra_args``."""
    sps = copy.deepcopy(pipe.default_sampling_params())
    for sp in sps[:2]:
        sp.skip_reading_prefix_cache = True  # SamplingParams derives it only at construction
    for k, v in thinker.items():
        setattr(sps[0], k, v)
    if thinker_extra:
        sps[0].extra_args = {**(sps[0].extra_args or {}), **thinker_extra}
    return sps


def thinker_params(pipe, **extra_args) -> list:
    """Per-stage default sampling params with ``extra_args`` entries on the thinker (e.g. the
    scheduler's fault injection, :data:`omni_cache.engine.scheduler.FORGET_ROWS`)."""
    sps = copy.deepcopy(pipe.default_sampling_params())
    sps[0].extra_args = {**(sps[0].extra_args or {}), **extra_args}
    return sps
