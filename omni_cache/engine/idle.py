"""Back-off for engine steps that schedule nothing, on the CPU platform.

While its scheduler holds a request, vLLM's engine core steps the stage in a loop; a step
that executes nothing is followed by a 1 ms sleep (``EngineCoreProc._process_engine_step``
in ``vllm/v1/engine/core.py``). With vLLM-Omni's streaming hand-off (``async_chunk: true``)
the talker's and code2wav's requests are queued as soon as the thinker starts and wait
there (``WAITING_FOR_CHUNK``) for the thinker's first chunk: two stages then step ~1,000
times a second each, doing nothing. On a GPU host that is a spare core's worth of Python;
on a 2-core CPU host it takes the cores the thinker's OpenMP threads compute on — measured
here (bench model, 3,048-token uncached prompt, vLLM's own prefill time): 25.8 s streaming
vs 14.0 s not, 2 requests a run (docs/benchmarks.md, run T, "Reading").

:class:`IdleBackoff` stretches the sleep of consecutive empty steps — 0, 1, 2, 4 … ms, at
most ``OMNI_CACHE_CPU_IDLE_BACKOFF_MS`` — and resets on the first step that schedules a
token. A waiting stage notices a new chunk at most that much later.

Import rule: standard library only (unit-tested without an engine).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class IdleBackoff:
    """Sleep schedule for consecutive engine steps with no scheduled token.

    Invariant: before the k-th consecutive empty step (k = 1, 2, …) it sleeps
    ``min(cap_s, first_s * 2 ** (k - 2))`` seconds for k ≥ 2 and not at all for k = 1 (the
    first empty step after work is often a finished request being removed); a step with
    tokens resets k.

    Args:
        cap_s: the longest sleep (seconds); ``0`` turns the back-off off.
        first_s: the sleep after the second consecutive empty step (seconds).
        sleep: the sleep function (``time.sleep``; tests pass a recorder).
    """

    def __init__(self, cap_s: float, first_s: float = 0.001,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if cap_s < 0 or first_s <= 0:
            raise ValueError(f"IdleBackoff: cap_s={cap_s} must be >= 0 and first_s={first_s} > 0")
        self.cap_s, self.first_s, self._sleep = cap_s, first_s, sleep
        self._delay: float | None = None  # None: the last step had tokens

    def before_step(self, num_scheduled_tokens: int) -> float:
        """Call before executing a step that schedules ``num_scheduled_tokens`` tokens;
        sleeps if the step is empty and returns the seconds slept."""
        if num_scheduled_tokens > 0 or self.cap_s == 0:
            self._delay = None
            return 0.0
        if self._delay is None:  # the first empty step after work
            self._delay = 0.0
            return 0.0
        self._delay = min(self.cap_s, self._delay * 2 if self._delay else self.first_s)
        self._sleep(self._delay)
        return self._delay
