"""Prefix-aware routing over two real thinker replicas (issue 17; docs/routing.md).

One pipeline from the streaming CPU config with ``num_replicas: 2`` on the thinker, omni-cache
on and ``OMNI_CACHE_ROUTING: prefix``; the router is taken off and put back on the running
engine (``ThinkerRouter.uninstall`` / ``install``) so one start serves four phases:

1. ``routed``: three conversations (set A), turns interleaved and sent one at a time, with
   omni-cache's router: every turn >= 2 must hit the previous prompt's whole blocks and each
   conversation must stay on one replica.
2. ``round_robin``: three fresh conversations (set B), same shape, vLLM-Omni's own in-process
   routing (round-robin; an odd number of conversations sends consecutive turns of a
   conversation to different replicas): fewer than half of those turns hit.
3. ``replay``: set A's exact prompts again under round-robin. Each lands on the replica that
   holds it or on the other, so its hits differ from phase 1's; every request's thinker tokens
   and every chunk the talker received must equal phase 1's bitwise (a wrong served row would
   show).
4. ``drained``: the router back on, the replica holding conversation A0 marked unavailable
   (``StagePool.mark_replica_unavailable``, vLLM-Omni's own failure path), one more turn of
   set A: every request runs on the other replica, without error, and the router forgets the
   drained one.

No hit may be refused in a worker (``hits_refused``).

A second pipeline runs the same config in vLLM-Omni's **distributed mode** on this host
(``single_stage_mode`` with an omni master address and port, no stage filter: every stage
local, vLLM-Omni's coordinator and membership controller up, ``--omni-lb-policy round-robin``
for every pool): omni-cache's ``PrefixRoutingBalancer`` replaces the thinker pool's balancer,
fed the hub's replica list and heartbeat queue lengths. Phase 1 again: routed turns all
hit and stay on one replica (the balancer chose each one); uninstalling restores vLLM-Omni's
own round-robin balancer; closing it stops every stage process.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections import defaultdict

import psutil
import pytest
import torch

from tests.util import in_process_stages, variant_stage_config

pytestmark = pytest.mark.pipeline
#: full pipeline starts in this module (the suite's time table, tests/conftest.py)
PIPELINE_STARTS = 2  # in-process replicas, distributed mode

BLOCK = 32
CONVS, TURNS = 3, 3
QUESTIONS = ["Tell me a story.", "And then?", "Why did that happen?", "What comes next?"]
TOPICS = {"A": ["the sea", "a mountain village", "an old library"],
          "B": ["a desert road", "a river delta", "a night train"]}


def _first_prompt(tok, topic: str) -> list[int]:
    system = f"Conversation about {topic}. " + "Look carefully and listen to every detail. " * 2
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{QUESTIONS[0]}"
                      "<|im_end|>\n<|im_start|>assistant\n")


def _next_prompt(tok, prev: list[int], answer: list[int], turn: int) -> list[int]:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tail = tok.encode(f"\n<|im_start|>user\n{QUESTIONS[turn]}<|im_end|>\n<|im_start|>assistant\n")
    return prev + [t for t in answer if t != im_end] + [im_end] + tail


def _replica_of_last(router) -> int:
    """The thinker replica id the router chose for the last request (one at a time)."""
    pool, addr = router.pool, router.decisions[-1].replica
    return next(rid for rid in range(pool.num_replicas)
                if (pool.clients[rid].client_addresses or {}).get("input_address") == addr)


def _send(pipe, prompt: list[int]):
    (r,) = pipe.generate([{"prompt_token_ids": prompt}])
    assert r.error is None, r.error
    return r


def _conversations(pipe, tok, topics: list[str], turns: range, prompts: dict | None = None,
                   results: dict | None = None, router=None):
    """Send ``turns`` of the conversations on ``topics``, interleaved; returns ``(prompts,
    results, replicas)`` keyed by ``(conv, turn)`` (replicas: the router's choice, if routed)."""
    prompts, results, replicas = dict(prompts or {}), dict(results or {}), {}
    for turn in turns:
        for c, topic in enumerate(topics):
            prompts[(c, turn)] = (_first_prompt(tok, topic) if turn == 0 else
                                  _next_prompt(tok, prompts[(c, turn - 1)], results[(c, turn - 1)].token_ids, turn))
            results[(c, turn)] = _send(pipe, prompts[(c, turn)])
            if router is not None:
                replicas[(c, turn)] = _replica_of_last(router)
    return prompts, results, replicas


def _chunks_by_request(out_dir) -> dict[str, list[dict]]:
    """Recorded hand-off chunks per request id (both replicas write into one folder; a
    replica's ``seq`` orders its own chunks)."""
    by_req: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for p in (out_dir / "handoff").glob("*.pt"):
        m = re.match(r"(\d+)-(.+)\.pt$", p.name)
        by_req[m.group(2)].append((int(m.group(1)), torch.load(p)))
    return {rid: [c for _, c in sorted(chunks, key=lambda x: x[0])] for rid, chunks in by_req.items()}


def _setup(tmp_path_factory, model_dir, name: str):
    """The thinker tokenizer, a fresh folder and the streaming CPU config with two thinker
    replicas, omni-cache on and ``OMNI_CACHE_ROUTING: prefix``, every stage on vLLM's ``uni``
    executor (the pipelines under test are vLLM-Omni's; the process layout is not)."""
    from transformers import AutoTokenizer

    from omni_cache import settings
    from omni_cache.driver.variants import derive_stage_config

    d = tmp_path_factory.mktemp(name)
    cfg = variant_stage_config(d, "omni_cache", thinker={"num_replicas": 2}, streaming=True)
    cfg = in_process_stages(derive_stage_config(cfg, cfg, env={0: {settings.ROUTING.name: "prefix"}}))
    return AutoTokenizer.from_pretrained(model_dir), d, cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    from omni_cache.driver.pipeline import OmniPipeline

    tok, d, cfg = _setup(tmp_path_factory, tiny_model_dir, "routing")
    out = {"dir": d}
    with OmniPipeline(tiny_model_dir, cfg) as pipe:
        router, engine = pipe.router, pipe.omni.engine
        assert router is not None
        pool = engine.stage_pools[0]
        prompts, out["routed"], out["routed_replicas"] = _conversations(pipe, tok, TOPICS["A"], range(TURNS),
                                                                        router=router)
        router.uninstall(engine)
        _, out["round_robin"], _ = _conversations(pipe, tok, TOPICS["B"], range(TURNS))
        out["replay"] = {key: _send(pipe, prompts[key]) for key in sorted(prompts, key=lambda k: (k[1], k[0]))}
        router.install(engine)
        out["drained_replica"] = out["routed_replicas"][(0, TURNS - 1)]
        pool.mark_replica_unavailable(out["drained_replica"])
        _, res, out["drained_replicas"] = _conversations(pipe, tok, TOPICS["A"], range(TURNS, TURNS + 1), prompts,
                                                         out["routed"], router=router)
        out["drained"] = {k: v for k, v in res.items() if k[1] == TURNS}
        out["policy_replicas"] = list(router.policy.replicas)
        out["live"] = pool.available_replica_ids()
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory, tiny_model_dir):
    from omni_cache.driver.pipeline import OmniPipeline

    tok, d, cfg = _setup(tmp_path_factory, tiny_model_dir, "routing-distributed")
    engine_args = {"single_stage_mode": True, "omni_master_address": "127.0.0.1",
                   "omni_master_port": _free_port(), "omni_lb_policy": "round-robin"}
    out = {"dir": d}
    with OmniPipeline(tiny_model_dir, cfg, engine_args=engine_args) as pipe:
        router, engine = pipe.router, pipe.omni.engine
        assert router is not None
        pool = engine.stage_pools[0]
        out["distributed"] = pool.is_distributed
        out["balancer"] = type(pool._lb).__name__
        out["own_balancer"] = type(getattr(router, "_previous_balancer", None)).__name__
        n0 = len(router.decisions)
        _, out["routed"], out["routed_replicas"] = _conversations(pipe, tok, TOPICS["A"], range(TURNS), router=router)
        out["decisions"] = len(router.decisions) - n0
        router.uninstall(engine)
        out["balancer_after_uninstall"] = type(pool._lb).__name__
        out["stages"] = _stage_processes()
        t0 = time.monotonic()
    out["close_s"] = time.monotonic() - t0
    time.sleep(1.0)  # vLLM's process manager has joined them; a zombie counts as stopped
    from omni_cache.driver.process_tree import _running  # a zombie has exited

    out["stages_left"] = [p for p in out["stages"] if _running(p)]
    for p in out["stages_left"]:  # leave nothing to later modules, whatever the outcome
        with contextlib.suppress(psutil.Error):
            p.kill()
    return out


def _stage_processes() -> list:
    """This process's descendants that are vLLM-Omni stage engine cores or their workers."""
    procs = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.name().startswith("VLLM::"):
                procs.append(p)
    return procs


def _hits(results) -> list[bool]:
    """Turns 2..TURNS: did each cover its previous prompt's whole blocks?"""
    return [results[(c, t)].num_cached_tokens >= results[(c, t - 1)].num_prompt_tokens // BLOCK * BLOCK
            for c in range(CONVS) for t in range(1, TURNS)]


def test_the_router_keeps_every_conversation_on_its_cache(run):
    assert all(_hits(run["routed"])), [(r.num_prompt_tokens, r.num_cached_tokens) for r in run["routed"].values()]
    for c in range(CONVS):
        assert len({run["routed_replicas"][(c, t)] for t in range(TURNS)}) == 1, (c, run["routed_replicas"])


def test_round_robin_loses_most_of_those_hits(run):
    hits = _hits(run["round_robin"])
    assert sum(hits) < len(hits) / 2, hits


def test_a_drained_replica_gets_nothing_and_is_forgotten(run):
    drained = run["drained_replica"]
    assert drained not in run["live"]
    assert drained not in run["drained_replicas"].values(), run["drained_replicas"]
    assert all(r.token_ids for r in run["drained"].values())  # served (no error: _send checks)
    assert len(run["policy_replicas"]) == 1


def test_routed_hits_are_exact(run):
    """Phase 1 (routed) vs phase 3 (the same prompts, round-robin): thinker tokens and talker
    inputs bitwise equal, though the cache served them differently."""
    chunks = _chunks_by_request(run["dir"])

    def of(r):
        (key,) = [k for k in chunks if r.request_id in k]
        return chunks[key]

    served_differently = 0
    for key, ra in run["routed"].items():
        rb = run["replay"][key]
        assert ra.token_ids == rb.token_ids, key
        ca, cb = of(ra), of(rb)
        assert len(ca) == len(cb), key
        for i, (x, y) in enumerate(zip(ca, cb)):
            assert set(x) == set(y), (key, i)
            for k in x:
                assert x[k].shape == y[k].shape and torch.equal(x[k], y[k]), (key, i, k)
        served_differently += ra.num_cached_tokens != rb.num_cached_tokens
    assert served_differently >= CONVS, "the replay must be served differently from the routed run"
    for p in (run["dir"] / "metrics").glob("metrics-*.json"):
        assert json.loads(p.read_text())["hits_refused"] == 0, p


def test_distributed_mode_routes_through_omni_caches_balancer(dist_run):
    """vLLM-Omni's coordinator on one host: the thinker pool's balancer is omni-cache's, it
    chose every routed request, routed turns all hit and stay on one replica; uninstalling
    gives the pool vLLM-Omni's own balancer back. (What round-robin loses is shown on the
    in-process pipeline above; the distributed balancer is the same policy code.)"""
    run = dist_run
    assert run["distributed"] and run["balancer"] == "PrefixRoutingBalancer", run
    assert run["own_balancer"] == "RoundRobinBalancer", run
    assert run["decisions"] == CONVS * TURNS, run["decisions"]
    assert run["balancer_after_uninstall"] == "RoundRobinBalancer"
    assert all(_hits(run["routed"])), [(r.num_prompt_tokens, r.num_cached_tokens) for r in run["routed"].values()]
    for c in range(CONVS):
        assert len({run["routed_replicas"][(c, t)] for t in range(TURNS)}) == 1, (c, run["routed_replicas"])
    for p in (run["dir"] / "metrics").glob("metrics-*.json"):
        assert json.loads(p.read_text())["hits_refused"] == 0, p


def test_closing_a_distributed_pipeline_stops_its_stages(dist_run):
    """Closing the distributed-mode pipeline stops every stage process, well within vLLM-Omni's
    30 s orchestrator join (``omni_cache.driver.distributed_stop``). Without the release of
    the membership watcher the orchestrator never ends on its shutdown request: the close
    waited those 30 s and the stage processes (stage 0's two replicas, the talker, code2wav)
    stayed up until the interpreter exited."""
    assert len(dist_run["stages"]) >= 4, dist_run["stages"]  # stage 0 x2, stage 1, stage 2
    assert not dist_run["stages_left"], dist_run["stages_left"]
    assert dist_run["close_s"] < 25, dist_run["close_s"]
