"""The stage manager: omni-cache behind vLLM-Omni's prefix-cache seam, one method per arrow.

vLLM-Omni's AR runner drives a prefix-cache manager through the calls listed in
:mod:`omni_cache.engine.seam` (``new_step_starts`` before ``_update_states``,
``save_outputs`` after the forward, ``materialize`` / ``discard_step`` when it builds the
hand-off). :class:`OmniCacheStageManager` is that manager, built on
:class:`omni_cache.core.HiddenStateCache`. One engine step is the data path of
docs/architecture.md, each arrow one method:

1. :meth:`~OmniCacheStageManager.new_step_starts` — mirror the scheduler output: each
   request's block table row of the mirrored (full-attention) KV cache group, its
   ``num_computed_tokens`` before this step; new and resumed requests with
   ``num_computed_tokens > 0`` are prefix hits (hit length = ``num_computed_tokens``).
2. :meth:`~OmniCacheStageManager.classify_outputs` — split the forward's outputs into
   token-aligned rows (cached) and everything else (handed through per request).
3. :meth:`~OmniCacheStageManager.plan_step` — the :class:`StepPlan`: each request's rows in
   the batch, the keys each write carries (fast prefill drops the final hidden states),
   the keys handed downstream.
4. :meth:`~OmniCacheStageManager.write_rows` — every scheduled token's rows at their KV slot
   ids; every block that became full is cached with its chained block hash.
5. :meth:`~OmniCacheStageManager.read_hits` — each hit's prefix rows (after all writes, so a
   same-step hit gets this step's rows).
6. :meth:`~OmniCacheStageManager.merge` — ``cached prefix ++ fresh`` per request.
7. :meth:`~OmniCacheStageManager.materialize` — the hand-off to vLLM-Omni's payload builder.

A hit whose rows the ledger cannot vouch for raises :class:`~omni_cache.core.StaleRowsError`
naming the request and block instead of serving a wrong row (the capped scheduler,
:mod:`omni_cache.engine.scheduler`, keeps that from happening).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_cache import settings
from omni_cache.core import HiddenStateCache, KeySpec, Tier, chained_block_hashes
from omni_cache.core.cache import StepRequest
from omni_cache.core.staging import HostStager, KeptIds, KeptIdsRing, StagedStep
from omni_cache.engine import scheduler_tokens
from omni_cache.engine.metrics import BlockDigestAudit, HitAudit, MetricsFile

logger = logging.getLogger(__name__)

#: key of the final hidden states (vLLM-Omni's ``text_hidden_states``) in the cache
HIDDEN_KEY = "hidden"
#: the token id vLLM's GPU runner puts in a request's host-side ``output_token_ids`` for a
#: token sampled under async scheduling whose value is still on the device
#: (``gpu_model_runner.py``: ``sampled_ids = [-1]``; ``InputBatch.update_async_output_token_ids``)
PLACEHOLDER_TOKEN = -1
#: attribute of a step's ``ModelRunnerOutput`` with the block ids the worker cached in that step
#: (a ``frozenset[int]``, :meth:`OmniCacheStageManager.cached_blocks`), set by
#: :class:`omni_cache.engine.runner.OmniCacheRunnerMixin`, read by the capped scheduler; an
#: instance attribute, so it travels wherever the output does (in process, or pickled)
CACHED_BLOCKS_ATTR = "omni_cache_cached_block_ids"


@dataclass
class RequestView:
    """The cache's view of one request.

    Attributes:
        block_ids: block table row of the mirrored KV cache group.
        num_computed_tokens: tokens computed before the current step.
        hit_tokens: prefix hit to serve in the current step (0: none), tokens.
        block_hashes: chained block hashes of the request's full blocks, computed so far.
        resolved: position → token id of output tokens the runner's host state holds as
            placeholders (async scheduling, :meth:`OmniCacheStageManager.keep_async_inputs`).
        device_inputs: ``(first position, kept step ids, start, end)``: the request's input
            ids of a step whose positions hold placeholders (rows ``[start, end)`` of that
            step's :class:`~omni_cache.core.staging.KeptIds`), not read on the host yet.
        late: ``(block index, block id)`` of blocks the request completed whose hash waits for
            a step's input ids to reach the host (:meth:`OmniCacheStageManager.cache_late_blocks`).
    """

    block_ids: list[int]
    num_computed_tokens: int
    hit_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    resolved: dict[int, int] = field(default_factory=dict)
    device_inputs: list[tuple[int, KeptIds, int, int]] = field(default_factory=list)
    late: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class StepOutputs:
    """The forward's outputs, classified (:meth:`OmniCacheStageManager.classify_outputs`).

    Attributes:
        rows: token-aligned key → ``[num_tokens, width]`` rows (``hidden`` and every
            per-token multimodal output, flattened to 2-D).
        passthrough: every other multimodal output, handed through per request.
        num_tokens: unpadded tokens of the step's batch.
    """

    rows: dict[str, torch.Tensor]
    passthrough: dict[str, Any]
    num_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """What one step writes, reads and hands off (:meth:`OmniCacheStageManager.plan_step`).

    Attributes:
        req_ids: scheduled requests in batch order.
        spans: request → its rows ``[start, end)`` in the batch.
        write_keys: the step's token-aligned keys (fresh rows of every request; a request
            in ``truncated`` writes them without ``hidden``).
        truncated: requests whose ``hidden`` rows this step are the self-decoder output
            (fast prefill, more than one token scheduled) and are not written.
        handoff_keys: keys handed downstream (and read for a hit).
        hits: request → hit tokens to read this step.
    """

    req_ids: tuple[str, ...]
    spans: Mapping[str, tuple[int, int]]
    write_keys: tuple[str, ...]
    truncated: frozenset[str]
    handoff_keys: tuple[str, ...]
    hits: Mapping[str, int]


@dataclass
class HandOff:
    """Per-request tensors of one step for vLLM-Omni's payload builder (its manager's
    ``materialize`` result: ``hidden_states`` req → ``[n, hidden]`` and ``mm_outputs``
    key → req → value)."""

    hidden_states: dict[str, torch.Tensor] | None
    mm_outputs: dict[str, dict[str, Any]]


@dataclass
class _SavedStep:
    plan: StepPlan
    merged: dict[str, dict[str, torch.Tensor]] | None  # req -> key -> rows (host tier)
    staged: StagedStep | None  # the same rows, staged to pinned host memory (CUDA)
    passthrough: dict[str, Any]
    num_tokens: int
    #: fresh rows come from vLLM-Omni's own output snapshot (:meth:`OmniCacheStageManager.attach_snapshot`);
    #: ``staged`` then holds only the hits' prefixes
    from_snapshot: bool = False
    snapshot: dict[str, torch.Tensor] | None = None  # key -> [>= num_tokens, ...] (attach_snapshot)
    #: block ids of the mirrored group whose rows this step completed and cached with a hash
    #: (:meth:`OmniCacheStageManager.cached_blocks`)
    cached_blocks: frozenset[int] = frozenset()
    #: every output the payload builder holds for this step is a host tensor (the CPU platform;
    #: on CUDA vLLM-Omni's async-output snapshot, :meth:`OmniCacheStageManager.attach_snapshot`):
    #: only then may a step without a hit leave its multimodal outputs to vLLM-Omni
    #: (:meth:`OmniCacheStageManager._handoff_fresh`)
    outputs_on_host: bool = False

    def rows(self, req_id: str) -> dict[str, torch.Tensor]:
        """Key → the request's hand-off rows (``cached prefix ++ fresh``)."""
        if self.from_snapshot:
            s, e = self.plan.spans[req_id]
            n = self.num_tokens
            fresh = {k: self.snapshot[k][:n].reshape(n, -1)[s:e] for k in self.plan.handoff_keys}
            if self.staged is not None and req_id in self.staged.prefix:
                return self.staged.complete(req_id, fresh)
            return fresh
        return self.staged.rows(req_id) if self.staged is not None else self.merged[req_id]


def mm_extra_keys(req_state) -> list[tuple[int, int, object]]:
    """``(start, end, identifier)`` of each multimodal item of a runner request state (its
    placeholder span and content hash), the extra keys of its block hashes."""
    keys = []
    for f in getattr(req_state, "mm_features", None) or []:
        pos = f.mm_position
        keys.append((int(pos.offset), int(pos.offset + pos.length), f.identifier))
    return keys


class OmniCacheStageManager:
    """omni-cache's prefix-cache manager for one AR stage (the seam in :mod:`.seam`).

    Args:
        runner: the AR model runner (``requests``: token ids and mm features;
            ``input_batch.req_ids``: batch order; ``cache_config``, ``model``).
        block_size: tokens per KV block of the mirrored group.
        num_blocks: KV blocks of the mirrored group (pool rows = ``num_blocks * block_size``).
        group_id: index of the mirrored (full-attention) KV cache group.

    The cache is built at the first save, when the rows' widths and dtypes are known; a
    token-aligned key that first appears in a later step is added then (its rows exist from
    that step on).
    """

    #: seconds between two metrics-file writes (the file's writer thread's, never the step's), besides shutdown
    PUBLISH_INTERVAL_S = 0.5

    def __init__(self, runner, block_size: int, num_blocks: int, group_id: int = 0):
        self.runner = runner
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.group_id = group_id
        self.cache: HiddenStateCache | None = None
        self._keys_seen: tuple[str, ...] = ()  # the keys of the last save (_ensure_keys)
        self.reqs: dict[str, RequestView] = {}
        self._scheduled: dict[str, int] = {}
        self._steps: dict[int, _SavedStep] = {}
        self._step_ids = itertools.count()
        self._metrics_file = MetricsFile("metrics", self.PUBLISH_INTERVAL_S)
        self._hit_audit = HitAudit()
        self._block_audit = BlockDigestAudit(block_size)  # audits: each filled block's writer digest
        self.step_seconds = 0.0  # the last save_outputs, whole (hashes, writes, reads, merge)
        self._stager: HostStager | None = None  # CUDA: hand-off rows to pinned host (ensure_keys)
        #: CUDA, ``OMNI_CACHE_HANDOFF_STAGING=snapshot``: fresh hand-off rows are taken from
        #: vLLM-Omni's output snapshot (:meth:`attach_snapshot`), only hits' prefixes are staged
        self._from_snapshot = False
        self._cached_this_step: list[int] = []  # write_rows: block ids it cached (cached_blocks)
        self._late: set[str] = set()  # requests with late blocks (RequestView.late)
        self._kept_ring: KeptIdsRing | None = None  # keep_async_inputs' pinned ring (first use)
        #: the scheduler's requests of this process (:mod:`omni_cache.engine.scheduler_tokens`),
        #: looked up at the first save that needs them; ``False``: not looked up yet
        self._sched_requests: Mapping[str, Any] | None | bool = False
        self._hashes_from: tuple[Any, int] | None | bool = False  # _hash_source (False: not decided yet)

    # ---- 1. step begin ---------------------------------------------------------------
    def new_step_starts(self, scheduler_output) -> None:
        """Mirror the scheduler output (called before the runner's ``_update_states``)."""
        for rid in scheduler_output.finished_req_ids:
            self.reqs.pop(rid, None)
            self._block_audit.forget(rid)
        for nr in scheduler_output.scheduled_new_reqs:
            self.reqs[nr.req_id] = RequestView(
                block_ids=list(nr.block_ids[self.group_id]),
                num_computed_tokens=nr.num_computed_tokens,
                hit_tokens=nr.num_computed_tokens,
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            view = self.reqs.get(rid)
            new_ids = cached.new_block_ids[i]
            ncomp = cached.num_computed_tokens[i]
            if view is None or rid in resumed:
                # resumed after preemption: the block table is replaced, the prefix hit
                # (if any) is served again from the cache like a new request's.
                self.reqs[rid] = RequestView(
                    block_ids=list(new_ids[self.group_id]) if new_ids is not None else [],
                    num_computed_tokens=ncomp, hit_tokens=ncomp,
                )
                continue
            if new_ids is not None:
                view.block_ids.extend(new_ids[self.group_id])
            view.num_computed_tokens = ncomp
            view.hit_tokens = 0
        self._scheduled = dict(scheduler_output.num_scheduled_tokens)
        if self.cache is not None:
            self.cache.begin_step()

    # ---- the seam's save: arrows 2-6 ---------------------------------------------------
    def save_outputs(
        self,
        hidden_states: torch.Tensor,
        mm_outputs: dict[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
    ) -> int:
        """Classify, plan, write, read hits, merge. Returns the step id to
        :meth:`materialize` (or :meth:`discard_step`) exactly once.

        Args:
            hidden_states: ``[num_tokens_padded, hidden_size]`` final hidden states.
            mm_outputs: the model's per-step extras, flattened (captured layers, ...).
            num_tokens_unpadded: tokens of the batch (rows past it are padding).
            num_tokens_padded: rows of the forward.

        Raises:
            RuntimeError: the batch's scheduled tokens do not add up to the forward's rows.
            StaleRowsError: a hit asks for rows the ledger cannot vouch for.
        """
        t0 = time.perf_counter()
        outputs = self.classify_outputs(hidden_states, mm_outputs,
                                        num_tokens_unpadded, num_tokens_padded)
        self._ensure_keys(outputs.rows)
        plan = self.plan_step(outputs)
        self.keep_async_inputs(plan)
        t_plan = time.perf_counter()
        snapshot = self._from_snapshot  # (set only with a stager)
        fresh = self.write_rows(plan, outputs, keep_fresh=not snapshot)
        cached_blocks, self._cached_this_step = frozenset(self._cached_this_step), []
        prefixes = self.read_hits(plan)
        t_stage = time.perf_counter()
        if snapshot:
            merged = None
            staged = self.stage_prefixes(plan, prefixes) if prefixes else None
        elif self._stager is not None:
            merged, staged = None, self.stage_handoff(plan, fresh, prefixes)
        else:
            merged, staged = self.merge(plan, fresh, prefixes), None
        step_id = next(self._step_ids)
        self._steps[step_id] = _SavedStep(plan, merged, staged, outputs.passthrough, outputs.num_tokens,
                                          from_snapshot=snapshot, cached_blocks=cached_blocks,
                                          outputs_on_host=not snapshot and self._stager is None
                                          and _all_on_host([hidden_states, *(mm_outputs or {}).values()]))
        t1 = time.perf_counter()
        self.step_seconds = t1 - t0
        m = self.cache.metrics
        m.seconds_save += self.step_seconds
        m.seconds_plan += t_plan - t0
        m.seconds_stage += t1 - t_stage
        if outputs.num_tokens == len(plan.req_ids) and not plan.hits:  # a no-hit decode step
            m.decode_steps += 1
            m.seconds_save_decode += self.step_seconds
        return step_id

    # ---- 2. classify outputs -------------------------------------------------------------
    @staticmethod
    def classify_outputs(hidden_states: torch.Tensor, multimodal_outputs: Mapping[str, Any] | None,
                         num_tokens_unpadded: int, num_tokens_padded: int) -> StepOutputs:
        """Token-aligned outputs (first dim = the step's unpadded or padded token count,
        at least 2-D) become cached rows ``[num_tokens, -1]``; the rest passes through."""
        n = num_tokens_unpadded
        # (no slice where there is no padding, no reshape of 2-D rows: a decode step's host time)
        # (shape[0], not len(): Tensor.__len__ is Python code)
        hidden = hidden_states if hidden_states.shape[0] == n else hidden_states[:n]
        rows: dict[str, torch.Tensor] = {HIDDEN_KEY: hidden}
        passthrough: dict[str, Any] = {}
        for k, v in (multimodal_outputs or {}).items():
            if (k != HIDDEN_KEY and isinstance(v, torch.Tensor) and v.dim() >= 2
                    and v.shape[0] in (n, num_tokens_padded)):
                t = v if v.shape[0] == n else v[:n]
                rows[k] = t if t.dim() == 2 else t.reshape(n, -1)
            else:
                passthrough[k] = v
        return StepOutputs(rows, passthrough, n)

    def _ensure_keys(self, rows: Mapping[str, torch.Tensor]) -> HiddenStateCache:
        """Build the cache at the first save; add keys that appear later (a step with the
        previous step's keys, the usual one, checks nothing more)."""
        names = tuple(rows)
        if self.cache is not None and names == self._keys_seen:
            return self.cache
        self._keys_seen = names
        specs = [KeySpec(k, int(t.shape[-1]), t.dtype) for k, t in sorted(rows.items())]
        if self.cache is None:
            device = next(iter(rows.values())).device
            # On an accelerator the pool lives next to the hidden states (no host sync on
            # the forward path); on the CPU platform it is plain host memory.
            tier = Tier.DEVICE if device.type != "cpu" else Tier.HOST
            self.cache = HiddenStateCache(self.num_blocks, self.block_size, specs, device=device, tier=tier)
            self.cache.begin_step()
            staging = settings.HANDOFF_STAGING.get()
            if device.type == "cuda" and staging in ("host", "snapshot"):
                self._stager = HostStager(device)
                self._from_snapshot = staging == "snapshot"
            logger.info("omni-cache: %s", self.cache.describe().replace("\n", "; "))
        else:
            new = [s for s in specs if s.name not in self.cache.specs]
            if new:
                self.cache.add_keys(new)
                logger.info("omni-cache: caching new keys %s from this step on", [s.name for s in new])
        return self.cache

    # ---- 3. plan the step ----------------------------------------------------------------
    def plan_step(self, outputs: StepOutputs) -> StepPlan:
        """Batch spans (the runner's batch order), the keys written and handed off, the
        hits to read.

        Raises:
            RuntimeError: the scheduled tokens do not add up to ``outputs.num_tokens``.
        """
        req_ids = tuple(r for r in self.runner.input_batch.req_ids if r in self._scheduled)
        spans: dict[str, tuple[int, int]] = {}
        off = 0
        for rid in req_ids:
            n = self._scheduled[rid]
            spans[rid] = (off, off + n)
            off += n
        if off != outputs.num_tokens:
            raise RuntimeError(f"omni-cache: batch spans {off} tokens but the forward produced {outputs.num_tokens}")
        truncated = frozenset(r for r in req_ids if spans[r][1] - spans[r][0] > 1) \
            if fast_prefill_truncates(self.runner) else frozenset()
        # keys handed downstream (and needed on a hit): the final hidden states only for
        # models that hand them off (vLLM-Omni's ``omni_pooler_payload_include_hidden``)
        handoff = tuple(k for k in self.cache.specs
                        if k in outputs.rows and (k != HIDDEN_KEY or hands_off_hidden(self.runner)))
        hits = {r: self.reqs[r].hit_tokens for r in req_ids if self.reqs[r].hit_tokens > 0}
        return StepPlan(req_ids, spans, tuple(outputs.rows), truncated, handoff, hits)

    def keep_async_inputs(self, plan: StepPlan) -> None:
        """Under async scheduling (vLLM-Omni's default on GPUs) the runner's host-side
        ``output_token_ids`` hold :data:`PLACEHOLDER_TOKEN` for tokens sampled in earlier
        steps: their values stay on the device. A decode step's input ids — this step's
        tokens, in the runner's device ``input_ids`` — are those tokens: keep the step's ids
        (one non-blocking copy to a pinned ring per step, :class:`~omni_cache.core.staging.KeptIdsRing`;
        no host sync, not even when a block fills and they are read) for every request whose
        positions hold a placeholder, for :meth:`block_hashes` to hash the real tokens. Without
        this the writer's decode-filled blocks were cached under hashes of placeholders, and the
        next turn's hit on them was refused (``StaleRowsError``, the engine stopped) — found on an H200 (docs/gpu.md).
        Nothing to do under synchronous scheduling (the CPU platform's only mode)."""
        ids = getattr(getattr(self.runner, "input_ids", None), "gpu", None)
        if ids is None or self._scheduler_requests() is not None:
            return  # (the scheduler of this process knows the tokens: nothing to keep)
        need = []
        for rid in plan.req_ids:
            st = self.runner.requests.get(rid)
            out = getattr(st, "output_token_ids", None)
            if not out or out[-1] != PLACEHOLDER_TOKEN:
                continue
            n_prompt = len(st.prompt_token_ids or [])
            s, e = plan.spans[rid]
            start = self.reqs[rid].num_computed_tokens
            lo = max(start, n_prompt)
            hi = min(start + (e - s), n_prompt + len(out))
            if any(out[p - n_prompt] == PLACEHOLDER_TOKEN for p in range(lo, hi)):
                need.append((rid, start, s, e))
        if need:
            if self._kept_ring is None:
                self._kept_ring = KeptIdsRing(ids.device)
            kept = self._kept_ring.keep(ids[:need[-1][3]])  # one copy for the step (batch order: the last ends last)
            for rid, start, s, e in need:
                self.reqs[rid].device_inputs.append((start, kept, s, e))

    def _hash_source(self) -> tuple[Any, int] | None:
        """``(scheduler, vLLM hashes per block)`` where this stage's block hashes are vLLM's own
        (:mod:`omni_cache.engine.scheduler_tokens`: the scheduler runs in this process and its
        hash blocks tile ours), else ``None``; decided once per process, so a writer's and a
        reader's hash of a block always come from the same source."""
        if self._hashes_from is False:
            sched = scheduler_tokens.scheduler_of(getattr(self.runner, "vllm_config", None))
            per_block = None if sched is None else scheduler_tokens.hash_blocks_per_block(sched, self.block_size)
            self._hashes_from = None if per_block is None else (sched, per_block)
            logger.info("omni-cache: block hashes: %s", "vLLM's own (the scheduler's, this process)"
                        if per_block else "omni-cache's (token ids + multimodal identifiers)")
        return self._hashes_from

    def _scheduler_requests(self) -> Mapping[str, Any] | None:
        """The requests of the scheduler that drives this runner, where it runs in this process
        (:func:`omni_cache.engine.scheduler_tokens.scheduler_requests`; vLLM's ``uni``
        executor), else ``None``; looked up once."""
        if self._sched_requests is False:
            self._sched_requests = scheduler_tokens.scheduler_requests(getattr(self.runner, "vllm_config", None))
            if self._sched_requests is not None:
                logger.info("omni-cache: decode-filled blocks hashed from the scheduler's token ids "
                            "(same process; no input ids kept per step)")
        return self._sched_requests

    def _known_tokens(self, rid: str, view: RequestView, st, lo: int, hi: int, wait: bool = False) -> list[int]:
        """The request's token ids at positions ``[lo, hi)``: prompt, then output tokens with
        placeholders replaced by the scheduler's tokens where its scheduler runs in this process
        (:mod:`omni_cache.engine.scheduler_tokens`: it has a sampled token a step after the
        runner; never a wait), else by their kept values — those whose copy has reached the host
        (:meth:`~omni_cache.core.staging.KeptIds.ready`; never waiting for the device: the
        step that fills a block by decoding has its input token still in flight, and waiting
        for it here stalled the engine's overlap of host and device, docs/gpu.md
        "Twenty-second session"; ``wait``: read them all, waiting where needed). A position still
        unknown stays :data:`PLACEHOLDER_TOKEN`."""
        prompt = st.prompt_token_ids or []
        n_prompt = len(prompt)
        tokens = (list(prompt[lo:hi])
                  + list(st.output_token_ids or [])[max(lo - n_prompt, 0):max(hi - n_prompt, 0)])
        if PLACEHOLDER_TOKEN not in tokens[max(n_prompt - lo, 0):]:
            return tokens
        sched = self._scheduler_requests()
        if sched is not None:
            # (unchanged where the two disagree)
            scheduler_tokens.known_tokens(tokens, PLACEHOLDER_TOKEN, sched.get(rid), lo)
            return tokens
        waiting = []
        for item in view.device_inputs:
            first, kept, s, e = item
            if kept.lost:  # overwritten before it was read (never expected): its blocks stay uncached
                continue
            if not wait and not kept.ready():
                waiting.append(item)
                continue
            for i, tok in enumerate(kept.values(s, e)):
                view.resolved[first + i] = int(tok)
        view.device_inputs[:] = waiting
        for i in range(max(n_prompt - lo, 0), len(tokens)):
            if tokens[i] == PLACEHOLDER_TOKEN:
                tokens[i] = view.resolved.get(lo + i, PLACEHOLDER_TOKEN)
        return tokens

    def block_hashes(self, rid: str, upto_tokens: int, wait: bool = False) -> list[int]:
        """Chained block hashes of the request's first ``upto_tokens // block_size`` blocks:
        vLLM's own (:func:`~omni_cache.engine.scheduler_tokens.vllm_block_hashes`) where the
        stage's scheduler runs in this process (:meth:`_hash_source`), else ours (token ids +
        multimodal identifiers, :func:`~omni_cache.core.chained_block_hashes`); only blocks not
        hashed yet are hashed, continuing the chain from the last hash. The
        chain stops before a block holding a token whose value is unknown (a placeholder the
        kept device inputs do not resolve): such a block is written but never cached, so no
        hit is ever served from it."""
        view = self.reqs[rid]
        nfull = upto_tokens // self.block_size
        done = len(view.block_hashes)
        source = self._hash_source() if done < nfull else None
        if source is not None:  # vLLM's own hashes of the request
            sched, per_block = source
            view.block_hashes = view.block_hashes + scheduler_tokens.vllm_block_hashes(
                sched.requests.get(rid), per_block, done, nfull)
        elif done < nfull:
            st = self.runner.requests[rid]
            lo, hi = done * self.block_size, nfull * self.block_size
            tokens = self._known_tokens(rid, view, st, lo, hi, wait)
            if PLACEHOLDER_TOKEN in tokens:
                hi = lo + (tokens.index(PLACEHOLDER_TOKEN) // self.block_size) * self.block_size
                tokens = tokens[:hi - lo]
            if hi > lo:
                extra = [(a - lo, b - lo, ident) for a, b, ident in mm_extra_keys(st) if b > lo and a < hi]
                view.block_hashes = view.block_hashes + chained_block_hashes(
                    tokens, self.block_size, extra, parent=view.block_hashes[-1] if view.block_hashes else None)
            for p in [p for p in view.resolved if p < len(view.block_hashes) * self.block_size]:
                del view.resolved[p]
        return view.block_hashes[:nfull]

    def cache_late_blocks(self, wait: bool = False) -> None:
        """Cache the blocks whose hash had to wait (:attr:`RequestView.late`): under async
        scheduling a block filled by a decode step ends with that step's input token, whose
        value is on the device until the step's copy to the host completes; its rows were
        written in that step, its hash is computed here once the copy is done (normally the
        next step or the one after), and its block id joins this step's :meth:`cached_blocks`,
        which the capped scheduler waits for before it vouches for the block
        (:meth:`omni_cache.engine.scheduler.OmniCacheSchedulerMixin._confirm_pending`). Only a
        request scheduled in this step caches (and reports) its late blocks: it still holds its
        block table, so a reported block id is its own, never one vLLM gave to another request
        since (a preempted request's are kept until it is scheduled again, then dropped with its
        view on resume). A block no longer in the request's block table is dropped; the ledger
        ignores a block whose owner changed (:meth:`~omni_cache.core.BlockLedger.cache_full_blocks`).
        ``wait``: read ids still in flight too, waiting for them (:meth:`read_hits`, for a hit on
        a late block only)."""
        for rid in list(self._late):
            view = self.reqs.get(rid)
            if view is None or not view.late or rid not in self.runner.requests:
                self._late.discard(rid)
                if view is not None:
                    view.late.clear()
                continue
            if rid not in self._scheduled:  # preempted (or not scheduled): its blocks may be another's
                continue                    # by now; a resumed request starts a new view anyway
            hashes = self.block_hashes(rid, (max(b for b, _ in view.late) + 1) * self.block_size, wait)
            done = [(b, bid) for b, bid in view.late
                    if b < len(hashes) and b < len(view.block_ids) and view.block_ids[b] == bid]
            if done:
                self.cache.ledger.cache_full_blocks([bid for _, bid in done], [hashes[b] for b, _ in done], owner=rid)
                self._cached_this_step.extend(bid for _, bid in done)
                # the writer's digest of the block, from the rows its steps recorded (audits only): a
                # late block was not full-and-hashed in the step that wrote it (oracle (a) found it
                # unverified on an H200 once every decode-filled block came late, 24th session)
                self._block_audit.add(rid, 0, {}, [b for b, _ in done])
            view.late = [x for x in view.late if x[0] >= len(hashes)]
            if not view.late:
                self._late.discard(rid)

    # ---- 4. write --------------------------------------------------------------------------
    def write_rows(self, plan: StepPlan, outputs: StepOutputs,
                   keep_fresh: bool = True) -> dict[str, dict[str, torch.Tensor]]:
        """Write every scheduled request's rows at its KV slot ids, caching each block that
        became full with its block hash: the whole step at once
        (:meth:`~omni_cache.core.HiddenStateCache.write_step_rows`: one index, one write per
        key), or per request in a step where fast prefill truncated some request's final
        hidden rows. Returns request → key → this step's rows (fresh; empty with
        ``keep_fresh=False`` unless the step writes per request); the ids of the blocks it
        cached are kept for :meth:`cached_blocks`."""
        fresh: dict[str, dict[str, torch.Tensor]] = {}
        step: list[StepRequest] = []
        if self._late:  # (the step's list starts empty: save_outputs took the previous step's)
            self.cache_late_blocks()
        keep_fresh = keep_fresh or bool(plan.truncated)
        # a batch's fresh rows: one split per key, not a slice per request and key (a decode
        # step of 16 requests: -3.5 % of its host time, benchmarks.step_overhead); a slice is
        # cheaper for one or two requests
        split = keep_fresh and len(plan.req_ids) > 2
        if split:
            sizes = [e - s for s, e in (plan.spans[r] for r in plan.req_ids)]
            parts = {k: outputs.rows[k][:sum(sizes)].split(sizes) for k in plan.write_keys}
        for i, rid in enumerate(plan.req_ids):
            s, e = plan.spans[rid]
            if split:
                fresh[rid] = {k: p[i] for k, p in parts.items()}
            elif keep_fresh:
                fresh[rid] = {k: outputs.rows[k][s:e] for k in plan.write_keys}
            view = self.reqs[rid]
            start = view.num_computed_tokens
            first, end_block = start // self.block_size, (start + e - s) // self.block_size
            if end_block > first:  # a block completes
                hashes = self.block_hashes(rid, start + (e - s))
                new_full = {b: hashes[b] for b in range(first, len(hashes))}
                self._cached_this_step.extend(view.block_ids[b] for b in new_full)
                if len(hashes) < end_block:  # a token of it still on the device: hashed in a later step
                    view.late.extend((b, view.block_ids[b]) for b in range(max(first, len(hashes)), end_block))
                    self._late.add(rid)
            else:  # (most decode steps) nothing to hash: block_hashes would hash nothing either
                new_full = {}
            if self._block_audit.path is not None:
                keys = [k for k in plan.handoff_keys if not (k == HIDDEN_KEY and rid in plan.truncated)]
                self._block_audit.add(rid, start, {k: outputs.rows[k][s:e] for k in keys}, new_full)
            step.append(StepRequest(rid, view.block_ids, start, e - s, new_full))
        if not plan.truncated:
            rows = outputs.rows  # (classify_outputs made them [num_tokens, width])
            self.cache.write_step_rows(step, rows if len(plan.write_keys) == len(rows) else
                                       {k: rows[k] for k in plan.write_keys})
            return fresh
        for r in step:
            rows = fresh[r.req_id]
            if r.req_id in plan.truncated:
                # KV-sharing fast prefill: the final hidden rows of a prefill chunk are the
                # self-decoder output, not the final layer's; they are never marked valid.
                rows = {k: v for k, v in rows.items() if k != HIDDEN_KEY}
            self.cache.write_request_rows(r.req_id, r.block_ids, r.start, rows, r.block_hashes,
                                          num_tokens=r.num_tokens)
        return fresh

    # ---- 5. read hits ----------------------------------------------------------------------
    def read_hits(self, plan: StepPlan) -> dict[str, dict[str, torch.Tensor]]:
        """Each hit's prefix rows: request → key → ``[hit_tokens, width]`` (handoff keys).

        A hit on a block still waiting for its hash (:meth:`cache_late_blocks`; the capped
        scheduler vouches for such a block only once the worker reported it, so this is not
        expected) waits for the ids it needs instead of refusing the hit: a wait for the
        device in a rare step, not an engine stopped by ``StaleRowsError``.

        Raises:
            StaleRowsError: a hit block is not covered for a handoff key.
        """
        if plan.hits and self._late:
            late = {bid for r in self._late if r in self.reqs for _, bid in self.reqs[r].late}
            bs = self.block_size
            if any(b in late for r, hit in plan.hits.items() for b in self.reqs[r].block_ids[:hit // bs]):
                self.cache_late_blocks(wait=True)  # (reported with the next step's output)
        prefixes = {}
        for rid, hit in plan.hits.items():
            view = self.reqs[rid]
            prefixes[rid] = self.cache.read_prefix(rid, view.block_ids, hit, self.block_hashes(rid, hit),
                                                   plan.handoff_keys)
            if self._hit_audit.path is not None:
                owner = self.cache.ledger.owner
                self._hit_audit.log(rid, hit, [owner[b] for b in view.block_ids[:hit // self.block_size]])
            view.hit_tokens = 0
        return prefixes

    # ---- 6. merge --------------------------------------------------------------------------
    @staticmethod
    def merge(plan: StepPlan, fresh: Mapping[str, Mapping[str, torch.Tensor]],
              prefixes: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Request → handoff key → ``cached prefix ++ fresh`` rows in prompt order (fresh
        rows alone for a request without a hit)."""
        merged = {}
        for rid in plan.req_ids:
            rows = {k: fresh[rid][k] for k in plan.handoff_keys}
            merged[rid] = HiddenStateCache.merge(prefixes[rid], rows) if rid in prefixes else rows
        return merged

    def stage_handoff(self, plan: StepPlan, fresh: Mapping[str, Mapping[str, torch.Tensor]],
                      prefixes: Mapping[str, Mapping[str, torch.Tensor]]) -> StagedStep:
        """The merge on CUDA: every request's ``cached prefix ++ fresh`` rows of the handoff
        keys, copied off the forward's buffers and on to pinned host memory asynchronously
        (:class:`~omni_cache.core.staging.HostStager`), so the payload builder, which runs a
        step late on another thread, gets host tensors and never waits for a later step."""
        parts = {rid: ([prefixes[rid]] if rid in prefixes else []) + [fresh[rid]] for rid in plan.req_ids}
        return self._stager.stage(plan.handoff_keys, plan.req_ids, parts)

    def stage_prefixes(self, plan: StepPlan, prefixes: Mapping[str, Mapping[str, torch.Tensor]]) -> StagedStep:
        """The merge on CUDA with ``OMNI_CACHE_HANDOFF_STAGING=snapshot``: only the
        hits' cached prefix rows are copied to pinned host memory now
        (:meth:`~omni_cache.core.staging.HostStager.stage_prefixes`), each with room for the
        request's fresh rows, which :meth:`materialize` copies in from vLLM-Omni's own output
        snapshot (:meth:`attach_snapshot`). A step without a hit stages nothing."""
        hits = [(rid, prefixes[rid], plan.spans[rid][1] - plan.spans[rid][0]) for rid in plan.req_ids
                if rid in prefixes]
        return self._stager.stage_prefixes(plan.handoff_keys, hits)

    def attach_snapshot(self, step_id: int | None, hidden_states: torch.Tensor,
                        mm_outputs: Mapping[str, Any] | None) -> None:
        """Give a saved step vLLM-Omni's snapshot of its outputs (called by the runner as its
        payload builder starts, ``OmniCacheRunnerMixin._build_omni_model_runner_output_from_snapshot``):
        the host copy vLLM-Omni makes of every step under async output, else the live tensors.
        A step saved without ``snapshot`` staging ignores it.

        Args:
            step_id: the step's id (``None``: nothing was saved).
            hidden_states: ``[>= num_tokens, hidden_size]`` final hidden states (may be empty
                for a model that does not hand them off).
            mm_outputs: the step's multimodal outputs as the model returned them (flattened
                here with vLLM-Omni's ``flatten_payload``, as its runner does before a save).

        Raises:
            RuntimeError: a hand-off key missing from the snapshot, or with fewer rows than the
                step's tokens (vLLM-Omni's snapshot no longer holds what was saved).
        """
        step = self._steps.get(step_id) if step_id is not None else None
        if step is None or not step.from_snapshot:
            return
        from vllm_omni.data_entry_keys import flatten_payload

        flat = flatten_payload(mm_outputs) if mm_outputs else {}
        n = step.num_tokens
        # vLLM-Omni's builder slices what it holds itself when we hand over no multimodal
        # outputs: only safe when all of it is on the host, as ours are (under async omni output,
        # streaming; without it the builder holds the forward's device tensors, and a request's
        # accumulated payload would mix device and host rows: found on an H200, 2026-11-29)
        step.outputs_on_host = _all_on_host([hidden_states, *flat.values()])
        snap = {}
        for k in step.plan.handoff_keys:
            t = hidden_states if k == HIDDEN_KEY else flat.get(k)
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] < n:
                raise RuntimeError(
                    f"omni-cache: vLLM-Omni's output snapshot of step {step_id} has no {n} rows of {k!r} "
                    f"(got {type(t).__name__}{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}); "
                    f"set {settings.HANDOFF_STAGING.name}=host")
            # without async omni output the "snapshot" is the forward's live device tensors: one
            # copy to the host per key, as vLLM-Omni's own path does (every hand-off row on the
            # host: its payload accumulation concatenates them across steps)
            snap[k] = t if t.device.type == "cpu" else t[:n].to("cpu")
        step.snapshot = snap

    # ---- 7. hand off -----------------------------------------------------------------------
    def materialize(self, step_id: int, req_ids: list[str]) -> HandOff:
        """Per-request merged tensors of a saved step (consumes the step).

        Raises:
            RuntimeError: a request id that the step did not schedule.
            KeyError: an unknown or already consumed step id.
        """
        from vllm_omni.utils.mm_outputs import to_payload_element

        t0 = time.perf_counter()
        step = self._steps.pop(step_id)
        plan = step.plan
        unknown = set(req_ids) - set(plan.spans)
        if unknown:
            raise RuntimeError(f"omni-cache: materialize(step {step_id}) got unknown request ids {sorted(unknown)[:8]}")
        if step.from_snapshot and step.snapshot is None:
            raise RuntimeError(f"omni-cache: step {step_id} was materialized without vLLM-Omni's output "
                               "snapshot (the runner seam moved: omni_cache/engine/seam.py); set "
                               f"{settings.HANDOFF_STAGING.name}=host")
        if step.staged is not None:
            t_wait = time.perf_counter()
            step.staged.wait()
            if self.cache is not None:
                self.cache.metrics.seconds_handoff_wait += time.perf_counter() - t_wait
        if not plan.hits and not plan.truncated and step.outputs_on_host:
            return self._handoff_fresh(step, req_ids, t0)
        rows = {rid: step.rows(rid) for rid in req_ids}
        hidden = {rid: rows[rid][HIDDEN_KEY] for rid in req_ids if HIDDEN_KEY in rows[rid]}
        mm: dict[str, dict[str, Any]] = {}
        for rid in req_ids:
            for k, v in rows[rid].items():
                if k != HIDDEN_KEY:
                    mm.setdefault(k, {})[rid] = v
        for k, v in step.passthrough.items():
            mm[k] = {
                rid: to_payload_element(v, plan.req_ids.index(rid), start=plan.spans[rid][0],
                                        end=plan.spans[rid][1], pass_lists_through=True,
                                        seq_len=step.num_tokens)
                for rid in req_ids
            }
        if self.cache is not None:
            self.cache.metrics.seconds_materialize += time.perf_counter() - t0
        self._publish_metrics()
        return HandOff(hidden_states=hidden or None, mm_outputs=mm)

    def _handoff_fresh(self, step: _SavedStep, req_ids: list[str], t0: float) -> HandOff:
        """A step without a hit (and without fast prefill's truncated rows), whose outputs the
        builder holds on the host (:attr:`_SavedStep.outputs_on_host`): every row it hands
        off is the step's own, as with cache off. Only the final hidden rows are handed over
        (vLLM-Omni's builder takes them from the prefix cache when one is on, for a model that
        hands them off); the multimodal outputs are left to vLLM-Omni, which then builds them
        from its own snapshot exactly as with cache off — no per-request, per-key work of ours
        on the builder's thread, the step's hot path (an H200, 2026-11-29, docs/gpu.md
        "Twenty-first session": omni-cache's per-step host time grew with the batch)."""
        hidden = None
        plan = step.plan
        if HIDDEN_KEY in plan.handoff_keys and step.from_snapshot:
            # one view of the step's rows, then one slice per request (a split where the
            # builder asks for the whole batch in order, its usual call)
            n = step.num_tokens
            full = step.snapshot[HIDDEN_KEY][:n].reshape(n, -1)
            if len(req_ids) > 2 and tuple(req_ids) == plan.req_ids:
                hidden = dict(zip(req_ids, full.split([e - s for s, e in (plan.spans[r] for r in req_ids)]),
                                  strict=True))
            else:
                hidden = {rid: full[plan.spans[rid][0]:plan.spans[rid][1]] for rid in req_ids}
        elif HIDDEN_KEY in plan.handoff_keys:
            hidden = {rid: step.rows(rid)[HIDDEN_KEY] for rid in req_ids}
        if self.cache is not None:
            m, dt = self.cache.metrics, time.perf_counter() - t0
            m.seconds_materialize += dt
            m.fresh_handoffs += 1
            m.seconds_materialize_fresh += dt
        self._publish_metrics()
        return HandOff(hidden_states=hidden, mm_outputs={})

    def cached_blocks(self, step_id: int) -> frozenset[int] | None:
        """Block ids (mirrored KV cache group) whose rows the saved step ``step_id`` completed
        and cached under the block hash this stage manager computed — None for an unknown or
        consumed step. The runner hands them to the scheduler with the step's output
        (:data:`CACHED_BLOCKS_ATTR`): under async scheduling the scheduler vouches for a
        decode-filled block only once the worker has cached it
        (:meth:`omni_cache.engine.scheduler.OmniCacheSchedulerMixin.update_from_output`), so a
        block the worker could not hash (a token still a placeholder) is never hit: the hit
        is capped and recomputed, the engine keeps serving."""
        step = self._steps.get(step_id)
        return None if step is None else step.cached_blocks

    def discard_step(self, step_id: int) -> None:
        """Drop a saved step that will not be handed off."""
        self._steps.pop(step_id)

    # ---- metrics / lifecycle --------------------------------------------------------------
    def _publish_metrics(self, force: bool = False) -> None:
        """With ``OMNI_CACHE_METRICS_DIR`` set, write the counters to ``metrics-<pid>.json``:
        at shutdown (``force``), else from the file's writer thread at most every
        :attr:`PUBLISH_INTERVAL_S` seconds after a step (a hit shows in the file within that;
        :meth:`omni_cache.engine.metrics.MetricsFile.publish`, ``defer``). Besides the counters:
        the pool's size in bytes (``pool_bytes``), its tier (``pool_tier``) and its bytes of
        pinned host memory (``pool_pinned_bytes``). ``seconds_publish`` counts the calling
        thread's time only (the step's: scheduling a deferred write, or the forced one)."""
        if self.cache is not None:
            t0 = time.perf_counter()
            self._metrics_file.publish(
                lambda: {**self.cache.metrics.as_dict(), "last_save_seconds": self.step_seconds,
                         "pool_bytes": self.cache.nbytes, "pool_tier": self.cache.tier.value,
                         "pool_pinned_bytes": self.cache.pinned_nbytes}, force=force, defer=not force)
            self.cache.metrics.seconds_publish += time.perf_counter() - t0

    def shutdown(self) -> None:
        """Final metrics (log line and file); called from the model runner's ``shutdown``."""
        if self.cache is not None:
            logger.info("omni-cache metrics: %s", self.cache.metrics.as_dict())
            self._publish_metrics(force=True)
        self._steps.clear()

    def metrics(self) -> dict[str, float]:
        """Counters of the hidden-state cache (rows, bytes, hits, seconds)."""
        return self.cache.metrics.as_dict() if self.cache is not None else {}


def fast_prefill_truncates(runner) -> bool:
    """True if this step's forward runs KV-sharing fast prefill (cross-decoder on logit rows
    only): the engine setting is on (switched off for a step that falls back, see
    :meth:`omni_cache.engine.runner.OmniCacheRunnerMixin.execute_model`) and the model has
    KV-shared layers."""
    return bool(getattr(runner.cache_config, "kv_sharing_fast_prefill", False)
                and getattr(runner, "kv_sharing_fast_prefill_eligible_layers", None))


def _all_on_host(values) -> bool:
    """Whether every tensor among ``values`` (anything else is ignored) is on the CPU."""
    return all(v.device.type == "cpu" for v in values if isinstance(v, torch.Tensor))


def hands_off_hidden(runner) -> bool:
    """Whether the stage's model hands the final hidden states downstream (vLLM-Omni's
    ``omni_pooler_payload_include_hidden``, default True)."""
    return bool(getattr(getattr(runner, "model", None), "omni_pooler_payload_include_hidden", True))
