"""Embedded local models: a small Qwen3-Omni-MoE built deterministically, no downloads.

``build_qwen3_omni(out_dir, size="tiny")`` writes a complete model directory that vLLM-Omni
loads with ``load_format: auto``: ``config.json`` (transformers' ``Qwen3OmniMoeConfig`` with
thinker / talker / code2wav sub-configs), seeded-random ``model.safetensors`` (transformers'
own normal init, std = ``initializer_range`` = 0.02, the real model's value — vLLM's
``load_format: dummy`` draws ±1e-3, which makes activations tiny and outputs repeat, so an
equality test on it is weak), a byte-level BPE tokenizer with every special token at its
real Qwen3-Omni id, and the real HF processor files (``WhisperFeatureExtractor``,
``Qwen2VLImageProcessor``, ``Qwen3OmniMoeProcessor``).

Sizes (parameters, fp32 bytes on disk):

- ``tiny``  (tests): thinker hidden 64, 2 layers, 4 experts top-2, head_dim 32.
- ``bench`` (benchmarks): thinker hidden 768, 12 layers, 12 heads (head_dim 64, 4 KV heads),
  8 experts top-2 of width 768 (~0.42 B parameters) — an uncached prefill of ~2,900 tokens
  takes ~2 s on 2 CPU cores, so prefill dominates a request (the issue's target: ≥ 1 s).
- ``bench-voice`` (the voice-chat benchmark): the ``bench`` thinker with a talker proportioned
  like Qwen3-Omni-30B-A3B's (hidden 384, 6 layers, 4 experts of width 384; its code predictor
  as wide) — the other sizes' talker is a stub (hidden 64, 2 layers) whose prefill costs
  next to nothing.

Sources: the sub-config fields, special-token ids and settings (``audio_end_token_id``,
``vision_end_token_id``, ``seconds_per_chunk``, ``position_id_per_seconds``, ...) follow the
released ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` ``config.json`` (every one of its token ids and
settings is here with its value; ``tests/unit/test_model_config.py`` compares the keys and
cites the copy it was read from); sizes from ``../shared/notes``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omni_cache.models.build import SEED, build_once, check_size, fingerprint, models_home, save_seeded

MODEL_FORMAT_VERSION = 3  # bump when the built model changes; part of the cache key
# (3: the talker's expert weights initialised, see init_talker_experts)

# Real Qwen3-Omni special-token ids (tokenizer_config.json of the released model).
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<|audio_start|>": 151669,
    "<|audio_end|>": 151670,
    "<tts_pad>": 151671,
    "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673,
    "<tts_text_bos_single>": 151674,
    "<|audio_pad|>": 151675,
}
# Whole-word tokens the talker looks up by id (system / user / assistant roles).
WORD_TOKENS: dict[str, int] = {"system": 8948, "user": 872, "assistant": 77091}
#: the TTS tokens' ids under the config keys Qwen3-Omni's ``config.json`` gives them; the
#: KV-shared thinkers' configs carry them too (the thinker stage reads them from its config)
TTS_TOKEN_IDS: dict[str, int] = {
    "tts_pad_token_id": SPECIAL_TOKENS["<tts_pad>"],
    "tts_bos_token_id": SPECIAL_TOKENS["<tts_text_bos>"],
    "tts_eos_token_id": SPECIAL_TOKENS["<tts_text_eod>"],
}
BASE_VOCAB = 151643  # regular (non-special) ids are [0, BASE_VOCAB)
THINKER_VOCAB = 152064

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- elif item['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif item['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class ModelSize:
    """Widths of the embedded model (tokens / channels, not bytes)."""

    name: str
    thinker_hidden: int
    thinker_layers: int
    thinker_heads: int
    thinker_kv_heads: int
    thinker_experts: int
    thinker_moe_intermediate: int
    mrope_section: tuple[int, int, int]
    accept_hidden_layer: int
    # the talker (and its code predictor): a stub by default
    talker_hidden: int = 64
    talker_layers: int = 2
    talker_heads: int = 2
    talker_moe_intermediate: int = 64
    talker_intermediate: int = 128
    talker_mrope_section: tuple[int, int, int] = (6, 5, 5)  # sums to talker head_dim / 2

    @property
    def head_dim(self) -> int:
        return self.thinker_hidden // self.thinker_heads

    @property
    def talker_head_dim(self) -> int:
        return self.talker_hidden // self.talker_heads


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize("tiny", 64, 2, 2, 2, 4, 64, (6, 5, 5), 1),
    "bench": ModelSize("bench", 768, 12, 12, 4, 8, 768, (16, 8, 8), 4),
    # the bench thinker with a talker proportioned like Qwen3-Omni-30B-A3B's (talker compute
    # per token ~1/8 of the thinker's; the released talker: hidden 1024, 20 layers, against
    # the thinker's 2048 / 48 with ~10x the active parameters), for talker-side benchmarks
    "bench-voice": ModelSize("bench-voice", 768, 12, 12, 4, 8, 768, (16, 8, 8), 4,
                             talker_hidden=384, talker_layers=6, talker_heads=6,
                             talker_moe_intermediate=384, talker_intermediate=768,
                             talker_mrope_section=(16, 8, 8)),
}


def _rope(theta: float, mrope_section: tuple[int, int, int] | None = None) -> dict:
    rope = {"rope_type": "default", "rope_theta": theta}
    if mrope_section is not None:
        rope.update(
            {"mrope_section": list(mrope_section), "interleaved": True, "mrope_interleaved": True}
        )
    return rope


def qwen3_omni_config_dict(size: ModelSize) -> dict:
    """The ``Qwen3OmniMoeConfig`` keyword arguments for ``size`` (plain dict, JSON-able)."""
    h = size.thinker_hidden
    small = 64  # width of every non-thinker sub-model
    return {
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "enable_audio_output": True,
        "im_start_token_id": SPECIAL_TOKENS["<|im_start|>"],
        "im_end_token_id": SPECIAL_TOKENS["<|im_end|>"],
        **TTS_TOKEN_IDS,
        "system_token_id": WORD_TOKENS["system"],
        "user_token_id": WORD_TOKENS["user"],
        "assistant_token_id": WORD_TOKENS["assistant"],
        "thinker_config": {
            "audio_token_id": SPECIAL_TOKENS["<|audio_pad|>"],
            "image_token_id": SPECIAL_TOKENS["<|image_pad|>"],
            "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
            "audio_start_token_id": SPECIAL_TOKENS["<|audio_start|>"],
            "audio_end_token_id": SPECIAL_TOKENS["<|audio_end|>"],
            "vision_start_token_id": SPECIAL_TOKENS["<|vision_start|>"],
            "vision_end_token_id": SPECIAL_TOKENS["<|vision_end|>"],
            "user_token_id": WORD_TOKENS["user"],
            "position_id_per_seconds": 13,
            "seconds_per_chunk": 2,
            "initializer_range": 0.02,
            "audio_config": {
                "num_mel_bins": 128,
                "encoder_layers": 2,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 128,
                "d_model": small,
                "output_dim": h,
                "downsample_hidden_size": 32,
                "n_window": 50,
                "n_window_infer": 400,
                "conv_chunksize": 500,
                "max_source_positions": 1500,
            },
            "vision_config": {
                "depth": 2,
                "hidden_size": small,
                "intermediate_size": 128,
                "num_heads": 2,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": h,
                "num_position_embeddings": 2304,
                "deepstack_visual_indexes": [1],
                "image_size": 768,
                "apply_vit_abs_pos_embed": True,
            },
            "text_config": {
                "vocab_size": THINKER_VOCAB,
                "hidden_size": h,
                "intermediate_size": 2 * h,
                "num_hidden_layers": size.thinker_layers,
                "num_attention_heads": size.thinker_heads,
                "num_key_value_heads": size.thinker_kv_heads,
                "head_dim": size.head_dim,
                "moe_intermediate_size": size.thinker_moe_intermediate,
                "num_experts": size.thinker_experts,
                "num_experts_per_tok": 2,
                "max_position_embeddings": 32768,
                "rope_parameters": _rope(1_000_000.0, size.mrope_section),
            },
        },
        "talker_config": {
            "thinker_hidden_size": h,
            "accept_hidden_layer": size.accept_hidden_layer,
            "num_code_groups": 16,
            "spatial_merge_size": 2,
            "audio_token_id": SPECIAL_TOKENS["<|audio_pad|>"],
            "image_token_id": SPECIAL_TOKENS["<|image_pad|>"],
            "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
            "vision_start_token_id": SPECIAL_TOKENS["<|vision_start|>"],
            "audio_start_token_id": SPECIAL_TOKENS["<|audio_start|>"],
            "audio_end_token_id": SPECIAL_TOKENS["<|audio_end|>"],
            "position_id_per_seconds": 13,
            "seconds_per_chunk": 2,
            "output_router_logits": False,
            "codec_pad_id": 2148,
            "codec_bos_id": 2149,
            "codec_eos_token_id": 2150,
            "codec_nothink_id": 2155,
            "codec_think_bos_id": 2156,
            "codec_think_eos_id": 2157,
            "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
            "text_config": {
                "vocab_size": 3072,
                "hidden_size": size.talker_hidden,
                "intermediate_size": size.talker_intermediate,
                "num_hidden_layers": size.talker_layers,
                "num_attention_heads": size.talker_heads,
                "num_key_value_heads": size.talker_heads,
                "head_dim": size.talker_head_dim,
                "moe_intermediate_size": size.talker_moe_intermediate,
                "shared_expert_intermediate_size": size.talker_moe_intermediate,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "rope_parameters": _rope(1_000_000.0, size.talker_mrope_section),
            },
            "code_predictor_config": {
                "vocab_size": 2048,
                "hidden_size": size.talker_hidden,
                "intermediate_size": size.talker_intermediate,
                "num_hidden_layers": 1,
                "num_attention_heads": size.talker_heads,
                "num_key_value_heads": size.talker_heads,
                "head_dim": size.talker_head_dim,
                "num_code_groups": 16,
                "rope_parameters": _rope(1_000_000.0),
            },
        },
        "code2wav_config": {
            "codebook_size": 2048,
            "hidden_size": small,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_quantizers": 16,
            "sliding_window": 72,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
            "decoder_dim": 64,
            "rope_parameters": _rope(10000.0),
        },
    }


_SYLLABLES = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]  # 75 syllables


def _filler_word(i: int) -> str:
    """A unique pronounceable pseudo-word for regular id ``i`` (byte-level form, with a
    leading space ``Ġ`` on even ids), so random-weight output decodes to readable text."""
    n, parts = i, []
    while True:
        n, r = divmod(n, len(_SYLLABLES))
        parts.append(_SYLLABLES[r])
        if n == 0:
            break
    return ("Ġ" if i % 2 == 0 else "") + "".join(parts) + "q"


def build_tokenizer(out_dir: Path):
    """A byte-level BPE tokenizer with Qwen3-Omni's special tokens at their real ids.

    Regular ids: the 256 byte symbols first, merges spelling the role words at the ids the
    talker expects (``system`` 8948, ``user`` 872, ``assistant`` 77091), the rest of
    ``[0, 151643)`` filled with unreachable placeholder entries so the id space matches.

    Returns:
        The ``Qwen2TokenizerFast`` saved into ``out_dir``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2TokenizerFast

    byte_syms = sorted(ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for s in byte_syms:
        vocab[s] = len(vocab)
    merges: list[tuple[str, str]] = []
    reserved = set(WORD_TOKENS.values())
    next_id = len(vocab)

    def take_id() -> int:
        nonlocal next_id
        while next_id in reserved:
            next_id += 1
        next_id += 1
        return next_id - 1

    for word, wid in WORD_TOKENS.items():
        for piece in ("Ġ" + word, word):  # with and without a leading space
            prefix = piece[0]
            for ch in piece[1:]:
                new = prefix + ch
                if new not in vocab:
                    vocab[new] = wid if new == word else take_id()
                    merges.append((prefix, ch))
                prefix = new
    used = set(vocab.values())
    for i in range(BASE_VOCAB):
        if i not in used:
            vocab[_filler_word(i)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Special tokens in id order so each lands on its real id.
    from tokenizers import AddedToken

    for text, tid in sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1]):
        while tok.get_vocab_size(with_added_tokens=True) < tid:
            tok.add_tokens([AddedToken(f"<|reserved_{tok.get_vocab_size(True)}|>", special=True)])
        tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        assert tok.token_to_id(text) == tid, (text, tok.token_to_id(text), tid)
    hf = Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_processor(tokenizer):
    """Qwen3-Omni's processor (Qwen2-VL image and video processors, Whisper feature extractor
    at 16 kHz, ``tokenizer``) as the released checkpoint configures it; returns a
    ``Qwen3OmniMoeProcessor`` to ``save_pretrained`` next to the model."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        min_pixels=64 * 32 * 32, max_pixels=256 * 32 * 32,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen2VLVideoProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        min_pixels=64 * 32 * 32, max_pixels=256 * 32 * 32,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300, n_fft=400,
        padding_value=0.0, return_attention_mask=True,
    )
    return Qwen3OmniMoeProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def model_fingerprint(size: str) -> str:
    """A short digest of everything that determines the built model (sizes, seed, format)."""
    return fingerprint({"cfg": qwen3_omni_config_dict(SIZES[size]), "seed": SEED, "v": MODEL_FORMAT_VERSION})


def init_talker_experts(model, seed: int, std: float = 0.02) -> int:
    """Give the talker's MoE expert weights (``talker.*.mlp.experts.*``: transformers' fused
    ``gate_up_proj`` ``[experts, 2 * intermediate, hidden]`` and ``down_proj``, saved as
    per-expert ``…experts.N.{gate,up,down}_proj.weight``) values: normal
    ``(0, std)`` from a generator seeded with ``seed``, parameter by parameter in name order.

    transformers 5.14's ``Qwen3OmniMoeForConditionalGeneration`` leaves them as allocated
    (``torch.empty``: whatever the memory held — denormals, zeros, or large and non-finite
    values), so every build of the embedded model had other talker weights, and some builds a
    talker that produced no codec frame: no audio at all, no error (first seen on an H200,
    then on the CPU after a rebuild; docs/gpu.md, "Audio on the GPU"). ``std`` is the
    config's ``initializer_range``, what transformers gives the other linear weights.

    Returns:
        The number of parameters initialised.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.startswith("talker.") and ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
                n += 1
    return n


def build_qwen3_omni(out_dir: str | os.PathLike, size: str = "tiny", *, force: bool = False) -> Path:
    """Build the embedded Qwen3-Omni-MoE model directory (:func:`omni_cache.models.build.build_once`).

    Args:
        out_dir: target directory (created).
        size: a key of :data:`SIZES` (``tiny``, ``bench`` or ``bench-voice``).
        force: rebuild even if ``out_dir`` already holds this exact model.

    Returns:
        The model directory.

    Raises:
        KeyError: unknown ``size``.
    """
    check_size(size, SIZES, "model")

    def write(out: Path) -> dict:
        from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

        cfg = Qwen3OmniMoeConfig(**qwen3_omni_config_dict(SIZES[size]))
        save_seeded(out, Qwen3OmniMoeForConditionalGeneration, cfg, init=lambda model: init_talker_experts(model, SEED))
        tokenizer = build_tokenizer(out)
        build_processor(tokenizer).save_pretrained(out)
        tokenizer.save_pretrained(out)
        return {"size": size, "seed": SEED}

    return build_once(out_dir, model_fingerprint(size), write, force=force)


def default_model_dir(size: str = "tiny") -> Path:
    """Where ``omni-cache make-model`` puts a model by default:
    ``$OMNI_CACHE_HOME/models/qwen3-omni-<size>`` (:func:`omni_cache.models.build.models_home`)."""
    return models_home() / f"qwen3-omni-{size}"
