"""CPU workers and model runners for vLLM-Omni's AR (thinker/talker) and generation
(code2wav) stages.

Runner MRO matters: the vLLM-Omni runner comes **before** vLLM's ``CPUModelRunner`` so its
``load_model`` / ``execute_model`` hooks run (``class X(GPUARModelRunner, CPUModelRunner)``);
``CPUModelRunner.__init__`` still wraps construction so no CUDA API is touched.

The AR runner class is chosen per stage by :func:`ar_runner_cls`
(``OMNI_CACHE_PREFIX_CACHE_BACKEND`` in the stage's ``env``), so the hidden-state cache can
take over vLLM-Omni's prefix-cache seam without touching vLLM-Omni's files.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

from omni_cache import settings
from omni_cache.engine.idle import IdleBackoff
from omni_cache.engine.runner import OmniCacheRunnerMixin

logger = init_logger(__name__)


class _CPURunnerFixups:
    """What vLLM-Omni's runners need on a CPU host: settings vLLM's CPU config leaves unset,
    and a back-off for steps that schedule nothing (:mod:`omni_cache.engine.idle`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM-Omni computes max(max_num_reqs, max_cudagraph_capture_size) for the talker
        # MTP; on CPU the latter is None (no CUDA graphs).
        if self.compilation_config.max_cudagraph_capture_size is None:
            self.compilation_config.max_cudagraph_capture_size = 0
        self._idle_backoff = IdleBackoff(settings.CPU_IDLE_BACKOFF_MS.get_int() / 1000)

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._idle_backoff.before_step(scheduler_output.total_num_scheduled_tokens)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def shutdown(self) -> None:
        """vLLM's runner teardown with the heap frozen first in a stage's own process
        (:func:`omni_cache.engine.plugin.freeze_gc_for_process_teardown`): every CPU stage,
        whatever its cache, so a stop on a busy CPU stays within vLLM's 5 s grace."""
        from omni_cache.engine.plugin import freeze_gc_for_process_teardown

        freeze_gc_for_process_teardown()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()


class CPUARModelRunner(_CPURunnerFixups, GPUARModelRunner, CPUModelRunner):
    """vLLM-Omni's AR runner (thinker / talker) on vLLM's CPU runner."""


class CPUGenerationModelRunner(_CPURunnerFixups, GPUGenerationModelRunner, CPUModelRunner):
    """vLLM-Omni's generation runner (code2wav) on vLLM's CPU runner."""


class OmniCacheCPUARModelRunner(OmniCacheRunnerMixin, CPUARModelRunner):
    """CPU AR runner with omni-cache as the stage's hidden-state prefix cache."""


def ar_runner_cls() -> type:
    """The CPU AR runner of this stage: omni-cache's, or vLLM-Omni's own with
    ``OMNI_CACHE_PREFIX_CACHE_BACKEND=builtin``.

    Raises:
        SettingError: the variable holds another value.
    """
    if settings.PREFIX_CACHE_BACKEND.get() == "builtin":
        return CPUARModelRunner
    return OmniCacheCPUARModelRunner


class _OmniCPUWorker(OmniWorkerMixin, CPUWorker):
    """Common part: build vLLM's CPU worker, then swap in an omni runner."""

    def _runner_cls(self) -> type:
        raise NotImplementedError

    def init_device(self) -> None:
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):
            raise NotImplementedError(
                "model_runner: v2 is not supported on the omni-cache CPU platform; use v1"
            )
        # CPUWorker.init_device built a plain CPUModelRunner; replace it.
        self.model_runner = self._runner_cls()(self.vllm_config, torch.device("cpu"))

    # vLLM-Omni calls these on every worker; there is no sleep mode on CPU.
    def handle_sleep_task(self, task):  # pragma: no cover - not used on CPU
        raise NotImplementedError("sleep mode is not supported on CPU")

    def handle_wake_task(self, task):  # pragma: no cover - not used on CPU
        raise NotImplementedError("sleep mode is not supported on CPU")


class CPUARWorker(_OmniCPUWorker):
    """Worker for AR stages (thinker, talker)."""

    # Read by vLLM-Omni's connector validation; the instance may get a subclass of it.
    model_runner_cls = CPUARModelRunner

    def _runner_cls(self) -> type:
        return ar_runner_cls()


class CPUGenerationWorker(_OmniCPUWorker):
    """Worker for generation stages (code2wav)."""

    model_runner_cls = CPUGenerationModelRunner

    def _runner_cls(self) -> type:
        return CPUGenerationModelRunner
