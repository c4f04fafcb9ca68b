"""A vLLM-Omni AR scheduler that caps each prefix hit to what the hidden-state tier covers.

``_get_local_prefix_cache_hit`` (vLLM's scheduler seam for the local KV prefix-cache lookup)
returns the KV hit; :class:`OmniCacheSchedulerMixin` truncates it to the leading blocks whose
hidden-state rows are complete (:class:`~omni_cache.core.coverage.WrittenBlocks`), so the
runner never has to serve — or refuse — rows it does not have: the uncovered tail is simply
recomputed, and the engine keeps serving. After each ``schedule()`` it records the blocks
that this step's scheduled tokens complete; within ``schedule()`` a hit may also cover blocks
that requests scheduled earlier in the same step complete (a same-step hit).

Selected through the pipeline topology (vLLM-Omni 0.30 owns ``scheduler_cls`` there, not in
the deploy YAML): ``pipeline: qwen3_omni_moe_omni_cache`` (see :mod:`omni_cache.vllm_omni.plugin`).
Synchronous scheduling only (``async_scheduling: false``; the CPU platform forces it).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm_omni.core.sched.omni_ar_scheduler import OmniARScheduler

from omni_cache.vllm_omni.runner import ENV_METRICS_DIR
from omni_cache.core.coverage import ALL_KEYS, WrittenBlocks, spans_overlap

logger = logging.getLogger(__name__)

# Fault injection for tests: the first N requests' writes are not recorded (as if their
# rows were lost), so hits on their blocks must be capped and recomputed.
ENV_TEST_FORGET = "OMNI_CACHE_TEST_FORGET_FIRST_N_REQUESTS"


class OmniCacheSchedulerMixin:
    """Caps KV prefix hits to the hidden-state tier's coverage."""

    def _omni_cache_state(self):
        st = getattr(self, "_oc_state", None)
        if st is None:
            from omni_cache.vllm_omni.runner import _full_attention_group

            st = self._oc_state = {
                "written": WrittenBlocks(),
                "group": _full_attention_group(self.kv_cache_config),
                "bs": None,
                "forget_left": int(os.environ.get(ENV_TEST_FORGET, "0") or 0),
                "forgotten": set(),
                "capped_tokens": 0,
                "same_step_hit_tokens": 0,  # hit tokens on blocks completed in the same step
                # req id -> (capped, same-step) tokens of its latest lookup; a waiting request
                # is looked up again every step until admitted, so the counters above take
                # only the lookup that admitted it (in schedule())
                "lookup": {},
                "preemptions": 0,
                "resumed": {},  # (request id, num_preemptions) -> prefix-hit tokens on resume
                "truncated_spans": {},  # req id -> [(start, end)] written under fast prefill
            }
            groups = self.kv_cache_config.kv_cache_groups
            st["bs"] = groups[st["group"]].kv_cache_spec.block_size
            st["truncates"], st["hit_keys"] = _yoco_rules(self.vllm_config)
        return st

    def _get_local_prefix_cache_hit(self, request):
        blocks, num_local, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        st = self._omni_cache_state()
        st["lookup"].pop(request.request_id, None)
        if num_local <= 0:
            return blocks, num_local, boundary, diverged
        g, bs = st["group"], st["bs"]
        mirrored = blocks.blocks[g]
        pairs = [(b.block_id, b.block_hash) for b in mirrored[: num_local // bs]]
        covered = st["written"].covered(pairs, keys=st["hit_keys"])
        same_step = 0
        if covered < len(pairs):
            # a same-step hit: blocks that requests scheduled earlier in this step complete now
            with_pending = st["written"].covered(pairs, keys=st["hit_keys"],
                                                 pending=self._blocks_completed_this_step(st))
            same_step = (with_pending - covered) * bs
            covered = with_pending
        capped = max(num_local - covered * bs, 0)
        if same_step or capped or request.num_preemptions > 0:
            st["lookup"][request.request_id] = (capped, same_step)
        if capped:
            logger.info("omni-cache: request %s prefix hit capped %d -> %d tokens (hidden rows not covered)",
                        request.request_id, num_local, covered * bs)
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
            st["resumed"][(request.request_id, request.num_preemptions)] = num_local
        return blocks, num_local, boundary, diverged

    def _blocks_completed_this_step(self, st) -> dict:
        """Block id → ``(block hash, keys)`` of the mirrored group's blocks that requests
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
        ``self.running``, so its blocks never count. Under KV-sharing fast prefill the keys
        are the captured ones only (conservative: as for a prefill chunk).
        """
        g, bs = st["group"], st["bs"]
        if st["forget_left"] > 0:  # fault injection pending: do not vouch for anything new
            return {}
        keys = CAPTURED_ONLY if st["truncates"] else ALL_KEYS
        out = {}
        for req in self.running:
            if req.request_id in st["forgotten"]:
                continue
            blocks = self.kv_cache_manager.get_blocks(req.request_id).blocks[g]
            for b in blocks[req.num_computed_tokens // bs:]:
                if b.block_hash is None:
                    break
                out[b.block_id] = (b.block_hash, keys)
        return out

    def _preempt_request(self, request, *args, **kwargs):
        super()._preempt_request(request, *args, **kwargs)
        st = self._omni_cache_state()
        st["preemptions"] += 1
        self._publish_scheduler_metrics()

    def _publish_scheduler_metrics(self) -> None:
        """With ``OMNI_CACHE_METRICS_DIR`` set, write the scheduler's counters (preemptions,
        resumed hits, capped and same-step hit tokens) to ``<dir>/scheduler-<pid>.json``;
        called on each preemption, on a step that admits a capped, same-step or resumed hit, and at
        shutdown (rare events, never on a plain step; an engine core killed before its
        shutdown still leaves the counters of those events)."""
        out = os.environ.get(ENV_METRICS_DIR)
        if not out:
            return
        st = self._omni_cache_state()
        counters = {"preemptions": st["preemptions"], "resumed_hits": len(st["resumed"]),
                    "resumed_hit_tokens": sum(st["resumed"].values()), "capped_tokens": st["capped_tokens"],
                    "same_step_hit_tokens": st["same_step_hit_tokens"]}
        path = Path(out) / f"scheduler-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(counters))
        tmp.replace(path)

    def shutdown(self) -> None:
        self._publish_scheduler_metrics()
        super().shutdown()

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        st = self._omni_cache_state()
        g, bs, written = st["group"], st["bs"], st["written"]
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        new_ids = set(starts)
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        trunc, lookup = st["truncated_spans"], st["lookup"]
        for rid in out.finished_req_ids:
            trunc.pop(rid, None)
            lookup.pop(rid, None)  # aborted while waiting: never admitted, not counted
        admitted = starts.keys() & lookup.keys()  # requests whose counted lookup admitted them now
        for rid in admitted:
            capped, same_step = lookup.pop(rid)
            st["capped_tokens"] += capped
            st["same_step_hit_tokens"] += same_step
        if admitted:  # rare (a capped, same-step or resumed hit): publish now, not only at shutdown
            self._publish_scheduler_metrics()
        for rid, start in starts.items():
            if st["forget_left"] > 0 and rid not in st["forgotten"] and rid in new_ids:
                st["forgotten"].add(rid)
                st["forget_left"] -= 1
            if rid in st["forgotten"]:
                continue
            end = start + out.num_scheduled_tokens.get(rid, 0)
            if st["truncates"] and end - start > 1:
                trunc.setdefault(rid, []).append((start, end))
            spans = trunc.get(rid, ())
            req_blocks = self.kv_cache_manager.get_blocks(rid).blocks[g]
            for i in range(start // bs, min(end // bs, len(req_blocks))):
                b = req_blocks[i]
                keys = CAPTURED_ONLY if spans_overlap(spans, i * bs, (i + 1) * bs) else ALL_KEYS
                written.record(b.block_id, b.block_hash, keys)
        return out


#: per-key validity of a block written by a fast-prefill chunk: every key but the final hidden
#: states (the runner writes the same subset, :mod:`omni_cache.vllm_omni.runner`)
CAPTURED_ONLY = frozenset({"captured"})


def _yoco_rules(vllm_config) -> tuple[bool, frozenset[str] | None]:
    """``(truncates, hit_keys)``: whether fast prefill truncates this stage's prefill rows (a
    KV-shared model with ``kv_sharing_fast_prefill``), and the keys a hit needs: only the
    captured ones, unless the stage hands the final hidden states downstream
    (``OMNI_CACHE_YOCO_ACCEPT_LAYER=final``, refused at start-up together with fast
    prefill) — then every key (:data:`ALL_KEYS`)."""
    from omni_cache.yoco import YocoConfigError, stage_plan

    try:
        plan, _ = stage_plan(vllm_config.model_config.hf_config,
                             bool(vllm_config.cache_config.kv_sharing_fast_prefill), os.environ)
    except YocoConfigError:
        return False, ALL_KEYS
    if plan.num_kv_shared_layers == 0:
        return False, ALL_KEYS  # not a YOCO model: every write carries every key
    return plan.truncates, (ALL_KEYS if plan.needs_final else CAPTURED_ONLY)


class OmniCacheARScheduler(OmniCacheSchedulerMixin, OmniARScheduler):
    """vLLM-Omni's synchronous AR scheduler with the hidden-tier hit cap."""
