"""``omni-cache serve`` without starting a server: the command it runs, and refusals before
any process starts. The running server is tested in tests/pipeline/test_serve.py."""

from __future__ import annotations

import sys

from omni_cache.cli import main
from omni_cache.driver.server import DEFAULT_SERVE_ARGS, OmniServer
from tests.util import CPU_STAGE_CONFIG


def test_command_is_vllm_omni_serve_with_our_registration(tiny_model_dir, tmp_path):
    srv = OmniServer(tiny_model_dir, CPU_STAGE_CONFIG, port=0, log_path=tmp_path / "s.log",
                     extra_args=["--served-model-name", "qwen3-omni"])
    cmd = srv.command()
    assert cmd[1:4] == ["-m", "omni_cache.driver.vllm_serve", str(tiny_model_dir)]
    assert "--omni" in cmd and cmd[cmd.index("--deploy-config") + 1] == str(CPU_STAGE_CONFIG)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and int(cmd[cmd.index("--port") + 1]) == srv.port > 0
    assert cmd[-len(DEFAULT_SERVE_ARGS) - 2:-2] == list(DEFAULT_SERVE_ARGS)
    assert cmd[-2:] == ["--served-model-name", "qwen3-omni"]
    assert srv.base_url == f"http://127.0.0.1:{srv.port}/v1"
    assert not srv.alive() and srv.stop() is None  # never started


def test_serve_refuses_a_bad_stage_config_before_starting(tmp_path, capsys, tiny_model_dir):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - stage_id: 0\n    max_num_seqs: many\n")
    rc = main(["serve", "--stage-config", str(bad), "--model", str(tiny_model_dir), "--log", str(tmp_path / "s.log")])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.yaml" in err and "max_num_seqs" in err
    assert not (tmp_path / "s.log").exists()


def test_a_server_that_exits_is_reported_with_its_log(tiny_model_dir, tmp_path):
    import pytest

    from omni_cache.driver.server import ServeError

    srv = OmniServer(tiny_model_dir, CPU_STAGE_CONFIG, log_path=tmp_path / "s.log",
                     extra_args=["--no-such-option"]).start()
    try:
        with pytest.raises(ServeError, match=r"(?s)exited with code 2.*no-such-option"):
            srv.wait_ready(timeout=600)
    finally:
        srv.stop()


def test_embedded_model_notice_and_kind(tiny_model_dir, tmp_path, capsys):
    """The embedded model says what it is (seeded random weights); a checkpoint directory
    without an embedded builder's stamp is a ``checkpoint`` and gets no notice."""
    from omni_cache.cli import _print_model_notice
    from omni_cache.models import EMBEDDED_MODEL_NOTICE, ModelKind, model_kind

    assert model_kind(tiny_model_dir) is ModelKind.EMBEDDED
    assert model_kind(tmp_path) is ModelKind.CHECKPOINT
    assert model_kind("Qwen/Qwen3-Omni-30B-A3B-Instruct") is ModelKind.CHECKPOINT
    _print_model_notice(tmp_path)
    assert capsys.readouterr().out == ""
    assert main(["make-model", "--out", str(tiny_model_dir)]) == 0  # up to date: no rebuild
    out = capsys.readouterr().out
    assert EMBEDDED_MODEL_NOTICE in out
    assert "no trained weights" in EMBEDDED_MODEL_NOTICE and "--model DIR" in EMBEDDED_MODEL_NOTICE
    assert ModelKind("embedded-untrained") is ModelKind.EMBEDDED  # the value summary.json records


def test_parallel_stage_init_reaches_the_servers_engine(monkeypatch):
    """``OMNI_CACHE_PARALLEL_STAGE_INIT=1`` reaches the ``AsyncOmni`` vLLM-Omni's server builds:
    vLLM-Omni passes it only the explicit keys of its ``TrackingNamespace`` (the real class
    here); the engine builder is a stand-in that records what it would pass."""
    import argparse
    import asyncio
    import contextlib

    from vllm_omni.entrypoints.openai import api_server
    from vllm_omni.utils.tracking_parser import TrackingNamespace

    from omni_cache.driver.vllm_serve import pass_start_kwargs

    seen = []

    @contextlib.asynccontextmanager
    async def builder(args, **kwargs):
        seen.append(args.get_explicit_kwargs_dict())
        yield "engine"

    def build(args):
        async def go():
            async with api_server.build_async_omni(args) as e:
                return e
        return asyncio.run(go())

    monkeypatch.setattr(api_server, "build_async_omni", builder)
    monkeypatch.delenv("OMNI_CACHE_PARALLEL_STAGE_INIT", raising=False)
    assert pass_start_kwargs() == {} and api_server.build_async_omni is builder  # off: untouched
    monkeypatch.setenv("OMNI_CACHE_PARALLEL_STAGE_INIT", "1")
    assert pass_start_kwargs() == {"parallel_stage_init": True}
    args = TrackingNamespace(argparse.Namespace(model="m", port=8000), frozenset({"model"}))
    assert build(args) == "engine"
    assert seen == [{"model": "m", "parallel_stage_init": True}]
    assert pass_start_kwargs() == {"parallel_stage_init": True}  # installed once
    build(TrackingNamespace(argparse.Namespace(model="m"), frozenset({"model"})))
    assert len(seen) == 2


_EARLIER_RUN = "".join(
    f"(APIServer pid=1) INFO 11-26 10:00:0{i} [launcher.py:1] stage-{i} [rep-0] EngineCore running\n" for i in range(3)
) + "(APIServer pid=1) INFO 11-26 10:00:09 [launcher.py:2] earlier run's last line\n"


def test_startup_progress_counts_only_this_starts_lines(tiny_model_dir, tmp_path):
    """Issue 45 item 4: ``omni-cache serve`` appends to its log, so the log of a second start
    holds the first run's "EngineCore running" lines; the progress counter (and the log tail
    of an error) read only what this start wrote. The server is a stand-in that writes one
    stage's line, then waits for the test before exiting."""
    import pytest

    from omni_cache.driver.server import ServeError, _stages_up

    log, go = tmp_path / "serve.log", tmp_path / "go"
    log.write_text(_EARLIER_RUN)
    assert _stages_up(log) == {0, 1, 2} and _stages_up(log, log.stat().st_size) == set()
    script = ("import os, sys, time\n"
              "print('loading this start', flush=True)\n"
              "time.sleep(2.5)\n"
              "print('(APIServer pid=2) INFO 11-26 11:00:00 [launcher.py:1] stage-1 [rep-0] EngineCore running',"
              " flush=True)\n"
              f"t = time.time()\nwhile not os.path.exists({str(go)!r}) and time.time() - t < 60: time.sleep(0.1)\n"
              "sys.exit(3)\n")
    srv = OmniServer(tiny_model_dir, CPU_STAGE_CONFIG, log_path=log)
    srv.command = lambda: [sys.executable, "-c", script]
    seen: list[str] = []

    def progress(msg: str) -> None:
        seen.append(msg)
        if " 1/3 stages up" in msg:
            go.touch()

    srv.start()
    try:
        assert srv.log_start == len(_EARLIER_RUN)
        with pytest.raises(ServeError, match="exited with code 3") as err:
            srv.wait_ready(timeout=120, progress=progress, every_s=0.0)
    finally:
        go.touch()
        srv.stop()
    assert seen and " 0/3 stages up" in seen[0], seen
    assert any(" 1/3 stages up" in m for m in seen), seen
    assert not any(" 2/3 " in m or " 3/3 " in m or "earlier run" in m for m in seen), seen
    assert "loading this start" in str(err.value) and "earlier run" not in str(err.value)
