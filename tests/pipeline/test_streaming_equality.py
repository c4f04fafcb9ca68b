"""omni-cache on the production path: streaming hand-off (``async_chunk: true``), cache on vs
off, bitwise.

The workload of ``test_cache_equality`` (text, image, audio, a two-turn chat whose second turn
hits the first answer's decode-filled block, a thinker prefill chunked over two steps with a
same-step hit) runs on three streaming pipelines: prefix caching off, omni-cache, and
omni-cache with the first request's rows declared lost (capped hits). What is compared is what
the talker *receives*: every streamed chunk the thinker sends — the first hand-off
(``embed.prefill``, ``hidden_states.output``, ``embed.tts_*``, ``ids.*``: prompt rows
``cached prefix ++ fresh`` on a hit) and every decode chunk (``embed.decode``) — recorded at the
hand-off seam, plus thinker tokens; audio too for requests sent one at a time (for the
two-request batch the talker's sampling follows chunk timing, so its audio would not tell a
wrong row from a right one: its hand-off chunks are compared instead). In that batch, B's hit
rows must equal the rows A computed in the same step bitwise (what the cache served is what
its writer computed); against cache off, the batch's prompt rows are compared within batch
variance (``tests.util.assert_batch_rows``): cache on changes the step's batch, and the CPU
kernels are not batch-invariant — with cache off, B's recompute of A's prefix differed from
A's own rows in the last bf16 bit (3 of 1,440 captured-layer rows). Decode chunks, ids and
thinker tokens are compared bitwise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.pipeline.workloads import (
    BLOCK,
    FIRST,
    REPEAT,
    STEP_BUDGET,
    assert_talker_workload,
    recorded_by_request,
    run_talker_workload,
    run_workload,
)
from tests.util import assert_batch_rows, assert_same_chunks, recorded_chunks, variant_stage_config

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    from omni_cache.driver.pipeline import OmniPipeline

    out = {}
    for variant in ("off", "omni_cache", "omni_cache_forget"):
        d = tmp_path_factory.mktemp(f"stream-{variant}")
        cfg = variant_stage_config(d, variant, thinker={"max_num_batched_tokens": STEP_BUDGET}, streaming=True)
        with OmniPipeline(tiny_model_dir, cfg) as pipe:
            named, t1_len, batch = run_workload(pipe, tiny_model_dir)
            if variant != "omni_cache_forget":  # the talker cache: on in omni_cache, off in off
                out[f"talker-{variant}"] = run_talker_workload(pipe, tiny_model_dir,
                                                               placeholder_demo=variant == "omni_cache")
        out[variant] = (d, named, t1_len, batch)
    return out


def _assert_same_chunks_tail(got: list[dict], ref: list[dict], name: str) -> None:
    """Decode chunks (after the first hand-off) equal bitwise, same count."""
    assert len(got) == len(ref), (name, len(got), len(ref))
    for i, (g, r) in enumerate(zip(got[1:], ref[1:]), 1):
        assert set(g) == set(r) and all(torch.equal(g[k], r[k]) for k in r), (name, i)
    assert set(got[0]) == set(ref[0]), name


def test_streaming_hits_happen_and_are_served(runs):
    d, named, t1_len, batch = runs["omni_cache"]
    hits = {n: r.num_cached_tokens for n, r in named}
    for n, r in named:
        if n.endswith("second, please?"):
            assert r.num_cached_tokens >= BLOCK, (n, hits)
    assert hits["chat:turn2"] > t1_len, (hits, t1_len)  # the answer's decode-filled block
    assert batch[1].num_cached_tokens > STEP_BUDGET  # same-step hit past the chunked prefill's first step
    m = json.loads(next((d / "metrics").glob("metrics-*.json")).read_text())
    assert m["hits_served"] >= 4 and m["hits_refused"] == 0, m
    first = recorded_chunks(d)[1][0]  # the second request's first hand-off covers its whole prompt
    assert first["embed.prefill"].shape[0] == named[1][1].num_prompt_tokens + 1, first["embed.prefill"].shape


@pytest.mark.parametrize("variant", ["omni_cache", "omni_cache_forget"])
def test_streamed_talker_inputs_equal_cache_off_bitwise(runs, variant):
    d_off, off, _, batch_off = runs["off"]
    d_on, on, _, batch_on = runs[variant]
    ch_off, ch_on = recorded_chunks(d_off), recorded_chunks(d_on)
    n = len(off)
    assert len(ch_off) >= n + 2 and len(ch_on) >= n + 2  # the sequential requests, the batch of two, ...
    ch_off, ch_on = ch_off[:n + 2], ch_on[:n + 2]
    for (name, r_off), (_, r_on), c_off, c_on in zip(off, on, ch_off[:n], ch_on[:n]):
        assert r_off.error is None and r_on.error is None, name
        assert r_on.token_ids == r_off.token_ids, name
        assert_same_chunks(c_on, c_off, name)
        assert r_off.audio is not None and np.array_equal(r_on.audio, r_off.audio), name
    # the batch: its two requests' chunks, matched by prompt length
    key = lambda c: c[0]["embed.prefill"].shape[0]  # noqa: E731
    (a_on, b_on), (a_off, b_off) = sorted(ch_on[n:], key=key), sorted(ch_off[n:], key=key)
    _assert_same_chunks_tail(a_on, a_off, "batch:A")
    _assert_same_chunks_tail(b_on, b_off, "batch:B")
    hit = max(r.num_cached_tokens for r in batch_on)
    for k in set(b_off[0]) - {"embed.prefill", "hidden_states.output"}:  # tts embeddings, ids, meta
        assert torch.equal(a_on[0][k], a_off[0][k]) and torch.equal(b_on[0][k], b_off[0][k]), k
    for k in ("embed.prefill", "hidden_states.output"):
        assert_batch_rows(a_on[0][k], a_off[0][k], f"batch:A {k}")
        assert_batch_rows(b_on[0][k], b_off[0][k], f"batch:B {k}", writer=a_on[0][k], hit=hit)
    for r_on, r_off in zip(batch_on, batch_off):
        assert r_on.token_ids == r_off.token_ids


@pytest.mark.parametrize("variant", ["off", "omni_cache"])
def test_a_request_sent_again_gets_the_same_audio(runs, variant):
    """Per-request talker generators (``tts_local_seed``, omni_cache.engine.talker): the first
    request sent again after all the others (a whole-prompt hit with the cache on) gets the
    same codec frames, hence the same audio packet. With the talker's residual codebooks drawn
    from its process's global RNG — vLLM-Omni's Qwen3-Omni — the repeat's audio differed
    (docs/architecture.md, "What is bitwise under concurrency")."""
    named = dict(runs[variant][1])
    first, again = named[FIRST], named[REPEAT]
    assert again.token_ids == first.token_ids
    assert first.audio is not None and np.array_equal(again.audio, first.audio)


def test_streaming_capped_hits_stay_exact(runs):
    normal = dict(runs["omni_cache"][1])
    forgot = dict(runs["omni_cache_forget"][1])
    second = "text:And what comes second, please?"
    assert forgot[second].num_cached_tokens < normal[second].num_cached_tokens
    d = runs["omni_cache_forget"][0]
    sched = json.loads(next((d / "metrics").glob("scheduler-*.json")).read_text())
    assert sched["capped_tokens"] > 0, sched
    m = json.loads(next((d / "metrics").glob("metrics-*.json")).read_text())
    assert m["hits_refused"] == 0, m  # capped before the forward, never refused in the worker


def test_streamed_talker_prefix_cache_exact_and_content_keyed(runs):
    """Talker prefix caching on the streaming path (the production one): the checks of
    :func:`tests.pipeline.workloads.assert_talker_workload`, the thinker→talker chunks of
    every talker-workload request equal cache off bitwise (what the talker received), and the
    codec chunks code2wav received too (what the talker computed from it)."""
    (on, keys), (off, _) = runs["talker-omni_cache"], runs["talker-off"]
    on, off = dict(on), dict(off)
    assert_talker_workload(on, off, keys)
    n_main = len(runs["omni_cache"][1]) + 2
    n_talker = sum(1 for n in on if not n.startswith("placeholder:"))
    for sub in ("handoff", "codec"):
        rec_on = recorded_by_request(runs["omni_cache"][0], sub)[n_main:n_main + n_talker]
        rec_off = recorded_by_request(runs["off"][0], sub)[n_main:n_main + n_talker]
        assert len(rec_on) == len(rec_off) == n_talker, sub
        for i, (c_on, c_off) in enumerate(zip(rec_on, rec_off)):
            assert len(c_on) == len(c_off) > 0, (sub, i)
            for g, r in zip(c_on, c_off):
                assert set(g) == set(r), (sub, i)
                for k in r:
                    if isinstance(r[k], torch.Tensor):
                        assert torch.equal(g[k], r[k]), (sub, i, k)

