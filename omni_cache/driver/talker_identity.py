"""Content identity for talker requests, attached where vLLM-Omni 0.30's orchestrator submits
them — the only module that touches that part of vLLM-Omni's orchestrator.

The thinker's prompt (token ids, media identifiers, cache salt, LoRA) and the talker's
request meet only in the orchestrator: the thinker's ``OmniEngineCoreRequest`` goes to
stage 0's ``StagePool.submit_initial``; the talker's (placeholder prompt ``[0] * n``) to
stage 1's, built by the async-chunk prewarm (``Orchestrator._prewarm_async_chunk_stages``,
streaming) or from ``thinker2talker_token_only`` (``Orchestrator._build_next_stage_request``,
not streaming). :class:`TalkerIdentity` wraps those two pools' ``submit_initial`` on the
running engine instance (no vLLM-Omni class or file changes): it remembers the thinker
prompt per request id and gives each talker request its block keys
(:func:`omni_cache.core.talker_keys.talker_block_keys`) in
``sampling_params.extra_args[TALKER_KEYS_ARG]`` — ``{"block_size": B, "keys": [...]}``.
omni-cache's talker scheduler (:mod:`omni_cache.engine.talker_scheduler`) hashes the
talker's blocks from them. A talker request without keys (this hook not installed, a prompt
whose layout does not match) shares nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from omni_cache.core.talker_keys import (
    TALKER_KEYS_ARG,
    MediaItem,
    ensure_signing_secret,
    signature,
    talker_block_keys,
    talker_prompt_rows,
)

logger = logging.getLogger(__name__)

_MAX_PENDING = 4096  # thinker prompts remembered until their talker request is submitted
_MAX_KEYS = 256      # talker requests whose keys are kept for audits (TalkerIdentity.keys)


def _media(mm_features: Any) -> list[MediaItem]:
    items = []
    for f in mm_features or ():
        pos = getattr(f, "mm_position", None)
        items.append(MediaItem(offset=int(getattr(pos, "offset", 0)), length=int(getattr(pos, "length", 0)),
                               modality=str(getattr(f, "modality", "")), identifier=str(getattr(f, "identifier", ""))))
    return items


class TalkerIdentitySetupError(RuntimeError):
    """Talker identity cannot run on this vLLM-Omni: a helper that feeds the talker keys moved
    (:func:`omni_cache.engine.seam.check_talker_keys_seam`)."""


def _key_helpers() -> tuple:
    """vLLM-Omni's speaker / language helpers (:func:`omni_cache.engine.seam.talker_key_helpers`).

    Raises:
        TalkerIdentitySetupError: they moved; keys without them would be weaker, so talker
            identity refuses to start.
    """
    from omni_cache.engine.seam import talker_key_helpers

    try:
        return talker_key_helpers()
    except ImportError as exc:
        raise TalkerIdentitySetupError(f"vLLM-Omni's speaker/language helpers moved ({exc}); the talker "
                                       f"block keys need them: fix the seam (omni_cache/engine/seam.py)") from exc


def _speaker_language(prompt: Any) -> tuple[Any, Any]:
    """The speaker and language vLLM-Omni reads from the request's ``prompt`` (a dict or a list
    of dicts; any other prompt, e.g. a text prompt, carries neither: ``(None, None)``).

    Raises:
        TalkerIdentitySetupError: the helpers moved.
        Exception: whatever the helpers raise for a malformed prompt (the caller refuses keys).
    """
    if not isinstance(prompt, (dict, list)):
        return None, None
    extract_speaker, extract_language = _key_helpers()
    return extract_speaker(prompt), extract_language(prompt)


class TalkerIdentity:
    """Attaches talker block keys to talker requests on a running vLLM-Omni engine.

    Args:
        thinker_pool: the engine's stage-0 ``StagePool``.
        talker_pool: the talker's ``StagePool`` (stage 1 of Qwen3-Omni).
        block_size: the talker's KV block size (tokens).

    Attributes:
        attached: talker requests given keys; ``unkeyed``: talker requests given none (no
            remembered thinker prompt, or a layout mismatch).
        hits: request id → ``(talker prefix-hit tokens, talker prompt tokens)``, from the
            talker's first output (vLLM's ``RequestOutput.num_cached_tokens``); read with
            :meth:`pop_hit`.
        keys: request id → the block keys given to its talker request (the last
            256; for audits and tests: two requests can share exactly their common
            leading keys).

    The keys come from :meth:`block_keys`; a test can replace it on an instance (e.g.
    ``tests.util.placeholder_talker_keys``: every block keyed by its index alone, what vLLM's
    own hash of the placeholder prompt ``[0] * n`` amounts to, to show that scheme sharing KV
    between different conversations of equal lengths).
    """

    def __init__(self, thinker_pool: Any, talker_pool: Any, *, block_size: int) -> None:
        self.thinker_pool, self.talker_pool, self.block_size = thinker_pool, talker_pool, int(block_size)
        self._thinker: OrderedDict[str, tuple[list[int], list[MediaItem], tuple]] = OrderedDict()
        self.attached = 0
        self.unkeyed = 0
        self.hits: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.keys: OrderedDict[str, list[str]] = OrderedDict()
        self._originals: dict[str, Any] = {}

    def remember_thinker(self, request_id: str, request: Any) -> None:
        """Keep the thinker prompt of ``request`` (an ``EngineCoreRequest``) until its talker
        request is submitted."""
        ids = getattr(request, "prompt_token_ids", None)
        if ids is None:
            return
        lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
        self._thinker[request_id] = (list(ids), _media(getattr(request, "mm_features", None)),
                                     (getattr(request, "cache_salt", None), lora))
        self._thinker.move_to_end(request_id)
        while len(self._thinker) > _MAX_PENDING:
            self._thinker.popitem(last=False)

    def keys_for(self, request_id: str, talker_request: Any, req_state: Any) -> dict | None:
        """The ``extra_args`` entry for one talker request, or None (no thinker prompt
        remembered, or a talker prompt whose length the layout does not give)."""
        thinker = self._thinker.pop(request_id, None)
        talker_ids = getattr(talker_request, "prompt_token_ids", None)
        if thinker is None or talker_ids is None:
            return None
        return self.block_keys(request_id, thinker, talker_ids, req_state)

    def block_keys(self, request_id: str, thinker: tuple, talker_ids: list[int], req_state: Any) -> dict | None:
        """The signed ``extra_args`` entry of a talker request from its thinker prompt
        (``thinker``: ``(token ids, media items, (cache salt, LoRA name))`` as remembered),
        or None when the talker prompt's length is not the one the layout gives."""
        ids, media, (salt, lora) = thinker
        rows, assistant = talker_prompt_rows(ids)
        if len(rows) + assistant != len(talker_ids):
            logger.warning("talker identity: request %s: talker prompt of %d tokens, but the thinker prompt's "
                           "layout gives %d user rows + %d: its talker blocks are not shared",
                           request_id, len(talker_ids), len(rows), assistant)
            return None
        speaker, language = _speaker_language(getattr(req_state, "prompt", None))
        keys = talker_block_keys(ids, media, talker_prompt_len=len(talker_ids), block_size=self.block_size,
                                 seed=(repr(speaker), repr(language), salt, lora))
        return self.signed(keys)

    def signed(self, keys: list[str]) -> dict:
        """``keys`` as the signed ``extra_args`` entry the talker scheduler accepts."""
        return {"block_size": self.block_size, "keys": keys,
                "signature": signature(self.block_size, keys, ensure_signing_secret())}

    def attach(self, request_id: str, talker_request: Any, req_state: Any) -> None:
        """Put the keys into the talker request's own copy of its sampling params (and drop
        any a client sent: only the driver's signed keys are ever used)."""
        entry = self.keys_for(request_id, talker_request, req_state)
        sp = getattr(talker_request, "sampling_params", None)
        if sp is None:
            self.unkeyed += 1
            return
        if entry is None:
            self.unkeyed += 1
            if TALKER_KEYS_ARG in (sp.extra_args or {}):
                sp = sp.clone()
                sp.extra_args = {k: v for k, v in sp.extra_args.items() if k != TALKER_KEYS_ARG}
                talker_request.sampling_params = sp
            return
        sp = sp.clone()  # the orchestrator's per-stage params may be shared between requests
        sp.extra_args = {**(sp.extra_args or {}), TALKER_KEYS_ARG: entry}
        talker_request.sampling_params = sp
        self.attached += 1
        self.keys[str(request_id)] = entry["keys"]
        while len(self.keys) > _MAX_KEYS:
            self.keys.popitem(last=False)

    def record_outputs(self, request_outputs: Any) -> None:
        """Keep the talker prefix hit of each request's first output."""
        for o in request_outputs or ():
            rid, n = getattr(o, "request_id", None), getattr(o, "num_cached_tokens", None)
            if rid is None or n is None or rid in self.hits:
                continue
            self.hits[str(rid)] = (int(n), len(getattr(o, "prompt_token_ids", None) or ()))
            while len(self.hits) > _MAX_PENDING:
                self.hits.popitem(last=False)

    def pop_hit(self, request_id: str) -> tuple[int, int] | None:
        """``(talker prefix-hit tokens, talker prompt tokens)`` of a finished request (once),
        or None if the talker produced no output for it. ``request_id`` is the caller's:
        ``AsyncOmni`` runs a request as ``<request_id>-<8 hex digits>`` in the engine, so
        that form is matched too (the latest such request)."""
        rid = _engine_request_id(self.hits, str(request_id))
        return self.hits.pop(rid, None) if rid is not None else None

    # ---- installation ----

    def install(self) -> None:
        """Wrap both pools' ``submit_initial`` and the talker pool's
        ``process_llm_raw_outputs`` (instance attributes). Idempotent."""
        if getattr(self.talker_pool, "_omni_cache_talker_identity", None) is self:
            return
        thinker_submit, talker_submit = self.thinker_pool.submit_initial, self.talker_pool.submit_initial
        talker_outputs = self.talker_pool.process_llm_raw_outputs

        async def submit_thinker(request_id: str, req_state: Any, request: Any, *args: Any, **kwargs: Any):
            try:
                self.remember_thinker(request_id, request)
            except Exception:  # identity must never fail a request: its talker then shares nothing
                logger.exception("talker identity: could not read the thinker prompt of %s", request_id)
            return await thinker_submit(request_id, req_state, request, *args, **kwargs)

        async def submit_talker(request_id: str, req_state: Any, request: Any, *args: Any, **kwargs: Any):
            try:
                self.attach(request_id, request, req_state)
            except Exception:
                logger.exception("talker identity: no keys for %s; its talker blocks are not shared", request_id)
            return await talker_submit(request_id, req_state, request, *args, **kwargs)

        async def process_talker_outputs(*args: Any, **kwargs: Any):
            outs = await talker_outputs(*args, **kwargs)
            try:
                self.record_outputs(outs)
            except Exception:
                logger.exception("talker identity: could not read the talker's outputs")
            return outs

        self._originals = {"thinker": thinker_submit, "talker": talker_submit, "outputs": talker_outputs}
        self.thinker_pool.submit_initial = submit_thinker
        self.talker_pool.submit_initial = submit_talker
        self.talker_pool.process_llm_raw_outputs = process_talker_outputs
        self.talker_pool._omni_cache_talker_identity = self

    def uninstall(self) -> None:
        """Undo :meth:`install` (talker requests submitted afterwards carry no keys: they share
        nothing). No-op if not installed."""
        if getattr(self.talker_pool, "_omni_cache_talker_identity", None) is not self:
            return
        self.thinker_pool.submit_initial = self._originals["thinker"]
        self.talker_pool.submit_initial = self._originals["talker"]
        self.talker_pool.process_llm_raw_outputs = self._originals["outputs"]
        self.talker_pool._omni_cache_talker_identity = None


def _engine_request_id(table: Mapping[str, Any], request_id: str) -> str | None:
    """The key of ``table`` for the caller's ``request_id``: itself, else the latest
    ``<request_id>-<suffix>`` (``AsyncOmni``'s engine-side request id)."""
    if request_id in table:
        return request_id
    prefix = request_id + "-"
    for key in reversed(table):
        if key.startswith(prefix) and "-" not in key[len(prefix):]:
            return key
    return None


def _talker_pool(pools: Any) -> Any | None:
    for pool in list(pools)[1:]:
        mc = getattr(getattr(pool, "stage_vllm_config", None), "model_config", None)
        if getattr(mc, "model_stage", None) == "talker":
            return pool
    return None


def install_talker_identity(omni: Any) -> TalkerIdentity | None:
    """Install :class:`TalkerIdentity` on a running ``Omni`` / ``AsyncOmni`` whose talker stage
    runs with prefix caching.

    Returns:
        The installed hook, or None: no talker stage, or its prefix caching is off.

    Raises:
        TalkerIdentitySetupError: vLLM-Omni's speaker/language helpers moved.
    """
    engine = getattr(omni, "engine", omni)
    pools = getattr(engine, "stage_pools", None)
    if not pools:
        return None
    talker = _talker_pool(pools)
    cache = getattr(getattr(talker, "stage_vllm_config", None), "cache_config", None)
    if talker is None or not getattr(cache, "enable_prefix_caching", False):
        return None
    _key_helpers()  # a moved helper is an error at start-up, not a weaker key per request
    hook = TalkerIdentity(pools[0], talker, block_size=int(cache.block_size))
    hook.install()
    logger.info("talker prefix caching: content identity on (talker block size %d)", hook.block_size)
    return hook
