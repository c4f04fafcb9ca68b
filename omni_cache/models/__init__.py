"""The embedded models ``omni-cache make-model`` builds locally (no downloads).

- :mod:`~omni_cache.models.build`: the one build step every builder shares (size check,
  fingerprint, stamp, up-to-date check), the default model home and :func:`model_kind`;
- :mod:`~omni_cache.models.qwen3`: Qwen3-Omni-MoE at small sizes (seeded weights, the
  byte-level tokenizer with the real special-token ids, the real HF processor);
- :mod:`~omni_cache.models.gemma`: KV-shared (YOCO) thinkers — Gemma-4-style multimodal,
  Gemma-3n-style text — paired with the Qwen3-Omni talker;
- :mod:`~omni_cache.models.full`: the released shapes (Qwen3-Omni-30B-A3B, Gemma-4-E4B as the
  thinker) without weights (``load_format: dummy``).

Builders run in the user's process (CLI, tests, benchmarks); engine code never imports them
(``tests/unit/test_layout.py``): a stage reads what it needs (token ids) from the model's
config. The names below are the entry points; the rest lives in the submodules.
"""

from omni_cache.models.build import EMBEDDED_MODEL_NOTICE, ModelKind, model_kind, models_home
from omni_cache.models.full import build_full, build_gemma4_full
from omni_cache.models.gemma import build_gemma_omni, default_gemma_dir
from omni_cache.models.qwen3 import build_qwen3_omni, default_model_dir

__all__ = [
    "EMBEDDED_MODEL_NOTICE", "ModelKind", "build_full", "build_gemma4_full", "build_gemma_omni",
    "build_qwen3_omni", "default_gemma_dir", "default_model_dir", "model_kind", "models_home",
]
