"""The vLLM-Omni adapter of prefix routing (omni_cache.driver.routing), against vLLM-Omni
0.30's real ``StagePool`` / ``LoadBalancer`` / ``Task`` / ``ReplicaInfo`` — no engine: the
pool's clients are stand-ins with the input address a real stage client advertises. Also
the deploy-YAML validation of the routing settings."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest
import yaml

pytest.importorskip("vllm_omni")

from vllm_omni.distributed.omni_coordinator import (  # noqa: E402
    LoadBalancer,
    ReplicaInfo,
    ReplicaList,
    ReplicaStatus,
    Task,
)
from vllm_omni.engine.stage_pool import StagePool  # noqa: E402

from omni_cache.driver.routing import (  # noqa: E402
    PrefixRoutingBalancer,
    RoutingSetupError,
    ThinkerRouter,
    install_prefix_routing,
    prompt_routing_key,
    routing_config,
)
from omni_cache.driver.stage_config import StageConfigError, load_stage_config  # noqa: E402
from omni_cache.routing import PrefixAwarePolicy, RoutingConfig, request_block_hashes  # noqa: E402
from omni_cache.settings import SettingError  # noqa: E402
from tests.util import CPU_STAGE_CONFIG  # noqa: E402

BS = 4
ADDRS = ["ipc:///tmp/thinker-0", "ipc:///tmp/thinker-1"]


def _pool(n: int = 2) -> StagePool:
    return StagePool(0, [SimpleNamespace(client_addresses={"input_address": a}) for a in ADDRS[:n]])


class _Engine:
    """What ThinkerRouter.install touches on vLLM-Omni's engine: ``add_request`` and
    ``stage_pools``."""

    def __init__(self, pool):
        self.stage_pools = [pool]
        self.admitted = []

    def add_request(self, request_id, prompt, *args, **kwargs):
        self.admitted.append(request_id)


def _turns(seed: int, n: int) -> list[dict]:
    """A conversation's prompts: turn t's prompt extends turn t-1's."""
    toks, out = [], []
    for t in range(n):
        toks = toks + [seed * 10_000 + t * 100 + i for i in range(3 * BS)]
        out.append({"prompt_token_ids": list(toks)})
    return out


def _router(pool, margin: int = 4) -> tuple[ThinkerRouter, _Engine]:
    engine = _Engine(pool)
    router = ThinkerRouter(pool, PrefixAwarePolicy(RoutingConfig(load_margin=margin)), block_size=BS)
    router.install(engine)
    return router, engine


def test_in_process_turns_stick_where_round_robin_alternates():
    pool = _pool()
    router, engine = _router(pool)
    a, b = _turns(1, 3), _turns(2, 3)
    got = {}
    for t in range(3):
        for name, conv in (("a", a), ("b", b)):
            rid = f"{name}{t}"
            engine.add_request(rid, conv[t])
            # vLLM-Omni's own in-process selection returns the router's binding
            got[rid] = pool.select_replica_id(rid)
            pool.release_binding(rid)                  # finished
    assert engine.admitted == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert got["a0"] != got["b0"]
    assert got["a0"] == got["a1"] == got["a2"] and got["b0"] == got["b1"] == got["b2"]
    assert [d.reason for d in router.decisions[2:]] == ["prefix"] * 4
    # without the router, vLLM-Omni's round-robin alternates a conversation's turns
    rr = _pool()
    picks = [rr.select_replica_id(f"r{i}") for i in range(4)]
    assert picks == [0, 1, 0, 1]


def test_in_process_queue_counts_bound_requests():
    pool = _pool()
    router, engine = _router(pool, margin=1)
    a = _turns(1, 4)
    engine.add_request("a0", a[0])
    home = pool.get_bound_replica_id("a0")
    # a0..a2 still running on `home`: the next turn exceeds the margin and goes to the other replica
    engine.add_request("a1", a[1])
    engine.add_request("x", _turns(9, 1)[0])
    assert pool.get_bound_replica_id("x") != home
    engine.add_request("a2", a[2])
    assert pool.get_bound_replica_id("a2") == home                         # 2 vs 1: within margin 1
    engine.add_request("a3", a[3])
    assert pool.get_bound_replica_id("a3") != home and router.decisions[-1].reason == "load"


def test_in_process_dead_or_drained_replica_is_forgotten():
    pool = _pool()
    router, engine = _router(pool)
    a = _turns(1, 3)
    engine.add_request("a0", a[0])
    home = pool.get_bound_replica_id("a0")
    pool.release_binding("a0")
    pool.mark_replica_unavailable(home)               # vLLM-Omni's eviction of a failed replica
    engine.add_request("a1", a[1])
    other = pool.get_bound_replica_id("a1")
    assert other != home and pool.select_replica_id("a1") == other
    assert ADDRS[home] not in router.policy.replicas
    assert router.decisions[-1].hit_blocks == 0       # its prefixes went with it


def test_admission_failure_releases_the_binding():
    pool = _pool()
    engine = _Engine(pool)

    def boom(request_id, prompt, *a, **k):
        raise RuntimeError("queue full")

    engine.add_request = boom
    router = ThinkerRouter(pool, PrefixAwarePolicy(), block_size=BS)
    router.install(engine)
    with pytest.raises(RuntimeError):
        engine.add_request("a0", _turns(1, 1)[0])
    assert pool.get_bound_replica_id("a0") is None


class _Hub:
    """vLLM-Omni's OmniCoordClientForHub as StagePool reads it."""

    def __init__(self, replicas):
        self.replicas = replicas

    def get_replicas_for_stage(self, stage_id):
        return ReplicaList(replicas=[r for r in self.replicas if r.stage_id == stage_id], timestamp=0.0)


def _info(addr, q=0, status=ReplicaStatus.UP):
    return ReplicaInfo(input_addr=addr, output_addr=addr + "-out", stage_id=0, status=status,
                       queue_length=q, last_heartbeat=0.0, registered_at=0.0)


def test_distributed_pick_goes_through_the_balancer():
    pool = _pool()
    hub = _Hub([_info(ADDRS[0]), _info(ADDRS[1])])
    pool.attach_hub(hub)
    router, engine = _router(pool)
    assert isinstance(pool._lb, LoadBalancer) and isinstance(pool._lb, PrefixRoutingBalancer)
    a = _turns(1, 3)
    picks = []
    for t in range(3):
        engine.add_request(f"a{t}", a[t])
        picks.append(asyncio.run(pool.pick(f"a{t}")))      # vLLM-Omni's pick -> our select
        pool.release(f"a{t}")
    assert picks[0] == picks[1] == picks[2]
    # the holder goes DOWN: vLLM-Omni leaves it out of the candidates; the router forgets it
    hub.replicas[picks[0]].status = ReplicaStatus.DOWN
    engine.add_request("a3", _turns(1, 4)[3])
    assert pool.preselect_replica_id("a3") == 1 - picks[0]
    assert router.policy.replicas == [ADDRS[1 - picks[0]]]


def test_balancer_reads_task_engine_inputs_and_queue_lengths():
    pool = _pool()
    router = ThinkerRouter(pool, PrefixAwarePolicy(RoutingConfig(load_margin=2)), block_size=BS)
    lb = PrefixRoutingBalancer(router)
    a = _turns(1, 2)
    reps = [_info(ADDRS[0], 0), _info(ADDRS[1], 0)]
    first = lb.select(Task(request_id="a0", engine_inputs=SimpleNamespace(prompt_token_ids=a[0]["prompt_token_ids"])),
                      reps)
    assert lb.select(Task(request_id="a1", engine_inputs=a[1]), reps) == first
    reps[first].queue_length = 3                                            # over the margin
    assert lb.select(Task(request_id="a1", engine_inputs=a[1]), reps) == 1 - first
    with pytest.raises(ValueError):
        lb.select(Task(request_id="x"), [])
    with pytest.raises(ValueError):
        lb.select(Task(request_id="x"), [_info(ADDRS[0], -1)])


def test_prompt_routing_key_media_and_text():
    pad = 7
    toks = [1, 2, pad, 3, 4, 5, 6, 8]
    img_a = {"prompt_token_ids": toks, "multi_modal_data": {"image": ["A"]}}
    img_b = {"prompt_token_ids": toks, "multi_modal_data": {"image": ["B"]}}
    ka = prompt_routing_key(img_a, BS, None, {"image": pad})
    kb = prompt_routing_key(img_b, BS, None, {"image": pad})
    assert len(ka) == 2 and ka != kb and ka[0] != request_block_hashes(toks, BS)[0]
    # a user uuid is the identifier; without a tokenizer a text prompt has no key
    ku = prompt_routing_key({**img_a, "multi_modal_uuids": {"image": ["u1"]}}, BS, None, {"image": pad})
    assert ku == request_block_hashes(toks, BS, [(2, 3, "image:u1")])
    assert prompt_routing_key({"prompt": "hi"}, BS, None) == []
    assert prompt_routing_key("abcdefgh", BS, lambda s: [ord(c) for c in s]) == \
        request_block_hashes([ord(c) for c in "abcdefgh"], BS)


def test_install_from_settings():
    pool = _pool()
    omni = SimpleNamespace(engine=_Engine(pool))
    assert install_prefix_routing(omni, {}, block_size=BS) is None
    r = install_prefix_routing(omni, {"OMNI_CACHE_ROUTING": "prefix", "OMNI_CACHE_ROUTING_LOAD_MARGIN": "2",
                                      "OMNI_CACHE_ROUTING_CAPACITY_BLOCKS": "128"}, block_size=BS)
    assert r is not None and r.policy.config.load_margin == 2 and r.policy.config.capacity_blocks == 128
    assert omni.engine._omni_cache_router is r
    assert routing_config({"OMNI_CACHE_ROUTING": "vllm_omni"}) is None
    with pytest.raises(SettingError):
        routing_config({"OMNI_CACHE_ROUTING": "prefix", "OMNI_CACHE_ROUTING_LOAD_MARGIN": "-1"})
    one = SimpleNamespace(engine=_Engine(_pool(1)))
    assert install_prefix_routing(one, {"OMNI_CACHE_ROUTING": "prefix"}, block_size=BS) is None


def test_a_tokenizer_that_cannot_look_up_placeholders_refuses_routing():
    """A tokenizer error is never skipped: routing media prompts without their placeholders
    would key them differently; installing fails loudly instead."""

    class BrokenTokenizer:
        unk_token_id = 0

        def encode(self, text):
            return [1]

        def convert_tokens_to_ids(self, token):
            raise KeyError(token)

    omni = SimpleNamespace(engine=_Engine(_pool()))
    with pytest.raises(RoutingSetupError, match="image placeholder"):
        install_prefix_routing(omni, {"OMNI_CACHE_ROUTING": "prefix"}, block_size=BS, tokenizer=BrokenTokenizer())
    assert getattr(omni.engine, "_omni_cache_router", None) is None


def _write(tmp_path, mutate):
    raw = yaml.safe_load(CPU_STAGE_CONFIG.read_text())
    mutate(raw)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_yaml_prefix_routing_on_the_thinker_validates(tmp_path):
    def on(r):
        r["stages"][0]["num_replicas"] = 2
        r["stages"][0]["env"].update(OMNI_CACHE_ROUTING="prefix", OMNI_CACHE_ROUTING_LOAD_MARGIN="4")

    cfg = load_stage_config(_write(tmp_path, on))
    assert not [n for n in cfg.notes if "ROUTING" in n]
    cfg = load_stage_config(_write(tmp_path, lambda r: r["stages"][0]["env"].update(OMNI_CACHE_ROUTING="prefix")))
    assert any("num_replicas" in n for n in cfg.notes)


@pytest.mark.parametrize("mutate, stage, key, words", [
    (lambda r: r["stages"][1].setdefault("env", {}).update(OMNI_CACHE_ROUTING="prefix"),
     1, "env.OMNI_CACHE_ROUTING", "thinker's (stage 0) replicas only"),
    (lambda r: r["stages"][2].setdefault("env", {}).update(OMNI_CACHE_ROUTING_LOAD_MARGIN="2"),
     2, "env.OMNI_CACHE_ROUTING_LOAD_MARGIN", "stage 0"),
    (lambda r: r["stages"][0]["env"].update(OMNI_CACHE_ROUTING_LOAD_MARGIN="2"),
     0, "env.OMNI_CACHE_ROUTING_LOAD_MARGIN", "no effect without"),
    (lambda r: r["stages"][0]["env"].update(OMNI_CACHE_ROUTING="prefix_aware"),
     0, "env.OMNI_CACHE_ROUTING", "expected one of"),
    (lambda r: r["stages"][0]["env"].update(OMNI_CACHE_ROUTING="prefix", OMNI_CACHE_ROUTING_LOAD_MARGIN="lots"),
     0, "env.OMNI_CACHE_ROUTING_LOAD_MARGIN", "non-negative integer"),
    (lambda r: (r["stages"][0].update(enable_prefix_caching=False),
                r["stages"][0]["env"].update(OMNI_CACHE_ROUTING="prefix")),
     0, "env.OMNI_CACHE_ROUTING", "enable_prefix_caching"),
])
def test_yaml_bad_routing_is_refused(tmp_path, mutate, stage, key, words):
    with pytest.raises(StageConfigError) as e:
        load_stage_config(_write(tmp_path, mutate))
    assert (e.value.stage_id, e.value.key) == (stage, key)
    assert words in str(e.value)


def test_kv_events_with_vllms_own_classes():
    kv = pytest.importorskip("vllm.distributed.kv_events")
    p = PrefixAwarePolicy()
    toks = list(range(8))
    p.apply_kv_events("r0", [kv.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=toks,
                                            block_size=BS, lora_id=None, medium="GPU", lora_name=None)])
    assert p.prefix_hits(request_block_hashes(toks, BS), ["r0"]) == {"r0": 2}
    p.apply_kv_events("r0", [kv.BlockRemoved(block_hashes=[11], medium="GPU")])
    assert p.prefix_hits(request_block_hashes(toks, BS), ["r0"]) == {"r0": 0}


def test_serve_installs_the_router_on_the_servers_engine(tmp_path, monkeypatch):
    """``omni-cache serve``: the server's ``AsyncOmni`` (yielded by vLLM-Omni's
    ``build_async_omni``, here a stand-in yielding an engine over a real ``StagePool``) gets the
    router when the deploy config asks for prefix routing, and not otherwise."""
    import contextlib

    from vllm_omni.entrypoints.openai import api_server

    from omni_cache.driver.vllm_serve import hook_the_servers_engine

    engines = []

    @contextlib.asynccontextmanager
    async def stand_in(args, **kwargs):
        engines.append(SimpleNamespace(engine=_Engine(_pool())))
        yield engines[-1]

    def serve(path):
        monkeypatch.setattr(api_server, "build_async_omni", stand_in)
        hooked = hook_the_servers_engine(["model", "--deploy-config", str(path)])

        async def worker():  # what omni_run_server_worker does with it
            async with api_server.build_async_omni(None) as client:
                return getattr(client.engine, "_omni_cache_router", None)

        return hooked, asyncio.run(worker())

    def on(r):
        r["stages"][0]["num_replicas"] = 2
        r["stages"][0]["env"]["OMNI_CACHE_ROUTING"] = "prefix"

    hooked, router = serve(_write(tmp_path, on))
    assert hooked and isinstance(router, ThinkerRouter) and router.block_size == 32
    # the bundled config: no routing, but the talker's prefix cache wants talker identity
    assert serve(CPU_STAGE_CONFIG) == (True, None)
    assert serve(_write(tmp_path, lambda r: r["stages"][1].update(enable_prefix_caching=False))) == (False, None)


def test_uninstall_gives_routing_back_to_vllm_omni():
    pool = _pool()
    router, engine = _router(pool)
    conv = _turns(7, 4)
    engine.add_request("a0", conv[0])
    first = pool.get_bound_replica_id("a0")
    router.uninstall(engine)
    assert engine._omni_cache_router is None
    engine.add_request("a1", conv[1])  # the engine's own add_request: nothing bound by the router
    assert pool.get_bound_replica_id("a1") is None and engine.admitted == ["a0", "a1"]
    router.install(engine)
    engine.add_request("a2", conv[2])
    assert pool.get_bound_replica_id("a2") == first  # it kept what it learned


def test_serve_releases_the_watcher_when_vllm_shuts_the_engine_down(monkeypatch):
    """``omni-cache serve``: on the engine client that vLLM-Omni's ``build_async_omni`` yields,
    ``shutdown`` — what vLLM's launcher calls on SIGTERM / Ctrl-C — first releases the
    distributed-mode membership watcher (``omni_cache.driver.distributed_stop``), then shuts
    down as before, with its arguments; a second wrap does nothing."""
    from vllm_omni.entrypoints.openai import api_server

    from omni_cache.driver import distributed_stop
    from omni_cache.driver.vllm_serve import stop_distributed_stages

    events = []

    class Client:
        def shutdown(self, timeout=None):
            events.append(("shutdown", timeout))

    @contextlib.asynccontextmanager
    async def stand_in(args, **kwargs):
        yield Client()

    monkeypatch.setattr(api_server, "build_async_omni", stand_in)
    monkeypatch.setattr(distributed_stop, "release_membership_watcher",
                        lambda omni: events.append(("released", type(omni).__name__)))
    assert stop_distributed_stages()

    async def server():  # what vLLM's launcher does on a stop signal
        async with api_server.build_async_omni(None) as client:
            assert distributed_stop.release_before_shutdown(client) is False  # already wrapped
            client.shutdown(timeout=0)

    asyncio.run(server())
    assert events == [("released", "Client"), ("shutdown", 0)]
