"""``benchmarks/lab.py``, engine-free: the shared options, the results folder and its stamp, the
stage-config variants, and ``start`` — which yields the driver's object, passes what it is
given, and stops what it started however the block ends (the driver's classes are replaced by
recorders here; the real starts are the benchmarks' smoke runs, docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import random
import re

import pytest
import yaml

from benchmarks import lab


def test_shared_options_and_their_aliases():
    ap = argparse.ArgumentParser()
    lab.add_options(ap, "x")
    a = ap.parse_args([])
    assert (a.model, a.size, a.stage_config, a.out) == (None, "bench", lab.BASE_CONFIG, None)
    assert ap.parse_args(["--model-size", "tiny"]).size == ap.parse_args(["--size", "tiny"]).size == "tiny"
    with pytest.raises(SystemExit):
        ap.parse_args(["--size", "huge"])
    bare = argparse.ArgumentParser()
    lab.add_options(bare, "x", size="bench-voice", sizes=("bench-voice",), stage_config=None)
    assert not hasattr(bare.parse_args([]), "stage_config") and bare.parse_args([]).size == "bench-voice"


def test_results_dir_and_stamp(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "RESULTS", tmp_path / "results")
    d = lab.results_dir(None, "serve-load")
    assert d.parent == tmp_path / "results" and re.fullmatch(r"serve-load-\d{8}-\d{6}", d.name) and d.is_dir()
    assert lab.results_dir(tmp_path / "given", "x") == (tmp_path / "given").resolve()
    s = lab.stamp("benchmarks.serve_load", ["--rounds", "1"])
    assert s["command"].endswith("-m benchmarks.serve_load --rounds 1")
    assert re.fullmatch(r"[0-9a-f]{40}", s["git"]["commit"]) and isinstance(s["git"]["dirty"], bool)
    assert s["machine"]["cpus"] >= 1 and "torch" in s["versions"] and "date" in s
    path = lab.write_result(d, {**s, "p": tmp_path})
    assert yaml.safe_load(path.read_text())["p"] == str(tmp_path)


def test_variant_configs(tmp_path):
    def stage0(path):
        return next(s for s in yaml.safe_load(path.read_text())["stages"] if s["stage_id"] == 0)

    on, off = (lab.prefix_cache_variant(lab.BASE_CONFIG, tmp_path, v) for v in ("on", "off"))
    assert stage0(on)["enable_prefix_caching"] is True and stage0(off)["enable_prefix_caching"] is False
    assert off.name == "stage_config_off.yaml"
    with pytest.raises(ValueError, match="unknown variant"):
        lab.prefix_cache_variant(lab.BASE_CONFIG, tmp_path, "maybe")
    v = lab.variant_config(lab.BASE_CONFIG, tmp_path, "a+b", stages={0: {"num_replicas": 2}}, env={0: {"X_Y": "1"}})
    assert v.name == "stage_config_a_b.yaml" and stage0(v)["num_replicas"] == 2 and stage0(v)["env"]["X_Y"] == "1"
    with pytest.raises(ValueError, match="no stage 9"):
        lab.variant_config(lab.BASE_CONFIG, tmp_path, "bad", stages={9: {}})


class _Recorder:
    """Stands in for a driver class: records its arguments and whether it was stopped."""

    made: list[_Recorder] = []

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.stopped, self.ready_s, self.proc = args, kwargs, 0, None, None
        _Recorder.made.append(self)

    # the server's surface
    def start(self):
        self.proc = "running"
        return self

    def wait_ready(self, timeout, progress=None):
        self.ready_s = 1.5
        return 1.5

    def stop(self):
        self.stopped += 1
        self.proc = None
        return 0

    # the pipelines' surface
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def test_start_yields_the_drivers_object_and_stops_it(monkeypatch, tmp_path):
    import omni_cache.driver.pipeline as P
    import omni_cache.driver.server as SV
    import omni_cache.driver.streaming as ST

    for mod, name in ((P, "OmniPipeline"), (ST, "StreamingPipeline"), (SV, "OmniServer")):
        monkeypatch.setattr(mod, name, type(name, (_Recorder,), {}))
    _Recorder.made.clear()
    with lab.start("server", "m", "c.yaml", log=tmp_path / "s.log", env={"A": "1"}) as srv:
        assert type(srv).__name__ == "OmniServer" and srv.ready_s == 1.5
        assert srv.kwargs == {"log_path": tmp_path / "s.log", "env": {"A": "1"}} and not srv.stopped
    assert srv.stopped == 1 and srv.exit_code == 0
    with lab.start("server", "m", "c.yaml") as srv:
        srv.stop()  # a benchmark that times its own stop (soak)
    assert srv.stopped == 1 and srv.exit_code is None
    for kind, cls in (("pipeline", "OmniPipeline"), ("streaming", "StreamingPipeline")):
        with pytest.raises(RuntimeError, match="boom"), lab.start(kind, "m", "c.yaml",
                                                                  engine_args={"log_stats": True}) as pipe:
            assert type(pipe).__name__ == cls and pipe.kwargs == {"engine_args": {"log_stats": True}}
            raise RuntimeError("boom")
        assert pipe.stopped == 1  # stopped although the block raised
    n = len(_Recorder.made)
    with pytest.raises(ValueError, match="unknown kind"), lab.start("cluster", "m", "c.yaml"):
        pass
    with pytest.raises(ValueError, match="server's"), lab.start("streaming", "m", "c.yaml", env={"A": "1"}):
        pass
    assert len(_Recorder.made) == n  # refused before anything was constructed


def test_random_text_has_about_the_tokens_asked_for():
    class Tok:
        def encode(self, text):
            return text.split()

    text = lab.random_text(random.Random(0), 25, Tok())
    assert 25 <= len(text.split()) < 35 and set(text.replace(".", "").lower().split()) <= set(lab.WORDS)
    assert text == lab.random_text(random.Random(0), 25, Tok())  # seeded


def test_variant_worker_wraps_the_drivers_pipeline(monkeypatch):
    """The prefill worker starts its pipeline through the lab (streaming, or the synchronous
    pipeline with ``stream=False``) with vLLM's stats on — the per-request prefill time is read
    from vLLM's histograms, which exist only with ``log_stats`` — reports the talker's hit only
    where its identity hook is wanted, and stops the pipeline on close."""
    import contextlib
    from types import SimpleNamespace as NS

    from benchmarks.prefill import worker as W

    calls, closed = [], []

    @contextlib.contextmanager
    def start(kind, model, config, **kw):
        calls.append((kind, model, config, kw))
        try:
            yield NS(stage_config=NS(thinker_family="gemma4", raw={}), hooks="HOOKS", start_s=2.5, omni="ENGINE")
        finally:
            closed.append(kind)

    monkeypatch.setattr(lab, "start", start)
    for stream, wanted in ((True, True), (False, False)):
        monkeypatch.setattr("omni_cache.driver.engine_hooks.hooks_wanted", lambda cfg, w=wanted: w)
        w = W.VariantWorker("model-dir", "cfg.yaml", stream=stream)
        assert calls[-1] == ("streaming" if stream else "pipeline", "model-dir", "cfg.yaml",
                             {"engine_args": {"log_stats": True}})
        assert (w.family, w.start_s, w.omni, w.hooks) == ("gemma4", 2.5, "ENGINE", "HOOKS" if wanted else None)
        assert len(closed) == len(calls) - 1  # running until closed
        w.close()
        assert len(closed) == len(calls)


def test_thinker_block_size_from_the_stage_config_and_checked_against_the_hit_audit(tmp_path):
    # the CPU configs set 32; the GPU configs set none and run with vLLM's default, 16 — the
    # realtime oracle assumed 32 on the first full-size run and paired rows 16-32 of every
    # served block 0 with another session's writer (210 false violations, 2 x H100)
    gpu = lab.REPO / "stage_configs" / "qwen3_omni_30b_a3b_2xh100_dummy_duplex.yaml"
    assert lab.thinker_block_size(None) == lab.thinker_block_size(lab.BASE_CONFIG) == 32
    assert lab.thinker_block_size(gpu) == 16
    audit = tmp_path / "audit"
    audit.mkdir()
    line = {"request": "duplex-s.x.e.0.r.stage0-turn1", "hit_tokens": 224, "writers": ["w"] * 14}
    (audit / "hits-1.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({**line, "hit_tokens": 0, "writers": []}))
    assert lab.thinker_block_size(gpu, tmp_path) == 16
    with pytest.raises(ValueError, match=r"stage0-turn1 was served 224 tokens from 14 blocks, not blocks of 32"):
        lab.thinker_block_size(lab.BASE_CONFIG, tmp_path)


def test_git_names_the_commit_a_gpu_session_gives(monkeypatch):
    """On a GPU host the tree's git metadata is stale: ``BENCH_COMMIT`` (set by
    ``scripts/gpu_session.sh``) names the result's commit instead; unset, HEAD is read."""
    from benchmarks import lab

    monkeypatch.setenv("BENCH_COMMIT", "9616e9c")
    assert lab.git() == {"commit": "9616e9c", "dirty": None, "from": "BENCH_COMMIT"}
    monkeypatch.delenv("BENCH_COMMIT")
    assert lab.git()["commit"] != "9616e9c" and "from" not in lab.git()
