"""The streaming thinker → talker hand-off around a preemption
(:func:`omni_cache.engine.handoff.thinker2talker_async_chunk` over vLLM-Omni's real
``thinker2talker_async_chunk``; the connector's transfer manager and the request are small fakes
of the attributes the function reads). Oracle: the rows the talker's first chunk must carry —
positions ``[0, prompt + 1)`` once each, in order — as an unpreempted request sends them."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace as NS

import pytest
import torch

from omni_cache.engine.handoff import thinker2talker_async_chunk

H, PROMPT, ACCEPT = 8, 6, 3  # hidden size, prompt tokens, the talker's accept_hidden_layer


def _manager():
    cfg = NS(hf_config=NS(talker_config=NS(accept_hidden_layer=ACCEPT)))
    return NS(put_req_chunk=defaultdict(int), request_payload={}, config=cfg)


def _request(num_tokens: int, preemptions: int = 0):
    """The request snapshot a save carries: ``num_tokens`` ids known (prompt + sampled)."""
    return NS(external_req_id="r", request_id="r", prompt_token_ids=list(range(PROMPT)),
              all_token_ids=list(range(num_tokens)), num_preemptions=preemptions, resumable=False,
              additional_information=None, num_computed_tokens=0)


def _rows(lo: int, hi: int) -> dict:
    """A step's outputs for positions ``[lo, hi)``: row ``p`` of every layer is filled with ``p``."""
    pos = torch.arange(lo, hi, dtype=torch.float32)[:, None].expand(hi - lo, H).clone()
    return {"hidden_states": {"layers": {0: pos, ACCEPT: pos + 1000}}, "embed": {}}


def _send(tm, rows: dict, request, view: bool = False) -> torch.Tensor | None:
    """One save: our wrapper (``view``: through a fresh per-call view of the manager, as the
    Gemma thinker's hand-off calls it), then what the connector does after a sent chunk."""
    from omni_cache.engine.gemma_thinker import _AcceptLayerView

    payload = thinker2talker_async_chunk(_AcceptLayerView(tm, ACCEPT) if view else tm, rows, request)
    if payload is None:
        return None
    tm.put_req_chunk[request.external_req_id] += 1
    return payload.embed.prefill if payload.embed.prefill is not None else payload.embed.decode


def _positions(t: torch.Tensor) -> list[int]:
    return t[:, 0].to(torch.int64).tolist()


def test_unpreempted_prefill_then_decode_sends_prompt_plus_one():
    tm = _manager()
    assert _send(tm, _rows(0, 4), _request(PROMPT)) is None              # chunked prefill: stashed
    assert _send(tm, _rows(4, PROMPT), _request(PROMPT + 1)) is None     # prompt complete, + t0 sampled
    first = _send(tm, _rows(PROMPT, PROMPT + 1), _request(PROMPT + 2))   # t0 fed: the first chunk
    assert _positions(first) == list(range(PROMPT + 1))


@pytest.mark.parametrize("view", [False, True], ids=["qwen3", "gemma-view"])
@pytest.mark.parametrize("runner_dropped_first", [False, True])
def test_preempted_after_its_first_token_sends_each_prompt_row_once(runner_dropped_first, view):
    """Preempted after its prefill sampled t0, before the first chunk went out; the resumed step
    yields rows [0, prompt + 1) (re-hit prefix ++ recompute). Without the fix the talker got the
    stale prompt rows followed by all of them again (the stress run: 1,141 rows for 570)."""
    tm = _manager()
    assert _send(tm, _rows(0, PROMPT), _request(PROMPT + 1), view) is None
    if runner_dropped_first:  # the runner's drop at the resume got there before this save
        tm.request_payload.pop("r")
    first = _send(tm, _rows(0, PROMPT + 1), _request(PROMPT + 2, preemptions=1), view)
    assert first is not None and _positions(first) == list(range(PROMPT + 1))
    later = _send(tm, _rows(PROMPT + 1, PROMPT + 2), _request(PROMPT + 3, preemptions=1), view)
    assert _positions(later) == [PROMPT + 1]


def test_preempted_during_chunked_prefill_restarts_the_stash():
    tm = _manager()
    assert _send(tm, _rows(0, 4), _request(PROMPT)) is None
    assert _send(tm, _rows(0, 5), _request(PROMPT, preemptions=1)) is None   # resumed: [0, 5) again
    assert _send(tm, _rows(5, PROMPT), _request(PROMPT + 1, preemptions=1)) is None
    first = _send(tm, _rows(PROMPT, PROMPT + 1), _request(PROMPT + 2, preemptions=1))
    assert _positions(first) == list(range(PROMPT + 1))


def test_requests_aborted_before_their_first_chunk_are_forgotten(monkeypatch):
    """A request that never sends its first chunk (aborted during its prefill) leaves no entry
    for ever: the oldest are dropped past the bound."""
    from omni_cache.engine import handoff

    monkeypatch.setattr(handoff, "_MAX_STASHED_REQUESTS", 3)
    tm = _manager()
    for i in range(5):
        req = _request(PROMPT)
        req.external_req_id = req.request_id = f"r{i}"
        _send(tm, _rows(0, 4), req)
    assert list(getattr(tm, handoff._PREEMPTIONS_ATTR)) == ["r2", "r3", "r4"]
