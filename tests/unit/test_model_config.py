"""The embedded model's config carries every token id and setting of the released
Qwen3-Omni config, with the released values, so vLLM-Omni's code paths that read them (video
with its audio track: ``get_updates_use_audio_in_video`` reads ``audio_end_token_id``; M-RoPE
reads ``vision_end_token_id`` / ``seconds_per_chunk``) run on it as on the real model.

The published config is ``Qwen/Qwen3-Omni-30B-A3B-Instruct``'s ``config.json``
(https://huggingface.co/Qwen/Qwen3-Omni-30B-A3B-Instruct/blob/main/config.json). Its keys and
token ids below were read from two public copies that agree on every one of them: a dump of
``Qwen3OmniMoeConfig.from_pretrained`` of that checkpoint (transformers 5.7) in a public
"model report" file, and NVIDIA-NeMo/Megatron-Bridge
``tests/functional_tests/models/qwen_omni/test_qwen3_omni_moe_generation.py`` (commit aabb8ea,
``HF_QWEN3_OMNI_MOE_TOY_MODEL_CONFIG``: the released config with the widths shrunk). Widths,
layer counts and dtypes differ on purpose (the embedded model is tiny); keys do not.
"""

from __future__ import annotations

import pytest

from omni_cache.models.qwen3 import SIZES, qwen3_omni_config_dict

# Keys of the published config at each level (nested sub-configs are dicts of their own).
PUBLISHED_KEYS = {
    "": {"architectures", "assistant_token_id", "code2wav_config", "dtype", "enable_audio_output",
         "im_end_token_id", "im_start_token_id", "initializer_range", "model_type", "system_token_id",
         "talker_config", "thinker_config", "tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id",
         "user_token_id"},
    "thinker_config": {"audio_config", "audio_end_token_id", "audio_start_token_id", "audio_token_id", "dtype",
                       "image_token_id", "initializer_range", "model_type", "position_id_per_seconds",
                       "seconds_per_chunk", "text_config", "tie_word_embeddings", "user_token_id", "video_token_id",
                       "vision_config", "vision_end_token_id", "vision_start_token_id"},
    "talker_config": {"accept_hidden_layer", "audio_end_token_id", "audio_start_token_id", "audio_token_id",
                      "code_predictor_config", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                      "codec_pad_id", "codec_think_bos_id", "codec_think_eos_id", "image_token_id",
                      "initializer_range", "model_type", "num_code_groups", "output_router_logits",
                      "position_id_per_seconds", "seconds_per_chunk", "spatial_merge_size", "speaker_id",
                      "text_config", "thinker_hidden_size", "tie_word_embeddings", "video_token_id",
                      "vision_start_token_id"},
}
# Token ids and settings of the published config: the same values in the embedded one.
PUBLISHED_VALUES = {
    "": {"assistant_token_id": 77091, "enable_audio_output": True, "im_end_token_id": 151645,
         "im_start_token_id": 151644, "system_token_id": 8948, "tts_bos_token_id": 151672,
         "tts_eos_token_id": 151673, "tts_pad_token_id": 151671, "user_token_id": 872},
    "thinker_config": {"audio_end_token_id": 151670, "audio_start_token_id": 151669, "audio_token_id": 151675,
                       "image_token_id": 151655, "position_id_per_seconds": 13, "seconds_per_chunk": 2,
                       "user_token_id": 872, "video_token_id": 151656, "vision_end_token_id": 151653,
                       "vision_start_token_id": 151652},
    "talker_config": {"audio_end_token_id": 151670, "audio_start_token_id": 151669, "audio_token_id": 151675,
                      "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
                      "codec_pad_id": 2148, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
                      "image_token_id": 151655, "num_code_groups": 16, "position_id_per_seconds": 13,
                      "seconds_per_chunk": 2, "spatial_merge_size": 2,
                      "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
                      "video_token_id": 151656, "vision_start_token_id": 151652},
}


def _level(cfg: dict, level: str) -> dict:
    return cfg if level == "" else cfg[level]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> dict:
    """The embedded tiny model's config as vLLM-Omni loads it (transformers' class, from the
    built directory)."""
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig.from_pretrained(str(tiny_model_dir)).to_dict()


@pytest.mark.parametrize("level", list(PUBLISHED_KEYS), ids=lambda lv: lv or "top")
def test_built_config_has_every_published_key(loaded, level):
    missing = PUBLISHED_KEYS[level] - set(_level(loaded, level))
    assert not missing, f"{level or 'top level'}: keys of the published config missing: {sorted(missing)}"


@pytest.mark.parametrize("level", list(PUBLISHED_VALUES), ids=lambda lv: lv or "top")
def test_built_config_has_the_published_token_ids_and_settings(loaded, level):
    got = {k: _level(loaded, level).get(k) for k in PUBLISHED_VALUES[level]}
    assert got == PUBLISHED_VALUES[level]


@pytest.mark.parametrize("size", list(SIZES))
def test_every_size_sets_the_published_token_ids_and_settings(size):
    """Set explicitly by the builder for every size (not left to a transformers default)."""
    cfg = qwen3_omni_config_dict(SIZES[size])
    for level, values in PUBLISHED_VALUES.items():
        got = {k: _level(cfg, level).get(k) for k in values}
        assert got == values, (size, level)


@pytest.mark.parametrize("level", list(PUBLISHED_VALUES), ids=lambda lv: lv or "top")
def test_the_full_size_config_agrees(level):
    """``make-model --size full`` writes the released shape from the same published config
    (:mod:`omni_cache.models.full`): its token ids and settings are these too."""
    from omni_cache.models.full import FULL_CONFIG

    got = {k: _level(FULL_CONFIG, level).get(k) for k in PUBLISHED_VALUES[level]}
    assert got == PUBLISHED_VALUES[level]
