"""The stage manager's ordinary path without an engine: vLLM-Omni's seam calls
(``new_step_starts`` → ``save_outputs`` → ``materialize``) driven with small fakes of the
runner and the scheduler output, as vLLM's scheduler would produce them.

Every row a fake forward computes is a function of the token prefix up to it (as a causal
model's are), so "what a full recompute gives" is known: a hand-off must equal the rows of
the request's whole prompt computed from scratch, bitwise.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace as NS

import pytest
import torch

from omni_cache.core import StaleRowsError
from omni_cache.core.staging import KeptIds
from omni_cache.engine import scheduler_tokens
from omni_cache.engine.stage_manager import HIDDEN_KEY, OmniCacheStageManager

BS, H = 4, 6
LAYER = "hidden_states.layer_0"


def prefix_rows(tokens: list[int], start: int, end: int) -> torch.Tensor:
    """``[end - start, H]`` rows; row ``p`` depends on ``tokens[:p + 1]`` only."""
    out = []
    for p in range(start, end):
        seed = int.from_bytes(hashlib.blake2b(repr(tokens[: p + 1]).encode(), digest_size=8).digest(), "little")
        out.append(torch.randn(H, generator=torch.Generator().manual_seed(seed % 2**63)))
    return torch.stack(out)


def scheduler_output(new=(), cached=(), resumed=(), finished=()):
    """A scheduler output as vLLM's scheduler makes it. ``new``: ``(rid, block_ids,
    num_computed, num_scheduled)``; ``cached``: ``(rid, new_block_ids | None, num_computed,
    num_scheduled)``."""
    return NS(
        finished_req_ids=set(finished),
        scheduled_new_reqs=[NS(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c, _ in new],
        scheduled_cached_reqs=NS(req_ids=[r for r, *_ in cached],
                                 new_block_ids=[None if b is None else (list(b),) for _, b, _, _ in cached],
                                 num_computed_tokens=[c for _, _, c, _ in cached],
                                 resumed_req_ids=set(resumed)),
        num_scheduled_tokens={r: n for r, _, _, n in (*new, *cached)},
    )


class SchedulerRequests:
    """The scheduler's ``requests`` as the worker reads them (request id → ``all_token_ids``):
    every token it has received, i.e. all sampled tokens but the last ``lag`` (under async
    scheduling vLLM's scheduler gets a step's sampled token with that step's output, after the
    next step was scheduled and saved)."""

    def __init__(self, eng: FakeEngine, lag: int) -> None:
        self.eng, self.lag = eng, lag

    def get(self, rid: str):
        st = self.eng.runner.requests.get(rid)
        if st is None:
            return None
        real = self.eng.real[rid]
        tokens = list(st.prompt_token_ids) + real[:max(len(real) - self.lag, 0)]
        hbs = getattr(self.eng.scheduler, "hash_block_size", None)
        return NS(all_token_ids=tokens, block_hashes=vllm_hashes(tokens, hbs) if hbs else [])


class FakeScheduler:
    """A scheduler as :func:`omni_cache.engine.scheduler_tokens.register` reads it; with
    ``hash_block_size``, vLLM's own block hashes too (``Request.block_hashes``, 32 bytes each)."""

    def __init__(self, vllm_config, requests, hash_block_size: int | None = None) -> None:
        self.vllm_config, self.requests = vllm_config, requests
        if hash_block_size is not None:
            self.hash_block_size = hash_block_size
            self.cache_config = NS(enable_prefix_caching=True)


def vllm_hashes(tokens: list[int], hash_block_size: int) -> list[bytes]:
    """Chained hashes of ``tokens``' full ``hash_block_size`` blocks as vLLM's hasher makes them
    (each identifies the prefix up to its end; bytes, as ``BlockHash``)."""
    return [hashlib.sha256(repr(tokens[:(i + 1) * hash_block_size]).encode()).digest()
            for i in range(len(tokens) // hash_block_size)]


class FakeEngine:
    """The runner-side state the manager reads, and a forward that computes
    :func:`prefix_rows` for the hidden states and (optionally) a captured layer."""

    def __init__(self, keys=(HIDDEN_KEY, LAYER), *, async_tokens: bool = False, scheduler_lag: int | None = None,
                 hash_block_size: int | None = None):
        self.keys = keys
        #: as vLLM's GPU runner under async scheduling: a sampled token is -1 in the host-side
        #: ``output_token_ids``; its value is only in the device ``input_ids`` of the next step
        self.async_tokens = async_tokens
        self.real: dict[str, list[int]] = {}
        self.cached_log: list[frozenset[int] | None] = []  # per step: the block ids it cached
        self.runner = NS(cache_config=NS(kv_sharing_fast_prefill=False),
                         kv_sharing_fast_prefill_eligible_layers=None,
                         model=NS(omni_pooler_payload_include_hidden=True),
                         requests={}, input_batch=NS(req_ids=[]))
        self.manager = OmniCacheStageManager(self.runner, block_size=BS, num_blocks=16)
        if scheduler_lag is not None:  # a scheduler in this process (vLLM's uni executor), registered
            self.runner.vllm_config = object()
            self.scheduler = FakeScheduler(self.runner.vllm_config, SchedulerRequests(self, scheduler_lag),
                                           hash_block_size)
            scheduler_tokens.register(self.scheduler)

    def add(self, rid: str, prompt: list[int]) -> None:
        self.runner.requests[rid] = NS(prompt_token_ids=prompt, output_token_ids=[], mm_features=None)
        self.real[rid] = []

    def tokens(self, rid: str) -> list[int]:
        """The request's real tokens (prompt + sampled), whatever the host state holds."""
        return list(self.runner.requests[rid].prompt_token_ids) + self.real[rid]

    def step(self, *, new=(), cached=(), resumed=(), finished=(), keys=None):
        """One engine step. ``new``: ``(rid, block_ids, num_computed, num_scheduled)``;
        ``cached``: ``(rid, new_block_ids | None, num_computed, num_scheduled)``.
        Returns the step's hand-off (``materialize`` of every scheduled request)."""
        keys = self.keys if keys is None else keys
        self.manager.new_step_starts(scheduler_output(new, cached, resumed, finished))
        order = [r for r, *_ in (*new, *cached)]
        self.runner.input_batch.req_ids = order
        spans = {r: (c, c + n) for r, _, c, n in (*new, *cached)}
        self.runner.input_ids = NS(gpu=torch.tensor([t for r in order for t in self.tokens(r)[slice(*spans[r])]]))
        hidden = torch.cat([prefix_rows(self.tokens(r), *spans[r]) for r in order])
        mm = {k: hidden * 2 + 1 for k in keys if k != HIDDEN_KEY}
        step_id = self.manager.save_outputs(hidden, mm, num_tokens_unpadded=hidden.shape[0],
                                            num_tokens_padded=hidden.shape[0])
        self.cached_log.append(self.manager.cached_blocks(step_id))  # what the step's output reports
        out = self.last_handoff = self.manager.materialize(step_id, order)
        assert self.manager.cached_blocks(step_id) is None  # consumed
        if not out.mm_outputs:
            # as vLLM-Omni's payload builder when the prefix cache hands over no multimodal
            # outputs (a step without a hit): each request's own slice of the step's outputs
            off, batch = 0, {}
            for r in order:
                n = spans[r][1] - spans[r][0]
                batch[r], off = (off, off + n), off + n
            return {r: {HIDDEN_KEY: out.hidden_states[r], **{k: v[slice(*batch[r])] for k, v in mm.items()}}
                    for r in order}
        return {r: {HIDDEN_KEY: out.hidden_states[r], **{k: v[r] for k, v in out.mm_outputs.items()}}
                for r in order}

    def sample(self, rid: str, token: int) -> None:
        self.real[rid].append(token)
        self.runner.requests[rid].output_token_ids.append(-1 if self.async_tokens else token)


def expected(tokens: list[int], start: int, end: int, keys=(HIDDEN_KEY, LAYER)) -> dict[str, torch.Tensor]:
    rows = prefix_rows(tokens, start, end)
    return {k: rows if k == HIDDEN_KEY else rows * 2 + 1 for k in keys}


def assert_rows(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        assert got[k].shape == want[k].shape and torch.equal(got[k], want[k]), k


def test_chunked_prefill_decode_and_a_hit_hand_off_what_a_recompute_gives():
    eng = FakeEngine()
    a = list(range(100, 110))  # 10 tokens: blocks 0, 1 full, block 2 partial
    eng.add("A", a)
    assert_rows(eng.step(new=[("A", [3, 7], 0, 6)])["A"], expected(a, 0, 6))        # chunk 1
    assert_rows(eng.step(cached=[("A", [9], 6, 4)])["A"], expected(a, 6, 10))       # chunk 2, table grows
    eng.sample("A", 55)
    assert_rows(eng.step(cached=[("A", None, 10, 1)])["A"], expected(a + [55], 10, 11))  # decode
    assert eng.manager.reqs["A"].block_ids == [3, 7, 9]

    # B shares A's first two blocks: vLLM admits it with num_computed_tokens = 8 on A's blocks
    b = a[:8] + [1, 2, 3]
    eng.add("B", b)
    got = eng.step(new=[("B", [3, 7, 11], 8, 3)])["B"]
    assert_rows(got, expected(b, 0, 11))
    m = eng.manager.metrics()
    assert m["hits_served"] == 1 and m["hit_tokens"] == 8 and m["hits_refused"] == 0


def test_a_batch_of_many_requests_hands_each_its_own_rows():
    """A step of four requests — two prefill chunks of different lengths and two decodes — hands
    each request the rows of its own span — oracle: the rows the fake forward computed for that
    request's positions (the writer's rows), bitwise (the batch's rows are split once per key
    when a step has more than two requests; a slice per request below that)."""
    eng = FakeEngine()
    prompts = {r: list(range(10 * i, 10 * i + 5)) for i, r in enumerate("ABCD")}
    for r, p in prompts.items():
        eng.add(r, p)
    eng.step(new=[("A", [0, 1], 0, 5), ("B", [2, 3], 0, 5)])
    eng.sample("A", 90)
    eng.sample("B", 91)
    got = eng.step(new=[("C", [4, 5], 0, 5), ("D", [6, 7], 0, 3)],
                   cached=[("A", None, 5, 1), ("B", None, 5, 1)])
    assert_rows(got["C"], expected(prompts["C"], 0, 5))
    assert_rows(got["D"], expected(prompts["D"], 0, 3))
    assert_rows(got["A"], expected(prompts["A"] + [90], 5, 6))
    assert_rows(got["B"], expected(prompts["B"] + [91], 5, 6))


def _decode_then_turn2(eng: FakeEngine):
    """Turn 1 decodes two tokens that complete its block 1; turn 2 repeats them and hits it."""
    a = list(range(6))
    eng.add("A", a)
    eng.step(new=[("A", [0, 1], 0, 6)])
    for i, tok in enumerate([70, 71]):  # positions 6, 7 complete block 1
        eng.sample("A", tok)
        eng.step(cached=[("A", None, 6 + i, 1)])
    eng.sample("A", 72)  # sampled, not fed back yet: its value is on the device only
    turn2 = a + [70, 71, 9, 9, 9]
    eng.add("T2", turn2)
    return turn2, eng.step(new=[("T2", [0, 1, 5], 8, 3)], finished=["A"])["T2"]


def test_hit_on_a_block_filled_by_decode_tokens():
    """Turn 2 of a chat hits the block that turn 1's answer filled (prompt + output tokens)."""
    turn2, got = _decode_then_turn2(eng := FakeEngine())
    assert_rows(got, expected(turn2, 0, 11))
    assert eng.manager.metrics()["hit_tokens"] == 8


def test_async_scheduling_placeholders_hash_the_real_decode_tokens():
    """Under async scheduling (vLLM-Omni's default on GPUs) the runner's host-side output
    tokens are -1 placeholders: the writer hashes its decode-filled block from the device
    input ids, so turn 2's hit on it is served — rows equal to a recompute (oracle: the
    writer's rows, :func:`prefix_rows`), bitwise. On an H200 this hit stopped the engine
    (``StaleRowsError``: block hashed from placeholders)."""
    eng = FakeEngine(async_tokens=True)
    turn2, got = _decode_then_turn2(eng)
    assert eng.runner.requests["A"].output_token_ids == [-1, -1, -1]  # the placeholders were there
    assert_rows(got, expected(turn2, 0, 11))
    assert eng.manager.metrics()["hit_tokens"] == 8
    # each step reports the blocks it cached (for the capped scheduler): the decode step that
    # completed block 1 (position 7) reports it
    assert eng.cached_log == [{0}, set(), {1}, set()], eng.cached_log


def test_an_unresolved_placeholder_block_is_never_cached(monkeypatch):
    """Fault: the device input ids are not kept. The decode-filled block is then written but
    never cached (no hash made of placeholders), and the hit on it is refused — not served."""
    eng = FakeEngine(async_tokens=True)
    monkeypatch.setattr(OmniCacheStageManager, "keep_async_inputs", lambda self, plan: None)
    with pytest.raises(StaleRowsError):
        _decode_then_turn2(eng)
    assert eng.manager.cache.ledger.block_hash[1] is None and eng.manager.cache.ledger.block_hash[0] is not None
    # ... and the step that completed it does not report it: the capped scheduler, told so, caps
    # the hit instead (tests/unit/test_scheduler_async.py), and the refusal above never happens
    assert eng.cached_log == [{0}, set(), set()], eng.cached_log


def _late_copies(monkeypatch, clock: list[int], lag: int = 1, waits: list | None = None):
    """Each step's kept input ids reach the host ``lag`` steps after that step (``KeptIds.ready``
    is False until then, as a copy queued behind the step's forward on a GPU); reading ids that
    are not ready fails the test — the stage manager must never wait — unless ``waits`` is
    given: such a read is then counted there."""
    init, made = KeptIds.__init__, {}  # (KeptIds has __slots__) id -> (the step that made it, it)

    def make(self, ids, *args, **kwargs):
        init(self, ids, *args, **kwargs)
        made[id(self)] = (clock[0], self)

    def values(self, start, end):
        if not self.ready():
            assert waits is not None, "read kept input ids still in flight: a host sync on a GPU"
            waits.append((start, end))
        return self.host[start:end].tolist()

    monkeypatch.setattr(KeptIds, "__init__", make)
    monkeypatch.setattr(KeptIds, "ready", lambda self: made[id(self)][0] + lag <= clock[0])
    monkeypatch.setattr(KeptIds, "values", values)


def _a_fills_block_1(eng: FakeEngine, clock: list[int]) -> list[int]:
    """A (6 prompt tokens) decodes 70 and 71: position 7 completes its block 1, in a step whose
    ids are in flight. Returns A's prompt."""
    a = list(range(6))
    eng.add("A", a)
    eng.step(new=[("A", [0, 1], 0, 6)])
    for i, tok in enumerate([70, 71]):
        clock[0] += 1
        eng.sample("A", tok)
        eng.step(cached=[("A", None, 6 + i, 1)])
    return a


def _decode_late_then_turn2(eng: FakeEngine, clock: list[int]):
    """Turn 1 completes block 1 by decoding (position 7), decodes one more token, finishes;
    turn 2 repeats its first 8 tokens and hits block 1."""
    a = _a_fills_block_1(eng, clock)
    clock[0] += 1
    eng.sample("A", 72)
    eng.step(cached=[("A", [2], 8, 1)])
    clock[0] += 1
    eng.sample("A", 73)
    turn2 = a + [70, 71, 9, 9, 9]
    eng.add("T2", turn2)
    return turn2, eng.step(new=[("T2", [0, 1, 5], 8, 3)], finished=["A"])["T2"]


def test_a_decode_filled_block_is_cached_a_step_late_without_waiting_for_the_device(monkeypatch):
    """Under async scheduling the token that completes a block by decoding is this step's input,
    still on the device when the step is saved: the block's rows are written now, its hash
    made the next step from the ids' host copy (``cache_late_blocks``) — never a wait for the
    device, which stalled the thinker's decode on an H200 (docs/gpu.md, "Twenty-second
    session"). The next step reports the block cached (the capped scheduler vouches for it
    then: tests/unit/test_scheduler_async.py), and turn 2's hit on it is served: rows equal to
    the writer's (oracle: :func:`prefix_rows`, a recompute), bitwise."""
    clock = [0]
    _late_copies(monkeypatch, clock)
    eng = FakeEngine(async_tokens=True)
    turn2, got = _decode_late_then_turn2(eng, clock)
    assert_rows(got, expected(turn2, 0, 11))
    assert eng.manager.metrics()["hit_tokens"] == 8
    assert eng.cached_log == [{0}, set(), set(), {1}, set()], eng.cached_log  # block 1: one step late


def test_decode_filled_blocks_are_hashed_from_the_scheduler_of_this_process(monkeypatch):
    """With the scheduler in the worker's process (vLLM's ``uni`` executor), a decode-filled
    block is hashed from the scheduler's token ids, a step late (the scheduler gets a sampled
    token a step after the runner), and no step keeps its input ids (no device → host copy:
    making a ``KeptIds`` fails the test). The next step reports the block, and turn 2's hit on it
    is served: rows equal to the writer's (oracle: :func:`prefix_rows`, a recompute), bitwise."""
    monkeypatch.setattr(KeptIds, "__init__", lambda self, *a, **k: pytest.fail("input ids kept"))
    eng = FakeEngine(async_tokens=True, scheduler_lag=1)
    turn2, got = _decode_late_then_turn2(eng, [0])
    assert_rows(got, expected(turn2, 0, 11))
    assert eng.manager.metrics()["hit_tokens"] == 8
    assert eng.cached_log == [{0}, set(), set(), {1}, set()], eng.cached_log  # block 1: one step late


@pytest.mark.parametrize("hash_block_size", [BS, BS // 2])
def test_block_hashes_are_vllms_own_where_the_scheduler_runs_in_this_process(monkeypatch, hash_block_size):
    """With the scheduler in this process and prefix caching on, a block's hash is vLLM's own
    (its last hash inside the block, first 8 bytes) — no hashing of ours (calling
    ``chained_block_hashes`` fails the test) — for prompt blocks and, a step late, for a
    decode-filled block; turn 2's hit is served, rows equal to the writer's (oracle:
    :func:`prefix_rows`), bitwise."""
    from omni_cache.engine import stage_manager

    monkeypatch.setattr(stage_manager, "chained_block_hashes", lambda *a, **k: pytest.fail("hashed by omni-cache"))
    monkeypatch.setattr(KeptIds, "__init__", lambda self, *a, **k: pytest.fail("input ids kept"))
    eng = FakeEngine(async_tokens=True, scheduler_lag=1, hash_block_size=hash_block_size)
    turn2, got = _decode_late_then_turn2(eng, [0])
    assert_rows(got, expected(turn2, 0, 11))
    assert eng.manager.metrics()["hit_tokens"] == 8
    per = BS // hash_block_size
    want = [int.from_bytes(h[:8], "little") for h in vllm_hashes(turn2[:8], hash_block_size)[per - 1::per]]
    assert [eng.manager.cache.ledger.block_hash[b] for b in (0, 1)] == want


def test_a_block_whose_last_tokens_differ_is_refused_with_vllms_hashes():
    """A hit on a block that shares only its first half with the writer's (vLLM hashes at half a
    block) is refused: the block's hash is vLLM's hash of the whole block, not of its first half
    (which would have served the writer's rows for other tokens)."""
    eng = FakeEngine(scheduler_lag=0, hash_block_size=BS // 2)
    eng.add("A", list(range(8)))
    eng.step(new=[("A", [0, 1], 0, 8)])
    eng.add("B", [0, 1, 2, 3, 4, 5, 99, 99, 9])  # block 1: same first half, other second half
    with pytest.raises(StaleRowsError):
        eng.step(new=[("B", [0, 1, 2], 8, 1)], finished=["A"])


def test_a_late_block_is_audited_with_its_writers_rows(monkeypatch, tmp_path):
    """With the audits on (oracle (a)'s writer records), a decode-filled block cached a step late
    is logged once, when it is cached, with the digests of the rows its writer's steps computed
    (oracle: :func:`prefix_rows`) — on an H200 such a block was served but left unverified, the
    lane's ``test_served_rows_equal_their_writers_rows`` failed on it (24th session)."""
    import json

    from omni_cache.engine.metrics import rows_digest

    monkeypatch.setenv("OMNI_CACHE_HIT_AUDIT", str(tmp_path))
    eng = FakeEngine(async_tokens=True, scheduler_lag=1)
    turn2, got = _decode_late_then_turn2(eng, [0])
    assert_rows(got, expected(turn2, 0, 11))
    lines = [json.loads(x) for f in tmp_path.glob("blocks-*.jsonl") for x in f.read_text().splitlines()]
    late = [x for x in lines if x["writer"] == "A" and x["block"] == 1]
    want = expected(turn2[:8], 4, 8)
    assert [x["digests"] for x in late] == [{k: rows_digest(want[k]) for k in want}], lines


def test_a_scheduler_that_disagrees_with_the_runner_resolves_nothing(monkeypatch):
    """A registered scheduler whose request holds other tokens than the runner's at positions
    both know (not this runner's request) is not trusted: the decode-filled block is written
    but never cached, and turn 2's hit on it is refused — never served from a block hashed with
    another request's tokens."""
    monkeypatch.setattr(KeptIds, "__init__", lambda self, *a, **k: pytest.fail("input ids kept"))
    eng = FakeEngine(async_tokens=True, scheduler_lag=1)
    eng.scheduler.requests.get = lambda rid: NS(all_token_ids=[1, 2, 3, 4, 5, 6, 70, 71, 72, 73])  # prompt 1.. not 0..
    with pytest.raises(StaleRowsError):
        _decode_late_then_turn2(eng, [0])
    assert eng.manager.cache.ledger.block_hash[1] is None


def test_without_late_caching_the_late_block_is_refused(monkeypatch):
    """Fault: the late blocks are never cached (``cache_late_blocks`` a no-op): the block filled
    while its token was on the device stays uncached, and turn 2's hit on it is refused — so
    the test above can fail."""
    clock = [0]
    _late_copies(monkeypatch, clock)
    monkeypatch.setattr(OmniCacheStageManager, "cache_late_blocks", lambda self: None)
    with pytest.raises(StaleRowsError):
        _decode_late_then_turn2(FakeEngine(async_tokens=True), clock)


def _hit_while_late(eng: FakeEngine, clock: list[int]):
    """A completes block 1 by decoding (position 7); in the very next step, while A decodes on,
    T2 arrives and hits A's first 8 tokens — block 1 with it."""
    a = _a_fills_block_1(eng, clock)
    clock[0] += 1
    eng.sample("A", 72)
    turn2 = a + [70, 71, 9, 9, 9]
    eng.add("T2", turn2)
    return turn2, eng.step(new=[("T2", [0, 1, 5], 8, 3)], cached=[("A", [2], 8, 1)])["T2"]


def test_a_hit_on_a_block_still_late_waits_for_its_ids_instead_of_refusing(monkeypatch):
    """The capped scheduler vouches for a late block only once the worker reported it cached, so a
    hit on a block whose ids are still in flight is not expected; should one come, the stage
    manager waits for those ids (one wait, in that step) and serves the hit — rows equal to the
    writer's, bitwise — instead of refusing it (``StaleRowsError`` stops the engine)."""
    clock, waits = [0], []
    _late_copies(monkeypatch, clock, lag=2, waits=waits)
    eng = FakeEngine(async_tokens=True)
    turn2, got = _hit_while_late(eng, clock)
    assert_rows(got, expected(turn2, 0, 11))
    assert waits, "the hit on the late block did not wait for its ids"


def test_a_hit_on_a_block_still_late_is_refused_without_the_wait(monkeypatch):
    """Fault: the hit's read never waits (``cache_late_blocks`` always non-blocking): the late
    block is uncached when the hit reads it and the hit is refused — so the test above can fail."""
    clock = [0]
    _late_copies(monkeypatch, clock, lag=2, waits=[])
    late = OmniCacheStageManager.cache_late_blocks
    monkeypatch.setattr(OmniCacheStageManager, "cache_late_blocks", lambda self, wait=False: late(self))
    with pytest.raises(StaleRowsError):
        _hit_while_late(FakeEngine(async_tokens=True), clock)


def test_a_late_block_is_cached_only_in_a_step_that_schedules_its_request(monkeypatch):
    """A request not scheduled in a step (preempted: vLLM may have handed its blocks to another
    request) neither caches nor reports its late block there — a reported block id is always
    its own; it does once it is scheduled again with the same block table."""
    clock = [0]
    _late_copies(monkeypatch, clock)
    eng = FakeEngine(async_tokens=True)
    _a_fills_block_1(eng, clock)
    eng.add("X", list(range(100, 104)))
    clock[0] += 1
    eng.step(new=[("X", [3], 0, 4)])  # A not scheduled in this step
    assert eng.cached_log[-1] == {3}, eng.cached_log  # X's block only: A's block 1 not reported
    clock[0] += 1
    eng.sample("A", 72)
    eng.step(cached=[("A", [2], 8, 1)])
    assert eng.cached_log[-1] == {1}, eng.cached_log  # scheduled again: now cached and reported


def test_resumed_request_serves_its_hit_from_the_cache():
    """A preempted request comes back with a new block table (``resumed_req_ids``) and its
    prefix hit; its first step after the resume hands off rows ``[0, end)``."""
    eng = FakeEngine()
    a = list(range(40, 50))
    eng.add("A", a)
    eng.step(new=[("A", [2, 4, 6], 0, 10)])
    eng.sample("A", 5)
    eng.step(cached=[("A", None, 10, 1)])
    # preempted; resumed with its two full blocks hit (vLLM: num_computed_tokens = 8)
    got = eng.step(cached=[("A", [2, 4, 8], 8, 3)], resumed=["A"])["A"]
    assert_rows(got, expected(a + [5], 0, 11))
    assert eng.manager.reqs["A"].block_ids == [2, 4, 8]


def test_same_step_hit_reads_rows_written_in_that_step():
    eng = FakeEngine()
    a = list(range(20, 32))  # 3 full blocks
    b = a[:8] + [0, 0]
    eng.add("A", a)
    eng.add("B", b)
    out = eng.step(new=[("A", [1, 2, 3], 0, 12), ("B", [1, 2, 4], 8, 2)])
    assert_rows(out["A"], expected(a, 0, 12))
    assert_rows(out["B"], expected(b, 0, 10))


def test_a_key_that_first_appears_in_a_later_step_is_cached_and_handed_off():
    """The set of cached keys is not fixed at the first save: a per-token output that first
    appears in step 2 is handed off from step 2 on (it used to be dropped from every
    hand-off), and a hit that needs it on blocks written before it existed is refused, never
    served with missing rows."""
    eng = FakeEngine()
    a = list(range(8))
    eng.add("A", a)
    first = eng.step(new=[("A", [0, 1], 0, 8)], keys=(HIDDEN_KEY,))["A"]
    assert set(first) == {HIDDEN_KEY}
    eng.sample("A", 3)
    got = eng.step(cached=[("A", [2], 8, 1)])["A"]  # the captured layer appears now
    assert_rows(got, expected(a + [3], 8, 9))
    assert LAYER in eng.manager.cache.specs

    eng.add("B", a + [4, 4])
    with pytest.raises(StaleRowsError, match="'B'.*block 0.*hidden_states.layer_0"):
        eng.step(new=[("B", [0, 1, 3], 8, 2)])
    assert eng.manager.metrics()["hits_refused"] == 1


def test_materialize_refuses_unknown_requests_and_consumes_the_step():
    eng = FakeEngine()
    eng.add("A", [1, 2, 3])
    sched = NS(finished_req_ids=set(), scheduled_new_reqs=[NS(req_id="A", block_ids=([0],), num_computed_tokens=0)],
               scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
               num_scheduled_tokens={"A": 3})
    eng.manager.new_step_starts(sched)
    eng.runner.input_batch.req_ids = ["A"]
    step = eng.manager.save_outputs(prefix_rows([1, 2, 3], 0, 3), {}, num_tokens_unpadded=3, num_tokens_padded=3)
    with pytest.raises(RuntimeError, match="unknown request ids"):
        eng.manager.materialize(step, ["Z"])
    with pytest.raises(RuntimeError, match="forward produced 2"):
        eng.manager.save_outputs(prefix_rows([1, 2], 0, 2), {}, num_tokens_unpadded=2, num_tokens_padded=2)


def test_step_host_time_is_split_into_its_parts(tmp_path, monkeypatch):
    """``seconds_save`` holds its parts (``seconds_plan``, ``seconds_stage``, the write and
    read); the counter file's own writes are counted in ``seconds_publish`` (docs/gpu.md: a
    GPU step's host time placed without a profiler)."""
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    eng = FakeEngine()
    a = list(range(100, 110))
    eng.add("A", a)
    eng.step(new=[("A", [3, 7, 9], 0, 10)])
    b = a[:8] + [1, 2]
    eng.add("B", b)
    eng.step(new=[("B", [3, 7, 11], 8, 2)])  # a hit
    m = eng.manager.metrics()
    assert m["hits_served"] == 1
    parts = m["seconds_plan"] + m["seconds_stage"] + m["seconds_write"] + m["seconds_read"]
    assert 0 < m["seconds_plan"] and 0 < m["seconds_stage"] and parts <= m["seconds_save"]
    assert m["seconds_publish"] > 0
    # the no-hit decode step's share: two prefills above count none; one decode step of A counts
    assert m["decode_steps"] == 0 and m["seconds_save_decode"] == 0
    assert m["fresh_handoffs"] == 1 and 0 < m["seconds_materialize_fresh"] <= m["seconds_materialize"]
    eng.sample("A", 55)
    eng.step(cached=[("A", None, 10, 1)])
    m = eng.manager.metrics()
    assert m["decode_steps"] == 1 and 0 < m["seconds_save_decode"] < m["seconds_save"]
    assert m["fresh_handoffs"] == 2
    import json

    eng.manager.shutdown()  # the forced write (the steps' writes are a timer thread's)
    written = json.loads(next(tmp_path.glob("metrics-*.json")).read_text())
    assert {"seconds_plan", "seconds_stage", "seconds_handoff_wait", "seconds_publish"} <= set(written)


def test_a_step_without_a_hit_leaves_the_multimodal_outputs_to_vllm_omni():
    """A step whose requests have no hit hands over the final hidden rows alone: vLLM-Omni's
    builder slices the multimodal outputs from its own copy, as with cache off (no per-request
    work of ours on its thread); a step with a hit hands over every key (its prefix rows)."""
    eng = FakeEngine()
    a = list(range(100, 110))
    eng.add("A", a)
    assert_rows(eng.step(new=[("A", [3, 7, 9], 0, 10)])["A"], expected(a, 0, 10))
    assert eng.last_handoff.mm_outputs == {} and set(eng.last_handoff.hidden_states) == {"A"}
    b = a[:8] + [1, 2]
    eng.add("B", b)
    eng.add("C", [5, 6, 7])
    got = eng.step(new=[("B", [3, 7, 11], 8, 2), ("C", [12], 0, 3)])  # B hits 8 tokens, C misses
    assert set(eng.last_handoff.mm_outputs) == {LAYER}
    assert_rows(got["B"], expected(b, 0, 10))
    assert_rows(got["C"], expected([5, 6, 7], 0, 3))
