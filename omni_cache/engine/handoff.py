"""Stage hand-off recording: what the thinker hands the talker, for equality tests and audits.

:func:`record_thinker2talker_full_payload` is a drop-in ``custom_process_next_stage_input_func``
for a Qwen3-Omni thinker stage (set it on stage 0 of a stage config). It saves every tensor of
the thinker's per-request pooling output — ``hidden`` (final layer) and the captured layers
``hidden_states.layer_N`` — to ``$OMNI_CACHE_HANDOFF_DUMP/<seq>-<request_id>.pt`` (``seq``:
hand-off order in the stage process) (CPU copies,
``torch.save``), then delegates to vLLM-Omni's own ``thinker2talker_full_payload``.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import torch

from omni_cache import settings

_SEQ = itertools.count()  # hand-off order in this stage process


def record_payload(pooling_output: Any, request: Any) -> None:
    """With ``OMNI_CACHE_HANDOFF_DUMP`` set, save every tensor of a stage's per-request
    pooling output (CPU copies) to ``<dir>/<seq>-<request_id>.pt``; otherwise do nothing."""
    out_dir = settings.HANDOFF_DUMP.get()
    if out_dir and isinstance(pooling_output, dict):
        raw = next((getattr(request, a) for a in ("request_id", "req_id", "external_req_id")
                    if isinstance(getattr(request, a, None), str)), "request")
        rid = f"{next(_SEQ):05d}-" + re.sub(r"[^A-Za-z0-9_.-]", "_", raw)
        tensors = {k: v.detach().to("cpu").clone() for k, v in pooling_output.items() if isinstance(v, torch.Tensor)}
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save(tensors, Path(out_dir) / f"{rid}.pt")


def record_thinker2talker_full_payload(transfer_manager: Any, pooling_output: dict, request: Any):
    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import thinker2talker_full_payload

    record_payload(pooling_output, request)
    return thinker2talker_full_payload(transfer_manager, pooling_output, request)
