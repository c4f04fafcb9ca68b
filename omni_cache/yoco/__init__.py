"""YOCO (KV-shared) thinkers: which layers are exact under KV-sharing fast prefill.

No vLLM imports here (like :mod:`omni_cache.core`); engine glue lives in
:mod:`omni_cache.engine`. See docs/yoco.md.
"""

from omni_cache.yoco.plan import (
    ACCEPT_LAYER_ENV,
    CAPTURE_LAYERS_ENV,
    FINAL,
    LayerPlan,
    YocoConfigError,
    parse_accept_layer,
    parse_capture_layers,
    stage_plan,
)

__all__ = ["ACCEPT_LAYER_ENV", "CAPTURE_LAYERS_ENV", "FINAL", "LayerPlan", "YocoConfigError",
           "parse_accept_layer", "parse_capture_layers", "stage_plan"]
