"""Prefix-cache counters that reach ``/metrics`` when the lookup happens, not a step later.

vLLM-Omni throttles a stage's scheduler stats to one ``SchedulerStats`` a second
(``OmniSchedulerMixin.make_stats``, ``_STATS_INTERVAL_S`` = 1.0 s in
``vllm_omni/core/sched/omni_scheduler_mixin.py``, vLLM-Omni 0.30): a step within a second of the
last emission sends none, and vLLM's ``KVCacheManager.prefix_cache_stats`` keeps accumulating
until a step outside that second drains it (``make_prefix_cache_stats``). A request admitted
less than a second after the last emission whose engine then goes idle — a fast GPU turn —
has its prefix-cache queries and hits held back until the stage's next request: the server's
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` of that stage do not move (seen on an
H100: the talker's counters unchanged 20 s after turn 2 of a chat that hit; reproduced on the
CPU with vLLM's real scheduler, ``tests/unit/test_sched_stats.py``).

:class:`PrefixStatsFlushMixin` emits the stats of a step that admitted requests (pending
prefix-cache lookups) at once, throttle or not, and restarts the throttle's second; every other
step keeps vLLM-Omni's throttle. Cost: at most one extra ``SchedulerStats`` per step that admits
requests.
"""

from __future__ import annotations

import time


class PrefixStatsFlushMixin:
    """Put before vLLM-Omni's scheduler class in the bases (see the module docstring)."""

    def make_stats(self, *args, **kwargs):
        if not getattr(self, "log_stats", False):
            return super().make_stats(*args, **kwargs)
        pending = getattr(getattr(self, "kv_cache_manager", None), "prefix_cache_stats", None)
        if pending is not None and (
                pending.requests or pending.preempted_requests):
            from vllm.v1.core.sched.scheduler import Scheduler

            self._last_stats_time = time.monotonic()  # vLLM-Omni's throttle: its next second starts now
            return Scheduler.make_stats(self, *args, **kwargs)
        return super().make_stats(*args, **kwargs)
