"""Code that runs in the user's process: it starts and talks to vLLM-Omni pipelines and
servers (one half of the adapter to vLLM / vLLM-Omni; the other half is
:mod:`omni_cache.engine`, whose code runs inside the stage processes).

- ``stage_config``: stage-config (deploy YAML) loading and validation; ``schema``: the
  deploy schema read from vLLM-Omni; ``variants``: derived stage configs.
- ``pipeline``: a running in-process pipeline (``vllm_omni.Omni``) and request results.
- ``inputs``: requests (text, image, audio, chat turns) and bundled media.
- ``server``: supervises ``vllm-omni serve``; ``vllm_serve``: that server's entry (runs in the
  API-server process); ``http_errors``: its ASGI middleware.
"""
