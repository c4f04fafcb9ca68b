"""Embedded KV-shared (YOCO) thinker: a small Gemma-3n-style text model, built locally.

``build_gemma3n_thinker(out_dir, size)`` writes a model directory that vLLM loads as
``Gemma3nForCausalLM`` (``load_format: auto``): ``config.json`` (transformers'
``Gemma3nTextConfig``), seeded-random ``model.safetensors`` (transformers' own init,
``initializer_range`` 0.02 — realistic variance, see ``omni_cache/models.py``) and the
embedded Qwen3-Omni byte-level tokenizer (:func:`omni_cache.models.build_tokenizer`), so
token ids — chat markers, the talker's role words and TTS special tokens — are the ids the
Qwen3-Omni talker expects. The vocabulary is Qwen3-Omni's (152064 ids).

Layer layout (YOCO): ``num_hidden_layers`` layers, the last ``num_kv_shared_layers`` of
them KV-shared (cross-decoder). Layer types repeat ``3 sliding : 1 full``; the self-decoder
ends with ``sliding, full`` so vLLM's KV-sharing targets exist (a shared sliding layer reads
layer ``F-2``'s KV, a shared full layer layer ``F-1``'s, ``F`` = first KV-shared layer).

``build_gemma_omni(out_dir, size)`` builds the whole pipeline directory: the embedded
Qwen3-Omni (talker + code2wav; its own thinker weights are unused) with this thinker in
``thinker/`` (stage 0 loads it through ``model_subdir``). The thinker's hidden size equals
the Qwen3-Omni thinker's so the Qwen3-Omni talker consumes its captured layers unchanged.

Sizes:

- ``tiny`` (tests): hidden 64, 8 layers (4 KV-shared = 50 %), head_dim 32, window 64.
- ``bench`` (benchmarks): hidden = the bench Qwen3-Omni thinker's (768 today), 16 layers
  (8 KV-shared = 50 %), heads of 64, window 512 — prefill of a few thousand tokens
  dominates on 2 CPU cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path


from omni_cache.models import SEED, THINKER_VOCAB, build_qwen3_omni, build_tokenizer, is_up_to_date

GEMMA_FORMAT_VERSION = 1
THINKER_SUBDIR = "thinker"


@dataclass(frozen=True)
class GemmaSize:
    """Widths of the embedded KV-shared thinker (tokens / channels, not bytes)."""

    name: str
    hidden: int
    layers: int
    kv_shared_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    sliding_window: int
    per_layer_hidden: int
    laurel_rank: int
    qwen_size: str  # the Qwen3-Omni size whose talker consumes this thinker


def _bench_size() -> GemmaSize:
    # The talker consumes the thinker's hidden states: follow the bench Qwen3-Omni's width.
    from omni_cache.models import SIZES

    h = SIZES["bench"].thinker_hidden
    return GemmaSize("bench", h, 16, 8, h // 64, 2, 64, 2 * h, 512, 32, 32, "bench")


GEMMA_SIZES: dict[str, GemmaSize] = {
    "tiny": GemmaSize("tiny", 64, 8, 4, 2, 1, 32, 128, 64, 16, 16, "tiny"),
    "bench": _bench_size(),
}


def _layer_types(n: int) -> list[str]:
    return ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(n)]


def gemma3n_config_dict(size: GemmaSize) -> dict:
    """``Gemma3nTextConfig`` keyword arguments for ``size`` (plain dict, JSON-able).

    Raises:
        ValueError: the self-decoder does not end with ``sliding, full`` layers (vLLM's
            KV-sharing targets would not exist).
    """
    types = _layer_types(size.layers)
    first_shared = size.layers - size.kv_shared_layers
    if types[first_shared - 1] != "full_attention" or types[first_shared - 2] != "sliding_attention":
        raise ValueError(f"{size.name}: layers {first_shared - 2}, {first_shared - 1} must be sliding, full")
    return {
        "architectures": ["Gemma3nForCausalLM"],
        "vocab_size": THINKER_VOCAB,
        "vocab_size_per_layer_input": THINKER_VOCAB,
        "hidden_size": size.hidden,
        "hidden_size_per_layer_input": size.per_layer_hidden,
        "intermediate_size": [size.intermediate] * size.layers,
        "num_hidden_layers": size.layers,
        "num_kv_shared_layers": size.kv_shared_layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.head_dim,
        "layer_types": types,
        "sliding_window": size.sliding_window,
        "laurel_rank": size.laurel_rank,
        "activation_sparsity_pattern": [0.0] * size.layers,
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        # Qwen3-Omni special-token ids (the shared tokenizer)
        "pad_token_id": 151643,
        "eos_token_id": 151645,
        "bos_token_id": 151644,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    }


def gemma_fingerprint(size: str) -> str:
    """A short digest of everything that determines the built thinker (and, for the pipeline
    directory, the Qwen3-Omni it is paired with)."""
    from omni_cache.models import model_fingerprint

    payload = json.dumps({"cfg": gemma3n_config_dict(GEMMA_SIZES[size]), "seed": SEED,
                          "v": GEMMA_FORMAT_VERSION,
                          "qwen": model_fingerprint(GEMMA_SIZES[size].qwen_size)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_gemma3n_thinker(out_dir: str | os.PathLike, size: str = "tiny", *, force: bool = False) -> Path:
    """Build the KV-shared thinker directory (config, seeded weights, tokenizer).

    Returns:
        The model directory.

    Raises:
        KeyError: unknown ``size``.
    """
    import torch
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    if size not in GEMMA_SIZES:
        raise KeyError(f"unknown gemma thinker size {size!r}; choose one of {sorted(GEMMA_SIZES)}")
    out = Path(out_dir)
    stamp = out / "omni_cache_model.json"
    fp = gemma_fingerprint(size)
    if not force and is_up_to_date(stamp, fp):
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = Gemma3nTextConfig(**gemma3n_config_dict(GEMMA_SIZES[size]))
    torch.manual_seed(SEED)
    with torch.device("cpu"):
        model = Gemma3nForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    del model
    build_tokenizer(out).save_pretrained(out)
    stamp.write_text(json.dumps({"family": "gemma3n", "size": size, "seed": SEED, "fingerprint": fp,
                                 "widths": asdict(GEMMA_SIZES[size])}, indent=2))
    return out


def build_gemma_omni(out_dir: str | os.PathLike, size: str = "tiny", *, force: bool = False) -> Path:
    """Build the pipeline directory: the embedded Qwen3-Omni of the matching size (talker,
    code2wav, tokenizer, processor files) with the KV-shared thinker in ``thinker/``.

    Returns:
        The pipeline model directory.
    """
    out = Path(out_dir)
    spec = GEMMA_SIZES[size]
    stamp = out / "omni_cache_gemma_omni.json"
    fp = gemma_fingerprint(size)
    if not force and is_up_to_date(stamp, fp) and (out / "config.json").exists():
        return out
    from omni_cache.models import default_model_dir

    qwen = build_qwen3_omni(default_model_dir(spec.qwen_size), spec.qwen_size)
    out.mkdir(parents=True, exist_ok=True)
    for f in qwen.iterdir():
        if f.is_file():
            dst = out / f.name
            if dst.exists() or dst.is_symlink():
                dst.unlink()
            if f.suffix == ".safetensors":
                os.symlink(f.resolve(), dst)  # large; read-only use
            else:
                shutil.copy2(f, dst)
    build_gemma3n_thinker(out / THINKER_SUBDIR, size, force=force)
    stamp.write_text(json.dumps({"family": "gemma3n", "size": size, "fingerprint": fp}, indent=2))
    return out


def default_gemma_dir(size: str = "tiny", *, omni: bool = True) -> Path:
    """``$OMNI_CACHE_HOME/models/gemma3n-omni-<size>`` (pipeline directory) or
    ``.../gemma3n-thinker-<size>`` (thinker only)."""
    from omni_cache.models import models_home

    return models_home() / (f"gemma3n-omni-{size}" if omni else f"gemma3n-thinker-{size}")
