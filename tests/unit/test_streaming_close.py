"""``StreamingPipeline.close()`` aborts the requests still running before it stops the stages
(a stop during a request: the talker and code2wav then go idle instead of taking the CPU from
the stage being torn down; docs/architecture.md, "Stopping"). Engine-free: a small fake stands
in for vLLM-Omni's ``AsyncOmni`` (the real stop is tests/pipeline/test_run.py's)."""

from __future__ import annotations

import asyncio

from omni_cache.driver.streaming import StreamingPipeline


class FakeOmni:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.fail = fail

    async def abort(self, request_ids):
        self.calls.append(("abort", sorted(request_ids)))
        if self.fail:
            raise RuntimeError("orchestrator gone")

    def shutdown(self):
        self.calls.append(("shutdown",))


def _pipeline(omni, in_flight):
    pipe = StreamingPipeline.__new__(StreamingPipeline)  # no engine: only what close() reads
    pipe.omni, pipe._loop, pipe._in_flight, pipe.shm_sweeper = omni, asyncio.new_event_loop(), set(in_flight), None
    return pipe


def test_close_aborts_running_requests_before_the_stages_stop():
    omni = FakeOmni()
    pipe = _pipeline(omni, {"run-3", "run-2"})
    pipe.close()
    assert omni.calls == [("abort", ["run-2", "run-3"]), ("shutdown",)]
    assert pipe.omni is None and pipe._loop.is_closed()


def test_close_with_nothing_running_only_stops():
    omni = FakeOmni()
    _pipeline(omni, ()).close()
    assert omni.calls == [("shutdown",)]


def test_a_failed_abort_does_not_stop_the_stop(monkeypatch):
    from omni_cache.driver import streaming

    warned = []  # the module's logger itself: an earlier test's dictConfig may have disabled it for caplog
    monkeypatch.setattr(streaming, "logger", type("L", (), {"warning": lambda self, *a: warned.append(a[0] % a[1:])})())
    omni = FakeOmni(fail=True)
    _pipeline(omni, {"run-1"}).close()
    assert omni.calls == [("abort", ["run-1"]), ("shutdown",)]
    assert warned and warned[0].startswith("aborting 1 running request(s) before the stop failed"), warned
