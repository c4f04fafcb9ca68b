"""Qwen3-Omni with a per-request random stream for the talker's residual codebooks.

The talker stage samples two things per codec frame: the layer-0 code (vLLM's sampler; a
request whose sampling params carry ``seed`` gets its own ``torch.Generator`` there) and
the residual codebooks 1..G-1 (the code predictor's Gumbel-max sampling). vLLM-Omni 0.30's
runner already makes one generator per request for the second part — from
``sampling_params.extra_args["tts_local_seed"]`` (``OmniGPUModelRunner._talker_mtp_forward``,
``vllm_omni/worker/gpu_model_runner.py``) — and passes it to the model's
``talker_mtp(..., generator=...)`` (one request) or ``generators=[...]`` (one per row, if the
model sets ``talker_mtp_accepts_per_row_generators``); the shared code predictor samples with
per-row generators (``CodePredictorWrapper.forward``,
``vllm_omni/model_executor/models/common/qwen3_code_predictor.py``, as Qwen3-TTS uses it).
But Qwen3-Omni's ``talker_mtp`` (``models/qwen3_omni/qwen3_omni.py``) takes them as
``**kwargs`` and drops them, and ``code_predictor_forward``
(``qwen3_omni_moe_talker.py``) calls the predictor without one: every request's residual
codebooks come from the talker process's global torch RNG, so a request's audio depends on
which requests ran before it and beside it.

:class:`OmniCacheQwen3OmniMoeForConditionalGeneration` is vLLM-Omni's
``Qwen3OmniMoeForConditionalGeneration`` (weights, forward, hand-offs unchanged) whose
``talker_mtp`` hands the runner's generator(s) to the code predictor for that call, and
which accepts one generator per row (so a batch of seeded requests stays one batched call).
omni-cache's pipelines run it as the talker (stage 1, architecture name
:data:`TALKER_ARCH`, registered by :func:`omni_cache.engine.plugin.register_models`); with
``extra_args: {tts_local_seed: N}`` in the talker's ``default_sampling_params`` (omni-cache's
CPU stage configs set it) each request's talker sampling is a function of its own inputs
and seeds alone. Requests without ``tts_local_seed`` sample as before (global RNG).

Limits (docs/architecture.md, "What is bitwise under concurrency"): a batch's logits are not
bitwise a lone request's on the CPU kernels (not batch-invariant), so a near-tie can still
sample differently under concurrency; and where the runner replays the talker's whole-MTP
CUDA graph (GPU, full CUDA graphs), the graph was captured without a generator and the
global RNG is used — the GPU stage config therefore does not set ``tts_local_seed``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni import Qwen3OmniMoeForConditionalGeneration

from omni_cache.engine.plugin import TALKER_ARCH  # noqa: F401  (the architecture name of this class)


def predictor_sampling_kwargs(generator: torch.Generator | None,
                              generators: Sequence[torch.Generator | None] | None,
                              num_rows: int) -> dict[str, Any]:
    """The code predictor's sampling keyword arguments for one ``talker_mtp`` call.

    Args:
        generator: the runner's generator for a one-request call, or ``None``.
        generators: the runner's per-row generators (``None`` entries: that row samples
            from the global RNG), or ``None``.
        num_rows: rows of the call's inputs (``input_ids.shape[0]``); a graph-padded call
            has more rows than requests — padded rows get ``None``.

    Returns:
        ``{}`` (no generator: the predictor's default, the global RNG),
        ``{"generator": g}`` or ``{"generators": [g_0, ..., g_{num_rows-1}]}``.

    Raises:
        ValueError: more generators than rows.
    """
    if generators is not None:
        rows = list(generators)
        if len(rows) > num_rows:
            raise ValueError(f"talker_mtp got {len(rows)} generators for {num_rows} rows")
        if not any(g is not None for g in rows):
            return {}
        return {"generators": rows + [None] * (num_rows - len(rows))}
    if generator is not None:
        if num_rows == 1:
            return {"generator": generator}
        return {"generators": [generator] + [None] * (num_rows - 1)}
    return {}


@contextlib.contextmanager
def _predictor_sampling(predictor: torch.nn.Module, kwargs: dict[str, Any]) -> Iterator[None]:
    """Bind sampling ``kwargs`` to ``predictor``'s forward for the ``with`` block (an
    instance attribute shadowing the class's ``forward``; removed on exit)."""
    if not kwargs:
        yield
        return
    predictor.forward = functools.partial(type(predictor).forward, predictor, **kwargs)
    try:
        yield
    finally:
        del predictor.forward


class OmniCacheQwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeForConditionalGeneration):
    """Qwen3-Omni whose talker samples residual codebooks from the runner's per-request
    generators (see the module docstring). Only ``talker_mtp`` differs."""

    #: the runner may pass one generator per row of a batched ``talker_mtp`` call
    talker_mtp_accepts_per_row_generators = True

    def talker_mtp(self, input_ids: torch.Tensor, input_embeds: torch.Tensor,
                   last_talker_hidden: torch.Tensor, text_step: torch.Tensor, *,
                   generator: torch.Generator | None = None,
                   generators: Sequence[torch.Generator | None] | None = None,
                   **kwargs: Any):
        """vLLM-Omni's ``talker_mtp`` (shapes: ``input_ids [num_rows]`` layer-0 codes,
        ``input_embeds``/``last_talker_hidden``/``text_step`` ``[num_rows, hidden_size]``;
        returns ``(inputs_embeds [num_rows, hidden_size], codes [num_rows,
        num_code_groups])``), with ``generator``/``generators`` applied to the residual
        codebooks' sampling."""
        sampling = predictor_sampling_kwargs(generator, generators, int(input_ids.shape[0]))
        with _predictor_sampling(self.talker.code_predictor, sampling):
            return super().talker_mtp(input_ids, input_embeds, last_talker_hidden, text_step, **kwargs)
