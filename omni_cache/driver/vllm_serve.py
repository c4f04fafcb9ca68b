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
stage processes load the entry point themselves. Nothing of vLLM / vLLM-Omni is patched.

Stage processes are started with ``spawn`` and re-import ``__main__``: the server only starts
under the ``if __name__ == "__main__"`` guard below.
"""

from __future__ import annotations

import os
import sys


def run_vllm_omni_serve(argv: list[str]) -> None:
    """Run vLLM-Omni's ``serve`` subcommand with ``argv`` (everything after ``vllm serve``;
    ``--omni`` is added when missing) in this process. Blocks until the server stops.

    Raises:
        SystemExit: from vLLM-Omni's argument parser on bad arguments.
    """
    from omni_cache.engine.plugin import register

    register()
    args = list(argv)
    if "--omni" not in args:
        args.append("--omni")
    os.environ.setdefault("VLLM_LOGGING_COLOR", "0")  # vLLM-Omni forces colour unless told

    from vllm_omni.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *args]
    main()


if __name__ == "__main__":
    run_vllm_omni_serve(sys.argv[1:])
