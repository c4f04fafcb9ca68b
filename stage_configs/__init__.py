"""omni-cache's bundled vLLM-Omni stage configs (deploy YAMLs), shipped as package data.

They live at the repository root (``stage_configs/``) and install as the package
``omni_cache.stage_configs``; :func:`omni_cache.driver.stage_config.bundled_stage_config`
finds one by file name in a checkout and in an installed wheel alike.
"""
