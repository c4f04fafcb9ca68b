"""The server-side sweeper of unread shared-memory hand-offs (:mod:`omni_cache.driver.shm_sweeper`).

Engine-free: real POSIX segments in ``/dev/shm`` named as vLLM-Omni's ``SharedMemoryConnector``
names them, and an async generator standing in for ``AsyncOmni.generate``. The server-level
check is the soak slice in ``tests/pipeline/test_serve.py``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from multiprocessing import shared_memory
from pathlib import Path

from omni_cache.driver.shm_sweeper import (
    SHM_DIR,
    ShmSweeper,
    install_shm_sweeper,
    request_entries,
    sweep_requests,
)


def _segment(name: str) -> None:
    """A segment and its lock file, as ``SharedMemoryConnector.put`` leaves them."""
    seg = shared_memory.SharedMemory(create=True, size=64, name=name)
    seg.close()
    Path(SHM_DIR / f"shm_{name}_lockfile.lock").touch()


def _left(rid: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if rid in n)


def test_request_entries_match_exactly():
    names = ["chatcmpl-a_0_0", "chatcmpl-a_1_12", "shm_chatcmpl-a_0_0_lockfile.lock", "chatcmpl-ab_0_0",
             "shm_chatcmpl-ab_0_0_lockfile.lock", "chatcmpl-a_0_x", "other"]
    assert request_entries("chatcmpl-a", names) == (["chatcmpl-a_0_0", "chatcmpl-a_1_12"],
                                                    ["shm_chatcmpl-a_0_0_lockfile.lock"])


def test_sweep_unlinks_the_requests_segments_and_lockfiles_only():
    rid, other = f"chatcmpl-test-{uuid.uuid4().hex[:8]}", f"chatcmpl-test-{uuid.uuid4().hex[:8]}"
    for name in (f"{rid}_0_0", f"{rid}_0_6", f"{rid}_1_3", f"{other}_0_0"):
        _segment(name)
    try:
        assert sweep_requests([rid]) == (3, 3)
        assert _left(rid) == []
        assert _left(other) == [f"{other}_0_0", f"shm_{other}_0_0_lockfile.lock"]
        assert sweep_requests([rid]) == (0, 0)
    finally:
        sweep_requests([rid, other])
    assert _left(other) == []


def test_generate_wrapper_sweeps_after_the_stream_ends_finished_or_closed():
    rid_done, rid_closed = (f"chatcmpl-test-{uuid.uuid4().hex[:8]}" for _ in range(2))
    internal: list[str] = []

    class Engine:  # as vLLM-Omni's AsyncOmni: the stages see <client id>-<8 hex>
        @staticmethod
        def _get_unique_request_id(external_request_id):
            return f"{external_request_id}-{uuid.uuid4().hex[:8]}"

        async def generate(self, prompt, sampling_params=None, request_id="", **kwargs):
            rid = self._get_unique_request_id(request_id)
            internal.append(rid)
            _segment(f"{rid}_0_0")  # a hand-off the next stage never reads
            for k in range(3):
                yield k

        async def abort(self, request_id):
            pass

    engine = Engine()
    sweeper = install_shm_sweeper(engine, ShmSweeper(after_s=0.2, every_s=0.05))
    assert install_shm_sweeper(engine) is sweeper  # once
    twin = f"{rid_done}-0000abcd"  # another request with the same client id, still running
    _segment(f"{twin}_0_0")

    async def main():
        assert [x async for x in engine.generate("p", request_id=rid_done)] == [0, 1, 2]
        gen = engine.generate("p", None, rid_closed)  # the client goes away after one output
        assert await gen.__anext__() == 0
        await gen.aclose()
        assert _left(rid_closed)  # not before the grace
        await asyncio.sleep(0.5)

    try:
        asyncio.run(main())
        assert _left(rid_closed) == []
        assert sorted(_left(rid_done)) == [f"{twin}_0_0", f"shm_{twin}_0_0_lockfile.lock"]  # the twin's only
        assert (sweeper.swept_segments, sweeper.swept_lockfiles) == (2, 2)
    finally:
        sweep_requests([*internal, twin])


def test_abort_sweeps_without_the_stream_ending():
    """The server aborts a request whose client went away; its stream (a generator the client
    abandoned) may be finalized much later, outside any event loop: the abort alone sweeps."""
    rid = f"chatcmpl-test-{uuid.uuid4().hex[:8]}"

    class Engine:
        @staticmethod
        def _get_unique_request_id(external_request_id):
            return external_request_id

        async def generate(self, prompt, sampling_params=None, request_id="", **kwargs):
            yield 0

        async def abort(self, request_id):
            return "aborted"

    engine = Engine()
    install_shm_sweeper(engine, ShmSweeper(after_s=0.1, every_s=0.05))
    _segment(f"{rid}_0_6")
    try:
        assert asyncio.run(engine.abort([rid])) == "aborted"
        # no loop runs now: the sweeper's own thread does it (0.1 s after the abort; waited for
        # up to 10 s — a loaded CI host once needed more than 0.6 s)
        deadline = time.monotonic() + 10
        while _left(rid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _left(rid) == []
    finally:
        sweep_requests([rid])


def test_hand_offs_written_after_the_first_sweep_are_swept_again(tmp_path):
    """A stage's save thread can write chunks after its request's stream ended (vLLM-Omni's
    chunk adapter sends from a background thread; the landing CI of ca53e73 found 45 entries
    of one request written after its sweep). The request is swept again after its first sweep,
    and again while a sweep still finds entries, ``max_sweeps`` at most. Oracle: the directory's
    entries after each forced sweep (``now=inf``; ``after_s`` / ``again_s`` so long that the
    sweeper's own thread never sweeps)."""
    rid = "chatcmpl-late-0a1b2c3d"

    def write(chunk: int) -> None:
        (tmp_path / f"{rid}_0_{chunk}").write_bytes(b"x")
        (tmp_path / f"shm_{rid}_0_{chunk}_lockfile.lock").touch()

    sweeper = ShmSweeper(after_s=1e6, again_s=1e6, shm_dir=tmp_path, max_sweeps=3)
    write(1)
    sweeper.request_ended(rid)
    assert sweeper.sweep_due(now=math.inf) == [rid] and os.listdir(tmp_path) == []
    write(24)  # the save thread's late chunk
    assert sweeper.sweep_due(now=math.inf) == [rid] and os.listdir(tmp_path) == []
    assert (sweeper.swept_segments, sweeper.swept_lockfiles, sweeper.late_segments) == (2, 2, 1)
    write(25)  # the third sweep is the last (max_sweeps=3), whatever it finds
    assert sweeper.sweep_due(now=math.inf) == [rid] and os.listdir(tmp_path) == []
    assert sweeper.due == [] and sweeper.sweep_due(now=math.inf) == []


def test_a_sweep_that_finds_nothing_ends_the_requests_sweeps(tmp_path):
    """After the second sweep, a request is swept again only if the last sweep found some of
    its entries: a finished request costs two directory listings, not ``max_sweeps``."""
    sweeper = ShmSweeper(after_s=1e6, again_s=1e6, shm_dir=tmp_path)
    sweeper.request_ended("chatcmpl-quiet-0a1b2c3d")
    assert sweeper.sweep_due(now=math.inf) == ["chatcmpl-quiet-0a1b2c3d"]  # the first: nothing found
    assert len(sweeper.due) == 1  # the second is always due
    assert sweeper.sweep_due(now=math.inf) == ["chatcmpl-quiet-0a1b2c3d"]
    assert sweeper.due == []
    assert sweeper.sweep_due(now=0.0) == []
