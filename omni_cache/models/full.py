"""Qwen3-Omni at its released size, without weights: ``omni-cache make-model --size full``.

The model directory holds the published ``config.json`` shape of
**Qwen/Qwen3-Omni-30B-A3B-Instruct** (:data:`FULL_CONFIG`) and the embedded tokenizer and
processor files (:func:`omni_cache.models.qwen3.build_tokenizer`: the real special-token ids, the
152,064-token thinker vocabulary), and no weights: the stage configs load it with vLLM's
``load_format: dummy``, which builds the real architecture from the config alone — so
timings are the released model's, and its text and audio are noise.

Source of every number in :data:`FULL_CONFIG`: the released ``config.json`` of
``Qwen/Qwen3-Omni-30B-A3B-Instruct`` (Hugging Face), as parsed by transformers 5.7 in a public
model-information dump of that checkpoint (read through this project's code-search index,
2026-11-26); it agrees with ``../shared/notes/gpu.md`` (thinker 48 layers, hidden 2048,
32 / 4 heads, head_dim 128, 128 experts / 8 active, MoE intermediate 768, vocabulary 152,064,
``mrope_section`` [24, 20, 20], ``accept_hidden_layer`` 24). Thinker ≈ 30.5 B parameters
(≈ 61 GB in bf16): one H200 holds the three stages; one H100 does not with room for KV.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from omni_cache.models.build import build_once, fingerprint
from omni_cache.models.gemma import GEMMA4_TOWERS, THINKER_SUBDIR, gemma4_config_dict, save_gemma4_processor
from omni_cache.models.qwen3 import build_processor, build_tokenizer

#: the fingerprint of this builder's output (bump when the written files change)
FULL_FORMAT_VERSION = 1

_ROPE_TEXT = {"interleaved": True, "mrope_interleaved": True, "mrope_section": [24, 20, 20],
              "rope_theta": 1000000, "rope_type": "default"}

#: Qwen3-Omni-30B-A3B-Instruct's configuration (see the module docstring for its source);
#: the keys transformers fills with defaults are left out.
FULL_CONFIG: dict = {
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
    "model_type": "qwen3_omni_moe",
    "dtype": "bfloat16",
    "enable_audio_output": True,
    "im_start_token_id": 151644, "im_end_token_id": 151645,
    "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
    "system_token_id": 8948, "user_token_id": 872, "assistant_token_id": 77091,
    "thinker_config": {
        "model_type": "qwen3_omni_moe_thinker",
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "audio_start_token_id": 151669, "audio_end_token_id": 151670,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "user_token_id": 872, "position_id_per_seconds": 13, "seconds_per_chunk": 2,
        "initializer_range": 0.02,
        "audio_config": {
            "num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120, "d_model": 1280, "output_dim": 2048, "downsample_hidden_size": 480,
            "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500, "max_source_positions": 1500,
            "activation_function": "gelu", "scale_embedding": False,
        },
        "vision_config": {
            "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
            "hidden_act": "gelu_pytorch_tanh", "patch_size": 16, "spatial_patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "out_hidden_size": 2048,
            "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24], "image_size": 768,
            "apply_vit_abs_pos_embed": True, "tokens_per_second": 2,
        },
        "text_config": {
            "vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
            "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "shared_expert_intermediate_size": 0, "use_qk_norm": True, "rms_norm_eps": 1e-06,
            "max_position_embeddings": 65536, "rope_parameters": dict(_ROPE_TEXT),
            "tie_word_embeddings": False,
        },
    },
    "talker_config": {
        "accept_hidden_layer": 24, "thinker_hidden_size": 2048, "num_code_groups": 16,
        "spatial_merge_size": 2, "position_id_per_seconds": 13, "seconds_per_chunk": 2,
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "audio_start_token_id": 151669, "audio_end_token_id": 151670, "vision_start_token_id": 151652,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "text_config": {
            "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
            "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 6, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "rms_norm_eps": 1e-06, "max_position_embeddings": 65536,
            "rope_parameters": {"interleaved": True, "mrope_section": [24, 20, 20], "rope_theta": 1000000,
                                "rope_type": "default"},
        },
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
            "rms_norm_eps": 1e-06, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        },
    },
    "code2wav_config": {
        "codebook_size": 2048, "codebook_dim": 512, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "num_quantizers": 16,
        "num_semantic_quantizers": 1, "semantic_codebook_size": 4096, "sliding_window": 72,
        "decoder_dim": 1536, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
        "vector_quantization_hidden_dimension": 512, "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000, "rope_type": "default"},
    },
}


def full_config(thinker_layers: int | None = None) -> dict:
    """:data:`FULL_CONFIG`, or with ``thinker_layers`` (< 48) the same widths and fewer thinker
    layers — the profiling shape that fits one 80 GB card beside its talker (the issue's
    "12 of 48"): the talker's ``accept_hidden_layer`` becomes ``thinker_layers // 2`` (the
    released model takes layer 24 of 48, its middle), so the captured layers stay layer 0 and
    the middle one.

    Raises:
        ValueError: ``thinker_layers`` outside ``[2, 48]``.
    """
    cfg = copy.deepcopy(FULL_CONFIG)
    if thinker_layers is None or thinker_layers == 48:
        return cfg
    if not 2 <= thinker_layers <= 48:
        raise ValueError(f"--thinker-layers {thinker_layers}: Qwen3-Omni-30B-A3B's thinker has 48; give 2..48")
    cfg["thinker_config"]["text_config"]["num_hidden_layers"] = thinker_layers
    cfg["talker_config"]["accept_hidden_layer"] = thinker_layers // 2
    return cfg


def full_fingerprint(thinker_layers: int | None = None) -> str:
    """Digest of what :func:`build_full` writes (config + format version)."""
    return fingerprint({"cfg": full_config(thinker_layers), "v": FULL_FORMAT_VERSION})


def build_full(out_dir: str | os.PathLike, *, force: bool = False, thinker_layers: int | None = None) -> Path:
    """Write the full-size model directory: ``config.json`` (:data:`FULL_CONFIG`, or
    :func:`full_config` with ``thinker_layers``; checked by constructing transformers'
    ``Qwen3OmniMoeConfig`` from it), the tokenizer and processor files, and the build stamp —
    no weights (load it with ``load_format: dummy``).

    Returns:
        The model directory (``out_dir``).

    Raises:
        ValueError: ``thinker_layers`` outside ``[2, 48]``.
    """
    cfg = full_config(thinker_layers)
    layers = cfg["thinker_config"]["text_config"]["num_hidden_layers"]

    def write(out: Path) -> dict:
        _write_qwen3_omni_dir(out, cfg)
        return {"size": "full", "weights": "none (load_format: dummy)",
                "source": "Qwen/Qwen3-Omni-30B-A3B-Instruct config.json"
                          + ("" if layers == 48 else f", thinker cut to {layers} of 48 layers"),
                "thinker_layers": layers}

    return build_once(out_dir, full_fingerprint(thinker_layers), write, force=force)


def _write_qwen3_omni_dir(out: Path, config: dict):
    """``config.json`` (``config``, checked by constructing transformers' ``Qwen3OmniMoeConfig``
    first: raises if malformed) with the embedded tokenizer and processor files into ``out``.
    Returns the tokenizer."""
    from transformers import Qwen3OmniMoeConfig

    Qwen3OmniMoeConfig(**{k: v for k, v in config.items() if k != "model_type"})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = build_tokenizer(out)
    build_processor(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return tokenizer


# ---- Gemma-4-E4B as the YOCO thinker, at its released size (issue 38, item 5) -----------------

#: Gemma-4-E4B's text model: 42 layers, the last 18 KV-shared (the cross-decoder; first shared
#: layer 24), hidden 2560, 8 / 2 heads of 256 (full-attention layers 512), layer types
#: ``[sliding] * 5 + [full]`` repeated 7 times, window 512, per-layer inputs of 256, vocabulary
#: 262,144, final logit soft-cap 30. Source: the ``text_config`` of the released
#: ``google/gemma-4-E4B-it`` ``config.json`` as mirrored in several public repositories' model
#: tables and tests (read through this project's code-search index, 2026-11-26; they agree with
#: each other and with ``../shared/notes/production.md``: E4B 42 layers / 18 KV-shared).
#: RoPE (sliding: default, theta 1e4; full: proportional, partial rotary 0.25, theta 1e6) is
#: transformers' ``Gemma4TextConfig`` default, which is that release's.
GEMMA4_E4B_TEXT: dict = {
    "hidden_size": 2560, "num_hidden_layers": 42, "num_kv_shared_layers": 18, "intermediate_size": 10240,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
    "vocab_size": 262144, "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
    "sliding_window": 512, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
    "final_logit_softcapping": 30.0, "max_position_embeddings": 131072, "use_double_wide_mlp": False,
    "attention_k_eq_v": False, "enable_moe_block": False, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
}
#: the E4B thinker's hidden size: the width of the rows the talker consumes
GEMMA4_E4B_HIDDEN = GEMMA4_E4B_TEXT["hidden_size"]


def gemma4_e4b_config() -> dict:
    """``Gemma4Config`` keyword arguments of the at-size YOCO thinker: :data:`GEMMA4_E4B_TEXT`
    with the embedded tokenizer's special-token ids; the vision and audio towers and the media
    token ids of the ``bench`` Gemma-4 thinker (:func:`omni_cache.models.gemma.gemma4_config_dict`)
    — the towers are *not* E4B's (its benchmark, YOCO at size, sends text; say so beside any
    media timing)."""
    cfg = gemma4_config_dict("bench")
    text = {**GEMMA4_E4B_TEXT, "layer_types": list(GEMMA4_E4B_TEXT["layer_types"]),
            **{k: cfg["text_config"][k] for k in ("pad_token_id", "eos_token_id", "bos_token_id")}}
    return {**cfg, "text_config": text}


def gemma4_e4b_pipeline_config() -> dict:
    """The pipeline directory's ``config.json``: :data:`FULL_CONFIG` (Qwen3-Omni-30B-A3B's
    talker and code2wav) with the talker reading 2,560-wide thinker rows
    (``thinker_hidden_size``; its ``accept_hidden_layer`` 24 = E4B's self-decoder output, the
    first KV-shared layer's input) and the unused Qwen3-Omni thinker entry widened to match."""
    cfg = copy.deepcopy(FULL_CONFIG)
    th = cfg["thinker_config"]
    th["text_config"]["hidden_size"] = GEMMA4_E4B_HIDDEN
    th["vision_config"]["out_hidden_size"] = th["audio_config"]["output_dim"] = GEMMA4_E4B_HIDDEN
    cfg["talker_config"]["thinker_hidden_size"] = GEMMA4_E4B_HIDDEN
    return cfg


def gemma4_full_fingerprint() -> str:
    """Digest of what :func:`build_gemma4_full` writes."""
    return fingerprint({"thinker": gemma4_e4b_config(), "pipeline": gemma4_e4b_pipeline_config(),
                        "v": FULL_FORMAT_VERSION})


def build_gemma4_full(out_dir: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the at-size YOCO pipeline directory, no weights (``load_format: dummy``):
    ``config.json`` (:func:`gemma4_e4b_pipeline_config`, checked by ``Qwen3OmniMoeConfig``) with
    the embedded tokenizer and processor files, and ``thinker/`` (:func:`gemma4_e4b_config`,
    checked by ``Gemma4Config``; the Gemma-4 tokenizer and processor as for the small sizes,
    :func:`omni_cache.models.gemma.build_gemma4_thinker`).

    Returns:
        The pipeline directory (``out_dir``).
    """
    def write(out: Path) -> dict:
        from transformers import Gemma4Config

        tokenizer = _write_qwen3_omni_dir(out, gemma4_e4b_pipeline_config())
        thinker = out / THINKER_SUBDIR
        thinker.mkdir(exist_ok=True)
        Gemma4Config(**gemma4_e4b_config()).save_pretrained(thinker)  # raises if malformed
        save_gemma4_processor(thinker, tokenizer, GEMMA4_TOWERS["bench"].image_soft_tokens)
        return {"family": "gemma4", "size": "full", "weights": "none (load_format: dummy)",
                "source": "google/gemma-4-E4B-it text_config; Qwen/Qwen3-Omni-30B-A3B-Instruct "
                          "talker and code2wav; bench vision/audio towers"}

    return build_once(out_dir, gemma4_full_fingerprint(), write, force=force)
