"""A vLLM-Omni AR scheduler that caps each prefix hit to what the hidden-state tier covers.

``_get_local_prefix_cache_hit`` (vLLM's scheduler seam for the local KV prefix-cache lookup)
returns the KV hit; :class:`OmniCacheSchedulerMixin` truncates it to the leading blocks whose
hidden-state rows are complete (:class:`~omni_cache.core.coverage.WrittenBlocks`), so the
runner never has to serve — or refuse — rows it does not have: the uncovered tail is simply
recomputed, and the engine keeps serving. After each ``schedule()`` it records the blocks
that this step's scheduled tokens complete; within ``schedule()`` a hit may also cover blocks
that requests scheduled earlier in the same step complete (a same-step hit).

Selected through the pipeline topology (vLLM-Omni 0.30 owns ``scheduler_cls`` there, not in
the deploy YAML): ``pipeline: qwen3_omni_moe_omni_cache`` (see :mod:`omni_cache.engine.plugin`)
names :func:`capped_ar_scheduler`, which builds the synchronous
(:class:`OmniCacheARScheduler`) or the asynchronous (:class:`OmniCacheARAsyncScheduler`, over
vLLM-Omni's ``OmniARAsyncScheduler``, vLLM-Omni's default) variant from the stage's
``async_scheduling``. Under async scheduling step N+1 is scheduled while step N runs: a block
recorded at ``schedule()`` is written by that step, which runs before any later step reads a
hit; decode-filled blocks, hashed by vLLM only when their step's output arrives, are recorded
then (:meth:`OmniCacheSchedulerMixin._resolve_pending_blocks`), and only once the worker reports
that it cached the block under its own hash — with that step's output, or with a later one's
within ``LATE_CONFIRM_STEPS`` steps (the worker hashes the block once the step's input ids reach
the host, never waiting for the device); a block it never caches stays unrecorded: a hit on it
is capped and recomputed, never refused in the worker —
:meth:`OmniCacheSchedulerMixin._confirm_pending`). (vLLM's CPU platform forces synchronous
scheduling; ``tests/unit/test_scheduler_cap.py`` drives vLLM's real async
scheduler the way its engine core does.)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler

from omni_cache import settings
from omni_cache.core.coverage import RowValidity, WrittenBlocks, spans_overlap
from omni_cache.engine.metrics import MetricsFile
from omni_cache.engine.runner import full_attention_group
from omni_cache.engine.sched_stats import PrefixStatsFlushMixin
from omni_cache.engine.scheduler_tokens import register as register_scheduler
from omni_cache.engine.shm_hygiene import FinalStageHandOffMixin
from omni_cache.engine.stage_manager import CACHED_BLOCKS_ATTR

logger = logging.getLogger(__name__)


#: ``SamplingParams.extra_args`` key that marks a request whose hidden rows the scheduler must
#: not vouch for — fault injection for tests: the rows are treated as lost, so every later hit
#: on the request's blocks is capped and recomputed (chosen per request, so one engine serves
#: both a normal and a "lost rows" workload)
FORGET_ROWS = "omni_cache_test_forget_rows"


#: preempted request ids the scheduler keeps (and publishes) at most
PREEMPTED_KEPT = 256

#: steps after the one that completed it within which the worker may still confirm a
#: decode-filled block (its stage manager caches such a block once that step's input ids have
#: reached the host, without waiting for the device: normally the next step or the one after,
#: :meth:`omni_cache.engine.stage_manager.OmniCacheStageManager.cache_late_blocks`); a block not
#: confirmed by then is dropped (``unconfirmed_blocks``), a hit on it capped and recomputed
LATE_CONFIRM_STEPS = 8


def rows_forgotten(request) -> bool:
    """Whether ``request`` (a vLLM ``Request``) carries :data:`FORGET_ROWS`."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    return bool(extra.get(FORGET_ROWS))


@dataclass
class SchedulerCapState:
    """What the capped scheduler knows between steps.

    Attributes:
        written: blocks whose hidden rows are complete, with their block hash then.
        group: index of the mirrored (full-attention) KV cache group.
        block_size: its tokens per block.
        truncates: KV-sharing fast prefill truncates this stage's prefill rows.
        hit_needs: what a hit needs (:class:`RowValidity`; ``CAPTURED_ONLY`` for a KV-shared
            thinker that hands off captured layers only).
        forgotten: requests whose writes are not recorded (fault injection:
            :data:`FORGET_ROWS` in the request's ``SamplingParams.extra_args``).
        truncated_spans: request → ``[(start, end)]`` token spans written under fast prefill.
        lookup: request → ``(capped, same_step, short)`` tokens of its latest lookup
            (``short``: a hit below ``min_hit_tokens``, recomputed); a waiting request is
            looked up again every step until admitted, so the counters take only the lookup
            that admitted it (in ``schedule()``).
        resumed: ``(request id, num_preemptions)`` → prefix-hit tokens on resume, the latest
            :data:`PREEMPTED_KEPT` (:meth:`note_resumed`; older ones are in ``resumed_older``).
        resumed_older: ``(hits, hit tokens)`` of the resumes that left ``resumed``.
        capped_tokens: hit tokens cut by the cap, over admitted requests.
        min_hit_tokens: hits shorter than this are recomputed (``OMNI_CACHE_MIN_HIT_TOKENS``).
        short_hit_tokens: hit tokens recomputed for being below ``min_hit_tokens``, over
            admitted requests.
        same_step_hit_tokens: hit tokens on blocks completed in the same step, over admitted
            requests.
        preemptions: requests preempted.
        preempted: ids of the latest :data:`PREEMPTED_KEPT` requests preempted, oldest first
            (published, so that a test can tell which requests recomputed rows after a
            preemption).
        pending: request → block index → ``(block id, step, awaiting)`` of blocks completed by
            step ``step`` whose hash vLLM did not know yet (async scheduling: decode-filled
            blocks); ``awaiting``: the worker did not report the block cached with that step's
            output, and may still, within :data:`LATE_CONFIRM_STEPS` steps.
        steps_scheduled: ``schedule()`` calls so far (the index of the next step).
        steps_done: steps whose output has been processed (``update_from_output``): their
            rows are written.
        step_of_output: ``id(SchedulerOutput)`` → its step index, until its output arrives.
        worker_reports: step outputs that carried the worker's cached blocks
            (:data:`~omni_cache.engine.stage_manager.CACHED_BLOCKS_ATTR`).
        unconfirmed_blocks: pending blocks dropped because the worker did not cache them
            within :data:`LATE_CONFIRM_STEPS` steps of the step that completed them (0 unless
            the worker's hashes fall behind vLLM's: each one is a capped hit instead of a
            refused one).
    """

    written: WrittenBlocks
    group: int
    block_size: int
    truncates: bool
    hit_needs: RowValidity
    forgotten: set[str] = field(default_factory=set)
    truncated_spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    lookup: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    resumed: dict[tuple[str, int], int] = field(default_factory=dict)
    resumed_older: list[int] = field(default_factory=lambda: [0, 0])
    capped_tokens: int = 0
    min_hit_tokens: int = 0
    short_hit_tokens: int = 0
    same_step_hit_tokens: int = 0
    preemptions: int = 0
    preempted: dict[str, None] = field(default_factory=dict)
    pending: dict[str, dict[int, tuple[int, int, bool]]] = field(default_factory=dict)
    steps_scheduled: int = 0
    steps_done: int = 0
    step_of_output: dict[int, int] = field(default_factory=dict)
    worker_reports: int = 0
    unconfirmed_blocks: int = 0

    def note_resumed(self, request_id: str, num_preemptions: int, tokens: int) -> None:
        """A preempted request's prefix hit on resume (``tokens``). The lookup repeats while the
        request waits, so the latest value per ``(request, preemption)`` counts; only the latest
        :data:`PREEMPTED_KEPT` keys are kept (a long-running server resumes without end), the
        older ones folded into ``resumed_older``."""
        key = (request_id, num_preemptions)
        self.resumed.pop(key, None)
        self.resumed[key] = tokens
        while len(self.resumed) > PREEMPTED_KEPT:
            old = next(iter(self.resumed))
            self.resumed_older[0] += 1
            self.resumed_older[1] += self.resumed.pop(old)

    def counters(self) -> dict[str, int]:
        """The published counters (``scheduler-<pid>.json``)."""
        return {"preemptions": self.preemptions, "resumed_hits": self.resumed_older[0] + len(self.resumed),
                "resumed_hit_tokens": self.resumed_older[1] + sum(self.resumed.values()),
                "capped_tokens": self.capped_tokens, "short_hit_tokens": self.short_hit_tokens,
                "same_step_hit_tokens": self.same_step_hit_tokens,
                "worker_reports": self.worker_reports, "unconfirmed_blocks": self.unconfirmed_blocks,
                "preempted_requests": list(self.preempted),
                "resumed_hit_requests": sorted({rid for rid, _ in self.resumed})}


class OmniCacheSchedulerMixin:
    """Caps KV prefix hits to the hidden-state tier's coverage."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        register_scheduler(self)  # its token ids, for a model runner of this process (scheduler_tokens)

    def _omni_cache_state(self) -> SchedulerCapState:
        st = getattr(self, "_oc_state", None)
        if st is None:
            group = full_attention_group(self.kv_cache_config)
            truncates, hit_needs = _yoco_rules(self.vllm_config)
            st = self._oc_state = SchedulerCapState(
                written=WrittenBlocks(), group=group,
                block_size=self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size,
                truncates=truncates, hit_needs=hit_needs, min_hit_tokens=settings.MIN_HIT_TOKENS.get_int())
            self._oc_metrics = MetricsFile("scheduler")
        return st

    def _get_local_prefix_cache_hit(self, request):
        blocks, num_local, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        st = self._omni_cache_state()
        st.lookup.pop(request.request_id, None)
        if num_local <= 0:
            return blocks, num_local, boundary, diverged
        g, bs = st.group, st.block_size
        mirrored = blocks.blocks[g]
        pairs = [(b.block_id, b.block_hash) for b in mirrored[: num_local // bs]]
        covered = st.written.covered(pairs, st.hit_needs)
        same_step = 0
        if covered < len(pairs):
            # a same-step hit: blocks that requests scheduled earlier in this step complete now
            with_pending = st.written.covered(pairs, st.hit_needs, pending=self._blocks_completed_this_step(st))
            same_step = (with_pending - covered) * bs
            covered = with_pending
        short = 0
        if covered and covered * bs < st.min_hit_tokens:  # not worth the hit path: recomputed
            short, covered, same_step = covered * bs, 0, 0
        capped = max(num_local - covered * bs, 0)
        if same_step or capped or request.num_preemptions > 0:
            st.lookup[request.request_id] = (capped - short, same_step, short)
        if capped > short:
            logger.info("omni-cache: request %s prefix hit capped %d -> %d tokens (hidden rows not covered)",
                        request.request_id, num_local, covered * bs)
        if capped:
            if len(blocks.blocks) == 1:
                blocks = KVCacheBlocks(tuple(list(gb[:covered]) for gb in blocks.blocks))
                num_local = covered * bs
            else:
                # Hybrid KV groups (sliding window + full attention): a shorter hit must be
                # recomputed by vLLM's coordinator (a sliding group needs the blocks inside
                # the window before the new hit end), never cut per group.
                mgr = self.kv_cache_manager
                computed, num_local, _ = mgr.coordinator.find_longest_cache_hit(request.block_hashes, covered * bs)
                blocks = mgr.create_kv_cache_blocks(computed)
        if request.num_preemptions > 0 and num_local > 0:
            # a preempted request resumes from its (re-hit) blocks; the lookup repeats while
            # it waits, so keep the last hit per (request, preemption)
            st.note_resumed(request.request_id, request.num_preemptions, num_local)
        return blocks, num_local, boundary, diverged

    def _blocks_completed_this_step(self, st: SchedulerCapState) -> dict:
        """Block id → ``(block hash, validity)`` of the mirrored group's blocks that requests
        already scheduled in the running ``schedule()`` call complete in this step.

        vLLM hashes (caches) a block when it is allocated for tokens that fill it in this
        step (``KVCacheManager.allocate_slots`` → ``cache_blocks``), so a request admitted
        later in the same step can hit it; the runner writes every scheduled row before it
        reads any hit, so such a hit gets this step's rows. A request's
        ``num_computed_tokens`` advances only after ``schedule()`` (``_update_after_schedule``),
        so during the waiting loop the blocks a scheduled request completes in this step are
        exactly its hashed blocks from ``num_computed_tokens // block_size`` on; a running
        request not scheduled in this step has none. vLLM preempts only in its running loop,
        before the waiting loop's prefix lookups, and a preempted request has left
        ``self.running``, so its blocks never count. Under KV-sharing fast prefill the
        validity is ``CAPTURED_ONLY`` (conservative: as for a prefill chunk).
        """
        g, bs = st.group, st.block_size
        validity = RowValidity.CAPTURED_ONLY if st.truncates else RowValidity.ALL_KEYS
        out = {}
        for req in self.running:
            if rows_forgotten(req):
                continue
            blocks = self.kv_cache_manager.get_blocks(req.request_id).blocks[g]
            for b in blocks[req.num_computed_tokens // bs:]:
                if b.block_hash is None:
                    break
                out[b.block_id] = (b.block_hash, validity)
        return out

    def _preempt_request(self, request, *args, **kwargs):
        super()._preempt_request(request, *args, **kwargs)
        st = self._omni_cache_state()
        st.preemptions += 1
        st.preempted.pop(request.request_id, None)
        st.preempted[request.request_id] = None
        while len(st.preempted) > PREEMPTED_KEPT:
            del st.preempted[next(iter(st.preempted))]
        self._publish_scheduler_metrics()

    def _publish_scheduler_metrics(self, force: bool = False) -> None:
        """With ``OMNI_CACHE_METRICS_DIR`` set, write the scheduler's counters
        (:meth:`SchedulerCapState.counters`) to ``<dir>/scheduler-<pid>.json``; called on each
        preemption, on a step that admits a capped, same-step or resumed hit (rare events, never
        on a plain step), and at shutdown (``force``). The events' writes are the file's writer
        thread's, at once (a snapshot taken here; an engine core killed before its shutdown
        still leaves them): not on the scheduler's thread, every request's path (a write cost
        ~0.3–0.5 ms there on the CPU, 2026-11-30); shutdown writes on this thread."""
        if self._oc_metrics.path() is None:
            return
        st = self._omni_cache_state()
        if force:
            self._oc_metrics.publish(st.counters, force=True)
        else:
            self._oc_metrics.publish(st.counters(), defer=True)

    def shutdown(self) -> None:
        self._publish_scheduler_metrics(force=True)
        super().shutdown()

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        st = self._oc_state if hasattr(self, "_oc_state") else self._omni_cache_state()
        bs = st.block_size
        if out.finished_req_ids:
            for rid in out.finished_req_ids:
                st.truncated_spans.pop(rid, None)
                st.lookup.pop(rid, None)  # aborted while waiting: never admitted, not counted
        scheduled = out.num_scheduled_tokens
        if out.scheduled_new_reqs:
            publish = False
            for nr in out.scheduled_new_reqs:
                rid = nr.req_id
                if rows_forgotten(self.requests[rid]):
                    st.forgotten.add(rid)
                if rid in st.lookup:  # its counted lookup admitted it now
                    publish = self._admit_lookup(st, rid) or publish
                self._note_scheduled(st, rid, nr.num_computed_tokens, scheduled.get(rid, 0), bs)
        else:
            publish = False
        cached = out.scheduled_cached_reqs
        if st.lookup:  # (a resumed request's lookup admits it as a cached one)
            for rid in st.lookup.keys() & set(cached.req_ids):
                publish = self._admit_lookup(st, rid) or publish
        if publish:  # rare (a capped, same-step or resumed hit): publish now, not only at shutdown
            self._publish_scheduler_metrics()
        truncates, forgotten = st.truncates, st.forgotten
        for rid, start in zip(cached.req_ids, cached.num_computed_tokens):
            n = scheduled.get(rid, 0)
            # (a decode step that completes no block and truncates nothing: nothing to note)
            if ((n > 1 and truncates) or (start + n) // bs > start // bs) and rid not in forgotten:
                self._note_scheduled(st, rid, start, n, bs)
        st.step_of_output[id(out)] = st.steps_scheduled
        st.steps_scheduled += 1
        return out

    def _admit_lookup(self, st: SchedulerCapState, rid: str) -> bool:
        """``rid`` is scheduled now (new, or resumed as a cached request) and its lookup was
        counted: add that lookup's capped, same-step and short-hit tokens to the counters.
        Returns whether to publish them at once (a capped, same-step or resumed hit: rare)."""
        capped, same_step, short = st.lookup.pop(rid)
        st.capped_tokens += capped
        st.same_step_hit_tokens += same_step
        st.short_hit_tokens += short
        return bool(capped or same_step or self.requests[rid].num_preemptions)

    def _note_scheduled(self, st: SchedulerCapState, rid: str, start: int, n: int, bs: int) -> None:
        """A scheduled request's tokens ``[start, start + n)`` of this step: the span written
        under fast prefill, and the blocks they complete (:meth:`_record_completed_blocks`)."""
        if rid in st.forgotten:
            return
        end = start + n
        if st.truncates and n > 1:
            st.truncated_spans.setdefault(rid, []).append((start, end))
        if end // bs > start // bs:
            self._record_completed_blocks(st, rid, range(start // bs, end // bs))

    def _validity(self, st: SchedulerCapState, rid: str, block_index: int) -> RowValidity:
        bs = st.block_size
        spans = st.truncated_spans.get(rid, ())
        return (RowValidity.CAPTURED_ONLY if spans_overlap(spans, block_index * bs, (block_index + 1) * bs)
                else RowValidity.ALL_KEYS)

    def _record_completed_blocks(self, st: SchedulerCapState, rid: str, block_indices: range) -> None:
        """Record the blocks (indices into ``rid``'s mirrored block table) that this step's
        scheduled tokens complete: their rows are written in this step, before any hit read
        in it or in a later step.

        A block whose hash is not known yet is forgotten now (its rows are being rewritten)
        and kept pending: under async scheduling a decode step's input token is a placeholder
        until the previous step's output arrives, so vLLM hashes (caches) a decode-filled
        block only in ``update_from_output``; :meth:`_resolve_pending_blocks` records it once
        both its hash is known and the step that wrote its rows has finished.
        """
        req_blocks = self.kv_cache_manager.get_blocks(rid).blocks[st.group]
        for i in block_indices:
            if i >= len(req_blocks):
                break
            b = req_blocks[i]
            if b.block_hash is None:
                st.written.forget(b.block_id)
                st.pending.setdefault(rid, {})[i] = (b.block_id, st.steps_scheduled, False)
            else:
                st.written.record(b.block_id, b.block_hash, self._validity(st, rid, i))

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        st = self._oc_state if hasattr(self, "_oc_state") else self._omni_cache_state()
        step = st.step_of_output.pop(id(scheduler_output), None)
        if step is not None:
            st.steps_done = max(st.steps_done, step + 1)
            cached = getattr(model_runner_output, CACHED_BLOCKS_ATTR, None)
            if cached is not None:
                st.worker_reports += 1
                if st.pending:
                    self._confirm_pending(st, step, cached)
        if st.pending:
            self._resolve_pending_blocks(st)
        return outputs

    def _confirm_pending(self, st: SchedulerCapState, step: int, cached) -> None:
        """Match the worker's report of ``step`` (``cached``: the block ids its stage manager
        cached in that step under its own block hash,
        :meth:`~omni_cache.engine.stage_manager.OmniCacheStageManager.cached_blocks`) against the
        pending blocks. vLLM hashes a decode-filled block from its sampled tokens; the worker
        hashes it from the step's input ids, which under async scheduling reach the host only
        after the step's forward: it caches the block in that step if they already have, else
        in a later one (never waiting for the device). A block not in the report of the step
        that completed it is marked awaiting; a later report confirms it; one still
        unconfirmed :data:`LATE_CONFIRM_STEPS` steps on is dropped — counted in
        ``unconfirmed_blocks`` and logged — and a hit on it is capped and recomputed instead
        of refused in the worker (``StaleRowsError``, the engine would stop)."""
        for rid in list(st.pending):
            pending = st.pending[rid]
            for i, (block_id, at, awaiting) in list(pending.items()):
                if at > step:  # completed by a step whose output has not arrived
                    continue
                if block_id in cached:
                    if awaiting:
                        pending[i] = (block_id, at, False)
                elif at == step:
                    pending[i] = (block_id, at, True)
                elif awaiting and step - at >= LATE_CONFIRM_STEPS:
                    del pending[i]
                    st.unconfirmed_blocks += 1
                    if st.unconfirmed_blocks <= 8:
                        logger.warning("omni-cache: request %s: block %d (id %d), completed in step %d, was not "
                                       "cached by the worker within %d steps; hits on it are capped and recomputed",
                                       rid, i, block_id, at, LATE_CONFIRM_STEPS)
            if not pending:
                del st.pending[rid]

    def _resolve_pending_blocks(self, st: SchedulerCapState) -> None:
        """Record pending blocks (see :meth:`_record_completed_blocks`) whose writing step has
        finished and whose hash vLLM now knows; drop those of requests that left the running
        state or whose block table changed (preempted: vLLM does not hash their new tokens)."""
        from vllm.v1.request import RequestStatus

        for rid in list(st.pending):
            req = self.requests.get(rid)
            pending = st.pending[rid]
            if req is None or req.status != RequestStatus.RUNNING or rid in st.forgotten:
                del st.pending[rid]
                continue
            blocks = self.kv_cache_manager.get_blocks(rid).blocks[st.group]
            for i, (block_id, step, awaiting) in list(pending.items()):
                if i >= len(blocks) or blocks[i].block_id != block_id:
                    del pending[i]
                elif step < st.steps_done and not awaiting and blocks[i].block_hash is not None:
                    st.written.record(block_id, blocks[i].block_hash, self._validity(st, rid, i))
                    del pending[i]
            if not pending:
                del st.pending[rid]


def _yoco_rules(vllm_config) -> tuple[bool, RowValidity]:
    """``(truncates, hit_needs)``: whether fast prefill truncates this stage's prefill rows (a
    KV-shared model with ``kv_sharing_fast_prefill``), and what a hit needs: the captured
    layers only, unless the stage hands the final hidden states downstream
    (``OMNI_CACHE_YOCO_ACCEPT_LAYER=final``, refused at start-up together with fast
    prefill) — then every key."""
    from omni_cache.yoco import YocoConfigError, stage_plan

    try:
        plan, _ = stage_plan(vllm_config.model_config.hf_config,
                             bool(vllm_config.cache_config.kv_sharing_fast_prefill), os.environ)
    except YocoConfigError:
        return False, RowValidity.ALL_KEYS
    if plan.num_kv_shared_layers == 0:
        return False, RowValidity.ALL_KEYS  # not a YOCO model: every write carries every key
    return plan.truncates, (RowValidity.ALL_KEYS if plan.needs_final else RowValidity.CAPTURED_ONLY)


class OmniCacheARScheduler(FinalStageHandOffMixin, OmniCacheSchedulerMixin, PrefixStatsFlushMixin, OmniARScheduler):
    """vLLM-Omni's synchronous AR scheduler with the hidden-tier hit cap (and no hand-off of a
    request that ends here: :mod:`omni_cache.engine.shm_hygiene`)."""


class OmniCacheARAsyncScheduler(FinalStageHandOffMixin, OmniCacheSchedulerMixin, PrefixStatsFlushMixin,
                                OmniARAsyncScheduler):
    """vLLM-Omni's asynchronous AR scheduler (its default) with the hidden-tier hit cap (and no
    hand-off of a request that ends here)."""


def pick_ar_scheduler(sync_cls: type, async_cls: type, *args, vllm_config, **kwargs):
    """Build ``async_cls`` when the stage schedules asynchronously
    (``scheduler_config.async_scheduling``, vLLM-Omni's default for AR stages), else
    ``sync_cls`` (vLLM calls a stage's ``scheduler_cls`` with the scheduler's arguments)."""
    cls = async_cls if vllm_config.scheduler_config.async_scheduling else sync_cls
    return cls(*args, vllm_config=vllm_config, **kwargs)


def capped_ar_scheduler(*args, vllm_config, **kwargs):
    """The capped AR scheduler for this stage: :class:`OmniCacheARAsyncScheduler` when the
    stage schedules asynchronously (``scheduler_config.async_scheduling``, vLLM-Omni's
    default for AR stages), else :class:`OmniCacheARScheduler`. The pipelines name this
    factory as their ``scheduler_cls`` (vLLM only calls it: ``get_scheduler_cls()(...)``)."""
    return pick_ar_scheduler(OmniCacheARScheduler, OmniCacheARAsyncScheduler, *args, vllm_config=vllm_config,
                             **kwargs)
