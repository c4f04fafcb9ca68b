"""The sending scheduler drops the hand-off of a request that ends at its stage
(:mod:`omni_cache.engine.shm_hygiene`): the text-only shared-memory leak of issue 45.

Engine-free: a stand-in adapter records what reaches ``save_async``; the requests'
``additional_information`` is serialized by vLLM-Omni's own ``serialize_additional_information``
and the seam is checked against the installed ``OmniChunkTransferAdapter``. The server-level
check (``/dev/shm`` flat, nothing left after exit) is the soak slice in ``tests/pipeline/test_serve.py``.
"""

from __future__ import annotations

import pytest
from vllm_omni.engine.serialization import serialize_additional_information

from omni_cache.engine.shm_hygiene import (
    SeamMoved,
    check_save_async,
    drop_handoffs_past_final_stage,
    request_final_stage,
)


class _Request:
    def __init__(self, rid: str, final_stage: int | None, finished: bool = False):
        self.request_id = rid
        self.resumable = False
        self._finished = finished
        info = {} if final_stage is None else {"omni_final_stage_id": final_stage}
        self.additional_information = serialize_additional_information(info) if info else None

    def is_finished(self) -> bool:
        return self._finished


class _Adapter:
    def __init__(self):
        self.sent: list[tuple[str, object, bool]] = []

    def save_async(self, multimodal_output=None, request=None, is_segment_finished=False, new_token_ids=None,
                   confirmed_num_computed_tokens=None, segment_generation=None, force_request_finished=False):
        self.sent.append((request.request_id, multimodal_output, is_segment_finished))


def test_the_installed_adapter_has_the_seam():
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    check_save_async(OmniChunkTransferAdapter.save_async)
    check_save_async(_Adapter().save_async)


def test_a_moved_seam_fails_at_start_up():
    class Moved:
        def save_async(self, request, multimodal_output=None):
            pass

    with pytest.raises(SeamMoved, match="moved"):
        drop_handoffs_past_final_stage(Moved(), 0)


def test_request_final_stage():
    assert request_final_stage(_Request("a", 0)) == 0
    assert request_final_stage(_Request("b", 2)) == 2
    assert request_final_stage(_Request("c", None)) is None
    assert request_final_stage(object()) is None


def test_text_only_requests_send_nothing_downstream_the_rest_everything():
    adapter = _Adapter()
    drop_handoffs_past_final_stage(adapter, stage_id=0)
    text_only, with_audio, untagged = _Request("text", 0), _Request("audio", 2), _Request("plain", None)
    for req in (text_only, with_audio, untagged):
        adapter.save_async({"x": 1}, req, False, new_token_ids=[1])  # a decode step's payload
    text_only._finished = with_audio._finished = True
    adapter.save_async(None, text_only, True)   # the terminal marker that leaked a segment
    adapter.save_async(None, with_audio, True)
    assert adapter.sent == [("audio", {"x": 1}, False), ("plain", {"x": 1}, False), ("audio", None, True)]
    # a later stage: a request that ends at stage 2 is not dropped by stage 1's adapter
    talker = _Adapter()
    drop_handoffs_past_final_stage(talker, stage_id=1)
    talker.save_async(None, _Request("audio2", 2, finished=True), True)
    talker.save_async(None, _Request("ends-at-1", 1, finished=True), True)
    assert [s[0] for s in talker.sent] == ["audio2"]
