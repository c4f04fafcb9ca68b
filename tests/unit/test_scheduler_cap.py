"""omni-cache's scheduler hit cap on vLLM's real v1 scheduler and KV cache manager (no model:
each step is answered with one sampled token per scheduled request, as vLLM's own scheduler
tests do). A request that waits for KV blocks is looked up again every step; the cap must cut
its hit to the hidden-state tier's coverage, and the counters must count the hit that
admitted it once — not once per lookup — and nothing for a request aborted while waiting."""

from __future__ import annotations

import json
import time

import pytest

from omni_cache import settings
from tests.unit.sched_util import request as _request
from tests.unit.sched_util import scheduler_kwargs
from tests.unit.sched_util import step as _step
from tests.unit.sched_util import vllm_config as _vllm_config

NUM_BLOCKS = 10  # A (80 prompt tokens + decode) holds 6 blocks; B (144 tokens) needs 9


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return _vllm_config(tmp_path_factory.mktemp("llama-config"), num_blocks=NUM_BLOCKS,
                        max_num_batched_tokens=256, async_scheduling=False)


def _scheduler(vllm_config):
    from omni_cache.engine.scheduler import OmniCacheARScheduler

    return OmniCacheARScheduler(**scheduler_kwargs(vllm_config, NUM_BLOCKS))


A_PROMPT = list(range(1, 81))  # 5 full blocks
B_PROMPT = A_PROMPT[:64] + list(range(500, 580))  # shares A's first 4 blocks (64 tokens)


def _run(s, abort_b: bool = False, max_steps: int = 40, lose_a: bool = False):
    """A decodes (holding 6 of 10 blocks) while B waits for KV blocks and is looked up every
    step; returns ``(steps B waited, B's num_computed_tokens at admission or None)``.
    ``lose_a``: A's rows are "lost" (fault injection): its blocks are not covered."""
    from vllm.v1.request import RequestStatus

    s.add_request(_request("A", A_PROMPT, 16, forget_rows=lose_a))
    assert _step(s).num_scheduled_tokens == {"A": 80}
    s.add_request(_request("B", B_PROMPT, 1))
    for waited in range(max_steps):
        if abort_b and waited == 3:
            s.finish_requests("B", RequestStatus.FINISHED_ABORTED)
        out = _step(s)
        admitted = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        if "B" in admitted:
            return waited, admitted["B"]
        if not s.requests:
            return waited, None
    raise AssertionError(f"B neither admitted nor gone after {max_steps} steps")


def test_uncovered_hit_is_capped_and_counted_once(vllm_config, monkeypatch, tmp_path):
    import threading

    from omni_cache.engine.metrics import MetricsFile

    monkeypatch.setenv(settings.METRICS_DIR.name, str(tmp_path))
    writers: list[str] = []
    real = MetricsFile._write
    monkeypatch.setattr(MetricsFile, "_write",
                        lambda self, *a: (writers.append(threading.current_thread().name), real(self, *a))[1])
    s = _scheduler(vllm_config)
    waited, b_start = _run(s, lose_a=True)  # A's rows are "lost": its blocks are not covered
    st = s._omni_cache_state()
    assert waited >= 5, waited  # B was looked up (and capped) in every one of these steps
    assert b_start == 0  # the 64-token KV hit was capped to the covered prefix: nothing
    assert st.capped_tokens == 64, st.capped_tokens  # once, for the admitting lookup
    assert st.same_step_hit_tokens == 0 and st.lookup == {}
    # published by the admitting step itself (no shutdown yet): a killed engine core keeps it —
    # written by the file's writer thread, not on the scheduler's (every request's path)
    for _ in range(250):
        if list(tmp_path.glob("scheduler-*.json")):
            break
        time.sleep(0.01)
    (f,) = tmp_path.glob("scheduler-*.json")
    assert json.loads(f.read_text())["capped_tokens"] == 64
    assert writers and threading.current_thread().name not in writers, writers


def test_covered_hit_is_served_and_nothing_capped(vllm_config, monkeypatch):
    s = _scheduler(vllm_config)
    waited, b_start = _run(s)
    assert waited >= 5 and b_start == 64  # A's 4 shared blocks are written: the hit stands
    assert s._omni_cache_state().capped_tokens == 0


def test_request_aborted_while_waiting_is_not_counted(vllm_config, monkeypatch):
    s = _scheduler(vllm_config)
    waited, b_start = _run(s, abort_b=True, lose_a=True)
    st = s._omni_cache_state()
    assert b_start is None and "B" not in s.requests  # never admitted
    assert st.capped_tokens == 0 and st.lookup == {}, st


def test_resumed_hits_are_counted_in_bounded_memory():
    """A long-running server resumes preempted requests without end: the state keeps the latest
    PREEMPTED_KEPT resumes and folds older ones into totals; the published counters stay exact
    (oracle: the sums of what was noted). A repeated lookup of a waiting request overwrites."""
    from omni_cache.core.coverage import RowValidity
    from omni_cache.engine.scheduler import PREEMPTED_KEPT, SchedulerCapState

    st = SchedulerCapState(written=None, group=0, block_size=16, truncates=False, hit_needs=RowValidity.ALL_KEYS)
    n = 3 * PREEMPTED_KEPT
    for i in range(n):
        st.note_resumed(f"r{i}", 1, 16)
        st.note_resumed(f"r{i}", 1, 32)  # still waiting: looked up again, the latest counts
    c = st.counters()
    assert len(st.resumed) == PREEMPTED_KEPT
    assert (c["resumed_hits"], c["resumed_hit_tokens"]) == (n, 32 * n)
    assert c["resumed_hit_requests"] == sorted(f"r{i}" for i in range(n - PREEMPTED_KEPT, n))


@pytest.mark.parametrize("min_hit", [0, 64, 80])
def test_a_hit_below_the_minimum_is_recomputed(vllm_config, monkeypatch, tmp_path, min_hit):
    """``OMNI_CACHE_MIN_HIT_TOKENS``: B's covered 64-token hit stands at a minimum of 0 or 64,
    and is recomputed (B admitted from token 0) at 80 — counted once as a short hit, not as a
    capped one (its rows were covered), and not published at admission (no file before shutdown)."""
    monkeypatch.setenv(settings.METRICS_DIR.name, str(tmp_path))
    monkeypatch.setenv(settings.MIN_HIT_TOKENS.name, str(min_hit))
    s = _scheduler(vllm_config)
    waited, b_start = _run(s)
    st = s._omni_cache_state()
    assert waited >= 5 and b_start == (0 if min_hit > 64 else 64)
    assert (st.short_hit_tokens, st.capped_tokens) == ((64, 0) if min_hit > 64 else (0, 0))
    assert st.lookup == {} and not list(tmp_path.glob("scheduler-*.json"))
    s.shutdown()
    (f,) = tmp_path.glob("scheduler-*.json")
    assert json.loads(f.read_text())["short_hit_tokens"] == (64 if min_hit > 64 else 0)
