"""Streamed requests through vLLM-Omni's async engine (``AsyncOmni``, the one its server uses):
the time to the first text token (TTFT) and to the first audio packet (TTFP), and the waveform
written as its packets arrive.

Why not :class:`~omni_cache.driver.pipeline.OmniPipeline`: vLLM-Omni's synchronous ``Omni``
forces its LLM stages to final-only output and hands code2wav's audio over once, at the end —
measured on the tiny model with the streaming CPU config: one audio output of 43,605 samples at
4.6 s, where ``AsyncOmni`` delivered a first packet of 7,125 samples (the initial 4 codec
frames) at 2.2 s and the rest (43,605 samples) at 6.7 s. So TTFP can only be seen through
``AsyncOmni``. Each audio output of ``AsyncOmni`` is one packet, as vLLM-Omni's own chat and
speech servers stream them (``serving_speech.py`` treats a tensor output as a new chunk unless
a model keeps cumulative audio); the waveform is their concatenation. (The synchronous
``Omni`` path with ``async_chunk: true`` returns only the last packet as the request's audio.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_cache.driver.inputs import OmniRequest
from omni_cache.driver.pipeline import RequestResult, _audio_of, engine_start_environment
from omni_cache.driver.stage_config import load_stage_config

logger = logging.getLogger(__name__)


@dataclass
class StreamedResult(RequestResult):
    """A :class:`RequestResult` with the streaming times.

    Attributes:
        ttft_s: request sent → first thinker token arrived (seconds; None if none did).
        ttfp_s: request sent → first audio packet arrived (seconds; None without audio).
        audio_packets: audio packets received.
    """

    ttft_s: float | None = None
    ttfp_s: float | None = None
    audio_packets: int = 0


def _thinker_outputs_are_deltas(sampling_params_list: Sequence | None) -> bool:
    """Whether ``AsyncOmni`` will stream the thinker's outputs as deltas (new tokens only) for
    a request sent with ``sampling_params_list``: given none, it coerces the stage defaults to
    ``RequestOutputKind.DELTA`` (``coerce_param_message_types``); given a list, the thinker's
    ``output_kind`` stands (vLLM's default: cumulative)."""
    from vllm.sampling_params import RequestOutputKind

    if sampling_params_list is None:
        return True
    return getattr(sampling_params_list[0], "output_kind", None) == RequestOutputKind.DELTA


class StreamingPipeline:
    """vLLM-Omni's async multi-stage pipeline, started from a stage config; requests are run
    one at a time with :meth:`run`.

    Args:
        model_dir: a model directory.
        stage_config: vLLM-Omni deploy YAML; validated first.
        stage_init_timeout: seconds a stage may take to start.
        engine_args: further keyword arguments for vLLM-Omni's ``AsyncOmni`` (its engine
            arguments, e.g. ``{"log_stats": True}`` for vLLM's per-request histograms), over
            :func:`~omni_cache.driver.pipeline.start_kwargs`.

    Raises:
        omni_cache.driver.stage_config.StageConfigError: invalid stage config or model directory.
    """

    def __init__(self, model_dir: str | os.PathLike, stage_config: str | os.PathLike, *,
                 stage_init_timeout: int = 900, engine_args: Mapping[str, Any] | None = None):
        from omni_cache.engine.plugin import register

        self.stage_config = load_stage_config(stage_config, model_dir=model_dir)
        self.model_dir = Path(model_dir)
        register()  # vLLM-Omni resolves ``pipeline:`` in this process (see OmniPipeline)
        from omni_cache.driver.engine_hooks import prepare_environment

        prepare_environment()
        self._loop = asyncio.new_event_loop()
        t0 = time.perf_counter()
        with engine_start_environment(self.stage_config):
            self.omni = self._loop.run_until_complete(self._start(stage_init_timeout, dict(engine_args or {})))
        self.start_s = time.perf_counter() - t0
        self._seq = 0
        #: request ids sent and not yet finished (aborted first when the pipeline closes)
        self._in_flight: set[str] = set()
        from omni_cache.driver.engine_hooks import install_engine_hooks

        #: omni-cache's hooks on the engine (thinker router, talker identity)
        self.hooks = install_engine_hooks(self.omni, self.stage_config)
        #: omni-cache's thinker router (``OMNI_CACHE_ROUTING: prefix``, > 1 thinker replica), else None
        self.router = self.hooks.router
        from omni_cache.driver.shm_sweeper import install_shm_sweeper

        #: unlinks each ended request's shared-memory hand-offs and their lock files
        #: (:mod:`omni_cache.driver.shm_sweeper`), as ``omni-cache serve`` does: a chunk no stage
        #: reads stays in ``/dev/shm`` (its segment until exit, its empty lock file for good)
        self.shm_sweeper = install_shm_sweeper(self.omni)

    async def _start(self, stage_init_timeout: int, engine_args: dict[str, Any]):
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        from omni_cache.driver.pipeline import start_kwargs

        return AsyncOmni(model=str(self.model_dir), deploy_config=str(self.stage_config.path),
                         stage_init_timeout=stage_init_timeout, init_timeout=stage_init_timeout + 300,
                         **{**start_kwargs(), **engine_args})

    def run(self, request: OmniRequest | dict, on_audio: Callable[[np.ndarray, int], None] | None = None,
            sampling_params_list: Sequence | None = None) -> StreamedResult:
        """Send one request and wait for it; ``on_audio(packet, sample_rate)`` is called with
        each new audio packet (float32 ``[num_samples]``) as it arrives. A ``dict`` is passed
        to vLLM-Omni as is (e.g. ``{"prompt_token_ids": [...]}``). ``sampling_params_list``:
        one sampling-params object per stage (default: the stage config's
        ``default_sampling_params``; see :meth:`default_sampling_params`)."""
        return self.run_many([request], on_audio, sampling_params_list)[0]

    def run_many(self, requests: Sequence[OmniRequest | dict],
                 on_audio: Callable[[np.ndarray, int], None] | None = None,
                 sampling_params_list: Sequence | None = None) -> list[StreamedResult]:
        """Send ``requests`` together (in flight at once, as a server would see them) and wait
        for all; results in input order. Arguments as for :meth:`run`."""
        ids = []
        for _ in requests:
            self._seq += 1
            ids.append(f"run-{self._seq}")

        async def all_of():
            return await asyncio.gather(*(self._run(r, rid, on_audio, sampling_params_list)
                                          for r, rid in zip(requests, ids)))

        return list(self.run_async(all_of()))

    def run_async(self, coro: Any) -> Any:
        """Run ``coro`` — a coroutine that may drive :attr:`omni` (vLLM-Omni's ``AsyncOmni``)
        itself, e.g. to abort requests — on this pipeline's event loop; return its result."""
        return self._loop.run_until_complete(coro)

    def default_sampling_params(self) -> list:
        """Copies of the per-stage default sampling params (to adjust and pass to :meth:`run`)."""
        import copy

        # what generate() uses when given no list (AsyncOmni coerces the defaults for streaming)
        return [copy.deepcopy(sp) for sp in self.omni.resolve_sampling_params_list(None, allow_delta_coercion=True)]

    async def _run(self, request: OmniRequest | dict, request_id: str, on_audio,
                   sampling_params_list: Sequence | None = None) -> StreamedResult:
        res = StreamedResult(request_id=request_id)
        t0 = time.perf_counter()
        prompt = request.to_engine_prompt() if isinstance(request, OmniRequest) else request
        kw = {} if sampling_params_list is None else {"sampling_params_list": list(sampling_params_list)}
        delta = _thinker_outputs_are_deltas(sampling_params_list)
        self._in_flight.add(request_id)
        try:
            await self._stream(request_id, prompt, kw, delta, t0, res, on_audio)
        finally:
            self._in_flight.discard(request_id)
        res.wall_s = time.perf_counter() - t0
        res.talker_num_cached_tokens, res.talker_num_prompt_tokens = self.hooks.talker_hit(request_id)
        return res

    async def _stream(self, request_id: str, prompt: Any, kw: dict, delta: bool, t0: float,
                      res: StreamedResult, on_audio) -> None:
        audio = np.zeros(0, dtype=np.float32)
        async for o in self.omni.generate(prompt, request_id=request_id, **kw):
            now = time.perf_counter() - t0
            if o.error:
                res.error = str(o.error)
            res.stage_durations.update(o.stage_durations or {})
            if o.stage_id == 0:
                comp = o.outputs[0] if o.outputs else None
                if comp is not None and comp.token_ids:
                    if res.ttft_s is None:
                        res.ttft_s = now
                    if delta:  # each output carries the new tokens only
                        res.token_ids += list(comp.token_ids)
                        res.text += comp.text or ""
                    else:
                        res.token_ids, res.text = list(comp.token_ids), comp.text or ""
                res.prompt_token_ids = list(o.prompt_token_ids or []) or res.prompt_token_ids
                res.num_prompt_tokens = len(res.prompt_token_ids) or res.num_prompt_tokens
                res.num_cached_tokens = max(res.num_cached_tokens, int(o.num_cached_tokens or 0))
            if o.final_output_type == "audio":
                packet, res.sample_rate = _audio_of(o)
                if packet is None or packet.shape[0] == 0:
                    continue
                audio = np.concatenate([audio, packet])
                res.audio_packets += 1
                if res.ttfp_s is None:
                    res.ttfp_s = now
                if on_audio is not None:
                    on_audio(packet, res.sample_rate)
        res.audio = audio if audio.shape[0] else None

    def close(self) -> None:
        """Stop all stage processes, then let the engine's background tasks on this pipeline's
        event loop finish their cancellation before the loop closes (``AsyncOmni.shutdown``
        cancels its output-handler task without awaiting it; closing the loop then would
        destroy the pending task, and asyncio logs "Task was destroyed but it is pending!")."""
        omni, self.omni = getattr(self, "omni", None), None
        if omni is not None:
            self._abort_in_flight(omni)
            from omni_cache.driver.distributed_stop import release_membership_watcher

            release_membership_watcher(omni)  # distributed mode: else the stages stay up
            omni.shutdown()
        sweeper = getattr(self, "shm_sweeper", None)
        if sweeper is not None:  # the stages are gone: every ended request's entries can go now
            sweeper.sweep_due(now=math.inf)
        loop = getattr(self, "_loop", None)
        if loop is None or loop.is_closed():
            return
        tasks = asyncio.all_tasks(loop)
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def _abort_in_flight(self, omni: Any, timeout_s: float = 5.0) -> None:
        """Abort the requests still running (a stop during a request: SIGTERM, Ctrl-C) before
        the stages are stopped. vLLM-Omni stops the stages one after another, each within
        vLLM's 5 s grace (``vllm.v1.utils.shutdown``); a talker and code2wav still working on
        the request take the CPU from the stage being torn down — on a busy 2-core host the
        thinker then overran its grace and was force-killed (CI, 2026-11-28). Aborted, the
        later stages are idle by their next step. Errors and a ``timeout_s`` (seconds)
        overrun are logged, never raised: the stop goes on."""
        loop = getattr(self, "_loop", None)
        ids = sorted(getattr(self, "_in_flight", ()))
        if not ids or loop is None or loop.is_closed() or loop.is_running():
            return
        try:
            loop.run_until_complete(asyncio.wait_for(omni.abort(ids), timeout_s))
        except Exception as exc:  # noqa: BLE001 - a stop must go on
            logger.warning("aborting %d running request(s) before the stop failed: %r", len(ids), exc)

    def __enter__(self) -> StreamingPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
