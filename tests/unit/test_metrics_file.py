"""``MetricsFile`` under the threads of one engine process.

The sixth GPU session's full-size thinker died of ``FileNotFoundError`` in ``tmp.replace(path)``:
vLLM-Omni's background output builder and the step thread published at once through one
temporary file, and the second rename found it gone (docs/gpu.md). Counters are best-effort;
they must never take the engine down.
"""

from __future__ import annotations

import json
import threading

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
