"""A running vLLM-Omni pipeline (``vllm_omni.Omni``) and its per-request results.

Thin on purpose: the pipeline *is* vLLM-Omni's; this module starts it from a validated
stage config, sends :class:`~omni_cache.driver.inputs.OmniRequest` objects, and turns vLLM-Omni's
``OmniRequestOutput`` objects (one per final stage) into a :class:`RequestResult`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omni_cache.driver.inputs import OmniRequest
from omni_cache.driver.stage_config import load_stage_config

logger = logging.getLogger(__name__)

@dataclass
class RequestResult:
    """What one request produced.

    Attributes:
        request_id: the id sent to the engine.
        text: the thinker's decoded text.
        token_ids: the thinker's sampled token ids.
        num_prompt_tokens: thinker prompt length (tokens).
        prompt_token_ids: the thinker's prompt token ids (vLLM's, placeholders expanded).
        num_cached_tokens: thinker prefix-hit length (tokens).
        audio: code2wav waveform, float32 ``[num_samples]`` (None when no audio stage ran).
        sample_rate: Hz.
        wall_s: request wall time in the batch that carried it (seconds).
        stage_durations: vLLM-Omni's per-stage durations (seconds), where it reports them.
        error: vLLM-Omni's error text for a failed request, else None.
        prompt_logprobs: the thinker's prompt logprobs (vLLM's per-position list) when the
            request asked for them (``SamplingParams.prompt_logprobs``), else None.
        talker_num_prompt_tokens: the talker's prompt length (tokens; 0: not recorded —
            the talker's prefix caching is off).
        talker_num_cached_tokens: the talker's prefix-hit length (tokens).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    audio: np.ndarray | None = None
    sample_rate: int = 24_000
    wall_s: float = 0.0
    stage_durations: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: Any = None
    talker_num_prompt_tokens: int = 0
    talker_num_cached_tokens: int = 0


#: vLLM's switch between in-process and multiprocess engine cores; its CPU platform reads it
#: while a stage's config is resolved (``CpuPlatform.check_and_update_config``)
_V1_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def engine_start_environment(stage_config: Any) -> Iterator[None]:
    """The driver's environment while vLLM-Omni starts the stages of ``stage_config`` (a
    :class:`~omni_cache.driver.stage_config.StageConfig`).

    With every stage on vLLM's ``uni`` executor (``distributed_executor_backend: uni``:
    the worker runs inside the stage's engine-core process instead of a process of its own),
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set for the start: vLLM-Omni resolves each
    stage's vLLM config in this process, and vLLM's CPU platform otherwise turns ``uni`` into
    ``mp`` (``vllm/platforms/cpu.py``), which spawns one more process per stage (torch + vLLM
    imported again, ~0.9 GiB). vLLM-Omni still starts one process per stage. The variable is
    restored afterwards, so processes started later (servers, CLI commands) keep vLLM's
    default. Other configs: no change. Measured start times: docs/cpu.md ("Timings").
    """
    if not stage_config.in_process_workers:
        yield
        return
    before = os.environ.get(_V1_MULTIPROCESSING)
    os.environ[_V1_MULTIPROCESSING] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_V1_MULTIPROCESSING, None)
        else:
            os.environ[_V1_MULTIPROCESSING] = before


def start_kwargs() -> dict[str, Any]:
    """Keyword arguments for vLLM-Omni's ``Omni`` / ``AsyncOmni`` from omni-cache's settings:
    ``parallel_stage_init=True`` with ``OMNI_CACHE_PARALLEL_STAGE_INIT=1`` (stages sharing a
    GPU start together; docs/gpu.md, "Start-up"), else nothing (vLLM-Omni's defaults)."""
    from omni_cache import settings

    return {"parallel_stage_init": True} if settings.PARALLEL_STAGE_INIT.get() == "1" else {}


def _audio_of(out: Any) -> tuple[np.ndarray | None, int]:
    mm = out.multimodal_output or {}
    audio = mm.get("audio")
    if audio is None:
        audio = mm.get("model_outputs")
    sr = mm.get("sr", 24_000)
    if isinstance(sr, list):
        sr = sr[0] if sr else 24_000
    if hasattr(sr, "item"):
        sr = sr.item()
    if isinstance(audio, list):
        audio = [a for a in audio if a is not None]
        if not audio:
            return None, int(sr)
        import torch

        audio = torch.cat([a.reshape(-1).float() for a in audio]) if len(audio) > 1 else audio[0]
    if audio is None:
        return None, int(sr)
    if hasattr(audio, "detach"):
        audio = audio.detach().float().cpu().numpy()
    return np.asarray(audio, dtype=np.float32).reshape(-1), int(sr)


class OmniPipeline:
    """vLLM-Omni's multi-stage pipeline, started from a stage config.

    Args:
        model_dir: a model directory (e.g. from ``omni-cache make-model``).
        stage_config: vLLM-Omni deploy YAML; validated first (:func:`load_stage_config`).
        stage_init_timeout: seconds a stage may take to start.
        engine_args: further keyword arguments for ``vllm_omni.Omni`` (its engine arguments),
            e.g. vLLM-Omni's distributed mode on one host: ``{"single_stage_mode": True,
            "omni_master_address": "127.0.0.1", "omni_master_port": 29555,
            "omni_lb_policy": "round-robin"}``.

    Raises:
        omni_cache.driver.stage_config.StageConfigError: invalid stage config or model directory.
    """

    def __init__(self, model_dir: str | os.PathLike, stage_config: str | os.PathLike, *, stage_init_timeout: int = 900,
                 engine_args: Mapping[str, Any] | None = None):
        self.stage_config = load_stage_config(stage_config, model_dir=model_dir)
        self.model_dir = Path(model_dir)
        from vllm_omni import Omni

        from omni_cache.engine.plugin import register

        # vLLM-Omni resolves ``pipeline:`` in this (driver) process before it loads general
        # plugins, so omni-cache's pipeline variants are registered here first.
        register()

        from omni_cache.driver.engine_hooks import prepare_environment

        prepare_environment()
        t0 = time.perf_counter()
        with engine_start_environment(self.stage_config):
            self.omni = Omni(
                model=str(self.model_dir),
                deploy_config=str(self.stage_config.path),
                stage_init_timeout=stage_init_timeout,
                init_timeout=stage_init_timeout + 300,
                **{**start_kwargs(), **dict(engine_args or {})},
            )
        self.start_s = time.perf_counter() - t0
        logger.info("pipeline started in %.1f s", self.start_s)
        from omni_cache.driver.engine_hooks import install_engine_hooks

        #: omni-cache's hooks on the engine (thinker router, talker identity)
        self.hooks = install_engine_hooks(self.omni, self.stage_config)
        self.router = self.hooks.router

    def generate(self, requests: Sequence[OmniRequest | dict], sampling_params_list: Sequence | None = None
                 ) -> list[RequestResult]:
        """Run ``requests`` as one batch through all stages. A ``dict`` is passed to
        vLLM-Omni as is (e.g. ``{"prompt_token_ids": [...]}``). ``sampling_params_list``:
        one sampling-params object per stage (default: the stage config's
        ``default_sampling_params``; see :meth:`default_sampling_params`).

        Returns:
            One :class:`RequestResult` per request, in input order. With a streaming stage
            config (``async_chunk: true``) vLLM-Omni's synchronous engine returns only the
            last audio packet as a request's audio; use
            :class:`~omni_cache.driver.streaming.StreamingPipeline` for the whole waveform and
            the time to the first packet.
        """
        prompts = [r.to_engine_prompt() if isinstance(r, OmniRequest) else r for r in requests]
        t0 = time.perf_counter()
        outs = self.omni.generate(prompts, sampling_params_list, use_tqdm=False)
        wall = time.perf_counter() - t0
        by_id: dict[str, RequestResult] = {}
        for o in outs:
            rid = str(o.request_id)
            res = by_id.get(rid)
            if res is None:
                res = by_id[rid] = RequestResult(request_id=rid, wall_s=wall)
            if o.error:
                res.error = o.error
            res.stage_durations.update(o.stage_durations or {})
            if o.final_output_type == "text" or o.stage_id == 0:
                comp = o.outputs[0] if o.outputs else None
                if comp is not None:
                    res.text = comp.text or ""
                    res.token_ids = list(comp.token_ids or [])
                res.prompt_token_ids = list(o.prompt_token_ids or [])
                res.num_prompt_tokens = len(res.prompt_token_ids)
                res.num_cached_tokens = int(o.num_cached_tokens or 0)
                if getattr(o, "prompt_logprobs", None) is not None:
                    res.prompt_logprobs = o.prompt_logprobs
            if o.final_output_type == "audio":
                res.audio, res.sample_rate = _audio_of(o)
        # vLLM-Omni names the i-th prompt of a batch "{i}_{uuid}".
        results = sorted(by_id.values(), key=lambda r: _batch_index(r.request_id))
        for res in results:
            res.talker_num_cached_tokens, res.talker_num_prompt_tokens = self.hooks.talker_hit(res.request_id)
        for req, res in zip(requests, results):
            if isinstance(req, OmniRequest):
                req.request_id = res.request_id
        return results

    def default_sampling_params(self) -> list:
        """Copies of the per-stage default sampling params (to adjust and pass to
        :meth:`generate`)."""
        import copy

        return [copy.deepcopy(sp) for sp in self.omni.resolve_sampling_params_list(None)]

    def close(self) -> None:
        """Stop all stage processes (in vLLM-Omni's distributed mode too:
        :func:`omni_cache.driver.distributed_stop.release_membership_watcher`)."""
        omni, self.omni = getattr(self, "omni", None), None
        if omni is not None:
            from omni_cache.driver.distributed_stop import release_membership_watcher

            release_membership_watcher(omni)
            omni.close() if hasattr(omni, "close") else omni.shutdown()

    def __enter__(self) -> OmniPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _batch_index(request_id: str) -> int:
    head = request_id.split("_", 1)[0]
    return int(head) if head.isdigit() else 1 << 30
