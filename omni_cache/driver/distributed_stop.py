"""Closing a pipeline in vLLM-Omni's distributed mode stops its stages.

In distributed mode (``single_stage_mode=True`` with an ``omni_master_address``, or
``omni-cache serve -- --stage-id N ...``) vLLM-Omni's ``Orchestrator.run`` gathers its request
handler, its output handler and the ``MembershipController``'s replica watcher
(``vllm_omni/engine/orchestrator.py``, ``run``). A shutdown request ends the first two; the
watcher loops until the controller's own ``_shutdown_event`` is set — which only
``MembershipController.shutdown()`` does, in ``run()``'s ``finally``, after that gather
returns. So the orchestrator never ends: ``OmniEngineBase.shutdown`` waits its 30 s join
timeout, logs "Orchestrator did not stop within 30.0 seconds", defers the stage runtime's
shutdown to a thread that waits for the orchestrator, and every stage process (engine core and
worker, each replica) stays up until the interpreter exits (seen in CI: a closed
``OmniPipeline`` in distributed mode kept its four stage processes through the later test
modules; vLLM's exit-time finalizers stopped them).

:func:`release_membership_watcher` sets that event on the orchestrator's event loop just before
the shutdown request is sent: the watcher leaves its loop within its poll interval
(``MembershipController.WATCH_INTERVAL_S``, 0.5 s), the gather returns, and ``run()``'s
``finally`` stops the stages as on an in-process pipeline. It touches vLLM-Omni internals (the
janus request queue's loop, the watcher task's name and coroutine frame); each is checked and
a miss is logged and returns False (the close then goes on as vLLM-Omni's own would).
:func:`release_before_shutdown` does it for callers that shut an engine down themselves (vLLM's
API-server launcher in ``omni-cache serve``). Measured with ``scripts/distributed_serve_stop.sh``
(this 2-core CPU host): the distributed ``serve`` head stops in 8.6 s instead of 33.1 s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

#: the name vLLM-Omni gives the replica watcher's task (``MembershipController.start``)
WATCHER_TASK_NAME = "membership-watcher"


def _set_watcher_shutdown_event(loop: asyncio.AbstractEventLoop) -> int:
    """On ``loop``'s thread: set the shutdown event of every membership watcher task on it.
    Returns how many were set."""
    count = 0
    for task in asyncio.all_tasks(loop):
        if task.get_name() != WATCHER_TASK_NAME or task.done():
            continue
        frame = getattr(task.get_coro(), "cr_frame", None)
        controller = frame.f_locals.get("self") if frame is not None else None
        event = getattr(controller, "_shutdown_event", None)
        if isinstance(event, asyncio.Event):
            event.set()
            count += 1
    return count


def release_membership_watcher(omni: Any, timeout_s: float = 5.0) -> bool:
    """Let a distributed-mode engine's orchestrator end on its shutdown request (module
    docstring). Call it just before ``omni.shutdown()`` / ``omni.close()``; on an engine
    without distributed mode it does nothing.

    Args:
        omni: a running ``vllm_omni.Omni`` or ``AsyncOmni`` (``omni.engine``), or the engine.
        timeout_s: seconds to wait for the orchestrator's loop to run the release.

    Returns:
        True when a membership watcher was released; False when there is none (not distributed
        mode, or the orchestrator has ended) or vLLM-Omni's internals moved (logged as a
        warning naming what is missing).
    """
    engine = getattr(omni, "engine", omni)
    runtime = getattr(engine, "_runtime", None)
    if getattr(runtime, "_coordinator_runtime", None) is None:
        return False  # no coordinator: no MembershipController (vLLM-Omni's DistStageRuntime)
    thread = getattr(engine, "orchestrator_thread", None)
    if thread is None or not thread.is_alive():
        return False
    loop = getattr(getattr(engine, "request_queue", None), "_loop", None)
    if not isinstance(loop, asyncio.AbstractEventLoop) or loop.is_closed():
        logger.warning("distributed mode: the orchestrator's event loop was not found (vLLM-Omni's "
                       "engine.request_queue._loop); its membership watcher is not released and the "
                       "engine's shutdown may wait 30 s and leave the stage processes running")
        return False

    async def release() -> int:
        return _set_watcher_shutdown_event(asyncio.get_running_loop())

    try:
        released = asyncio.run_coroutine_threadsafe(release(), loop).result(timeout_s)
    except Exception as exc:  # the loop stopped meanwhile, or did not answer in time
        logger.warning("distributed mode: releasing the orchestrator's membership watcher failed: %r", exc)
        return False
    if not released:
        logger.warning("distributed mode: no %r task on the orchestrator's loop (vLLM-Omni's "
                       "MembershipController.start); the engine's shutdown may wait 30 s and leave "
                       "the stage processes running", WATCHER_TASK_NAME)
    return released > 0


def release_before_shutdown(omni: Any) -> bool:
    """Make ``omni.shutdown`` release the membership watcher first
    (:func:`release_membership_watcher`), for callers that shut the engine down themselves —
    vLLM's API-server launcher calls ``engine_client.shutdown(timeout=...)`` on SIGTERM / Ctrl-C.
    The wrapper is set on this instance only; a second call does nothing.

    Returns:
        True when the wrapper was set now.
    """
    shutdown = omni.shutdown
    if getattr(shutdown, "_omni_cache_releases_watcher", False):
        return False

    @functools.wraps(shutdown)
    def shutdown_releasing_watcher(*args, **kwargs):
        release_membership_watcher(omni)
        return shutdown(*args, **kwargs)

    shutdown_releasing_watcher._omni_cache_releases_watcher = True
    omni.shutdown = shutdown_releasing_watcher
    return True
