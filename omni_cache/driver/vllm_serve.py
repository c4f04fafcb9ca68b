"""vLLM-Omni's own OpenAI-compatible server, with omni-cache's pipeline variants registered.

``python -m omni_cache.driver.vllm_serve <model> --omni --deploy-config <yaml> [vllm serve args]``
is ``vllm-omni serve <model> --omni ...`` (vLLM-Omni's console script,
``vllm_omni.entrypoints.cli.main:main``) run in this process after
:func:`omni_cache.engine.plugin.register`.

Why not the plain ``vllm-omni serve`` command: vLLM-Omni 0.30 resolves the deploy YAML's
``pipeline:`` name in the API-server process (``_should_serve_duplex`` →
``StageConfigFactory.get_pipeline_config``) before anything loads the
``vllm_omni.general_plugins`` entry points, so ``pipeline: qwen3_omni_moe_omni_cache`` fails
there with ``KeyError: "Pipeline 'qwen3_omni_moe_omni_cache' from deploy config is not
registered to OMNI_PIPELINES"``. Registering the variants first is all this module adds; the
stage processes load the entry point themselves. No vLLM / vLLM-Omni file is edited.

With ``OMNI_CACHE_ROUTING: prefix`` on the thinker of the ``--deploy-config`` (and more than
one thinker replica), the server's engine gets omni-cache's prefix-aware router
(docs/routing.md): :func:`hook_the_servers_engine` wraps vLLM-Omni's
``build_async_omni`` (``vllm_omni/entrypoints/openai/api_server.py``, the context manager
that builds the server's ``AsyncOmni`` and yields it to the server worker) in this process so
the router is installed on the ``AsyncOmni`` before the server takes requests; the same
wrapper installs talker content identity (:mod:`omni_cache.driver.talker_identity`) when the
talker's prefix caching is on. With
``--api-server-count`` > 1 vLLM-Omni runs its API servers in processes of its own, which do
not get it (a warning says so). :func:`pass_start_kwargs` wraps the same function to start the
engine with omni-cache's start-up settings (``OMNI_CACHE_PARALLEL_STAGE_INIT``).

:func:`sweep_request_segments` wraps the same function to give the engine omni-cache's
shared-memory sweeper (:mod:`omni_cache.driver.shm_sweeper`: hand-offs a stage never read are
unlinked when their request ends). :func:`stop_distributed_stages` wraps it once more so a
server in vLLM-Omni's distributed mode stops its stages when it stops
(:mod:`omni_cache.driver.distributed_stop`).

Stage processes are started with ``spawn`` and re-import ``__main__``: the server only starts
under the ``if __name__ == "__main__"`` guard below.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def _arg_value(argv: Sequence[str], flag: str) -> str | None:
    """``--flag value`` or ``--flag=value`` in ``argv`` (the last one wins), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def hook_the_servers_engine(argv: Sequence[str]) -> bool:
    """Arrange for the server's ``AsyncOmni`` to get omni-cache's engine hooks
    (:func:`omni_cache.driver.engine_hooks.install_engine_hooks`) when the
    ``--deploy-config`` asks for one (``OMNI_CACHE_ROUTING: prefix`` on stage 0, or
    ``enable_prefix_caching`` on the talker).

    Returns:
        True if the hook was installed (the router itself is installed when the server
        builds its engine, and only for more than one thinker replica; talker identity when
        the talker's prefix caching is on).

    Raises:
        omni_cache.driver.stage_config.StageConfigError: the deploy config is invalid.
    """
    path = _arg_value(argv, "--deploy-config")
    if path is None:
        return False
    from omni_cache.driver.engine_hooks import hooks_wanted, install_engine_hooks
    from omni_cache.driver.stage_config import load_stage_config

    cfg = load_stage_config(path)
    if not hooks_wanted(cfg):
        return False
    count = _arg_value(argv, "--api-server-count")
    if count is not None and int(count) > 1:
        logger.warning("--api-server-count %s: vLLM-Omni runs its API servers in processes of "
                       "their own, which route the thinker with vLLM-Omni's policy, not "
                       "omni-cache's prefix routing or talker identity (its talker then "
                       "shares no block)", count)
    _on_engine_built("_omni_cache_routing", lambda engine_client: install_engine_hooks(engine_client, cfg))
    return True


def _on_engine_built(marker: str, install) -> None:
    """Wrap vLLM-Omni's ``api_server.build_async_omni`` so ``install(engine_client)`` runs on
    the engine client it builds, before the server uses it; ``marker`` (an attribute set on the
    wrapper) keeps a second call from wrapping twice."""
    from vllm_omni.entrypoints.openai import api_server

    original = api_server.build_async_omni
    if getattr(original, marker, False):
        return

    @contextlib.asynccontextmanager
    async def build_async_omni(*args, **kwargs):
        async with original(*args, **kwargs) as engine_client:
            install(engine_client)
            yield engine_client

    setattr(build_async_omni, marker, True)
    api_server.build_async_omni = build_async_omni


def pass_start_kwargs() -> dict:
    """Give the server's ``AsyncOmni`` omni-cache's start-up keyword arguments
    (:func:`omni_cache.driver.pipeline.start_kwargs`: ``parallel_stage_init=True`` with
    ``OMNI_CACHE_PARALLEL_STAGE_INIT=1``), as ``omni-cache run`` does.

    vLLM-Omni 0.30's ``serve`` has no flag for ``parallel_stage_init`` (an ``OrchestratorArgs``
    field that ``AsyncOmni`` accepts): its ``build_async_omni_from_stage_config``
    (``vllm_omni/entrypoints/openai/api_server.py``) passes ``AsyncOmni`` the parsed arguments'
    *explicit* keys only (``TrackingNamespace.get_explicit_kwargs_dict``). The wrapper of
    ``api_server.build_async_omni`` installed here sets each argument and marks it explicit
    before the engine is built. Returns the keyword arguments passed ({}: nothing installed).
    """
    from omni_cache.driver.pipeline import start_kwargs

    extra = start_kwargs()
    if not extra:
        return {}
    from vllm_omni.entrypoints.openai import api_server

    original = api_server.build_async_omni
    if getattr(original, "_omni_cache_start_kwargs", False):
        return extra

    @contextlib.asynccontextmanager
    async def build_async_omni(args, *rest, **kwargs):
        for k, v in extra.items():
            setattr(args, k, v)
        if hasattr(args, "explicit_keys"):  # vLLM-Omni's TrackingNamespace
            object.__setattr__(args, "explicit_keys", frozenset(args.explicit_keys) | set(extra))
        async with original(args, *rest, **kwargs) as engine_client:
            yield engine_client

    build_async_omni._omni_cache_start_kwargs = True
    api_server.build_async_omni = build_async_omni
    logger.info("omni-cache: the server's engine starts with %s", extra)
    return extra


def sweep_request_segments() -> bool:
    """Give the server's engine omni-cache's shared-memory sweeper
    (:func:`omni_cache.driver.shm_sweeper.install_shm_sweeper`: a request's unread hand-off
    segments and lock files are unlinked a few seconds after its stream ends), through the same
    ``api_server.build_async_omni`` wrapper as the other hooks. Returns True once installed."""
    from omni_cache.driver.shm_sweeper import install_shm_sweeper

    _on_engine_built("_omni_cache_shm_sweeper", install_shm_sweeper)
    return True


def stop_distributed_stages() -> bool:
    """In vLLM-Omni's distributed mode (``--stage-id``), let the server's engine stop its
    stages when the server stops: through the same ``api_server.build_async_omni`` wrapper, the
    engine client's ``shutdown`` (which vLLM's launcher calls on SIGTERM / Ctrl-C) first
    releases the orchestrator's membership watcher
    (:func:`omni_cache.driver.distributed_stop.release_before_shutdown`; nothing happens on an
    engine without distributed mode). Returns True once installed."""
    from omni_cache.driver.distributed_stop import release_before_shutdown

    _on_engine_built("_omni_cache_distributed_stop", release_before_shutdown)
    return True


def run_vllm_omni_serve(argv: list[str]) -> None:
    """Run vLLM-Omni's ``serve`` subcommand with ``argv`` (everything after ``vllm serve``;
    ``--omni`` is added when missing) in this process. Blocks until the server stops.

    Raises:
        SystemExit: from vLLM-Omni's argument parser on bad arguments.
    """
    from omni_cache.engine.plugin import register

    register()
    from omni_cache.driver.engine_hooks import prepare_environment

    prepare_environment()  # before the server starts its engine: the stage processes inherit it
    args = list(argv)
    if "--omni" not in args:
        args.append("--omni")
    hook_the_servers_engine(args)
    pass_start_kwargs()
    sweep_request_segments()
    stop_distributed_stages()
    os.environ.setdefault("VLLM_LOGGING_COLOR", "0")  # vLLM-Omni forces colour unless told

    from vllm_omni.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *args]
    main()


if __name__ == "__main__":
    run_vllm_omni_serve(sys.argv[1:])
