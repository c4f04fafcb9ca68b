"""omni-cache on the real pipeline (non-streaming hand-off): a fixed workload, cache on vs a
cache-off reference, and every served row vs the row its writer computed (oracle (a)).

One engine (``sync_omni``: the CPU stage config, omni-cache on the thinker, the talker's prefix
cache on) runs the workload, then runs the same prompts again as cache-off references:
``skip_reading_prefix_cache`` on the thinker and the talker, so vLLM reads no cached block and
every prompt row is computed (:func:`tests.pipeline.engines.reference_params`). Every
request's thinker→talker tensors (final hidden + captured layers, recorded at the hand-off
seam: what the talker received), sampled thinker tokens and code2wav audio must be bitwise
equal to its reference's; the hit requests must actually hit (otherwise the comparison would
prove nothing), and omni-cache's own counters must show served rows. A real cache-off engine
is compared on the streaming path (``test_streaming_equality.py``, ``stream_off``). Capped
hits (a request's rows declared lost) are tested on the streaming path only: the cap is the
scheduler's decision, the same whichever way the thinker hands off.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omni_cache.driver.inputs import build_request
from omni_cache.exactness.fuzz import served_rows_report
from omni_cache.exactness.oracles import compare_prompt_rows, handoff_mismatches, prompt_rows
from tests.device import CACHE_OFF_BITWISE
from tests.pipeline.engines import reference_params
from tests.pipeline.workloads import (
    BLOCK,
    FIRST,
    FIRST_PROMPT,
    REPEAT,
    STEP_BUDGET,
    assert_served_rows,
    assert_talker_kv_oracle,
    assert_talker_workload,
    expected_hits,
    expected_talker_blocks,
    processor_prompt_ids,
    run_talker_workload,
    run_workload,
)
from tests.util import assert_audio_vs_cache_off, assert_batch_rows, read_metrics, records_of

pytestmark = pytest.mark.pipeline


def _code2wav_rate(model_dir) -> int:
    """code2wav's output rate from the model config: 12.5 Hz codec frames x prod(upsample
    rates) x prod(upsampling ratios)."""
    c2w = json.loads((model_dir / "config.json").read_text())["code2wav_config"]
    return int(12.5 * np.prod(c2w["upsample_rates"]) * np.prod(c2w["upsampling_ratios"]))


SAMPLE_RATE = 24_000


def test_code2wav_rate_from_the_model_config(tiny_model_dir):
    """The rate the bitwise test below expects the pipeline to report is the model's own."""
    assert _code2wav_rate(tiny_model_dir) == SAMPLE_RATE


def _handoff(d, r) -> dict:
    """The one thinker→talker hand-off recorded for result ``r`` (non-streaming: one a request)."""
    recs = records_of(d, r.request_id)
    assert len(recs) == 1, (r.request_id, len(recs))
    return recs[0]


@pytest.fixture(scope="session")
def runs(sync_omni):
    """The workload and the talker workload with the cache on, then both again as cache-off
    references in the same engine; then the unseeded control."""
    pipe, model_dir = sync_omni.pipe, sync_omni.model_dir
    named, t1_len, batch, sent = run_workload(pipe, model_dir)
    talker_on = run_talker_workload(pipe, model_dir, placeholder_demo=True)
    refs = reference_params(pipe)
    off_named, _, off_batch, _ = run_workload(pipe, model_dir, refs, replay=sent)
    talker_off = run_talker_workload(pipe, model_dir, sampling_params_list=refs, replay=talker_on[2])
    # the control: the same request twice without tts_local_seed (cache-off references)
    sp = reference_params(pipe)
    sp[1].extra_args = {}
    unseeded = [pipe.generate([build_request(FIRST_PROMPT)], sp)[0] for _ in range(2)]
    return {"dir": sync_omni.dir, "model_dir": model_dir, "sent": sent, "omni_cache": (named, t1_len, batch),
            "off": (off_named, t1_len, off_batch),
            "talker-omni_cache": talker_on[:2], "talker-off": talker_off[:2], "unseeded": unseeded,
            "all": [r for n, r in named + talker_on[0] + off_named + talker_off[0]] + batch + off_batch + unseeded}


def test_hits_happen_and_omni_cache_served_them(runs):
    d, (named, t1_len, batch) = runs["dir"], runs["omni_cache"]
    hits = {n: r.num_cached_tokens for n, r in named}
    # every hit exactly, computed from the processor's token ids — self-checked: its prompt
    # lengths are the engine's, except for speech (the HF feature extractor gives the clip one
    # audio token fewer than vLLM's input processing), whose two requests keep the bounds below
    results = [r for _, r in named] + list(batch)
    ids = processor_prompt_ids(runs["model_dir"], runs["sent"])
    names = [n for n, _ in named] + ["batch:A", "batch:B"]
    same_len = [len(i) == r.num_prompt_tokens for i, r in zip(ids, results)]
    assert {n for n, ok in zip(names, same_len) if not ok} <= {n for n in names if n.startswith("audio:")}, \
        [(n, len(i), r.num_prompt_tokens) for n, i, r in zip(names, ids, results)]
    expected = expected_hits(ids, results, together=2)
    got = {n: r.num_cached_tokens for n, r, ok in zip(names, results, same_len) if ok}
    assert got == {n: e for n, e, ok in zip(names, expected, same_len) if ok}, (got, expected)
    assert len(got) >= len(names) - 2, got
    for n, r in named:
        if n.endswith("second, please?"):
            assert r.num_cached_tokens >= BLOCK, (n, hits)
        # hits are whole KV blocks, and vLLM recomputes at least the last prompt token
        assert r.num_cached_tokens % BLOCK == 0 and r.num_cached_tokens < r.num_prompt_tokens, (n, hits)
    # the second turn hits the first turn's answer tokens (block filled by decode)
    assert hits["chat:turn2"] > t1_len, (hits, t1_len)
    # the references read no cached block
    references = [r for _, r in runs["off"][0]] + runs["off"][2] + [r for _, r in runs["talker-off"][0]]
    assert all(r.num_cached_tokens == 0 for r in references + runs["unseeded"])
    talker_workload = sum(r.num_cached_tokens for _, r in runs["talker-omni_cache"][0])  # sent after the batch
    expected = sum(hits.values()) + sum(r.num_cached_tokens for r in batch) + talker_workload
    m = read_metrics(d, "metrics", until=lambda m: m["hit_tokens"] >= expected)
    assert m["hits_served"] >= 4 and m["rows_read"] > 0 and m["hits_refused"] == 0
    assert m["hit_tokens"] == expected, (hits, [(r.num_prompt_tokens, r.num_cached_tokens) for r in batch],
                                         talker_workload)


def test_fixed_workload_equals_its_cache_off_references_bitwise(runs):
    """On this fixed workload every hand-off tensor, token and waveform equals its cache-off
    reference's bitwise — a regression test of these prompts, not a general claim: after a hit
    vLLM computes the suffix over cached KV, which can differ from a whole-prompt prefill in
    the last bits on other prompts (docs/architecture.md, "Integrity"; the generative search
    is ``test_exactness_fuzz.py`` / ``tests/lanes/fuzz_exactness.py``).
    On CUDA (``CACHE_OFF_BITWISE`` False, tests/device.py) cache off is held
    to oracle (c)'s stated precision instead: tokens equal, prompt rows within
    ``TOLERANCE_ULPS`` row-scale ulps (embedding rows bitwise), audio bitwise only where the
    talker got the same bits and did not hit."""
    d, off, on = runs["dir"], runs["off"][0], runs["omni_cache"][0]
    assert [n for n, _ in off] == [n for n, _ in on]
    compared_bitwise = 0
    for (name, r_off), (_, r_on) in zip(off, on):
        h_off, h_on = _handoff(d, r_off), _handoff(d, r_on)
        assert r_off.error is None and r_on.error is None
        assert r_on.num_prompt_tokens == r_off.num_prompt_tokens
        if CACHE_OFF_BITWISE:  # (CUDA: near-tie logits of the random model may flip)
            assert r_on.token_ids == r_off.token_ids, name
        assert set(h_off) == set(h_on) and "hidden" in h_on, (name, sorted(h_on))
        assert any(k.startswith("hidden_states.layer_") for k in h_on), sorted(h_on)
        for k in h_off:
            assert h_on[k].shape == h_off[k].shape, (name, k)
        same = all(torch.equal(h_on[k], h_off[k]) for k in h_off)
        if CACHE_OFF_BITWISE:
            for k in h_off:
                assert torch.equal(h_on[k], h_off[k]), (name, k)
        else:  # oracle (c) at its stated precision; the other tensors (ids, tts embeddings) bitwise
            n = r_on.num_prompt_tokens
            _, bad = compare_prompt_rows(prompt_rows([h_on], n), prompt_rows([h_off], n), r_on.num_cached_tokens)
            assert not bad, (name, bad)
            rest = [k for k in h_off if k != "hidden" and not k.startswith("hidden_states.")]
            assert not handoff_mismatches([{k: h_on[k] for k in rest}], [{k: h_off[k] for k in rest}]), name
        assert r_on.sample_rate == r_off.sample_rate == SAMPLE_RATE, name
        compared_bitwise += assert_audio_vs_cache_off(r_on, r_off, name, handoff_bitwise=same)
    assert compared_bitwise > 0  # at least the requests that hit nothing


def test_served_rows_equal_their_writers_rows(runs):
    """Oracle (a): every row served on a hit equals bitwise the row its writer computed (the
    thinker's hit audit names the writer of each served block; its hand-off holds those rows).
    Oracle (b), against vLLM-Omni's built-in cache, runs on the streaming path
    (``test_streaming_equality.py``, ``test_exactness_fuzz.py``)."""
    named, t1_len, batch = runs["omni_cache"]
    served = served_rows_report(runs["dir"], [r for _, r in named] + list(batch))
    assert sum(v for v, _, _ in served.values()) >= 40, served
    assert_served_rows(served, named, batch, t1_len)


def test_a_request_sent_again_gets_the_same_audio(runs):
    """Per-request talker generators (omni_cache.engine.talker): the first request sent again
    after all the others gets the same waveform, with the cache on and off. The control shows
    the comparison can fail: sent twice without ``tts_local_seed`` (the talker's residual
    codebooks then come from its process's global RNG), the same request's waveforms differ."""
    for variant in ("off", "omni_cache"):
        named = dict(runs[variant][0])
        if variant == "omni_cache" and not CACHE_OFF_BITWISE:  # the repeat hits in the talker
            assert_audio_vs_cache_off(named[REPEAT], named[FIRST], variant)
            continue
        assert np.array_equal(named[REPEAT].audio, named[FIRST].audio), variant
    a, b = runs["unseeded"]
    assert a.token_ids == b.token_ids and not np.array_equal(a.audio, b.audio)


def test_same_step_hit_is_served_and_exact(runs):
    """Two requests sharing a prefix longer than the thinker's token budget per step, sent together:
    B is admitted in the step where A completes its prompt and hits those blocks too (vLLM
    caches a block when it is scheduled; the runner writes before it reads). B's hit rows equal
    the rows A computed in that step bitwise; thinker tokens equal cache off; the hand-off rows
    of both equal cache off within batch variance (``assert_batch_rows``: cache on changes the
    step's batch and the CPU kernels are not batch-invariant). Audio of a batch is not
    compared: the talker's sampling is not batch-invariant."""
    d, batch_on, batch_off = runs["dir"], runs["omni_cache"][2], runs["off"][2]
    a, b = batch_on
    # A's document is new (A hits at most the system prompt of earlier requests)
    assert a.num_cached_tokens < STEP_BUDGET // 4 and b.num_prompt_tokens > a.num_prompt_tokens > STEP_BUDGET + BLOCK
    # B hits beyond A's first step: the blocks A completes in B's own first step are served
    assert b.num_cached_tokens > STEP_BUDGET, (b.num_cached_tokens, a.num_prompt_tokens)
    assert b.num_cached_tokens >= (a.num_prompt_tokens - 40) // BLOCK * BLOCK
    sched = read_metrics(d, "scheduler", until=lambda m: m["same_step_hit_tokens"] > 0)
    assert sched["same_step_hit_tokens"] > 0, sched
    # batches sorted by prompt length (A, B)
    ho_on, ho_off = [_handoff(d, r) for r in batch_on], [_handoff(d, r) for r in batch_off]
    for r_on, r_off in zip(batch_on, batch_off):
        assert r_on.error is None and r_off.error is None
        assert r_on.num_prompt_tokens == r_off.num_prompt_tokens
        assert r_on.token_ids == r_off.token_ids or not CACHE_OFF_BITWISE
    (a_on, b_on), (a_off, b_off) = ho_on, ho_off
    assert "hidden" in b_on and any(k.startswith("hidden_states.layer_") for k in b_on), sorted(b_on)
    assert set(a_on) == set(a_off) and set(b_on) == set(b_off)
    for k in b_off:
        if k.startswith("embed.tts_"):  # one row per prefill step (1 with the hit, 2 chunks without)
            assert torch.equal(a_on[k][0], a_off[k][0]) and torch.equal(b_on[k][0], b_off[k][0]), k
            continue
        assert_batch_rows(a_on[k], a_off[k], f"batch:A {k}")
        assert_batch_rows(b_on[k], b_off[k], f"batch:B {k}", writer=a_on[k], hit=b.num_cached_tokens)


def test_talker_prefix_cache_exact_and_content_keyed(runs):
    """Talker prefix caching (content-keyed talker blocks, on in the omni_cache run, off in the
    off run), not streaming: see :func:`tests.pipeline.workloads.assert_talker_workload`; and
    the codec frames code2wav received equal cache off bitwise for every request sent alone."""
    (on, keys), (off, _) = runs["talker-omni_cache"], runs["talker-off"]
    on, off = dict(on), dict(off)
    assert_talker_kv_oracle(runs["dir"], runs["all"], on, runs["model_dir"])
    assert_talker_workload(on, off, keys, expected=expected_talker_blocks(runs["model_dir"]))
    alone = [(r_on, dict(runs["off"][0])[n]) for n, r_on in runs["omni_cache"][0]]
    alone += [(r_on, off[n]) for n, r_on in on.items() if not n.startswith("placeholder:")]
    for r_on, r_off in alone:
        c_on = records_of(runs["dir"], r_on.request_id, "codec")
        c_off = records_of(runs["dir"], r_off.request_id, "codec")
        assert len(c_on) == len(c_off) == 1, (r_on.request_id, len(c_on), len(c_off))
        if CACHE_OFF_BITWISE or not r_on.talker_num_cached_tokens:
            assert torch.equal(c_on[0]["codes.audio"], c_off[0]["codes.audio"]), r_on.request_id
        else:  # CUDA, after a talker hit: the sampled codes may diverge (tests/device.py)
            assert c_on[0]["codes.audio"].shape == c_off[0]["codes.audio"].shape, r_on.request_id

