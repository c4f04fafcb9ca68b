"""Prefix-aware routing of thinker (stage 0) requests over its replicas, plugged into
vLLM-Omni 0.30 — the only module that touches vLLM-Omni's routing internals.

What vLLM-Omni offers (file:line of the installed 0.30 in ``docs/routing.md``):

- distributed mode (a hub attached): ``StagePool.pick`` / ``preselect_replica_id`` call
  ``LoadBalancer.select(task, replicas)`` of the pool's balancer, injected per pool by the
  public ``StagePool.attach_load_balancer``; the task carries only ``request_id``;
- in-process mode: ``StagePool.select_replica_id`` is a fixed round-robin with no balancer,
  but it honours a request's existing binding (``StagePool.bind(request_id, input_addr)``).

Neither sees the prompt, so :class:`ThinkerRouter` computes the request's routing key where
the prompt and its request id meet first — the engine's ``add_request`` (the caller's
thread, before tokenisation and before vLLM-Omni's own stage-0 pre-selection that scopes
multimodal cache keys to a replica) — and then:

- in-process: chooses with :class:`~omni_cache.routing.PrefixAwarePolicy` and binds the
  request to the chosen replica (``StagePool.bind``); vLLM-Omni's round-robin then returns
  that binding;
- distributed: keeps the key as a hint by request id; :class:`PrefixRoutingBalancer`, a
  ``LoadBalancer`` attached to the thinker pool only, chooses when vLLM-Omni asks.

Talker and code2wav pools keep vLLM-Omni's routing (the orchestrator's own affinity).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from hashlib import blake2b
from typing import Any

from omni_cache import settings
from omni_cache.routing import PrefixAwarePolicy, RouteDecision, RoutingConfig, request_block_hashes

logger = logging.getLogger(__name__)

#: Qwen3-Omni's multimodal placeholder tokens (one per item in the unexpanded chat prompt).
DEFAULT_PLACEHOLDERS = {"image": "<|image_pad|>", "audio": "<|audio_pad|>", "video": "<|video_pad|>"}
THINKER_STAGE_ID = 0
_MAX_HINTS = 65_536


#: KV blocks per replica the policy assumes where neither the setting nor the engine says
DEFAULT_CAPACITY_BLOCKS = 4096
#: vLLM's default KV block size (tokens), where the stage config names none
VLLM_DEFAULT_BLOCK_SIZE = 16
#: routing decisions kept for inspection (:attr:`ThinkerRouter.decisions`), the latest
DECISIONS_KEPT = 64


class RoutingSetupError(ValueError):
    """Prefix routing cannot be installed (no thinker pool, no tokenizer, ...)."""


def routing_config(stage_env: Mapping[str, Any] | None) -> RoutingConfig | None:
    """The thinker stage's routing settings from its ``env:`` mapping.

    Returns:
        A :class:`RoutingConfig` when ``OMNI_CACHE_ROUTING: prefix``, else None.
        ``capacity_blocks`` is ``OMNI_CACHE_ROUTING_CAPACITY_BLOCKS`` (0 = ask the engine,
        see :meth:`ThinkerRouter.install`; the config then holds a placeholder of 1).

    Raises:
        omni_cache.settings.SettingError: a value it does not accept.
    """
    env = {k: str(v) for k, v in (stage_env or {}).items()}
    if settings.ROUTING.get(env) != "prefix":
        return None
    cap = settings.ROUTING_CAPACITY_BLOCKS.get_int(env)
    return RoutingConfig(load_margin=settings.ROUTING_LOAD_MARGIN.get_int(env), capacity_blocks=max(cap, 1))


def media_identifier(item: Any) -> str:
    """A replica-independent content identifier of one multimodal item (hex blake2b of its
    bytes: numpy arrays, torch tensors, PIL images, ``(array, sample_rate)`` tuples; else its
    ``repr``)."""
    h = blake2b(digest_size=16)

    def feed(x: Any) -> None:
        if isinstance(x, (tuple, list)):
            h.update(b"(")
            for y in x:
                feed(y)
            h.update(b")")
        elif hasattr(x, "tobytes") and hasattr(x, "size") and hasattr(x, "mode"):  # PIL image
            h.update(f"img{x.size}{x.mode}".encode())
            h.update(x.tobytes())
        elif hasattr(x, "detach"):  # torch tensor
            feed(x.detach().cpu().numpy())
        elif hasattr(x, "tobytes") and hasattr(x, "dtype"):  # numpy array
            h.update(f"arr{x.shape}{x.dtype}".encode())
            h.update(x.tobytes())
        else:
            h.update(repr(x).encode())

    feed(item)
    return h.hexdigest()


def prompt_routing_key(
    prompt: Any,
    block_size: int,
    tokenize: Callable[[str], list[int]] | None,
    placeholder_token_ids: Mapping[str, int] | None = None,
) -> list[int]:
    """The routing key (block hashes) of a prompt as ``Omni.generate`` / ``add_request``
    take it.

    Token ids: ``prompt["prompt_token_ids"]`` if given, else ``tokenize(prompt["prompt"])``
    (a ``str`` prompt is the text). Media: the k-th item of modality ``m`` is placed at the
    k-th ``placeholder_token_ids[m]`` token; with no such token, at the prompt's last token
    (it then does not split earlier blocks: two prompts differing only in media may share a
    key — a routing miss at worst, never a wrong row: the engine hashes media itself).
    Identifiers: the user's ``multi_modal_uuids`` where given, else :func:`media_identifier`.

    Returns:
        Block hashes (:func:`omni_cache.routing.request_block_hashes`); ``[]`` for a prompt it
        cannot read (an ``EngineCoreRequest``-like object without ``prompt_token_ids``, or text
        without a tokenizer).
    """
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if isinstance(prompt, dict):
        token_ids = prompt.get("prompt_token_ids")
        if token_ids is None and isinstance(prompt.get("prompt"), str) and tokenize is not None:
            token_ids = tokenize(prompt["prompt"])
        mm = prompt.get("multi_modal_data") or {}
        uuids = prompt.get("multi_modal_uuids") or {}
    else:
        token_ids = getattr(prompt, "prompt_token_ids", None)
        mm, uuids = {}, {}
    if token_ids is None:
        return []
    token_ids = list(token_ids)
    media: list[tuple[int, int, object]] = []
    for modality, items in sorted(mm.items()):
        items = items if isinstance(items, list) else [items]
        given = uuids.get(modality) or []
        given = given if isinstance(given, list) else [given]
        pid = (placeholder_token_ids or {}).get(modality)
        positions = [i for i, t in enumerate(token_ids) if t == pid] if pid is not None else []
        for k, item in enumerate(items):
            ident = given[k] if k < len(given) and given[k] is not None else media_identifier(item)
            pos = positions[k] if k < len(positions) else max(len(token_ids) - 1, 0)
            media.append((pos, pos + 1, f"{modality}:{ident}"))
    return request_block_hashes(token_ids, block_size, media)


def _input_addr(client: Any) -> str | None:
    addrs = getattr(client, "client_addresses", None)
    addr = addrs.get("input_address") if isinstance(addrs, dict) else None
    return addr if isinstance(addr, str) and addr else None


class ThinkerRouter:
    """Prefix-aware routing of one stage pool's requests (the thinker's).

    Args:
        pool: vLLM-Omni's ``StagePool`` of the thinker stage.
        policy: the engine-free :class:`~omni_cache.routing.PrefixAwarePolicy`.
        block_size: the thinker's KV block size (tokens).
        tokenize: text -> token ids (the thinker's tokenizer); None: only prompts with
            ``prompt_token_ids`` get a key, the rest go by load.
        placeholder_token_ids: modality -> placeholder token id (see
            :func:`prompt_routing_key`).

    Thread safety: one lock around the policy (``add_request`` runs in the caller's thread,
    the balancer in the orchestrator's).
    """

    def __init__(self, pool: Any, policy: PrefixAwarePolicy, *, block_size: int,
                 tokenize: Callable[[str], list[int]] | None = None,
                 placeholder_token_ids: Mapping[str, int] | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.block_size = block_size
        self.tokenize = tokenize
        self.placeholder_token_ids = dict(placeholder_token_ids or {})
        self.lock = threading.Lock()
        self._hints: OrderedDict[str, list[int]] = OrderedDict()
        self._routed: dict[str, str] = {}  # request id -> input address (in-process in-flight)
        self.decisions: list[RouteDecision] = []  # the last few (tests, logs)

    # ---- keys and hints ----

    def key_of(self, prompt: Any) -> list[int]:
        """The prompt's block hashes (:func:`prompt_routing_key`)."""
        return prompt_routing_key(prompt, self.block_size, self.tokenize, self.placeholder_token_ids)

    def hint(self, request_id: str, block_hashes: Sequence[int]) -> None:
        """Remember a request's key for the balancer (bounded: the oldest hints go first)."""
        with self.lock:
            self._hints[request_id] = list(block_hashes)
            self._hints.move_to_end(request_id)
            while len(self._hints) > _MAX_HINTS:
                self._hints.popitem(last=False)

    def hint_of(self, request_id: str) -> list[int] | None:
        with self.lock:
            return self._hints.get(request_id)

    # ---- choice ----

    def choose(self, block_hashes: Sequence[int], queue_lengths: Mapping[str, int],
               tie_key: int | None = None) -> RouteDecision:
        """Sync the policy's replicas to ``queue_lengths``' keys (dead / drained ones are
        forgotten), then route (records the blocks on the chosen replica)."""
        with self.lock:
            self.policy.sync_replicas(queue_lengths)
            d = self.policy.route(block_hashes, queue_lengths, tie_key)
            self.decisions = (self.decisions + [d])[-DECISIONS_KEPT:]
            return d

    def _local_candidates(self) -> dict[str, int]:
        """In-process: live, available replicas' input address -> requests this router bound
        there that vLLM-Omni still holds a binding for (released at finish / abort)."""
        pool = self.pool
        addr_of = {}
        for rid in pool.available_replica_ids():
            addr = _input_addr(pool.clients[rid])
            if addr is not None:
                addr_of[rid] = addr
        queue = dict.fromkeys(addr_of.values(), 0)
        for req, addr in list(self._routed.items()):
            bound = pool.get_bound_replica_id(req)
            if bound is None or addr_of.get(bound) != addr:
                del self._routed[req]
            else:
                queue[addr] += 1
        return queue

    def route(self, request_id: str, prompt: Any) -> int | None:
        """Route one request before vLLM-Omni admits it.

        In-process: choose and bind it (``StagePool.bind``); returns the replica id.
        Distributed: store its key for :class:`PrefixRoutingBalancer`; returns None (vLLM-Omni
        calls the balancer). Also None when no replica has an input address to bind to.
        """
        key = self.key_of(prompt)
        if self.pool.is_distributed:
            self.hint(request_id, key)
            return None
        with self.lock:
            queue = self._local_candidates()
        if not queue:
            return None
        d = self.choose(key, queue, tie_key=_tie(request_id, key))
        with self.lock:
            self._routed[request_id] = d.replica
        self.pool.bind(request_id, d.replica)
        return self.pool.get_bound_replica_id(request_id)

    def release(self, request_id: str) -> None:
        """Drop a request's hint and binding (its admission failed)."""
        with self.lock:
            self._hints.pop(request_id, None)
            self._routed.pop(request_id, None)
        self.pool.release_binding(request_id)

    # ---- installation ----

    def install(self, engine: Any) -> None:
        """Plug into a running vLLM-Omni engine (``Omni(...).engine`` / ``AsyncOmni``'s).

        Wraps the engine instance's ``add_request`` (routes, then admits; no class or file of
        vLLM-Omni changes) and, in distributed mode, attaches :class:`PrefixRoutingBalancer`
        to the thinker pool (``StagePool.attach_load_balancer``). Idempotent.
        """
        if getattr(engine, "_omni_cache_router", None) is self:
            return
        original = engine.add_request

        def add_request(request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> None:
            try:
                self.route(request_id, prompt)
            except Exception:  # routing must never fail a request: vLLM-Omni routes it then
                logger.exception("prefix routing failed for %s; vLLM-Omni routes it", request_id)
            try:
                return original(request_id, prompt, *args, **kwargs)
            except Exception:
                self.release(request_id)
                raise

        engine.add_request = add_request
        engine._omni_cache_router = self
        self._original_add_request = original
        if self.pool.is_distributed:
            self._previous_balancer = getattr(self.pool, "_lb", None)
            self.pool.attach_load_balancer(PrefixRoutingBalancer(self))

    def uninstall(self, engine: Any) -> None:
        """Undo :meth:`install`: the engine's own ``add_request`` again (and, distributed, the
        balancer the pool had), so vLLM-Omni routes; bindings of requests in flight stay. The
        router keeps what it learned (install it again to resume). No-op if not installed."""
        if getattr(engine, "_omni_cache_router", None) is not self:
            return
        engine.add_request = self._original_add_request
        engine._omni_cache_router = None
        if self.pool.is_distributed and getattr(self, "_previous_balancer", None) is not None:
            self.pool.attach_load_balancer(self._previous_balancer)


def _tie(request_id: str, key: Sequence[int]) -> int:
    if key:
        return key[0]
    return int.from_bytes(blake2b(request_id.encode(), digest_size=8).digest(), "little")


def _load_balancer_base() -> type:
    from vllm_omni.distributed.omni_coordinator.load_balancer import LoadBalancer

    return LoadBalancer


class PrefixRoutingBalancer(_load_balancer_base()):
    """vLLM-Omni ``LoadBalancer`` for the thinker pool in distributed mode.

    ``select(task, replicas)``: the request's key is the hint :class:`ThinkerRouter` stored
    for ``task["request_id"]``, else computed from ``task["engine_inputs"]`` (should vLLM-Omni
    pass it one day: a prompt dict or an object with ``prompt_token_ids``), else empty (by
    load). Replicas are keyed by ``ReplicaInfo.input_addr``, loaded by
    ``ReplicaInfo.queue_length``; replicas absent from ``replicas`` (DOWN, ERROR, gone) are
    forgotten.

    Returns:
        Index into ``replicas``.

    Raises:
        ValueError: ``replicas`` is empty or a queue length is negative (as vLLM-Omni's own).
    """

    def __init__(self, router: ThinkerRouter) -> None:
        self.router = router

    def select(self, task: Mapping[str, Any], replicas: list[Any]) -> int:
        if not replicas:
            raise ValueError("replicas must not be empty")
        request_id = str(task.get("request_id", ""))
        key = self.router.hint_of(request_id)
        if key is None and task.get("engine_inputs") is not None:
            key = self.router.key_of(task["engine_inputs"])
        key = key or []
        queue = {}
        for rep in replicas:
            q = int(rep.queue_length)
            if q < 0:
                raise ValueError("queue_length must be non-negative for all replicas")
            queue[rep.input_addr] = q
        d = self.router.choose(key, queue, tie_key=_tie(request_id, key))
        return next(i for i, rep in enumerate(replicas) if rep.input_addr == d.replica)


def _engine_kv_blocks(pool: Any) -> int | None:
    cfg = getattr(getattr(pool, "stage_vllm_config", None), "cache_config", None)
    n = getattr(cfg, "num_gpu_blocks", None) or getattr(cfg, "num_gpu_blocks_override", None)
    return int(n) if n else None


def install_prefix_routing(omni: Any, stage_env: Mapping[str, Any] | None, *, block_size: int,
                           tokenizer: Any = None) -> ThinkerRouter | None:
    """Install prefix routing on a running ``Omni`` / ``AsyncOmni`` if the thinker stage's
    ``env:`` asks for it (``OMNI_CACHE_ROUTING: prefix``).

    Args:
        omni: the running ``vllm_omni.Omni`` (its ``engine.stage_pools[0]`` is the thinker's).
        stage_env: the thinker stage's ``env:`` mapping.
        block_size: the thinker's KV block size.
        tokenizer: the thinker's tokenizer (default: the engine's stage-0 input processor's).

    Returns:
        The :class:`ThinkerRouter`, or None when routing is not asked for or the thinker runs
        one replica (nothing to choose).

    Raises:
        RoutingSetupError: the engine has no thinker stage pool; its tokenizer raises looking
            up a placeholder token.
        omni_cache.settings.SettingError: a bad routing setting.
    """
    cfg = routing_config(stage_env)
    if cfg is None:
        return None
    engine = getattr(omni, "engine", omni)
    pools = getattr(engine, "stage_pools", None)
    if not pools:
        raise RoutingSetupError("the vLLM-Omni engine has no stage pools (vLLM-Omni 0.30's "
                                "`engine.stage_pools`); cannot route the thinker")
    pool = pools[THINKER_STAGE_ID]
    if pool.live_num_replicas <= 1 and not pool.is_distributed:
        logger.info("prefix routing: the thinker runs one replica; nothing to route")
        return None
    env = {k: str(v) for k, v in (stage_env or {}).items()}
    capacity = settings.ROUTING_CAPACITY_BLOCKS.get_int(env) or _engine_kv_blocks(pool) or DEFAULT_CAPACITY_BLOCKS
    cfg = RoutingConfig(load_margin=cfg.load_margin, capacity_blocks=capacity,
                        min_hit_blocks=cfg.min_hit_blocks, shared_prefix_fanout=cfg.shared_prefix_fanout)
    if tokenizer is None:
        tokenizer = getattr(getattr(engine, "input_processor", None), "tokenizer", None)
    tokenize = None
    placeholders: dict[str, int] = {}
    if tokenizer is not None:
        def tokenize(text: str) -> list[int]:
            return list(tokenizer.encode(text))

        unk = getattr(tokenizer, "unk_token_id", None)
        for modality, tok in DEFAULT_PLACEHOLDERS.items():
            try:
                tid = tokenizer.convert_tokens_to_ids(tok)
            except Exception as exc:  # a tokenizer that cannot look tokens up cannot route media prompts
                raise RoutingSetupError(f"the thinker's tokenizer cannot look up the {modality} placeholder "
                                        f"{tok!r}: {exc!r}") from exc
            if isinstance(tid, int) and tid != unk:
                placeholders[modality] = tid
    router = ThinkerRouter(pool, PrefixAwarePolicy(cfg), block_size=block_size, tokenize=tokenize,
                           placeholder_token_ids=placeholders)
    router.install(engine)
    logger.info("prefix routing on the thinker: %d replicas, load margin %d, %d KV blocks each",
                pool.live_num_replicas, cfg.load_margin, capacity)
    return router


def install_routing_from_stage_config(omni: Any, stage_config: Any) -> ThinkerRouter | None:
    """:func:`install_prefix_routing` with the thinker's ``env:`` and ``block_size`` (default
    16, vLLM's) read from ``stage_config`` (:class:`omni_cache.driver.stage_config.StageConfig`).
    Returns the router, or None (routing not asked for, or one thinker replica). Raises what
    :func:`install_prefix_routing` raises."""
    thinker = stage_config.stage(THINKER_STAGE_ID)
    if routing_config(thinker.get("env")) is None:
        return None
    return install_prefix_routing(omni, thinker.get("env"),
                                  block_size=int(thinker.get("block_size", VLLM_DEFAULT_BLOCK_SIZE)))
