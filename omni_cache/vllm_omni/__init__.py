"""Adapter package: the only place in omni-cache that imports vLLM / vLLM-Omni internals.

A version bump of vLLM or vLLM-Omni is fixed here and nowhere else. Modules:

- ``platform_cpu``: the CPU ``OmniPlatform`` (out-of-tree platform plugin, entry-point
  group ``vllm_omni.platform_plugins``).
- ``workers_cpu``: CPU AR / generation workers and model runners for that platform.
"""
