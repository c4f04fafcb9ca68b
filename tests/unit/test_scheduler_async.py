"""The capped scheduler under asynchronous scheduling (vLLM-Omni's default for AR stages), on
vLLM's real ``AsyncScheduler`` and KV cache manager, driven the way vLLM's engine core drives
it with a batch queue: step N+1 is scheduled while step N is still running, step N's output
is processed after that.

A small model-runner stand-in (:class:`Runner`) keeps the runner's view of each request's
block table from the scheduler outputs, writes every scheduled token's row at its slot when a
step runs — the row's content is the token prefix it was computed from, as a causal model's
is — and, after the step's writes, checks every prefix hit the step serves: each hit row must
hold exactly the hitting request's own prefix, and each hit block must be cached in the
worker's ledger (as the stage manager's read requires: a block it never hashed is refused
there, ``StaleRowsError``, and the engine stops). Rows of "lost" requests are never written
(fault injection: such a request carries the scheduler's ``FORGET_ROWS`` marker). Like the
real runner, each step's output carries the block ids the worker cached in it
(``CACHED_BLOCKS_ATTR``); with ``decode_blocks_hashed=False`` the worker cannot hash a block
whose last token it decoded in that step (the mutant ``async_placeholders_unresolved``: the
token a placeholder on the host) and never caches it.
"""

from __future__ import annotations

import pytest

from omni_cache.engine.stage_manager import CACHED_BLOCKS_ATTR
from tests.unit.sched_util import BS, scheduler_kwargs
from tests.unit.sched_util import request as _request
from tests.unit.sched_util import vllm_config as _vllm_config

NUM_BLOCKS = 13


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return _vllm_config(tmp_path_factory.mktemp("llama-config"), num_blocks=NUM_BLOCKS,
                        max_num_batched_tokens=64, async_scheduling=True)


def _scheduler(vllm_config, capped: bool = True):
    from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler

    from omni_cache.engine.scheduler import OmniCacheARAsyncScheduler, capped_ar_scheduler

    kwargs = scheduler_kwargs(vllm_config, NUM_BLOCKS)
    if not capped:
        return OmniARAsyncScheduler(**kwargs)
    s = capped_ar_scheduler(**kwargs)
    assert type(s) is OmniCacheARAsyncScheduler  # the factory follows async_scheduling
    return s


def sampled(pos: int) -> int:
    """The token a request samples at position ``pos`` (deterministic, so a later turn can
    repeat an earlier answer)."""
    return 1000 + (pos * 37) % 3000


class StaleRow(AssertionError):
    pass


class Runner:
    """The model runner's side of the simulation (see the module docstring)."""

    def __init__(self, lost: set[str] = frozenset(), *, decode_blocks_hashed: bool = True, report: bool = True,
                 decode_blocks_late: int = 0):
        self.lost = set(lost)
        self.decode_blocks_hashed = decode_blocks_hashed
        #: steps after the one that filled it that a decode-filled block is hashed and cached
        #: (the stage manager's late caching: the step's input ids reach the host a step or
        #: more later; reported with that later step's output)
        self.decode_blocks_late = decode_blocks_late
        self.late: list[tuple[int, str, int, int, tuple[int, ...]]] = []  # (due step, rid, block index, id, prefix)
        self.steps = 0
        self.finished: set = set()  # (the seeded test's bookkeeping)
        self.prompt_len: dict[str, int] = {}
        self.report = report  # the output carries the step's cached block ids
        self.cached: dict[int, tuple[int, ...]] = {}  # the worker's ledger: block id -> prefix through it
        self.tokens: dict[str, list[int]] = {}  # prompt + sampled so far (the runner samples)
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[int, tuple[int, ...]] = {}  # slot id -> the token prefix its row holds
        self.hit_tokens_checked = 0
        self.hits: dict[str, int] = {}  # request -> its largest hit (resumed ones included)
        self.first_hits: dict[str, int] = {}  # request -> its hit at admission

    def add(self, rid: str, prompt: list[int]) -> None:
        self.tokens[rid] = list(prompt)
        self.prompt_len[rid] = len(prompt)

    def execute(self, out):
        """Run one step: write its rows, check its hits; returns vLLM's ``ModelRunnerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        spans, hits = {}, {}
        for nr in out.scheduled_new_reqs:
            self.tables[nr.req_id] = list(nr.block_ids[0])
            spans[nr.req_id] = nr.num_computed_tokens
            if nr.num_computed_tokens:
                hits[nr.req_id] = nr.num_computed_tokens
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            new = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.tables[rid] = list(new[0]) if new is not None else []
                # a token sampled in the step in flight when the request was preempted is
                # dropped by the scheduler: resume from the tokens it knows
                known = (getattr(c, "all_token_ids", None) or {}).get(rid)
                if known is not None:
                    self.tokens[rid] = list(known)
                if c.num_computed_tokens[i]:
                    hits[rid] = c.num_computed_tokens[i]
            elif new is not None:
                self.tables[rid].extend(new[0])
            spans[rid] = c.num_computed_tokens[i]
        sampled_ids, cached = [], set()
        self.steps += 1
        for due, rid, b, block_id, prefix in [x for x in self.late if x[0] <= self.steps]:
            self.late.remove((due, rid, b, block_id, prefix))
            # cached late only while the request still holds the block and its rows (the
            # stage manager's check: same block id in the request's table, the ledger's owner)
            if self.tables.get(rid, [])[b:b + 1] == [block_id] and rid in spans:
                self.cached[block_id] = prefix
                cached.add(block_id)
        for rid, start in spans.items():  # 1. every write of the step ...
            end = start + out.num_scheduled_tokens[rid]
            toks = self.tokens[rid]
            assert end <= len(toks), (rid, start, end, len(toks))  # inputs are known when the step runs
            for b in range(start // BS, (end - 1) // BS + 1):  # blocks being (re)written
                self.cached.pop(self.tables[rid][b], None)
            if rid not in self.lost:
                for p in range(start, end):
                    self.slots[self._slot(rid, p)] = tuple(toks[: p + 1])
                decoded = end - start == 1 and start >= len(toks) - 1 and start > 0
                for b in range(start // BS, end // BS):  # blocks this step completes: hashed, cached
                    if decoded and not self.decode_blocks_hashed:
                        continue  # its last token a placeholder the worker could not resolve
                    late = self.decode_blocks_late() if callable(self.decode_blocks_late) else self.decode_blocks_late
                    if decoded and late:  # hashed and cached a later step
                        self.late.append((self.steps + late, rid, b, self.tables[rid][b], tuple(toks[: (b + 1) * BS])))
                        continue
                    self.cached[self.tables[rid][b]] = tuple(toks[: (b + 1) * BS])
                    cached.add(self.tables[rid][b])
            if end == len(toks):  # the step reached the last known token: it samples one
                toks.append(sampled(end))
                sampled_ids.append([toks[-1]])
            else:
                sampled_ids.append([])
        for rid, hit in hits.items():  # 2. ... before any hit is read
            for p in range(hit):
                if self.slots.get(self._slot(rid, p)) != tuple(self.tokens[rid][: p + 1]):
                    raise StaleRow(f"request {rid}: hit row at position {p} of {hit} is not its own")
            for b in range(hit // BS):
                if self.cached.get(self.tables[rid][b]) != tuple(self.tokens[rid][: (b + 1) * BS]):
                    raise StaleRow(f"request {rid}: hit block {b} is not cached by the worker")
            self.hit_tokens_checked += hit
            self.hits[rid] = max(self.hits.get(rid, 0), hit)
            self.first_hits.setdefault(rid, hit)
        ids = list(spans)
        output = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled_ids)
        if self.report:
            setattr(output, CACHED_BLOCKS_ATTR, frozenset(cached))
        return output

    def _slot(self, rid: str, pos: int) -> int:
        return self.tables[rid][pos // BS] * BS + pos % BS


A_PROMPT = list(range(1, 41))  # 40 tokens: 2 full blocks + 8
A_TOKENS = 30  # decode fills blocks 2 and 3 with sampled tokens (positions 40..69)


def _a_answer(n: int) -> list[int]:
    return [sampled(p) for p in range(len(A_PROMPT) + 1, len(A_PROMPT) + 1 + n)]


def _workload(s, runner: Runner, *, max_steps: int = 400) -> None:
    """Turn 1 (A) decodes while C (unrelated, long) and D compete for 13 blocks (preemption);
    C is aborted mid-decode; turn 2 (B) repeats A's prompt and the first 24 tokens of its
    answer, so its hit covers blocks A filled while decoding."""
    from vllm.v1.request import RequestStatus

    # A's first sampled token is at position 40 (the prefill's last step samples it)
    a_answer = [sampled(40)] + _a_answer(A_TOKENS - 1)
    plan = {
        0: [("A", A_PROMPT, A_TOKENS)],
        2: [("C", list(range(2000, 2070)), 40)],
        6: [("D", A_PROMPT[:32] + list(range(3000, 3050)), 8)],  # shares A's first 2 blocks
    }
    b_prompt = A_PROMPT + a_answer[:24] + list(range(4000, 4010))
    prev = None
    for step in range(max_steps):
        for rid, prompt, n in plan.pop(step, []):
            s.add_request(_request(rid, prompt, n, forget_rows=rid in runner.lost))
            runner.add(rid, prompt)
        if step > 4 and "C" in s.requests and len(runner.tokens["C"]) > 95:
            s.finish_requests("C", RequestStatus.FINISHED_ABORTED)
        if "A" not in s.requests and "B" not in runner.tokens and step > 2:
            s.add_request(_request("B", b_prompt, 4))
            runner.add("B", b_prompt)
        out = s.schedule()
        if prev is not None:
            s.update_from_output(prev, runner.execute(prev))
        prev = out
        if not s.requests and not plan and "B" in runner.tokens:
            s.update_from_output(prev, runner.execute(prev))
            return
    raise AssertionError(f"workload not finished after {max_steps} steps: {sorted(s.requests)}")


def test_async_hits_are_exact_across_decode_blocks_preemption_and_aborts(vllm_config, monkeypatch):
    s = _scheduler(vllm_config)
    runner = Runner()
    _workload(s, runner)
    st = s._omni_cache_state()
    # not vacuous: D hit A's prompt blocks; B hit blocks A filled while decoding (past its prompt)
    # exactly: D shares A's first 32 prompt tokens; B repeats A's 40 + the first 24 answer
    # tokens = 64, two whole blocks past A's prompt blocks, the third filled while decoding
    assert runner.first_hits.get("D", 0) == 32 and runner.first_hits.get("B", 0) == 64, runner.first_hits
    assert st.preemptions > 0, "the workload did not preempt"
    assert st.capped_tokens == 0 and not st.pending, (st.capped_tokens, st.pending)
    # the published counters name the preempted requests (and those resumed with a hit)
    c = st.counters()
    assert 0 < len(c["preempted_requests"]) <= st.preemptions and set(c["resumed_hit_requests"]) <= set(
        c["preempted_requests"]) and len(c["resumed_hit_requests"]) == len({r for r, _ in st.resumed}), c


def test_async_hits_on_lost_rows_are_capped(vllm_config, monkeypatch):
    """A's rows are lost (not written) and the scheduler is told so: D's and B's hits on A's
    blocks are capped and recomputed; every hit served is still exact."""
    s = _scheduler(vllm_config)
    runner = Runner(lost={"A"})
    _workload(s, runner)
    assert s._omni_cache_state().capped_tokens >= 32
    assert runner.hits.get("B", 0) < 40 and runner.hits.get("D", 0) == 0, runner.hits


def test_the_check_catches_an_uncapped_scheduler(vllm_config):
    """The same lost rows under vLLM-Omni's own async scheduler (no cap): the runner
    stand-in detects the wrong rows, so the two tests above can fail."""
    s = _scheduler(vllm_config, capped=False)
    with pytest.raises(StaleRow):
        _workload(s, Runner(lost={"A"}))


def test_async_decode_blocks_the_worker_did_not_cache_are_capped(vllm_config):
    """The worker cannot hash the blocks it fills while decoding (``async_placeholders_unresolved``:
    the step's input token stays a placeholder on the host), vLLM hashes them from the sampled
    tokens: the scheduler vouches for such a block only when the step's output says the worker
    cached it, so B's hit stops before A's first decode-filled block (block 2, positions
    32..47) and is recomputed from there — no hit on an uncached block, the engine keeps going."""
    s = _scheduler(vllm_config)
    runner = Runner(decode_blocks_hashed=False)
    _workload(s, runner)
    st = s._omni_cache_state()
    assert runner.first_hits.get("B") == 32 and runner.first_hits.get("D") == 32, runner.first_hits
    c = st.counters()
    assert c["unconfirmed_blocks"] >= 2 and c["capped_tokens"] >= 32 and c["worker_reports"] > 0, c
    assert not st.pending


@pytest.mark.parametrize("late", [1, 2])
def test_async_decode_blocks_the_worker_caches_late_are_hit(vllm_config, late):
    """The worker caches a decode-filled block ``late`` steps after the step that filled it
    (the stage manager never waits for the device to read that step's input ids: it hashes
    the block once their copy has reached the host) and reports it with that later step's
    output: the scheduler vouches for the block then, so B's hit covers A's decode-filled
    blocks as with a worker that caches them at once; every hit is exact, nothing is dropped."""
    s = _scheduler(vllm_config)
    runner = Runner(decode_blocks_late=late)
    _workload(s, runner)
    st = s._omni_cache_state()
    assert runner.first_hits.get("B") == 64 and runner.first_hits.get("D") == 32, runner.first_hits
    assert st.counters()["unconfirmed_blocks"] == 0 and not st.pending


def test_without_the_workers_report_the_uncached_block_is_hit(vllm_config):
    """The same worker, its outputs without the cached block ids (the scheduler vouches from
    vLLM's hashes alone, as before): B hits the block the worker never cached — the runner
    stand-in's ledger check refuses it, so the test above can fail."""
    s = _scheduler(vllm_config)
    with pytest.raises(StaleRow, match="not cached by the worker"):
        _workload(s, Runner(decode_blocks_hashed=False, report=False))


def _late_fn(rng):
    """Per decode-filled block: cached by the worker 0 to 6 steps late (the stage manager's late
    caching, normally 1 or 2; the scheduler's window ``LATE_CONFIRM_STEPS`` is 8), drawn from ``rng``."""
    return lambda: rng.randrange(7)


@pytest.mark.parametrize("seed", range(12))
def test_seeded_conversations_with_a_late_worker_serve_only_exact_hits(vllm_config, seed):
    """Seeded workloads on vLLM's real async scheduler: requests arrive at random steps, each a
    fresh prompt, a continuation of a finished one (its prompt plus part of its answer), or a
    repeat of a running one's tokens so far (hits on blocks filled while decoding, some just
    filled), with 13 blocks for all of them (preemption); the worker caches each decode-filled
    block 0 to 6 steps late. Every hit served is exact — each row its own request's prefix, each
    block cached in the worker's ledger (the runner stand-in's check) — and no block stays
    unconfirmed: the late reports all arrive within the scheduler's window."""
    import random

    rng = random.Random(seed)
    s = _scheduler(vllm_config)
    runner = Runner(decode_blocks_late=_late_fn(rng))
    done: list[tuple[list[int], int]] = []  # (prompt, answer tokens) of finished requests
    arrivals = sorted(rng.sample(range(50), 14))
    prev, n_new = None, 0
    for step in range(600):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            running = [r for r in s.requests if r in runner.tokens and len(runner.tokens[r]) > runner.prompt_len[r]]
            if running and rng.random() < 0.5:  # a request repeating a running one's tokens so far
                prompt = list(runner.tokens[rng.choice(running)]) + [6000 + n_new] * rng.randrange(0, 5)
            elif done and rng.random() < 0.75:  # a next turn: an earlier prompt + part of its answer
                p, n = rng.choice(done)
                k = rng.randrange(1, n + 1)
                prompt = p + [sampled(q) for q in range(len(p), len(p) + k)] + [5000 + n_new] * rng.randrange(0, 5)
            else:
                prompt = [rng.randrange(1, 900) for _ in range(rng.randrange(8, 40))]
            prompt = prompt[:72]
            rid = f"q{n_new}"
            n_new += 1
            s.add_request(_request(rid, prompt, rng.randrange(4, 30)))
            runner.add(rid, prompt)
        for rid in list(runner.tokens):
            if rid not in s.requests and rid in runner.tokens and (rid, "done") not in runner.finished:
                runner.finished.add((rid, "done"))
                toks = runner.tokens[rid]
                plen = runner.prompt_len[rid]
                done.append((toks[:plen], len(toks) - plen))
        out = s.schedule()
        if prev is not None:
            s.update_from_output(prev, runner.execute(prev))
        prev = out
        if not s.requests and not arrivals:
            s.update_from_output(prev, runner.execute(prev))
            break
    else:
        raise AssertionError(f"seed {seed}: not finished after 600 steps: {sorted(s.requests)}")
    st = s._omni_cache_state()
    assert n_new == 14 and st.counters()["unconfirmed_blocks"] == 0, st.counters()
    assert runner.hit_tokens_checked > 0, "no hit: the workload checks nothing"
