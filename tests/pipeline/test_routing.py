"""Prefix-aware routing over two real thinker replicas (issue 17; docs/routing.md).

Two pipelines from the streaming CPU config with ``num_replicas: 2`` on the thinker and
omni-cache on: one with ``OMNI_CACHE_ROUTING: prefix`` (omni-cache's router), one with
vLLM-Omni's own in-process routing (round-robin). Both get the same sequence: three
conversations, turns interleaved and sent one at a time (an odd number of conversations, so
round-robin sends consecutive turns of a conversation to different replicas); then the
replica holding conversation 0 is marked unavailable (vLLM-Omni's
``StagePool.mark_replica_unavailable``, as its own failure handling does) and every
conversation sends one more turn.

Checked: with the router every turn >= 2 before the drain hits the previous prompt's whole
blocks, each conversation stays on one replica, and after the drain conversation 0 runs on the
other replica (a miss, no error) and the drained replica is gone from the router's policy;
with round-robin fewer than half of those turns hit. Exactness: every request's thinker
tokens and every chunk the talker received are bitwise equal between the two pipelines — their
hits differ (the router's turns hit, round-robin's mostly recompute), so a wrong served row
would show; no hit was refused in a worker (``hits_refused``) on either.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
import torch

from tests.util import variant_stage_config

pytestmark = pytest.mark.pipeline

BLOCK = 32
CONVS, TURNS = 3, 3
QUESTIONS = ["Tell me a story.", "And then?", "Why did that happen?", "What comes next?"]
TOPICS = ["the sea", "a mountain village", "an old library"]


def _first_prompt(tok, conv: int) -> list[int]:
    system = f"Conversation about {TOPICS[conv]}. " + "Look carefully and listen to every detail. " * 2
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{QUESTIONS[0]}"
                      "<|im_end|>\n<|im_start|>assistant\n")


def _next_prompt(tok, prev: list[int], answer: list[int], turn: int) -> list[int]:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tail = tok.encode(f"\n<|im_start|>user\n{QUESTIONS[turn]}<|im_end|>\n<|im_start|>assistant\n")
    return prev + [t for t in answer if t != im_end] + [im_end] + tail


def _replica_of_last(pipe) -> int | None:
    """The thinker replica id the router chose for the last request (requests go one at a
    time); None without the router."""
    router = pipe.router
    if router is None:
        return None
    pool, addr = router.pool, router.decisions[-1].replica
    return next(rid for rid in range(pool.num_replicas)
                if (pool.clients[rid].client_addresses or {}).get("input_address") == addr)


def _conversations(pipe, tok, drain_replica: int | None):
    """Run the sequence; returns ``(results, replicas, drained)``: ``results[(conv, turn)]``,
    the router's replica per request (None entries without the router), the drained replica id."""
    pool = pipe.omni.engine.stage_pools[0]
    prompts = {c: _first_prompt(tok, c) for c in range(CONVS)}
    results, replicas = {}, {}
    drained = None
    for turn in range(TURNS + 1):
        if turn == TURNS:
            drained = drain_replica if drain_replica is not None else replicas[(0, TURNS - 1)]
            pool.mark_replica_unavailable(drained)
        for c in range(CONVS):
            if turn:
                prompts[c] = _next_prompt(tok, prompts[c], results[(c, turn - 1)].token_ids, turn)
            (r,) = pipe.generate([{"prompt_token_ids": prompts[c]}])
            assert r.error is None, (c, turn, r.error)
            results[(c, turn)] = r
            replicas[(c, turn)] = _replica_of_last(pipe)
    return results, replicas, drained


def _chunks_by_request(out_dir) -> dict[str, list[dict]]:
    """Recorded hand-off chunks per request id (both replicas write into one folder; a
    replica's ``seq`` orders its own chunks)."""
    by_req: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for p in (out_dir / "handoff").glob("*.pt"):
        m = re.match(r"(\d+)-(.+)\.pt$", p.name)
        by_req[m.group(2)].append((int(m.group(1)), torch.load(p)))
    return {rid: [c for _, c in sorted(chunks, key=lambda x: x[0])] for rid, chunks in by_req.items()}


def _chunks_of(chunks: dict[str, list[dict]], request_id: str) -> list[dict]:
    (key,) = [k for k in chunks if request_id in k]
    return chunks[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    from transformers import AutoTokenizer

    from omni_cache import settings
    from omni_cache.driver.pipeline import OmniPipeline
    from omni_cache.driver.variants import derive_stage_config

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = {}
    drain = None
    for routing in ("prefix", "vllm_omni"):
        d = tmp_path_factory.mktemp(f"routing-{routing}")
        cfg = variant_stage_config(d, "omni_cache", thinker={"num_replicas": 2}, streaming=True)
        cfg = derive_stage_config(cfg, cfg, env={0: {settings.ROUTING.name: routing}})
        with OmniPipeline(tiny_model_dir, cfg) as pipe:
            assert (pipe.router is not None) == (routing == "prefix")
            results, replicas, drained = _conversations(pipe, tok, drain)
            policy_replicas = set(pipe.router.policy.replicas) if pipe.router else None
            live = pipe.omni.engine.stage_pools[0].available_replica_ids()
        drain = drained  # the round-robin run drains the same replica id
        out[routing] = dict(dir=d, results=results, replicas=replicas, drained=drained,
                            policy_replicas=policy_replicas, live=live)
    return out


def _hits(run) -> list[bool]:
    """Turns 2..TURNS (before the drain): did each cover its previous prompt's whole blocks?"""
    res = run["results"]
    return [res[(c, t)].num_cached_tokens >= res[(c, t - 1)].num_prompt_tokens // BLOCK * BLOCK
            for c in range(CONVS) for t in range(1, TURNS)]


def test_the_router_keeps_every_conversation_on_its_cache(runs):
    run = runs["prefix"]
    assert all(_hits(run)), [(r.num_prompt_tokens, r.num_cached_tokens) for r in run["results"].values()]
    for c in range(CONVS):
        assert len({run["replicas"][(c, t)] for t in range(TURNS)}) == 1, (c, run["replicas"])


def test_round_robin_loses_most_of_those_hits(runs):
    hits = _hits(runs["vllm_omni"])
    assert sum(hits) < len(hits) / 2, hits


def test_a_drained_replica_gets_nothing_and_is_forgotten(runs):
    run = runs["prefix"]
    drained = run["drained"]
    assert drained not in run["live"]
    after = {c: run["replicas"][(c, TURNS)] for c in range(CONVS)}
    assert drained not in after.values(), after
    assert run["results"][(0, TURNS)].num_cached_tokens < run["results"][(0, TURNS - 1)].num_prompt_tokens, \
        "conversation 0 moved to the other replica, which never held its prompt"
    assert len(run["policy_replicas"]) == 1


def test_routed_hits_are_exact(runs):
    """Every request's thinker tokens and talker inputs: router pipeline == round-robin one."""
    a, b = runs["prefix"], runs["vllm_omni"]
    ch_a, ch_b = _chunks_by_request(a["dir"]), _chunks_by_request(b["dir"])
    served_differently = 0
    for key, ra in a["results"].items():
        rb = b["results"][key]
        assert ra.token_ids == rb.token_ids, key
        ca, cb = _chunks_of(ch_a, ra.request_id), _chunks_of(ch_b, rb.request_id)
        assert len(ca) == len(cb), key
        for i, (x, y) in enumerate(zip(ca, cb)):
            assert set(x) == set(y), (key, i)
            for k in x:
                if k.startswith("embed.tts_"):  # one row per thinker step: compare the first
                    assert torch.equal(x[k][0], y[k][0]), (key, i, k)
                else:
                    assert x[k].shape == y[k].shape and torch.equal(x[k], y[k]), (key, i, k)
        served_differently += ra.num_cached_tokens != rb.num_cached_tokens
    assert served_differently >= CONVS, "the two runs must differ in what the cache served"
    for run in (a, b):
        for p in (run["dir"] / "metrics").glob("metrics-*.json"):
            assert json.loads(p.read_text())["hits_refused"] == 0, p
