"""Serve Qwen3-Omni with vLLM-Omni's OpenAI-compatible server and omni-cache on the thinker.

The server is vLLM-Omni's (``vllm-omni serve <model> --omni --deploy-config <yaml>``), started
in a child process through :mod:`omni_cache.driver.vllm_serve` (which only registers omni-cache's
pipeline variants first). This module supervises it: validates the stage config, picks the
port, starts the process in its own session, waits for ``GET /health`` to answer 200 while
reporting progress, and stops the whole process group on exit. No HTTP server of our own.

``omni-cache serve`` (``omni_cache.cli``) and ``tests/pipeline/test_serve.py`` /
``benchmarks/serve_load.py`` use :class:`OmniServer`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

#: vLLM serve options always passed: ``usage.prompt_tokens_details.cached_tokens`` in every
#: chat completion (the thinker's prefix-hit tokens), and request-validation errors answered
#: 400 instead of vLLM-Omni 0.30's 500 (:mod:`omni_cache.driver.http_errors`).
DEFAULT_SERVE_ARGS: tuple[str, ...] = (
    "--enable-prompt-tokens-details",
    "--middleware", "omni_cache.driver.http_errors.ValidationErrorStatusMiddleware",
)


class ServeError(RuntimeError):
    """The server did not start (or died). The message carries the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n_bytes: int = 4000, start: int = 0) -> str:
    """The log's last ``n_bytes``, none before byte ``start`` (where this start's lines begin)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(start, size - n_bytes) if start <= size else 0)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


_LOG_PREFIX = re.compile(r"^(\([^)]*\)\s*)?([A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?")


def _last_log_line(path: Path, start: int = 0) -> str:
    """The server log's last line from byte ``start`` on, without vLLM's
    ``(Proc pid=N) LEVEL date [file:line]`` prefix."""
    lines = [ln.strip() for ln in _tail(path, 2000, start).splitlines() if ln.strip()]
    if not lines:
        return ""
    msg = _LOG_PREFIX.sub("", lines[-1])
    return msg[:100] + ("..." if len(msg) > 100 else "")


_STAGE_UP = re.compile(rb"stage-(\d+) \[rep-\d+\] EngineCore running")


def _stages_up(path: Path, start: int = 0) -> set[int]:
    """Stage ids whose engine core vLLM-Omni's API server reported running (progress only),
    counting only the log's lines from byte ``start`` on: a log appended to by several starts
    holds earlier runs' "running" lines, which say nothing about this start's stages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(start if start <= f.tell() else 0)  # truncated since: all of it is this start's
            return {int(m.group(1)) for m in _STAGE_UP.finditer(f.read())}
    except OSError:
        return set()


class OmniServer:
    """vLLM-Omni's OpenAI-compatible server in a child process.

    Args:
        model_dir: model directory or hub id served (e.g. the embedded tiny Qwen3-Omni).
        stage_config: vLLM-Omni deploy YAML; validated with
            :func:`omni_cache.driver.stage_config.load_stage_config` before anything starts.
        host: bind address (default loopback).
        port: TCP port; 0 picks a free one.
        log_path: file receiving the server's stdout + stderr (default:
            ``./omni-cache-serve-<port>.log``).
        extra_args: more ``vllm serve`` arguments, appended after the defaults.
        env: extra environment variables for the server process.
        stage_init_timeout: seconds a stage may take to start (vLLM-Omni's
            ``--stage-init-timeout``); ``--init-timeout`` gets 300 s more.

    Raises:
        omni_cache.driver.stage_config.StageConfigError: invalid stage config or model directory.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        stage_config: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | os.PathLike | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        stage_init_timeout: int = 900,
    ):
        from omni_cache.driver.stage_config import load_stage_config

        local_model = Path(model_dir).exists()
        self.stage_config = load_stage_config(stage_config, model_dir=model_dir if local_model else None)
        self.model = str(model_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else Path(f"omni-cache-serve-{self.port}.log")
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.stage_init_timeout = stage_init_timeout
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self.log_start = 0  # the log's size when start() opened it: this start's lines follow

    # -- addresses -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://host:port`` (``/health``, ``/metrics``, ``/v1/...`` live under it)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url``: ``http://host:port/v1``."""
        return self.url + "/v1"

    @property
    def realtime_url(self) -> str | None:
        """The OpenAI Realtime websocket, ``ws://host:port/v1/realtime?duplex=1``, when the
        stage config sets ``session_mode: duplex`` (vLLM-Omni then serves it next to
        ``/v1/chat/completions``); otherwise None."""
        if self.stage_config.raw.get("session_mode") != "duplex":
            return None
        return f"ws://{self.host}:{self.port}/v1/realtime?duplex=1"

    def command(self) -> list[str]:
        """The server command line (runs vLLM-Omni's ``serve`` after registering omni-cache's
        pipeline variants)."""
        return [
            sys.executable, "-m", "omni_cache.driver.vllm_serve", self.model, "--omni",
            "--deploy-config", str(self.stage_config.path),
            "--host", self.host, "--port", str(self.port),
            "--stage-init-timeout", str(self.stage_init_timeout),
            "--init-timeout", str(self.stage_init_timeout + 300),
            *DEFAULT_SERVE_ARGS, *self.extra_args,
        ]

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> OmniServer:
        """Start the server process (returns at once; see :meth:`wait_ready`)."""
        if self.proc is not None:
            raise ServeError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_LOGGING_COLOR": "0", "PYTHONUNBUFFERED": "1", **self.env}
        self._log = open(self.log_path, "ab")
        self._log.seek(0, os.SEEK_END)
        self.log_start = self._log.tell()  # earlier runs' lines (an appended log) end here
        self._t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,  # own process group: stop() reaches every stage
        )
        return self

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """``GET url+path`` → (status, body); status 0 when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, OSError):
            return 0, b""

    def wait_ready(self, timeout: float = 1200.0, progress: Callable[[str], None] | None = None,
                   every_s: float = 15.0) -> float:
        """Block until ``GET /health`` answers 200.

        Args:
            timeout: seconds to wait in total.
            progress: called with a one-line status (elapsed seconds + the server's last log
                line) about every ``every_s`` seconds.

        Returns:
            Seconds from :meth:`start` to ready.

        Raises:
            ServeError: the process exited or ``timeout`` passed (message: log tail).
        """
        if self.proc is None:
            raise ServeError("server not started")
        last_report = 0.0
        while True:
            elapsed = time.perf_counter() - self._t0
            if self.proc.poll() is not None:
                raise ServeError(f"server exited with code {self.proc.returncode} after {elapsed:.0f} s; "
                                 f"log {self.log_path}:\n{_tail(self.log_path, start=self.log_start)}")
            status, _ = self.get("/health", timeout=3.0)
            if status == 200:
                self.ready_s = elapsed
                return elapsed
            if elapsed > timeout:
                self.stop()
                raise ServeError(f"server not ready after {timeout:.0f} s; log {self.log_path}:\n"
                                 f"{_tail(self.log_path, start=self.log_start)}")
            if progress is not None and elapsed - last_report >= every_s:
                last_report = elapsed
                up = len(_stages_up(self.log_path, self.log_start))
                progress(f"[{elapsed:4.0f} s] starting: {up}/{len(self.stage_config.stage_ids)} stages up"
                         f" | {_last_log_line(self.log_path, self.log_start)}")
            time.sleep(1.0)

    def warm_up_realtime(self, seconds: float = 1.0, timeout: float = 300.0) -> dict | None:
        """One throwaway realtime turn (``seconds`` of the bundled speech, short instructions),
        so the first client's first turn does not pay the stages' first-request costs (about
        4 s of a 4.6 s first turn on this CPU, docs/serving.md); the session is closed for
        good. vLLM-Omni's own ``duplex_session.warmup_frames`` only appends silence and, for
        Qwen3-Omni, asks for no answer, so the talker and code2wav stay cold.

        Returns ``{"first_text_s", "first_audio_s", "wall_s"}``, or None when the stage config
        is not a duplex one.

        Raises:
            ServeError: the turn failed (message: the server's error event or the exception).
        """
        if self.realtime_url is None:
            return None
        import asyncio

        from omni_cache.driver.realtime import RealtimeSession, speech_clip

        async def turn():
            async with RealtimeSession(self.realtime_url, timeout=timeout, instructions="Warm-up.") as s:
                return await s.turn(speech_clip(seconds))

        t0 = time.perf_counter()
        try:
            t = asyncio.run(turn())
        except Exception as exc:  # noqa: BLE001 - reported with the server's log
            raise ServeError(f"realtime warm-up turn failed: {exc!r}; "
                             f"log {self.log_path}:\n{_tail(self.log_path, start=self.log_start)}") from exc
        return {"first_text_s": t.first_text_s, "first_audio_s": t.first_audio_s, "wall_s": time.perf_counter() - t0}

    def model_name(self) -> str:
        """The served model id from ``GET /v1/models``."""
        status, body = self.get("/v1/models")
        if status != 200:
            raise ServeError(f"GET /v1/models answered {status}: {body[:200]!r}")
        return json.loads(body)["data"][0]["id"]

    def alive(self) -> bool:
        """The server process is running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM the server (vLLM-Omni then stops its stage processes), wait, and SIGKILL
        the process group if anything is left. Returns the server's exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # stragglers in the server's own session (stage processes)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        rc = proc.wait()
        self._log.close()
        return rc

    def __enter__(self) -> OmniServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
