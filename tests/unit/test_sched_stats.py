"""A stage's prefix-cache counters are emitted with the step that looked the prefix up
(omni_cache.engine.sched_stats), on vLLM's real schedulers: two conversation turns within one
second (a GPU's pace), the engine idle after each — every query and hit reaches the stats the
engine core sends (what ``/metrics``' ``vllm:prefix_cache_queries`` / ``_hits`` count).
Oracle: the prompt tokens and hit tokens the scheduler admitted (its own counters / the
requests). Without the flush (vLLM-Omni's one-second throttle alone) turn 2's lookups stayed
in the scheduler: the talker's counters did not move on an H100 (docs/gpu.md)."""

from __future__ import annotations

import pytest

from tests.unit import test_talker_identity as talker
from tests.unit.sched_util import request as _request
from tests.unit.sched_util import scheduler_kwargs
from tests.unit.sched_util import vllm_config as _vllm_config

NUM_BLOCKS = 64


def _drive(s, requests) -> tuple[tuple[int, int], dict[str, int]]:
    """Add each request and step until it finishes (one sampled token per step, as vLLM's own
    scheduler tests do). Returns the (queries, hits) summed over the stats the steps emitted,
    and each request's hit tokens at admission (``num_computed_tokens`` of its first schedule)."""
    from vllm.v1.outputs import ModelRunnerOutput

    queries = hits = 0
    admitted: dict[str, int] = {}
    for req in requests:
        s.add_request(req)
        for _ in range(50):
            if not s.requests:
                break
            out = s.schedule()
            admitted.update((n.req_id, int(n.num_computed_tokens)) for n in out.scheduled_new_reqs)
            ids = list(out.num_scheduled_tokens)
            eco = s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in
                                                                                            enumerate(ids)},
                                                              sampled_token_ids=[[7] for _ in ids]))
            for o in eco.values():
                st = o.scheduler_stats
                if st is not None and st.prefix_cache_stats is not None:
                    queries += st.prefix_cache_stats.queries
                    hits += st.prefix_cache_stats.hits
    return (queries, hits), admitted


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_talker_turn_two_hit_is_emitted_at_once(tmp_path, async_scheduling):
    from omni_cache.engine.talker_scheduler import talker_ar_scheduler

    cfg = _vllm_config(tmp_path, num_blocks=NUM_BLOCKS, max_num_batched_tokens=512, async_scheduling=async_scheduling)
    s = talker_ar_scheduler(**scheduler_kwargs(cfg, NUM_BLOCKS), log_stats=True)
    t1 = talker.chat(talker.SYSTEM, [talker.U1], [])
    t2 = talker.chat(talker.SYSTEM, [talker.U1, talker.U2], [talker.A1])
    got, _ = _drive(s, [talker._talker_request("turn1", t1), talker._talker_request("turn2", t2)])
    c = s.talker_identity_counters
    assert c["hit_tokens"] > 0  # turn 2 hit turn 1's user blocks
    assert got == (c["prompt_tokens"], c["hit_tokens"])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_thinker_turn_two_hit_is_emitted_at_once(tmp_path, async_scheduling):
    from omni_cache.engine.scheduler import capped_ar_scheduler

    cfg = _vllm_config(tmp_path, num_blocks=NUM_BLOCKS, max_num_batched_tokens=512, async_scheduling=async_scheduling)
    s = capped_ar_scheduler(**scheduler_kwargs(cfg, NUM_BLOCKS), log_stats=True)
    doc = list(range(100, 180))
    r1, r2 = _request("turn1", doc + [5, 6], 4), _request("turn2", doc + [8, 9, 10], 4)
    got, admitted = _drive(s, [r1, r2])
    assert admitted["turn2"] > 0
    assert got == (r1.num_prompt_tokens + r2.num_prompt_tokens, admitted["turn1"] + admitted["turn2"])
