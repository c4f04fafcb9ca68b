"""``MetricsFile`` under the threads of one engine process.

The sixth GPU session's full-size thinker died of ``FileNotFoundError`` in ``tmp.replace(path)``:
vLLM-Omni's background output builder and the step thread published at once through one
temporary file, and the second rename found it gone (docs/gpu.md). Counters are best-effort;
they must never take the engine down.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from omni_cache.engine.metrics import MetricsFile


def test_concurrent_publishes_never_raise(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    mf = MetricsFile("metrics", min_interval_s=0.0)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def publish(i: int) -> None:
        start.wait()
        try:
            for n in range(300):
                mf.publish({"thread": i, "n": n}, force=True)
        except BaseException as e:  # noqa: BLE001 - the test collects what a thread raised
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    data = json.loads(mf.path().read_text())  # one whole write, not two interleaved
    assert set(data) == {"thread", "n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [mf.path().name]  # no temporary left


def test_a_failed_write_returns_false_and_the_engine_goes_on(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(blocker / "metrics"))
    mf = MetricsFile("metrics")
    assert mf.publish({"steps": 1}, force=True) is False
    assert mf.publish({"steps": 2}, force=True) is False
    assert sum("counters not written" in r.getMessage() for r in caplog.records) == 1


def test_a_deferred_write_leaves_the_calling_thread_and_lands_within_the_interval(tmp_path, monkeypatch):
    """The engine step's publishes are deferred: the step's thread never writes the file (a write
    cost ~0.26 ms of a GPU step's host time on every step that served a hit), the file's writer thread
    writes the counters as they are when it runs, within ``min_interval_s``, one pending write at
    a time; a forced write (shutdown) takes its place."""
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    mf = MetricsFile("metrics", min_interval_s=0.2)
    writers: list[str] = []
    real = mf._write
    monkeypatch.setattr(mf, "_write", lambda *a: (writers.append(threading.current_thread().name), real(*a))[1])
    counters = {"hits": 1}
    assert mf.publish(lambda: dict(counters), defer=True) is False  # never on this thread
    counters["hits"] = 2  # what the timer writes is read when it runs
    for _ in range(100):
        if mf.path().exists():
            break
        time.sleep(0.02)
    assert json.loads(mf.path().read_text()) == {"hits": 2}
    assert writers and threading.current_thread().name not in writers, writers
    # within the interval: one pending write for any number of steps, landing after it
    t0 = time.monotonic()
    for n in range(50):
        counters["hits"] = 10 + n
        mf.publish(lambda: dict(counters), defer=True)
    while json.loads(mf.path().read_text())["hits"] != 59 and time.monotonic() - t0 < 2:
        time.sleep(0.02)
    assert json.loads(mf.path().read_text())["hits"] == 59 and len(writers) == 2, writers
    assert time.monotonic() - t0 >= 0.1  # not before the interval allowed it
    # a forced write replaces a pending one
    mf.publish({"hits": 100}, defer=True)
    assert mf.publish({"hits": 101}, force=True) is True
    time.sleep(0.4)
    assert json.loads(mf.path().read_text()) == {"hits": 101} and len(writers) == 3, writers


def test_a_deferred_publish_never_waits_for_a_write_in_progress(tmp_path, monkeypatch):
    """While the writer thread writes (counters evaluated, JSON, rename: milliseconds on a GPU
    host's disk), the step's deferred publishes return at once — they used to queue on the lock
    the write held (the suspected part of full size's 0.08 ms of publishing a step on an H200).
    Checked by whether a publish returns while a write is held open, not by a timing."""
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    mf = MetricsFile("metrics", min_interval_s=0.0)
    writing, release = threading.Event(), threading.Event()

    def slow_counters():  # evaluated by the write, on the writer thread
        writing.set()
        release.wait(10)
        return {"steps": 1}

    mf.publish(slow_counters, defer=True)
    assert writing.wait(5), "the deferred write never started"
    returned = threading.Event()

    def step() -> None:  # a step's publishes during the write: the pending one and a fresh one
        mf.publish(lambda: {"steps": 2}, defer=True)
        mf.publish(lambda: {"steps": 3}, defer=True)
        returned.set()

    t = threading.Thread(target=step, daemon=True)
    t.start()
    try:
        assert returned.wait(2), "a deferred publish waited for the write in progress"
    finally:
        release.set()
        t.join(5)
    for _ in range(100):  # the step's newer counters land after the slow write
        if mf.path().exists() and json.loads(mf.path().read_text())["steps"] != 1:
            break
        time.sleep(0.02)
    assert json.loads(mf.path().read_text())["steps"] in (2, 3)


def test_deferred_writes_start_no_thread_after_the_first(tmp_path, monkeypatch):
    """Every deferred write after the first is handed to the same writer thread: a step's
    publish never starts a thread (``Thread.start()`` waits for the new thread to run, a GIL
    hand-over that can cost a busy step thread a switch interval). Oracle: threads started
    while 20 deferred writes land one after another, and that each landed."""
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    mf = MetricsFile("metrics", min_interval_s=0.01)

    def landed(n: int) -> bool:
        for _ in range(250):
            if mf.path().exists() and json.loads(mf.path().read_text())["n"] == n:
                return True
            time.sleep(0.01)
        return False

    mf.publish({"n": 0}, defer=True)
    assert landed(0)
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self))[1])
    for n in range(1, 21):
        assert mf.publish({"n": n}, defer=True) is False
        assert landed(n), f"deferred write {n} never landed"
    assert started == [], started


def test_a_forked_child_starts_its_own_writer(tmp_path, monkeypatch):
    """A process forked after the file's writer thread started has no such thread: its first
    deferred write starts its own (else the write would wait for ever). Oracle: the child's own
    file (``metrics-<child pid>.json``) appears; the child's exit code says so."""
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    mf = MetricsFile("metrics", min_interval_s=0.0)
    mf.publish({"n": 0}, defer=True)
    for _ in range(250):
        if mf.path().exists():
            break
        time.sleep(0.01)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 2
        try:
            mf.publish({"n": 1}, defer=True)
            code = 1
            for _ in range(250):
                if (tmp_path / f"metrics-{os.getpid()}.json").exists():
                    code = 0
                    break
                time.sleep(0.01)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's deferred write never landed"


def test_a_pending_write_takes_the_newest_counters(tmp_path, monkeypatch):
    """Snapshots published while a deferred write waits for its interval: the write carries the
    newest (the capped scheduler publishes snapshots of its counters at rare events; an older
    one written last would hide the latest event until the next). Oracle: the file after the
    interval."""
    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    mf = MetricsFile("scheduler", min_interval_s=0.3)
    assert mf.publish({"n": 0}, force=True) is True  # the interval starts now
    for n in (1, 2, 3):
        assert mf.publish({"n": n}, defer=True) is False
    assert json.loads(mf.path().read_text()) == {"n": 0}  # not before the interval
    for _ in range(200):
        if json.loads(mf.path().read_text()) != {"n": 0}:
            break
        time.sleep(0.01)
    time.sleep(0.1)
    assert json.loads(mf.path().read_text()) == {"n": 3}


def test_runner_step_times_written_and_summarised_per_variant(tmp_path, monkeypatch):
    """The runner's host time per step (cache off too) reaches ``runner-<pid>.json`` and the
    benchmark's per-variant summary: ms per call, wall and thread CPU."""
    from benchmarks.prefill import summary as S
    from omni_cache.engine.metrics import RunnerStepTimes

    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    times = RunnerStepTimes("thinker")
    for _ in range(4):
        times.add("execute_model", 0.002, 0.0015)
    times.add("output_builder", 0.003, 0.001)
    times.flush()
    data = json.loads((tmp_path / f"runner-{os.getpid()}.json").read_text())
    assert data["stage"] == "thinker" and data["execute_model"]["calls"] == 4
    rows = [{"variant": "off", "file": "runner-1.json", **data},
            {"variant": "off", "file": "runner-2.json", **{**data, "stage": "talker"}},  # not the thinker's
            {"variant": "omni_cache", "file": "metrics-3.json", "steps": 9}]             # not a runner file
    got = S.step_host_times(rows)
    assert set(got) == {"off"}
    assert got["off"]["execute_model"] == {"calls": 4, "ms_wall": pytest.approx(2.0), "ms_cpu": pytest.approx(1.5)}
    assert got["off"]["output_builder"]["ms_wall"] == pytest.approx(3.0)
    assert "execute_model 2.000 / 1.500 (4 calls)" in S.format_step_host_times(got)
    # omni-cache's own share of a no-hit step (its counter file: wall time only)
    rows.append({"variant": "omni_cache", "file": "metrics-4.json", "steps": 9, "decode_steps": 4,
                 "seconds_save_decode": 0.0008, "fresh_handoffs": 2, "seconds_materialize_fresh": 0.0006})
    got = S.step_host_times(rows)
    assert got["omni_cache"]["save_decode"] == {"calls": 4, "ms_wall": pytest.approx(0.2), "ms_cpu": None}
    assert got["omni_cache"]["handoff_no_hit"]["ms_wall"] == pytest.approx(0.3)
    assert "save_decode 0.200 / " in S.format_step_host_times(got)


def test_the_stage_managers_steps_start_no_thread(tmp_path, monkeypatch):
    """The stage manager's seam calls, step after step, with the counters file on and written
    every few steps: one thread is started, the file's writer, once (a thread started on the
    step's path waits for its GIL hand-over: the per-write timer this replaced cost the full-size
    H200 thinker 0.08 ms a step). Oracle: ``Thread.start`` calls over a prefill and 40 decode
    steps, with the file's interval 0 so that it is written throughout (its content checked)."""
    from benchmarks import step_overhead
    from omni_cache.engine.stage_manager import OmniCacheStageManager

    monkeypatch.setenv("OMNI_CACHE_METRICS_DIR", str(tmp_path))
    monkeypatch.setattr(OmniCacheStageManager, "PUBLISH_INTERVAL_S", 0.0)
    started: list[str] = []
    real_start = threading.Thread.start

    def counting_start(self):
        started.append(self.name)
        return real_start(self)

    step_overhead.decode_step_us(3, 1, handoff="snapshot")  # warm: what the seam imports on first use
    monkeypatch.setattr(threading.Thread, "start", counting_start)
    step_overhead.decode_step_us(3, 40, handoff="snapshot")  # one stage manager: a prefill, 40 decode steps
    assert started == ["omni-cache-metrics-file"], started  # its file's writer thread, once
    files = list(tmp_path.glob("metrics-*.json"))
    assert files and json.loads(files[0].read_text()).get("rows_written", 0) > 0
