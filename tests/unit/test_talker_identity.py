"""Talker prefix caching's content identity, engine-free: the row layout against vLLM-Omni's
own talker prompt length, the keys (shared up to the first difference, never after), and
omni-cache's talker scheduler on vLLM's real scheduler and KV cache manager (no model)."""

from __future__ import annotations

import os

import pytest

from omni_cache.core.talker_keys import (
    ASSISTANT_TOKEN_ID,
    IM_START_TOKEN_ID,
    SYSTEM_TOKEN_ID,
    TALKER_KEYS_ARG,
    USER_TOKEN_ID,
    MediaItem,
    ensure_signing_secret,
    signature,
    talker_block_keys,
    talker_prompt_rows,
)
from tests.unit.sched_util import BS, scheduler_kwargs
from tests.unit.sched_util import step as _step
from tests.unit.sched_util import vllm_config as _vllm_config
from tests.util import placeholder_talker_keys

IM_END, NL, IMAGE = 151645, 198, 151655


def seg(role: int, body: list[int]) -> list[int]:
    return [IM_START_TOKEN_ID, role, NL, *body, IM_END, NL]


def chat(system: list[int], users: list[list[int]], answers: list[list[int]]) -> list[int]:
    """A chat-template prompt: system, then user/answer turns, ending with the generation
    prompt ``<|im_start|>assistant\\n``."""
    ids = seg(SYSTEM_TOKEN_ID, system)
    for k, u in enumerate(users):
        ids += seg(USER_TOKEN_ID, u)
        if k < len(answers):
            ids += seg(ASSISTANT_TOKEN_ID, answers[k])
    return ids + [IM_START_TOKEN_ID, ASSISTANT_TOKEN_ID, NL]


SYSTEM = list(range(1000, 1040))
U1 = list(range(2000, 2070))
U2 = list(range(3000, 3050))
A1 = list(range(4000, 4020))


def _talker_len(ids: list[int]) -> int:
    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import _compute_talker_prompt_ids_length

    return _compute_talker_prompt_ids_length({"ids": {"all": ids, "prompt": ids}}, device="cpu")


def keys(ids, media=(), seed=()):
    return talker_block_keys(ids, list(media), talker_prompt_len=_talker_len(ids), block_size=BS, seed=seed)


def test_the_layout_gives_vllm_omnis_talker_prompt_length():
    for ids in (chat(SYSTEM, [U1], []), chat(SYSTEM, [U1, U2], [A1]), chat([], [U1, U2, U1], [A1, A1])):
        rows, assistant = talker_prompt_rows(ids)
        assert len(rows) + assistant == _talker_len(ids)
        assert assistant == 9
        # user rows come from user segments only, in order
        segment_starts = (max(i for i in range(int(r) + 1) if ids[i] == IM_START_TOKEN_ID) for r in rows)
        assert all(ids[s + 1] == USER_TOKEN_ID for s in segment_starts)


def test_turn_two_shares_exactly_turn_ones_user_blocks():
    t1, t2 = chat(SYSTEM, [U1], []), chat(SYSTEM, [U1, U2], [A1])
    k1, k2 = keys(t1), keys(t2)
    n_user1 = len(seg(USER_TOKEN_ID, U1))
    assert len(k1) == n_user1 // BS and len(k1) >= 2
    assert k2[:len(k1)] == k1  # turn 1's user rows are turn 2's first rows, same content
    assert len(k2) == (n_user1 + len(seg(USER_TOKEN_ID, U2))) // BS
    assert k1 == keys(t1)  # deterministic


@pytest.mark.parametrize("what", ["system prompt", "words", "image", "speaker"])
def test_no_shared_key_past_the_first_difference(what):
    """Equal token lengths, one difference: no key at or after it is shared — and vLLM's own
    hash of the placeholder prompt ``[0] * n`` (what vLLM-Omni gives the talker) cannot
    tell the two apart."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    u1_img = [*U1[:10], *[IMAGE] * 30, *U1[40:]]
    img_at = len(seg(SYSTEM_TOKEN_ID, SYSTEM)) + 3 + 10  # thinker position of the first image token
    a_ids = chat(SYSTEM, [u1_img, U2], [A1])
    a_media = [MediaItem(img_at, 30, "image", "cat")]
    b_ids, b_media, seed_b = list(a_ids), list(a_media), ()
    if what == "system prompt":
        b_ids[5] += 1
        diff = 5
    elif what == "words":  # turn 2's words
        diff = a_ids.index(U2[7])
        b_ids[diff] += 1
    elif what == "image":
        b_media = [MediaItem(img_at, 30, "image", "dog")]
        diff = img_at
    else:
        seed_b = ("speaker b",)
        diff = 0
    ka, kb = keys(a_ids, a_media), keys(b_ids, b_media, seed_b)
    rows, _ = talker_prompt_rows(a_ids)
    assert len(ka) == len(kb) >= 3
    for j in range(len(ka)):
        last_row_pos = int(rows[(j + 1) * BS - 1])
        assert (ka[j] == kb[j]) == (last_row_pos < diff), (what, j, last_row_pos, diff)
    assert ka[-1] != kb[-1]
    # the placeholder scheme: vLLM's own block hashes of the two talker requests (prompt
    # [0] * n, as vLLM-Omni builds them) are all equal, whatever the conversations said
    init_none_hash(sha256)
    ha = _talker_request("a", a_ids, keyed=False).block_hashes
    hb = _talker_request("b", b_ids, keyed=False).block_hashes
    assert len(ha) >= len(ka) and ha == hb


def test_a_layout_that_does_not_match_gets_no_keys():
    ids = chat(SYSTEM, [U1], [])
    assert talker_block_keys(ids, [], talker_prompt_len=_talker_len(ids) + 1, block_size=BS) == []
    with pytest.raises(ValueError):
        talker_block_keys(ids, [], talker_prompt_len=_talker_len(ids), block_size=0)


# ---- the talker scheduler on vLLM's real scheduler ----

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return _vllm_config(tmp_path_factory.mktemp("llama-config"), num_blocks=NUM_BLOCKS,
                        max_num_batched_tokens=512, async_scheduling=False)


def _talker_request(rid: str, thinker_ids: list[int], media=(), *, keyed: bool = True, block_size: int = BS):
    """A talker request as vLLM-Omni builds it (placeholder prompt ``[0] * n``), with vLLM's
    own block hasher, and the keys the orchestrator hook would attach."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    n = _talker_len(thinker_ids)
    extra = {}
    if keyed:
        keys = talker_block_keys(thinker_ids, list(media), talker_prompt_len=n, block_size=block_size)
        extra[TALKER_KEYS_ARG] = {"block_size": block_size, "keys": keys,
                                  "signature": signature(block_size, keys, ensure_signing_secret())}
    sp = SamplingParams(max_tokens=4, ignore_eos=True, extra_args=extra)
    return Request(rid, [0] * n, sp, None, block_hasher=get_request_block_hasher(BS, sha256))


def _admit(s, req) -> int:
    """Add ``req`` to the scheduler; tokens of its prefix hit on the KV cache manager."""
    s.add_request(req)
    return s.kv_cache_manager.get_computed_blocks(req)[1]


def test_the_talker_scheduler_hits_on_content_only(vllm_config):
    from omni_cache.engine.talker_scheduler import TalkerARScheduler

    s = TalkerARScheduler(**scheduler_kwargs(vllm_config, NUM_BLOCKS))
    t1, t2 = chat(SYSTEM, [U1], []), chat(SYSTEM, [U1, U2], [A1])
    turn1 = _talker_request("turn1", t1)
    placeholder_hashes = list(turn1.block_hashes)  # vLLM's own hash of [0] * n
    assert _admit(s, turn1) == 0
    assert set(s.schedule().num_scheduled_tokens) == {"turn1"}  # its blocks are in the prefix cache now
    n_user1 = len(seg(USER_TOKEN_ID, U1))
    # turn 2: its leading blocks are turn 1's user rows
    assert _admit(s, _talker_request("turn2", t2)) == (n_user1 // BS) * BS
    # the same lengths, another system prompt: nothing
    other = list(t2)
    other[5] += 1
    other_req = _talker_request("other-system", other)
    assert other_req.block_hashes[:2] == placeholder_hashes[:2]  # what the placeholder scheme would match
    assert _admit(s, other_req) == 0
    # without keys (the orchestrator hook not installed): nothing
    assert _admit(s, _talker_request("unkeyed", t2, keyed=False)) == 0
    # keys for another block size: nothing either
    assert _admit(s, _talker_request("wrong-bs", t2, block_size=2 * BS)) == 0
    c = s.talker_identity_counters
    assert c["unkeyed"] == 2 and c["keyed"] == 3


def test_a_keyed_turn_hashes_the_same_in_every_engine(vllm_config):
    """Two schedulers (two talker replicas, or a restart) hash a keyed block the same; the
    first unkeyed block (the assistant rows) and all after it differ per request."""
    from omni_cache.engine.talker_scheduler import TalkerARScheduler

    t1 = chat(SYSTEM, [U1], [])
    a, b = _talker_request("a", t1), _talker_request("b", t1)
    TalkerARScheduler(**scheduler_kwargs(vllm_config, NUM_BLOCKS)).add_request(a)
    TalkerARScheduler(**scheduler_kwargs(vllm_config, NUM_BLOCKS)).add_request(b)
    n_keyed = len(seg(USER_TOKEN_ID, U1)) // BS
    assert a.block_hashes[:n_keyed] == b.block_hashes[:n_keyed]
    assert len(a.block_hashes) > n_keyed
    assert a.block_hashes[n_keyed] != b.block_hashes[n_keyed]


# ---- the orchestrator hook on vLLM-Omni's real request objects ----


def _engine_request(rid: str, ids: list[int], mm=None):
    from vllm import SamplingParams
    from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

    req = build_engine_core_request_from_tokens(request_id=rid, prompt={"prompt_token_ids": ids},
                                                params=SamplingParams(max_tokens=4, extra_args={"tts_local_seed": 7}),
                                                mm_features=mm)
    return req


def test_the_hook_keys_talker_requests_from_the_thinker_prompt():
    """``TalkerIdentity`` reads the thinker's ``OmniEngineCoreRequest`` (token ids, media
    features) and gives the talker's (placeholder prompt) its keys in its own copy of the
    sampling params; a talker request whose thinker prompt it never saw, or whose length the
    layout does not give, gets none; the placeholder scheme keys by index only."""
    from types import SimpleNamespace

    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from omni_cache.driver.talker_identity import TalkerIdentity

    ids = chat(SYSTEM, [[*U1[:10], *[IMAGE] * 30, *U1[40:]], U2], [A1])
    at = ids.index(IMAGE)
    mm = [MultiModalFeatureSpec(data=None, modality="image", identifier="cat", mm_position=PlaceholderRange(at, 30))]
    hook = TalkerIdentity(None, None, block_size=BS)
    hook.remember_thinker("r1", _engine_request("r1", ids, mm))
    talker = _engine_request("r1", [0] * _talker_len(ids))
    shared_params = talker.sampling_params
    state = SimpleNamespace(prompt={"prompt": "…", "additional_information": {"speaker": ["ethan"]}})
    hook.attach("r1", talker, state)
    entry = talker.sampling_params.extra_args[TALKER_KEYS_ARG]
    assert talker.sampling_params is not shared_params and TALKER_KEYS_ARG not in (shared_params.extra_args or {})
    assert talker.sampling_params.extra_args["tts_local_seed"] == 7  # the request's other extra args stay
    assert entry["block_size"] == BS
    assert entry["keys"] == talker_block_keys(ids, [MediaItem(at, 30, "image", "cat")],
                                              talker_prompt_len=_talker_len(ids), block_size=BS,
                                              seed=(repr(["ethan"]), repr(None), None, None))
    assert hook.keys["r1"] == entry["keys"] and hook.attached == 1
    # no thinker prompt seen for it; a talker prompt of another length
    hook.attach("r2", other := _engine_request("r2", [0] * 99), state)
    assert TALKER_KEYS_ARG not in (other.sampling_params.extra_args or {})
    hook.remember_thinker("r3", _engine_request("r3", ids, mm))
    hook.attach("r3", wrong := _engine_request("r3", [0] * (_talker_len(ids) + 1)), state)
    assert TALKER_KEYS_ARG not in (wrong.sampling_params.extra_args or {}) and hook.unkeyed == 2
    # the placeholder scheme (test code): index keys, whatever the content; then content again
    with placeholder_talker_keys(hook):
        hook.remember_thinker("r4", _engine_request("r4", ids, mm))
        hook.attach("r4", ph := _engine_request("r4", [0] * _talker_len(ids)), state)
    assert ph.sampling_params.extra_args[TALKER_KEYS_ARG]["keys"][:2] == ["placeholder/0", "placeholder/1"]
    hook.remember_thinker("r5", _engine_request("r5", ids, mm))
    hook.attach("r5", again := _engine_request("r5", [0] * _talker_len(ids)), state)
    assert again.sampling_params.extra_args[TALKER_KEYS_ARG]["keys"] == entry["keys"]


def test_hits_are_found_by_the_callers_request_id():
    """``AsyncOmni`` runs ``run-1`` as ``run-1-<8 hex>`` in the engine; the result objects ask
    with the caller's id."""
    from types import SimpleNamespace

    from omni_cache.driver.talker_identity import TalkerIdentity

    hook = TalkerIdentity(None, None, block_size=BS)
    hook.record_outputs([SimpleNamespace(request_id="run-1-8cec72b0", num_cached_tokens=0, prompt_token_ids=[0] * 40),
                         SimpleNamespace(request_id="run-11-0a0b0c0d", num_cached_tokens=32, prompt_token_ids=[0] * 40),
                         SimpleNamespace(request_id="0_abc", num_cached_tokens=64, prompt_token_ids=[0] * 70)])
    hook.record_outputs([SimpleNamespace(request_id="0_abc", num_cached_tokens=0, prompt_token_ids=[0] * 70)])
    assert hook.pop_hit("run-1") == (0, 40) and hook.pop_hit("run-1") is None
    assert hook.pop_hit("run-11") == (32, 40)
    assert hook.pop_hit("0_abc") == (64, 70)  # the first output's hit is kept


# ---- eviction and preemption of talker blocks (vLLM's real KV cache manager) ----


def _run_until_done(s, max_steps: int = 200) -> list:
    outs = []
    for _ in range(max_steps):
        if not s.requests:
            return outs
        outs.append(_step(s))
    raise AssertionError("requests did not finish")


def _small(tmp_path, num_blocks: int):
    from omni_cache.engine.talker_scheduler import TalkerARScheduler

    cfg = _vllm_config(tmp_path, num_blocks=num_blocks, max_num_batched_tokens=512, async_scheduling=False)
    return TalkerARScheduler(**scheduler_kwargs(cfg, num_blocks))


def test_evicted_talker_blocks_are_recomputed_never_confused(tmp_path):
    """Turn 1's talker blocks are evicted by another conversation whose placeholder prompt is
    the same length and whose blocks reuse the same block ids: turn 2 then hits nothing
    (vLLM would have matched the other conversation's placeholder blocks)."""
    s = _small(tmp_path, 14)
    t1, t2 = chat(SYSTEM, [U1], []), chat(SYSTEM, [U1, U2], [A1])
    s.add_request(_talker_request("turn1", t1))
    _run_until_done(s)
    other = [*t1[:5], t1[5] + 1, *t1[6:]]  # another system prompt, same lengths
    filler = chat(SYSTEM[:20], [list(range(5000, 5160))], [])  # needs every block: evicts turn 1's
    for rid, ids in (("other", other), ("filler", filler)):
        s.add_request(_talker_request(rid, ids))
        _run_until_done(s)
    turn2 = _talker_request("turn2", t2)
    assert _admit(s, turn2) == 0
    # the control: the same turns in the same small cache with only the other conversation
    # between them (no filler) — turn 2 hits turn 1's keyed user blocks, so the 0 above is the
    # eviction's doing, not keys that never match
    c = _small(tmp_path, 14)
    for rid, ids in (("turn1", t1), ("other", other)):
        c.add_request(_talker_request(rid, ids))
        _run_until_done(c)
    assert _admit(c, _talker_request("turn2", t2)) == (len(seg(USER_TOKEN_ID, U1)) // BS) * BS > 0


def test_a_preempted_talker_request_resumes_on_its_own_blocks(tmp_path):
    """Two talker requests fill the KV cache; decode growth preempts the later one. Its block
    hashes (keys, then its nonce) are kept across the preemption, and on resume it hits its
    own blocks that were not evicted meanwhile — never the other request's."""
    from vllm import SamplingParams

    s = _small(tmp_path, 13)  # 12 usable (vLLM keeps a null block): 6 + 6 prompt blocks
    t1 = chat(SYSTEM, [U1], [])
    a = _talker_request("a", t1)
    a.sampling_params = SamplingParams(max_tokens=40, ignore_eos=True, extra_args=a.sampling_params.extra_args)
    a.max_tokens = 40
    b = _talker_request("b", chat([*SYSTEM[:-1], 9], [U1], []))  # another conversation, same lengths
    b.max_tokens = 30
    s.add_request(a)
    s.add_request(b)
    hashes_b = None
    resumed_at = None
    for _ in range(200):
        if not s.requests:
            break
        if hashes_b is None and b.num_computed_tokens > 0:
            hashes_b = list(b.block_hashes)
        out = _step(s)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid == "b" and rid in (cached.resumed_req_ids or ()):
                resumed_at = cached.num_computed_tokens[i]
    assert b.num_preemptions >= 1, "the KV cache did not force a preemption"
    assert resumed_at is not None and resumed_at % BS == 0
    n_keyed = len(seg(USER_TOKEN_ID, U1)) // BS
    assert 0 < resumed_at <= len(hashes_b) * BS
    assert b.block_hashes[:len(hashes_b)] == hashes_b  # the same hashes after the preemption
    assert not set(b.block_hashes[:n_keyed]) & set(a.block_hashes)  # never a's blocks


def test_client_sent_keys_are_never_trusted(vllm_config):
    """vLLM-Omni lets a client send the talker's sampling params: keys a client put there —
    unsigned, signed with another secret, or copied from a real request with other keys —
    share nothing, and the orchestrator hook drops them where it has no keys of its own."""
    from types import SimpleNamespace

    from omni_cache.driver.talker_identity import TalkerIdentity
    from omni_cache.engine.talker_scheduler import TalkerARScheduler

    s = TalkerARScheduler(**scheduler_kwargs(vllm_config, NUM_BLOCKS))
    t1 = chat(SYSTEM, [U1], [])
    victim = _talker_request("victim", t1)
    assert _admit(s, victim) == 0
    s.schedule()
    genuine = victim.sampling_params.extra_args[TALKER_KEYS_ARG]
    other = chat([*SYSTEM[:-1], 7], [U1], [])  # the attacker's conversation, same lengths
    forged = [
        {"block_size": BS, "keys": genuine["keys"]},  # unsigned
        {**genuine, "signature": signature(BS, genuine["keys"], "not the secret")},
        {**genuine, "keys": genuine["keys"][:-1] + ["x"]},  # the signature of other keys
    ]
    for i, entry in enumerate(forged):
        req = _talker_request(f"attacker{i}", other, keyed=False)
        req.sampling_params.extra_args = {TALKER_KEYS_ARG: entry}
        assert _admit(s, req) == 0, i
    # the control: the genuine entry, signed with the secret, does hit the victim's blocks
    req = _talker_request("genuine-copy", other, keyed=False)
    req.sampling_params.extra_args = {TALKER_KEYS_ARG: genuine}
    assert _admit(s, req) == len(genuine["keys"]) * BS > 0
    # the hook, with no thinker prompt for the request, strips what the client sent
    hook = TalkerIdentity(None, None, block_size=BS)
    req = _engine_request("attacker", [0] * _talker_len(other))
    req.sampling_params.extra_args = {TALKER_KEYS_ARG: genuine, "tts_local_seed": 1}
    hook.attach("attacker", req, SimpleNamespace(prompt=None))
    assert req.sampling_params.extra_args == {"tts_local_seed": 1}



def test_a_moved_speaker_helper_is_an_error_at_start_up(monkeypatch):
    """Keys without vLLM-Omni's speaker/language would be weaker: installing talker identity
    on a vLLM-Omni whose helper moved raises, and a malformed prompt the helper cannot read
    raises (the installed hook logs it and gives no keys), never keys without its speaker."""
    from types import SimpleNamespace

    import vllm_omni.model_executor.stage_input_processors.tts_utils as tts_utils

    from omni_cache.driver.talker_identity import TalkerIdentity, TalkerIdentitySetupError, install_talker_identity

    talker = SimpleNamespace(stage_vllm_config=SimpleNamespace(
        model_config=SimpleNamespace(model_stage="talker"),
        cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=BS)))
    engine = SimpleNamespace(stage_pools=[SimpleNamespace(), talker])
    ids = chat(SYSTEM, [U1], [])
    hook = TalkerIdentity(None, None, block_size=BS)
    hook.remember_thinker("r1", _engine_request("r1", ids))
    with pytest.raises(AttributeError):  # a list prompt holding a string: the helper cannot read it
        hook.keys_for("r1", _engine_request("r1", [0] * _talker_len(ids)), SimpleNamespace(prompt=["text"]))
    monkeypatch.delattr(tts_utils, "extract_language_from_prompt")
    with pytest.raises(TalkerIdentitySetupError, match="extract_language_from_prompt"):
        install_talker_identity(engine)


def test_the_talker_records_are_written_off_the_schedulers_thread(vllm_config, tmp_path, monkeypatch):
    """A request's first token publishes ``talker-<pid>.json`` through the file's writer thread,
    never on the scheduler's (its step is the first audio packet's path); shutdown writes the
    last records on the calling thread. Oracle: the thread of each write (``_write`` recorded)
    and the file's records."""
    import json
    import threading
    import time

    from omni_cache.engine.metrics import MetricsFile
    from omni_cache.engine.talker_scheduler import TalkerARScheduler

    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    writers: list[str] = []
    real = MetricsFile._write
    monkeypatch.setattr(MetricsFile, "_write",
                        lambda self, *a: (writers.append(threading.current_thread().name), real(self, *a))[1])
    s = TalkerARScheduler(**scheduler_kwargs(vllm_config, NUM_BLOCKS))
    s.add_request(_talker_request("first", chat(SYSTEM, [U1], [])))
    _step(s)  # its prefill: the first token comes
    path = tmp_path / f"talker-{os.getpid()}.json"
    for _ in range(250):
        if path.exists():
            break
        time.sleep(0.01)
    assert set(json.loads(path.read_text())["requests"]) == {"first"}
    assert writers and threading.current_thread().name not in writers, writers
    s.shutdown()
    assert writers[-1] == threading.current_thread().name
    assert set(json.loads(path.read_text())["requests"]) == {"first"}
