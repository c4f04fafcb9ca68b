"""``omni-cache make-model --size full``: the released Qwen3-Omni-30B-A3B-Instruct shape, no weights."""

from __future__ import annotations

import json

from omni_cache.models_full import FULL_CONFIG, build_full


def test_full_config_is_the_released_shape_and_transformers_reads_it(tmp_path):
    """The numbers the benchmarks' claims rest on (published config.json; docs/gpu.md)."""
    from transformers import AutoConfig

    out = build_full(tmp_path / "full")
    assert not list(out.glob("*.safetensors")), "no weights: the stage configs load it with load_format: dummy"
    cfg = AutoConfig.from_pretrained(out)
    t = cfg.thinker_config.text_config
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.vocab_size) == \
        (48, 2048, 32, 4, 128, 128, 8, 768, 152064)
    assert sum(t.rope_parameters["mrope_section"]) == t.head_dim // 2  # vLLM's M-RoPE asserts it
    assert cfg.talker_config.accept_hidden_layer == 24 and cfg.talker_config.thinker_hidden_size == 2048
    assert cfg.talker_config.text_config.num_hidden_layers == 20
    assert cfg.thinker_config.vision_config.out_hidden_size == cfg.thinker_config.audio_config.output_dim == 2048
    stamp = json.loads((out / "omni_cache_model.json").read_text())
    assert stamp["size"] == "full" and build_full(out) == out  # up to date: not rebuilt
    assert json.loads((out / "config.json").read_text()) == FULL_CONFIG
