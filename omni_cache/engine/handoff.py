"""Stage hand-off recording: what the thinker hands the talker, for equality tests and audits.

Two drop-in hand-off functions for a Qwen3-Omni thinker stage (the recording pipeline
``qwen3_omni_moe_omni_cache_recorded`` sets both), each saving CPU copies of what it hands
over to ``$OMNI_CACHE_HANDOFF_DUMP/<seq>-<request_id>.pt`` (``seq``: hand-off order in the stage
process; ``torch.save``) before delegating to vLLM-Omni's own function:

- :func:`record_thinker2talker_full_payload` (``async_chunk: false``): every tensor of the
  thinker's per-request pooling output — ``hidden`` (final layer) and the captured layers
  ``hidden_states.layer_N`` — as the talker's whole-prompt payload is built from it.
- :func:`record_thinker2talker_async_chunk` (``async_chunk: true``): every streamed chunk the
  talker receives — the first hand-off (``embed.prefill`` ``[prompt + 1, hidden]``,
  ``hidden_states.output``, ``embed.tts_*``, ``ids.*``) and each decode chunk
  (``embed.decode`` ``[1, hidden]``) — one file per chunk sent, ``None`` chunks (rows still
  accumulating) are not sent and not recorded.

and two for the talker stage (the same pipeline sets them on stage 1; its own
``OMNI_CACHE_HANDOFF_DUMP``): :func:`record_talker2code2wav_full_payload` and
:func:`record_talker2code2wav_async_chunk` — the codec codes code2wav receives.
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


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts → ``{"a.b": leaf}``; lists of ints become int64 tensors; bools and ints
    0-d tensors."""
    out: dict[str, Any] = {}
    for k, v in (obj or {}).items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        elif isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            out[name] = torch.tensor(v, dtype=torch.int64)
        elif isinstance(v, (bool, int)):
            out[name] = torch.tensor(v)
        else:
            out[name] = v
    return out


def thinker2talker_async_chunk(transfer_manager: Any, multimodal_output: Any, request: Any,
                               is_finished: bool = False):
    """vLLM-Omni's ``thinker2talker_async_chunk`` (the streaming thinker → talker hand-off), with
    a resumed request's decode row kept.

    After a request's first chunk (its prompt rows) went to the talker, every chunk is one
    decode token's row ``[1, hidden]``. A request preempted after that recomputes its prompt
    and answer so far when it resumes (from position 0, or after its re-hit prefix), so its
    first step after the resume carries many rows, and vLLM-Omni's function drops that chunk
    ("Unexpected multiple embeddings", ``stage_input_processors/qwen3_omni.py``): the talker
    never gets the embedding of the token fed in that step. Found by the stress test
    (``tests/pipeline/test_stress.py``: one decode row missing per preempted request, cache
    on or off). Here such a step hands on its last row only — the row of the token fed in this
    step, which is what an unpreempted decode step sends (the layers are computed for that
    position from the same prefix). Other chunks pass through unchanged.

    Args / returns: as vLLM-Omni's function (``multimodal_output``: the step's per-request
    outputs, ``hidden_states.layers`` tensors ``[num_rows, hidden]``).
    """
    from vllm_omni.model_executor.stage_input_processors import qwen3_omni

    chunks_sent = (getattr(transfer_manager, "put_req_chunk", None) or {}).get(request.external_req_id, 0)
    if chunks_sent > 0 and not getattr(request, "resumable", False):
        multimodal_output = _last_row_only(multimodal_output)
    _restart_stash_after_preemption(transfer_manager, multimodal_output, request, chunks_sent)
    return qwen3_omni.thinker2talker_async_chunk(transfer_manager, multimodal_output, request, is_finished)


#: ``transfer_manager`` attribute: external request id -> ``num_preemptions`` of its last prompt-stash step
_PREEMPTIONS_ATTR = "_omni_cache_stash_preemptions"
#: requests remembered there before their first chunk (a request aborted before it never comes
#: back to pop its entry: the oldest are forgotten past this many)
_MAX_STASHED_REQUESTS = 4096


def _restart_stash_after_preemption(transfer_manager: Any, multimodal_output: Any, request: Any,
                                    chunks_sent: int) -> None:
    """Before a request's first chunk, vLLM-Omni's function stashes its prompt rows step by step
    in ``transfer_manager.request_payload`` and never resets them on preemption. A request
    preempted before its first chunk yields rows ``[0, end)`` again in its first step after the
    resume (its re-hit prefix served from the cache, or recomputed), so the stash of the steps
    before the preemption must go, or the talker gets those rows twice (the stress test, CPU,
    2026-11-27: 1,141 rows for a 570-token prompt — rows [0, 570) twice plus one). The runner's
    own drop at the resume (``OmniCacheRunnerMixin._drop_stashed_prompt_rows``) races with this
    function, which runs one step later on the connector's save thread; here, in the save
    thread's order, a step whose request was preempted since the stash's last step empties the
    stash to zero rows (kept, not popped: vLLM-Omni then concatenates this step's rows to nothing
    and sends them at once when they already reach past the prompt — a request resumed after its
    first sampled token — instead of stashing them as a first prefill). A request's preemptions
    are read from the request snapshot each save carries (vLLM's ``Request.num_preemptions``)."""
    seen = getattr(transfer_manager, _PREEMPTIONS_ATTR, None)
    if seen is None:  # kept on the connector's manager itself, not on a per-call view of it (Gemma's)
        seen = {}
        setattr(getattr(transfer_manager, "unwrapped", transfer_manager), _PREEMPTIONS_ATTR, seen)
    ext = request.external_req_id
    if chunks_sent > 0:
        seen.pop(ext, None)
        return
    preemptions = int(getattr(request, "num_preemptions", 0) or 0)
    before = seen.pop(ext, None)
    seen[ext] = preemptions  # (re)inserted last: the oldest entries are first
    while len(seen) > _MAX_STASHED_REQUESTS:
        seen.pop(next(iter(seen)))
    if before is None or preemptions <= before:
        return
    payloads = getattr(transfer_manager, "request_payload", None)
    stash = payloads.get(ext) if isinstance(payloads, dict) else None
    if stash is not None:
        for outer, inner in (("embed", "prefill"), ("hidden_states", "output")):
            t = (stash.get(outer) or {}).get(inner)
            if isinstance(t, torch.Tensor):
                stash[outer][inner] = t[:0]
        return
    rows = _step_layers(multimodal_output)  # the runner's drop won the race: a stash of zero rows
    if rows is not None and isinstance(payloads, dict):
        empty = rows[:0].detach().cpu()  # vLLM-Omni's stash is on the host
        payloads[ext] = {"embed": {"prefill": empty}, "hidden_states": {"output": empty.clone()}}


def _step_layers(multimodal_output: Any) -> torch.Tensor | None:
    """One of the step's per-token layer tensors (``hidden_states.layers``), or None."""
    hs = multimodal_output.get("hidden_states") if isinstance(multimodal_output, dict) else None
    layers = hs.get("layers") if isinstance(hs, dict) else None
    if not isinstance(layers, dict):
        return None
    return next((v for v in layers.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)


def _last_row_only(multimodal_output: Any) -> Any:
    """``multimodal_output`` with each per-token layer tensor (``hidden_states.layers``) cut
    to its last row; the input is not modified."""
    if not isinstance(multimodal_output, dict):
        return multimodal_output
    hs = multimodal_output.get("hidden_states")
    layers = hs.get("layers") if isinstance(hs, dict) else None
    if not isinstance(layers, dict):
        return multimodal_output
    cut = {k: (v[-1:] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] > 1 else v)
           for k, v in layers.items()}
    return {**multimodal_output, "hidden_states": {**hs, "layers": cut}}


def record_thinker2talker_async_chunk(transfer_manager: Any, multimodal_output: Any, request: Any,
                                      is_finished: bool = False):
    """:func:`thinker2talker_async_chunk`, recording every chunk it sends (see the module
    docstring). Returns its payload unchanged."""
    from vllm_omni.data_entry_keys import to_dict

    payload = thinker2talker_async_chunk(transfer_manager, multimodal_output, request, is_finished)
    if payload is not None:
        record_payload(_flatten(to_dict(payload)), request)
    return payload


def record_thinker2talker_full_payload(transfer_manager: Any, pooling_output: dict, request: Any):
    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import thinker2talker_full_payload

    record_payload(pooling_output, request)
    return thinker2talker_full_payload(transfer_manager, pooling_output, request)


# ---- talker → code2wav (the codec frames): recorded into $OMNI_CACHE_HANDOFF_DUMP of the talker stage ----


def record_talker2code2wav_full_payload(transfer_manager: Any, pooling_output: dict, request: Any):
    """vLLM-Omni's ``talker2code2wav_full_payload``, recording the codec codes it sends
    (``codes.audio``, int64 ``[num_code_groups * num_frames]``). Returns its payload."""
    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import talker2code2wav_full_payload

    payload = talker2code2wav_full_payload(transfer_manager, pooling_output, request)
    if payload is not None:
        record_payload(_flatten(payload), request)
    return payload


def record_talker2code2wav_async_chunk(transfer_manager: Any, multimodal_output: Any, request: Any,
                                       is_finished: bool = False):
    """vLLM-Omni's ``talker2code2wav_async_chunk``, recording every codec chunk it sends
    (``codes.audio``, ``meta.left_context_size``). Returns its payload unchanged."""
    from vllm_omni.data_entry_keys import to_dict
    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import talker2code2wav_async_chunk

    payload = talker2code2wav_async_chunk(transfer_manager, multimodal_output, request, is_finished)
    log_talker_call(multimodal_output, request, is_finished, payload is not None)
    if payload is not None:
        record_payload(_flatten(to_dict(payload)), request)
    return payload


def log_talker_call(multimodal_output: Any, request: Any, is_finished: bool, sent: bool) -> None:
    """With ``OMNI_CACHE_HANDOFF_DUMP`` set, append one JSON line per talker hand-off call to
    ``<dir>/calls.jsonl``: the request, ``is_finished``, whether a codec chunk was sent, and
    what the step's ``codes.audio`` was (device, shape, dtype, whether any code is non-zero,
    the first codebook) — the evidence for "why did no audio arrive" (docs/gpu.md)."""
    import json

    out_dir = settings.HANDOFF_DUMP.get()
    if not out_dir:
        return
    codes = None
    if isinstance(multimodal_output, dict):
        c = multimodal_output.get("codes")
        codes = c.get("audio") if isinstance(c, dict) else None
    info: dict[str, Any] = {"request": str(getattr(request, "external_req_id", "?")), "is_finished": bool(is_finished),
                            "sent": sent, "keys": sorted(multimodal_output) if isinstance(multimodal_output, dict)
                            else type(multimodal_output).__name__}
    if isinstance(codes, torch.Tensor):
        info.update(device=str(codes.device), shape=list(codes.shape), dtype=str(codes.dtype),
                    any=bool(codes.any()) if codes.numel() else False,
                    first=int(codes.flatten()[0]) if codes.numel() else None)
    else:
        info["codes"] = type(codes).__name__
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(out_dir) / "calls.jsonl", "a") as f:
        f.write(json.dumps(info) + "\n")
