"""Embedded KV-shared (YOCO) thinkers, built locally: a Gemma-4-style multimodal model
(vision + audio towers) and a Gemma-3n-style text model.

Gemma 4 (``--family gemma4``, the default YOCO thinker)
-------------------------------------------------------
``build_gemma4_thinker(out_dir, size)`` writes a directory vLLM loads as
``Gemma4ForConditionalGeneration`` (vLLM's ``gemma4_mm.py``: the text model runs vLLM's
``Gemma4Model`` with ``kv_sharing_fast_prefill``, the towers are transformers'
``Gemma4VisionModel`` / ``Gemma4AudioModel``): transformers' ``Gemma4Config`` with text, vision
and audio sub-configs, seeded-random weights (transformers' init, ``initializer_range`` 0.02)
and **Gemma 4's real processor** (``Gemma4Processor``: ``Gemma4ImageProcessor`` — aspect-ratio
preserving resize to at most ``max_soft_tokens x 9`` patches of 16 px, pooled 3x3 —,
``Gemma4AudioFeatureExtractor`` — 128 mel bins, 25 soft tokens per second). The tokenizer is the
embedded Qwen3-Omni one with Gemma 4's media-token roles mapped onto Qwen3-Omni's ids
(``image_token`` = ``<|image_pad|>``, ``boi/eoi`` = ``<|vision_start|>/<|vision_end|>``,
``audio_token`` = ``<|audio_pad|>``, ``boa/eoa`` = ``<|audio_start|>/<|audio_end|>``), and the
config's ``image_token_id`` / ``audio_token_id`` / ``boi_token_id`` ... are those ids: the
Qwen3-Omni talker finds the media rows of the thinker's prompt by these ids
(``multimodal_mask`` in vLLM-Omni's ``_thinker_to_talker_prefill``) and its prompt layout by
the chat markers, so it consumes the Gemma-4 thinker unchanged. A prompt carries one bare
``<|image_pad|>`` / ``<|audio_pad|>`` per item; the processor expands it to
``boi + N x token + eoi``. Layer types repeat ``sliding, sliding, full`` (last layer full, as
Gemma 4 requires) and the last ~57 % of layers are KV-shared (Gemma 4 E2B: 20 of 35); the
self-decoder ends with ``sliding, full``. ``use_bidirectional_attention`` is left off (causal
attention over image tokens): see docs/yoco.md.

Gemma 3n (``--family gemma3n``, text only)
------------------------------------------

``build_gemma3n_thinker(out_dir, size)`` writes a model directory that vLLM loads as
``Gemma3nForCausalLM`` (``load_format: auto``): ``config.json`` (transformers'
``Gemma3nTextConfig``), seeded-random ``model.safetensors`` (transformers' own init,
``initializer_range`` 0.02 — realistic variance, see :mod:`omni_cache.models.qwen3`) and the
embedded Qwen3-Omni byte-level tokenizer (:func:`omni_cache.models.qwen3.build_tokenizer`), so
token ids — chat markers, the talker's role words and TTS special tokens — are the ids the
Qwen3-Omni talker expects. The vocabulary is Qwen3-Omni's (152064 ids).

Both families' configs carry Qwen3-Omni's TTS token ids (``tts_bos/eos/pad_token_id``,
:data:`omni_cache.models.qwen3.TTS_TOKEN_IDS`): the thinker stage reads them from its config
(:mod:`omni_cache.engine.gemma_thinker`), not from this builder.

Layer layout (YOCO): ``num_hidden_layers`` layers, the last ``num_kv_shared_layers`` of
them KV-shared (cross-decoder). Layer types repeat ``3 sliding : 1 full``; the self-decoder
ends with ``sliding, full`` so vLLM's KV-sharing targets exist (a shared sliding layer reads
layer ``F-2``'s KV, a shared full layer layer ``F-1``'s, ``F`` = first KV-shared layer).

``build_gemma_omni(out_dir, size)`` builds the whole pipeline directory: the embedded
Qwen3-Omni (talker + code2wav; its own thinker weights are unused) with this thinker in
``thinker/`` (stage 0 loads it through ``model_subdir``). The thinker's hidden size equals
the Qwen3-Omni thinker's so the Qwen3-Omni talker consumes its captured layers unchanged.

Sizes (both families follow the paired Qwen3-Omni thinker's hidden size):

- gemma3n ``tiny`` (tests): hidden 64, 8 layers (4 KV-shared = 50 %), head_dim 32, window 64;
  ``bench``: hidden 768, 16 layers (8 KV-shared), heads of 64, window 512.
- gemma4 ``tiny``: hidden 64, 7 layers (4 KV-shared = 57 %), head_dim 32, window 64; vision
  tower hidden 64 x 2 layers, 70 soft tokens per image; audio tower hidden 64 x 2 layers.
  ``bench``: hidden 768, 14 layers (8 KV-shared = 57 %), heads of 64, window 512; vision
  384 x 4 layers, 280 soft tokens per image (Gemma 4's default); audio 384 x 4 layers.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from omni_cache.models.build import (
    PIPELINE_STAMP,
    SEED,
    build_once,
    check_size,
    fingerprint,
    models_home,
    save_seeded,
)
from omni_cache.models.qwen3 import (
    CHAT_TEMPLATE,
    SIZES,
    SPECIAL_TOKENS,
    THINKER_VOCAB,
    TTS_TOKEN_IDS,
    build_qwen3_omni,
    build_tokenizer,
    default_model_dir,
    model_fingerprint,
)

GEMMA_FORMAT_VERSION = 2  # 2: the thinker configs carry the TTS token ids
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
        **TTS_TOKEN_IDS,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    }


@dataclass(frozen=True)
class Gemma4Towers:
    """Widths of the embedded Gemma-4 thinker's vision and audio towers (channels, layers,
    soft tokens per image)."""

    vision_hidden: int
    vision_layers: int
    vision_heads: int
    image_soft_tokens: int  # one of vLLM's supported 70 / 140 / 280 / 560 / 1120
    audio_hidden: int
    audio_layers: int
    audio_heads: int


#: family → size → text widths (Gemma-4 sizes also have :data:`GEMMA4_TOWERS`)
GEMMA4_SIZES: dict[str, GemmaSize] = {
    "tiny": GemmaSize("tiny", 64, 7, 4, 2, 1, 32, 128, 64, 16, 0, "tiny"),
    "bench": dataclasses.replace(_bench_size(), layers=14),
}
GEMMA4_TOWERS: dict[str, Gemma4Towers] = {
    "tiny": Gemma4Towers(64, 2, 2, 70, 64, 2, 2),
    "bench": Gemma4Towers(384, 4, 6, 280, 384, 4, 6),
}
FAMILIES = ("gemma4", "gemma3n")


def _gemma4_layer_types(n: int) -> list[str]:
    types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(n)]
    types[-1] = "full_attention"  # Gemma 4 requires a full-attention last layer
    return types


def gemma4_config_dict(size: str) -> dict:
    """``Gemma4Config`` keyword arguments for ``size`` (plain dict, JSON-able): text, vision
    and audio sub-configs and the media token ids (Qwen3-Omni's, see the module docstring).

    Raises:
        KeyError: unknown ``size``.
        ValueError: the self-decoder does not end with ``sliding, full`` layers.
    """
    t, tw = GEMMA4_SIZES[size], GEMMA4_TOWERS[size]
    types = _gemma4_layer_types(t.layers)
    first_shared = t.layers - t.kv_shared_layers
    if types[first_shared - 1] != "full_attention" or types[first_shared - 2] != "sliding_attention":
        raise ValueError(f"gemma4 {size}: layers {first_shared - 2}, {first_shared - 1} must be sliding, full")
    text = {
        "vocab_size": THINKER_VOCAB, "vocab_size_per_layer_input": THINKER_VOCAB,
        "hidden_size": t.hidden, "hidden_size_per_layer_input": t.per_layer_hidden,
        "intermediate_size": t.intermediate, "num_hidden_layers": t.layers,
        "num_kv_shared_layers": t.kv_shared_layers, "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads, "head_dim": t.head_dim, "global_head_dim": t.head_dim,
        "layer_types": types, "sliding_window": t.sliding_window, "max_position_embeddings": 32768,
        "final_logit_softcapping": 30.0, "initializer_range": 0.02,
        "pad_token_id": SPECIAL_TOKENS["<|endoftext|>"], "eos_token_id": SPECIAL_TOKENS["<|im_end|>"],
        "bos_token_id": SPECIAL_TOKENS["<|im_start|>"],
    }
    vision = {
        "hidden_size": tw.vision_hidden, "intermediate_size": 2 * tw.vision_hidden,
        "num_hidden_layers": tw.vision_layers, "num_attention_heads": tw.vision_heads,
        "num_key_value_heads": tw.vision_heads, "head_dim": tw.vision_hidden // tw.vision_heads,
        "pooling_kernel_size": 3, "patch_size": 16, "position_embedding_size": 1024,
        "default_output_length": tw.image_soft_tokens,
    }
    audio = {
        "hidden_size": tw.audio_hidden, "num_hidden_layers": tw.audio_layers,
        "num_attention_heads": tw.audio_heads,
        # the first conv's channels must equal the 128 mel bins (transformers' input projection
        # reads (channels[0] // 4) * channels[1] features)
        "subsampling_conv_channels": [128, 16], "output_proj_dims": tw.audio_hidden,
    }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text, "vision_config": vision, "audio_config": audio,
        "image_token_id": SPECIAL_TOKENS["<|image_pad|>"], "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
        "audio_token_id": SPECIAL_TOKENS["<|audio_pad|>"],
        "boi_token_id": SPECIAL_TOKENS["<|vision_start|>"], "eoi_token_id": SPECIAL_TOKENS["<|vision_end|>"],
        "boa_token_id": SPECIAL_TOKENS["<|audio_start|>"], "eoa_token_index": SPECIAL_TOKENS["<|audio_end|>"],
        **TTS_TOKEN_IDS, "initializer_range": 0.02,
    }


#: Gemma 4's media-token roles (``Gemma4Processor`` reads them off the tokenizer) → the
#: embedded Qwen3-Omni tokenizer's tokens
GEMMA4_MEDIA_TOKENS = {
    "image_token": "<|image_pad|>", "boi_token": "<|vision_start|>", "eoi_token": "<|vision_end|>",
    "audio_token": "<|audio_pad|>", "boa_token": "<|audio_start|>", "eoa_token": "<|audio_end|>",
}


def _thinker_config(family: str, size: str) -> dict:
    if family == "gemma4":
        return gemma4_config_dict(size)
    if family == "gemma3n":
        return gemma3n_config_dict(GEMMA_SIZES[size])
    raise KeyError(f"unknown YOCO thinker family {family!r}; choose one of {FAMILIES}")


def _sizes(family: str) -> dict[str, GemmaSize]:
    return GEMMA4_SIZES if family == "gemma4" else GEMMA_SIZES


def gemma_fingerprint(size: str, family: str = "gemma3n") -> str:
    """A short digest of everything that determines the built thinker (and, for the pipeline
    directory, the Qwen3-Omni it is paired with)."""
    cfg = {"cfg": _thinker_config(family, size), "seed": SEED, "v": GEMMA_FORMAT_VERSION,
           "qwen": model_fingerprint(_sizes(family)[size].qwen_size)}
    if family == "gemma4":
        cfg["towers"] = asdict(GEMMA4_TOWERS[size])
        cfg["media"] = GEMMA4_MEDIA_TOKENS
    return fingerprint(cfg)


def gemma4_tokenizer(qwen_tokenizer):
    """The embedded Qwen3-Omni tokenizer with Gemma 4's media-token roles
    (:data:`GEMMA4_MEDIA_TOKENS`) as its extra special tokens (same vocabulary and ids)."""
    from transformers import Qwen2TokenizerFast

    tok = Qwen2TokenizerFast(tokenizer_object=qwen_tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", unk_token=None, bos_token=None, model_max_length=32768,
                             extra_special_tokens=dict(GEMMA4_MEDIA_TOKENS))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_gemma4_processor(out: Path, qwen_tokenizer, soft_tokens: int) -> None:
    """Save Gemma 4's real processor into ``out``: its image processor (``soft_tokens`` soft
    tokens per image, at most ``soft_tokens x 9`` patches), audio feature extractor, video
    processor, and :func:`gemma4_tokenizer` of ``qwen_tokenizer``, with the embedded chat
    template."""
    from transformers import Gemma4AudioFeatureExtractor, Gemma4Processor
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                    image_processor=Gemma4ImageProcessor(max_soft_tokens=soft_tokens),
                    video_processor=Gemma4VideoProcessor(), tokenizer=gemma4_tokenizer(qwen_tokenizer),
                    chat_template=CHAT_TEMPLATE, image_seq_length=soft_tokens).save_pretrained(out)


def build_gemma4_thinker(out_dir: str | os.PathLike, size: str = "tiny", *, force: bool = False) -> Path:
    """Build the Gemma-4-style multimodal thinker directory: ``config.json``, seeded weights
    (``model.safetensors``), tokenizer and Gemma 4's processor (``processor_config.json``).

    Returns:
        The model directory.

    Raises:
        KeyError: unknown ``size``.
    """
    check_size(size, GEMMA4_SIZES, "gemma4 thinker")

    def write(out: Path) -> dict:
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        save_seeded(out, Gemma4ForConditionalGeneration, Gemma4Config(**gemma4_config_dict(size)))
        save_gemma4_processor(out, build_tokenizer(out), GEMMA4_TOWERS[size].image_soft_tokens)
        return {"family": "gemma4", "size": size, "seed": SEED, "widths": asdict(GEMMA4_SIZES[size]),
                "towers": asdict(GEMMA4_TOWERS[size])}

    return build_once(out_dir, gemma_fingerprint(size, "gemma4"), write, force=force)


def build_gemma3n_thinker(out_dir: str | os.PathLike, size: str = "tiny", *, force: bool = False) -> Path:
    """Build the KV-shared thinker directory (config, seeded weights, tokenizer).

    Returns:
        The model directory.

    Raises:
        KeyError: unknown ``size``.
    """
    check_size(size, GEMMA_SIZES, "gemma thinker")

    def write(out: Path) -> dict:
        from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

        save_seeded(out, Gemma3nForCausalLM, Gemma3nTextConfig(**gemma3n_config_dict(GEMMA_SIZES[size])))
        build_tokenizer(out).save_pretrained(out)
        return {"family": "gemma3n", "size": size, "seed": SEED, "widths": asdict(GEMMA_SIZES[size])}

    return build_once(out_dir, gemma_fingerprint(size), write, force=force)


def build_gemma_omni(out_dir: str | os.PathLike, size: str = "tiny", *, force: bool = False,
                     family: str = "gemma3n") -> Path:
    """Build the pipeline directory: the embedded Qwen3-Omni of the matching size (talker,
    code2wav, tokenizer, processor files) with the KV-shared thinker of ``family``
    (``gemma4`` or ``gemma3n``) in ``thinker/``.

    Returns:
        The pipeline model directory.

    Raises:
        KeyError: unknown ``family`` or ``size``.
    """
    check_size(size, _sizes(family), f"{family} thinker")
    spec = _sizes(family)[size]

    def write(out: Path) -> dict:
        qwen = build_qwen3_omni(default_model_dir(spec.qwen_size), spec.qwen_size)
        for f in qwen.iterdir():
            if f.is_file():
                dst = out / f.name
                if dst.exists() or dst.is_symlink():
                    dst.unlink()
                if f.suffix == ".safetensors":
                    os.symlink(f.resolve(), dst)  # large; read-only use
                else:
                    shutil.copy2(f, dst)
        build = build_gemma4_thinker if family == "gemma4" else build_gemma3n_thinker
        build(out / THINKER_SUBDIR, size, force=force)
        return {"family": family, "size": size}

    return build_once(out_dir, gemma_fingerprint(size, family), write, force=force, stamp=PIPELINE_STAMP,
                      needs=("config.json",))


def default_gemma_dir(size: str = "tiny", *, omni: bool = True, family: str = "gemma3n") -> Path:
    """``$OMNI_CACHE_HOME/models/<family>-omni-<size>`` (pipeline directory) or
    ``.../<family>-thinker-<size>`` (thinker only)."""
    return models_home() / (f"{family}-omni-{size}" if omni else f"{family}-thinker-{size}")
