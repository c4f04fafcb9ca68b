"""No hand-off to a stage a request never reaches: the shared-memory segment leak of text-only
answers, closed at the sending scheduler.

What leaked (vLLM-Omni 0.30, ``async_chunk: true``, the bundled CPU config; issue 45): a chat
request with ``modalities=["text"]`` ends at stage 0 (the orchestrator tags it
``omni_final_stage_id: 0`` in ``additional_information``,
``vllm_omni/engine/async_engine_utils.py`` ``apply_omni_final_stage_metadata``). The thinker's
runner then builds no payload for it, but ``OmniARScheduler.update_from_output``
(``vllm_omni/core/sched/omni_ar_scheduler.py``) still calls
``chunk_transfer_adapter.save_async`` when the request finishes, and the adapter's save thread
(``OmniChunkTransferAdapter._send_single_request_for_generation``,
``distributed/omni_connectors/transfer_adapter/chunk_transfer_adapter.py``) puts an empty
"finished" marker through ``SharedMemoryConnector.put``
(``distributed/omni_connectors/connectors/shm_connector.py``): a POSIX segment
``/dev/shm/<request id>_0_0`` plus an empty ``/dev/shm/shm_<request id>_0_0_lockfile.lock``.
Only the receiving stage unlinks a segment (when it reads it), and stage 1 never sees the
request; the sender's ``cleanup`` keeps a successfully sent terminal chunk on purpose ("must
remain readable by downstream"). So every text-only request left one segment until the server
exited (then Python's ``resource_tracker`` unlinked it, warning of "leaked shared_memory
objects") and one lock file for good.

:class:`FinalStageHandOffMixin` (put before vLLM-Omni's scheduler class in the bases) hands the
stage's ``chunk_transfer_adapter`` a ``save_async`` that drops the chunks of a request whose
``omni_final_stage_id`` is this stage or earlier — nothing downstream waits for them — and
passes every other call through unchanged. The wrapper lives on the adapter *instance* the
scheduler built; no vLLM-Omni file or class is changed. A ``save_async`` whose signature
moved is an error at start-up (:func:`check_save_async`), not a silent leak.

Not covered here: a stage that is *not* omni-cache's scheduler (vLLM-Omni's stock pipelines:
the same leak, upstream in the places named above), and chunks a receiving stage stops reading
(a request aborted after its sender finished): ``omni-cache serve`` unlinks those when the
request ends (``omni_cache/driver/shm_sweeper.py``); ``tests/lanes/soak.py`` measures what is left
(docs/serving.md, "Shared memory and the soak").
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)

#: request ids whose drop-or-send decision is remembered (oldest forgotten first)
VERDICTS_KEPT = 4096

#: ``OmniChunkTransferAdapter.save_async``'s leading parameters this wrapper relies on.
SAVE_ASYNC_PARAMS = ("multimodal_output", "request")


class SeamMoved(RuntimeError):
    """vLLM-Omni's chunk adapter no longer has the ``save_async`` this module wraps."""


def check_save_async(save_async: Any) -> None:
    """Raise :class:`SeamMoved` unless ``save_async``'s first parameters (after ``self``, for
    the class's function) are :data:`SAVE_ASYNC_PARAMS`."""
    try:
        params = tuple(p for p in inspect.signature(save_async).parameters if p != "self")[:len(SAVE_ASYNC_PARAMS)]
    except (TypeError, ValueError) as exc:
        raise SeamMoved(f"chunk_transfer_adapter.save_async has no signature: {exc}") from exc
    if params != SAVE_ASYNC_PARAMS:
        raise SeamMoved(f"chunk_transfer_adapter.save_async takes {params}, expected {SAVE_ASYNC_PARAMS} "
                        "(vLLM-Omni's chunk adapter moved: omni_cache/engine/shm_hygiene.py)")


def request_final_stage(request: Any) -> int | None:
    """The ``omni_final_stage_id`` vLLM-Omni's orchestrator put in a request's
    ``additional_information`` (the last stage whose output the client asked for), or None
    when the request carries none (then its chunks are always sent)."""
    payload = getattr(request, "additional_information", None)
    if payload is None:
        return None
    from vllm_omni.engine.serialization import deserialize_additional_information

    try:
        value = deserialize_additional_information(payload).get("omni_final_stage_id")
        return None if value is None else int(value)
    except (TypeError, ValueError, AttributeError):
        return None


def drop_handoffs_past_final_stage(adapter: Any, stage_id: int) -> None:
    """Wrap ``adapter.save_async`` (on the instance) so that a request whose final stage is
    ``stage_id`` or earlier sends nothing downstream; every other call is passed through.
    The decision is cached per request id (``additional_information`` is fixed for a
    request), for the :data:`VERDICTS_KEPT` latest ids.

    Raises:
        SeamMoved: ``save_async``'s signature is not the one this relies on.
    """
    save_async = adapter.save_async
    check_save_async(save_async)
    verdicts: OrderedDict[str, bool] = OrderedDict()

    @functools.wraps(save_async)
    def save_unless_final(multimodal_output=None, request=None, *args, **kwargs):
        rid = getattr(request, "request_id", None)
        drop = verdicts.get(rid) if rid is not None else None
        if drop is None:
            final = request_final_stage(request)
            drop = final is not None and final <= stage_id
            if rid is not None:
                verdicts[rid] = drop
                while len(verdicts) > VERDICTS_KEPT:
                    verdicts.popitem(last=False)
        if drop:
            return None
        return save_async(multimodal_output, request, *args, **kwargs)

    adapter.save_async = save_unless_final
    adapter.omni_cache_drops_final_stage_handoffs = True


class FinalStageHandOffMixin:
    """Put before vLLM-Omni's AR scheduler class in the bases: its chunk adapter (when the
    stage streams, ``async_chunk: true``) sends nothing for requests that end at this stage
    (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        adapter = getattr(self, "chunk_transfer_adapter", None)
        if adapter is not None:
            stage_id = int(getattr(self.vllm_config.model_config, "stage_id", 0) or 0)
            drop_handoffs_past_final_stage(adapter, stage_id)
