"""``omni_cache.driver.distributed_stop``: the release of vLLM-Omni's membership watcher, on a
real event loop in its own thread standing in for the orchestrator's (the engine around it is a
small fake; the real engine in distributed mode: tests/pipeline/test_routing.py,
``test_closing_a_distributed_pipeline_stops_its_stages``; ``omni-cache serve``'s call:
tests/unit/test_routing_adapter.py, next to the server's other hooks — importing vLLM-Omni's
API server here changed the log capture of the modules after this one)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import SimpleNamespace

from omni_cache.driver.distributed_stop import WATCHER_TASK_NAME, release_membership_watcher


class _Controller:
    """The shape of vLLM-Omni's ``MembershipController`` watcher: loops until its own event."""

    def __init__(self):
        self._shutdown_event = asyncio.Event()
        self.rounds = 0

    async def _watch_replica_list(self):
        while not self._shutdown_event.is_set():
            self.rounds += 1
            await asyncio.sleep(0.01)


@contextlib.contextmanager
def _orchestrator(task_name: str = WATCHER_TASK_NAME, coordinator: object | None = object()):
    """A loop on a thread running one watcher task; yields (engine, watcher task, controller)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    async def main():
        box["controller"] = controller = _Controller()
        box["task"] = asyncio.create_task(controller._watch_replica_list(), name=task_name)
        started.set()
        await box["task"]

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(5)
    engine = SimpleNamespace(_runtime=SimpleNamespace(_coordinator_runtime=coordinator),
                             orchestrator_thread=thread, request_queue=SimpleNamespace(_loop=loop))
    try:
        yield engine, box["task"], box["controller"]
    finally:
        if thread.is_alive():
            loop.call_soon_threadsafe(box["controller"]._shutdown_event.set)
        thread.join(5)
        loop.close()


def test_the_watcher_is_released_and_the_orchestrator_loop_ends():
    with _orchestrator() as (engine, task, controller):
        assert release_membership_watcher(SimpleNamespace(engine=engine)) is True
        engine.orchestrator_thread.join(5)
        assert not engine.orchestrator_thread.is_alive()
        assert task.done() and not task.cancelled() and controller._shutdown_event.is_set()


def test_not_distributed_mode_is_left_alone():
    with _orchestrator(coordinator=None) as (engine, task, controller):
        assert release_membership_watcher(engine) is False
        assert not controller._shutdown_event.is_set() and not task.done()


def test_a_renamed_watcher_is_reported_not_guessed(caplog):
    with _orchestrator(task_name="something-else") as (engine, task, controller):
        with caplog.at_level("WARNING"):
            assert release_membership_watcher(engine) is False
        assert not controller._shutdown_event.is_set()
        assert WATCHER_TASK_NAME in caplog.text


def test_a_missing_loop_is_reported(caplog):
    with _orchestrator() as (engine, task, controller):
        engine.request_queue = SimpleNamespace()
        with caplog.at_level("WARNING"):
            assert release_membership_watcher(engine) is False
        assert "event loop was not found" in caplog.text
