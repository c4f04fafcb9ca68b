"""omni-cache on the production path: vLLM-Omni's async engine (``AsyncOmni``) with the
streaming hand-off (``async_chunk: true``): a fixed workload, cache on vs a real cache-off
engine (bitwise on these prompts), vs vLLM-Omni's built-in cache (oracle (b): bitwise where
both serve the same hit) and every served row vs its writer's (oracle (a)).

The workload of ``test_cache_equality`` (text, image, audio, a two-turn chat whose second turn
hits the first answer's decode-filled block, a thinker prefill chunked over two steps with a
concurrent request hitting the shared prefix) and the talker workload run on two streaming
engines: ``stream_off`` (thinker and talker prefix caching off) and ``stream_omni``
(omni-cache + the talker's content-keyed prefix cache), and on ``stream_builtin``
(vLLM-Omni's own cache on the thinker). ``stream_omni`` then runs a pair whose
first request's rows are declared lost (fault injection, chosen per request: the scheduler's
``FORGET_ROWS`` marker), so the second one's hit is capped; ``stream_off`` runs the same pair.
What is compared is what the talker *receives*: every streamed chunk the thinker sends — the
first hand-off (``embed.prefill``, ``hidden_states.output``, ``embed.tts_*``, ``ids.*``: prompt
rows ``cached prefix ++ fresh`` on a hit) and every decode chunk (``embed.decode``) — recorded
at the hand-off seam, plus thinker tokens and the whole waveform for requests sent one at a
time (for the two-request batch the talker's sampling follows chunk timing, so its audio would
not tell a wrong row from a right one: its hand-off chunks are compared instead). In that
batch, B's hit rows must equal the rows A computed bitwise (what the cache served is what its
writer computed); against cache off, the batch's prompt rows are compared within batch
variance (``tests.util.assert_batch_rows``): cache on changes the step's batch, and the CPU
kernels are not batch-invariant — with cache off, B's recompute of A's prefix differed from
A's own rows in the last bf16 bit (3 of 1,440 captured-layer rows). Decode chunks, ids and
thinker tokens are compared bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_cache.driver.inputs import build_request
from omni_cache.engine.scheduler import FORGET_ROWS
from omni_cache.exactness.fuzz import audit_lines, served_rows_report
from tests.device import BATCH_INVARIANT, CACHE_OFF_BITWISE
from tests.pipeline.engines import thinker_params
from tests.pipeline.workloads import (
    BLOCK,
    FIRST,
    LONG,
    REPEAT,
    STEP_BUDGET,
    assert_served_rows,
    assert_talker_kv_oracle,
    assert_talker_workload,
    expected_hits,
    expected_talker_blocks,
    prefix_hit,
    run_talker_workload,
    run_workload,
)
from tests.util import (
    assert_audio_vs_cache_off,
    assert_batch_rows,
    assert_chunks_vs_cache_off,
    assert_same_chunks,
    read_metrics,
    records_of,
)

pytestmark = pytest.mark.pipeline

#: the fault-injection pair: a prompt prefix no other request shares (past the system prompt)
LOST_PREFIX = "These rows are declared lost. " + LONG
LOST_PAIR = [("lost:first", LOST_PREFIX + "What is first?"),
             ("lost:second", LOST_PREFIX + "And what comes second, please?")]


def _run(engine, *, placeholder_demo: bool, forget_first: bool):
    pipe, model_dir = engine.pipe, engine.model_dir
    named, t1_len, batch, _ = run_workload(pipe, model_dir)
    talker = run_talker_workload(pipe, model_dir, placeholder_demo=placeholder_demo)
    lost = {}
    for k, (name, text) in enumerate(LOST_PAIR):
        sps = thinker_params(pipe, **{FORGET_ROWS: True}) if forget_first and k == 0 else None
        lost[name] = pipe.run(build_request(text), sampling_params_list=sps)
    return {"dir": engine.dir, "model_dir": model_dir,
            "named": named, "t1_len": t1_len, "batch": batch, "talker": talker[:2], "lost": lost,
            "all": [r for _, r in named + talker[0]] + list(batch) + list(lost.values())}


@pytest.fixture(scope="session")
def stream_runs(stream_off, stream_omni, stream_builtin):
    return {"off": _run(stream_off, placeholder_demo=False, forget_first=False),
            "omni_cache": _run(stream_omni, placeholder_demo=True, forget_first=True),
            "builtin": _run(stream_builtin, placeholder_demo=False, forget_first=False)}


def _assert_same_chunks_tail(got: list[dict], ref: list[dict], name: str) -> None:
    """Decode chunks (after the first hand-off) equal bitwise, same count."""
    assert len(got) == len(ref), (name, len(got), len(ref))
    for i, (g, r) in enumerate(zip(got[1:], ref[1:]), 1):
        assert set(g) == set(r) and all(torch.equal(g[k], r[k]) for k in r), (name, i)
    assert set(got[0]) == set(ref[0]), name


def _expected_hits(run) -> list[int]:
    """Each workload request's thinker hit (named requests in order, then the batch), computed
    from the token ids vLLM-Omni handed the talker (:func:`~tests.pipeline.workloads.expected_hits`).
    Same photo and recording in every media request: their identifiers match wherever their
    token ids do."""
    results = [r for _, r in run["named"]] + list(run["batch"])
    return expected_hits([_prompt_ids(run["dir"], r.request_id) for r in results], results, together=2)


def test_streaming_hits_happen_and_are_served(stream_runs):
    run = stream_runs["omni_cache"]
    named, t1_len, batch = run["named"], run["t1_len"], run["batch"]
    hits = {n: r.num_cached_tokens for n, r in named}
    expected = _expected_hits(run)
    assert [r.num_cached_tokens for _, r in named] + [r.num_cached_tokens for r in batch] == expected, \
        (hits, [r.num_cached_tokens for r in batch], expected)
    bi = stream_runs["builtin"]  # the built-in cache caps nothing: the same hits
    assert [r.num_cached_tokens for _, r in bi["named"]] + [r.num_cached_tokens for r in bi["batch"]] == expected
    for n, r in named:
        if n.endswith("second, please?"):
            assert r.num_cached_tokens >= BLOCK, (n, hits)
    assert hits["chat:turn2"] > t1_len, (hits, t1_len)  # the answer's decode-filled block
    assert batch[1].num_cached_tokens > STEP_BUDGET  # hit past the chunked prefill's first step
    m = read_metrics(run["dir"], "metrics", until=lambda m: m["hits_served"] >= 4)  # the engine may be live
    assert m["hits_served"] >= 4 and m["hits_refused"] == 0, m
    # the second request's first hand-off covers its whole prompt
    first = records_of(run["dir"], named[1][1].request_id)[0]
    assert first["embed.prefill"].shape[0] == named[1][1].num_prompt_tokens + 1, first["embed.prefill"].shape
    assert all(r.num_cached_tokens == 0 for _, r in stream_runs["off"]["named"])  # the real cache-off engine


def test_fixed_workload_streamed_talker_inputs_equal_cache_off_bitwise(stream_runs):
    """This fixed workload's streamed chunks, tokens and audio equal the real cache-off
    engine's bitwise (a regression test of these prompts; in general the suffix after a hit
    may differ from cache off in the last bits: docs/architecture.md, "Integrity"). On CUDA at
    oracle (c)'s stated precision instead (tests/device.py)."""
    off, on = stream_runs["off"], stream_runs["omni_cache"]
    assert [n for n, _ in off["named"]] == [n for n, _ in on["named"]]
    for (name, r_off), (_, r_on) in zip(off["named"], on["named"]):
        assert r_off.error is None and r_on.error is None, name
        same_tokens = r_on.token_ids == r_off.token_ids
        assert same_tokens or not CACHE_OFF_BITWISE, name  # (CUDA: near-ties may flip)
        same = assert_chunks_vs_cache_off(records_of(on["dir"], r_on.request_id),
                                          records_of(off["dir"], r_off.request_id), name,
                                          num_prompt_tokens=r_on.num_prompt_tokens, hit=r_on.num_cached_tokens,
                                          same_tokens=same_tokens)
        assert_audio_vs_cache_off(r_on, r_off, name, handoff_bitwise=same)
    # the batch (sorted by prompt length: A, B)
    (a_on, b_on), (a_off, b_off) = ([records_of(run["dir"], r.request_id) for r in run["batch"]] for run in (on, off))
    hit = max(r.num_cached_tokens for r in on["batch"])
    if not CACHE_OFF_BITWISE:
        # CUDA: the batch's rows vs cache off are not bounded there (assert_batch_rows), so its
        # oracle is (a): B's served rows are the rows A computed for them, bitwise
        assert hit > 0, [r.num_cached_tokens for r in on["batch"]]
        for k in ("embed.prefill", "hidden_states.output"):
            assert torch.equal(b_on[0][k][:hit], a_on[0][k][:hit]), ("batch:B served rows", k)
        return
    _assert_same_chunks_tail(a_on, a_off, "batch:A")
    _assert_same_chunks_tail(b_on, b_off, "batch:B")
    for k in set(b_off[0]) - {"embed.prefill", "hidden_states.output"}:  # tts embeddings, ids, meta
        assert torch.equal(a_on[0][k], a_off[0][k]) and torch.equal(b_on[0][k], b_off[0][k]), k
    for k in ("embed.prefill", "hidden_states.output"):
        assert_batch_rows(a_on[0][k], a_off[0][k], f"batch:A {k}")
        assert_batch_rows(b_on[0][k], b_off[0][k], f"batch:B {k}", writer=a_on[0][k], hit=hit)
    for r_on, r_off in zip(on["batch"], off["batch"]):
        assert r_on.token_ids == r_off.token_ids


def test_served_rows_equal_their_writers_rows(stream_runs):
    """Oracle (a): every row served on a hit — text, image, audio, the chat's prompt blocks,
    the same-step hit — equals bitwise the row its writer computed (the thinker's hit audit
    names the writer of each served block; its first hand-off holds those rows), and the chat's
    decode-filled blocks equal the digest of the rows their writer's forward computed while
    decoding (:func:`~tests.pipeline.workloads.assert_served_rows`): none unverified, on CUDA as
    on the CPU."""
    on = stream_runs["omni_cache"]
    results = [r for _, r in on["named"]] + list(on["batch"])
    served = served_rows_report(on["dir"], results)
    assert served, "no audited hit"
    assert sum(v for v, _, _ in served.values()) >= 40, served
    assert_served_rows(served, on["named"], on["batch"], on["t1_len"])


def test_omni_cache_equals_the_builtin_cache_bitwise(stream_runs):
    """Oracle (b): vLLM-Omni's built-in cache (``stream_builtin``) on the same requests: both
    serve the same thinker hit on every request (asserted, none skipped), thinker tokens and
    every streamed chunk (first hand-off and decode chunks) are bitwise equal, and the audio
    too where omni-cache's talker computed its whole prompt. Where its talker hit (the
    built-in has no talker cache: a talker hit takes vLLM's hit path) the audio is held to the
    real cache-off engine's instead, bitwise
    (``test_fixed_workload_streamed_talker_inputs_equal_cache_off_bitwise``)."""
    on, bi = stream_runs["omni_cache"], stream_runs["builtin"]
    talker_hit = []
    for (name, r_on), (_, r_bi) in zip(on["named"], bi["named"], strict=True):
        assert r_bi.error is None, name
        assert r_on.num_cached_tokens == r_bi.num_cached_tokens, (name, r_on.num_cached_tokens, r_bi.num_cached_tokens)
        assert r_on.token_ids == r_bi.token_ids, name
        assert_same_chunks(records_of(on["dir"], r_on.request_id), records_of(bi["dir"], r_bi.request_id), name)
        if r_on.talker_num_cached_tokens == 0:
            assert np.array_equal(r_on.audio, r_bi.audio), name
        else:
            talker_hit.append(name)
    hits = [(n, r.num_cached_tokens) for n, r in on["named"]]
    assert sum(bool(h) for _, h in hits) >= 6, hits
    print(f"(b) audio vs the built-in: {len(on['named']) - len(talker_hit)} requests; talker hits {talker_hit}")


@pytest.mark.parametrize("variant", ["off", "omni_cache"])
def test_a_request_sent_again_gets_the_same_audio(stream_runs, variant):
    """Per-request talker generators (``tts_local_seed``, omni_cache.engine.talker): the first
    request sent again after all the others (a whole-prompt hit with the cache on) gets the
    same codec frames, hence the same waveform. With the talker's residual codebooks drawn
    from its process's global RNG — vLLM-Omni's Qwen3-Omni — the repeat's audio differed
    (docs/architecture.md, "What is bitwise under concurrency")."""
    named = dict(stream_runs[variant]["named"])
    first, again = named[FIRST], named[REPEAT]
    assert again.token_ids == first.token_ids
    assert first.audio is not None and np.array_equal(again.audio, first.audio)


def _prompt_ids(d, request_id: str) -> list[int]:
    """The thinker prompt's token ids as vLLM-Omni handed them to the talker (``ids.prompt`` of
    the first streamed chunk)."""
    return records_of(d, request_id)[0]["ids.prompt"].tolist()


def test_streaming_capped_hits_stay_exact(stream_runs):
    """Fault injection per request: the first request of the pair is marked ``FORGET_ROWS``
    (its rows are declared lost), so the second one's hit on its blocks is capped before the
    forward and recomputed — never refused in the worker — and both hand the talker bitwise
    what the cache-off engine hands it (chunks, tokens, audio).

    The worker still holds the lost rows (``FORGET_ROWS`` is read by the scheduler only), so
    bitwise equality alone would not show the cap: the hits are asserted exactly, computed
    from token ids here (:func:`~tests.pipeline.workloads.prefix_hit`) — capped to the blocks the pair shares with
    requests sent before it (the system prompt), while the built-in cache, on the same
    requests without the fault, serves the whole shared prefix.

    First, oracle (a) with the first request's rows declared lost: every row served to the
    second equals its writer's bitwise, and no served block's writer is the first (its rows
    are not there to serve — were the cap off, the worker's copy of them would be served, and
    this fails before any hit count is looked at)."""
    on, off, bi = stream_runs["omni_cache"], stream_runs["off"], stream_runs["builtin"]
    lost = on["lost"]["lost:second"]
    declared_lost = on["lost"]["lost:first"].request_id
    writers = [r for r in on["all"] if r.request_id != declared_lost]
    from_lost = [(line["request"], i) for line in audit_lines(on["dir"])
                 if line["request"].startswith(lost.request_id)
                 for i, w in enumerate(line["writers"]) if w and w.startswith(declared_lost)]
    assert not from_lost, f"served rows differ from their writer's: blocks {from_lost} served from rows declared lost"
    v, u, bad = served_rows_report(on["dir"], writers).get(lost.request_id, (0, 0, []))
    assert not bad and u == 0, ("served rows differ from their writer's", bad, u)
    ids = _prompt_ids(off["dir"], off["lost"]["lost:second"].request_id)
    before = [r for _, r in on["named"]] + list(on["batch"]) + [r for _, r in on["talker"][0]]
    earlier = [_prompt_ids(on["dir"], r.request_id) for r in before]
    first = _prompt_ids(off["dir"], off["lost"]["lost:first"].request_id)
    capped, whole = prefix_hit(ids, earlier), prefix_hit(ids, earlier + [first])
    assert 0 < capped < whole, (capped, whole)
    assert bi["lost"]["lost:second"].num_cached_tokens == whole  # the pair's hit, uncapped
    assert lost.num_cached_tokens == capped, (lost.num_cached_tokens, capped, whole)
    assert on["lost"]["lost:first"].num_cached_tokens == prefix_hit(first, earlier)
    sched = read_metrics(on["dir"], "scheduler", until=lambda m: m["capped_tokens"] >= whole - capped)
    assert sched["capped_tokens"] == whole - capped, (sched, whole - capped)
    # the worker reports with each step's output the blocks it cached (the real engine's path,
    # runner → scheduler), and cached every block the scheduler vouched for after the fact
    assert sched["worker_reports"] > 0 and sched["unconfirmed_blocks"] == 0, sched
    m = read_metrics(on["dir"], "metrics")
    assert m["hits_refused"] == 0, m  # capped before the forward, never refused in the worker
    for name, _ in LOST_PAIR:
        r_on, r_off = on["lost"][name], off["lost"][name]
        assert r_on.error is None and r_off.error is None and r_on.token_ids == r_off.token_ids, name
        assert_same_chunks(records_of(on["dir"], r_on.request_id), records_of(off["dir"], r_off.request_id), name)
        assert r_off.audio is not None and np.array_equal(r_on.audio, r_off.audio), name


def test_streamed_talker_prefix_cache_exact_and_content_keyed(stream_runs):
    """Talker prefix caching on the streaming path (the production one): the checks of
    :func:`tests.pipeline.workloads.assert_talker_workload`; the thinker→talker chunks of every
    talker-workload request (what the talker received) equal the built-in cache's bitwise (oracle
    (b): the same requests, the same thinker hits) and cache off's at oracle (c)'s precision on
    this device (bitwise on the CPU and with batch-invariant kernels); the codec chunks code2wav
    received (what the talker computed from them) equal cache off's where that is bitwise."""
    (on, keys), (off, _) = stream_runs["omni_cache"]["talker"], stream_runs["off"]["talker"]
    on, off, bi = dict(on), dict(off), dict(stream_runs["builtin"]["talker"][0])
    assert_talker_kv_oracle(stream_runs["omni_cache"]["dir"], stream_runs["omni_cache"]["all"], on,
                            stream_runs["omni_cache"]["model_dir"])
    assert_talker_workload(on, off, keys, expected=expected_talker_blocks(stream_runs["omni_cache"]["model_dir"]))
    d_on, d_off, d_bi = (stream_runs[v]["dir"] for v in ("omni_cache", "off", "builtin"))
    # On CUDA's default kernels (the compiled group) the thinker's suffix after a hit rounds
    # unlike cache off's whole prefill: the hand-off's fresh rows vs cache off differ in the
    # last bits (seen on an H100, 2026-11-27: 'talker-chat:turn3', hidden_states.output), and
    # a shorter talker prefill over served KV may flip a sampled code ('talker-chat:turn2',
    # codes.audio, 2026-11-27 earlier) — there the built-in cache is the bitwise oracle of the
    # hand-off, cache off holds it to TOLERANCE_ULPS, and the codec to its chunk count.
    kernels_invariant = CACHE_OFF_BITWISE or BATCH_INVARIANT
    for name, r_off in off.items():
        r_on, r_bi = on[name], bi[name]
        assert r_bi.num_cached_tokens == r_on.num_cached_tokens and r_bi.token_ids == r_on.token_ids, \
            (name, r_bi.num_cached_tokens, r_on.num_cached_tokens)
        assert_same_chunks(records_of(d_on, r_on.request_id), records_of(d_bi, r_bi.request_id), name)
        codec_bitwise = kernels_invariant or not r_on.talker_num_cached_tokens
        for sub in ("handoff", "codec"):
            c_on, c_off = records_of(d_on, r_on.request_id, sub), records_of(d_off, r_off.request_id, sub)
            assert len(c_on) == len(c_off) > 0, (sub, name, len(c_on), len(c_off))
            if sub == "handoff" and not kernels_invariant:
                assert_chunks_vs_cache_off(c_on, c_off, name, num_prompt_tokens=r_on.num_prompt_tokens,
                                           hit=r_on.num_cached_tokens, same_tokens=r_on.token_ids == r_off.token_ids)
                continue
            if sub == "codec" and not codec_bitwise:
                continue
            for g, r in zip(c_on, c_off):
                assert set(g) == set(r), (sub, name)
                for k in r:
                    if isinstance(r[k], torch.Tensor):
                        assert torch.equal(g[k], r[k]), (sub, name, k)
