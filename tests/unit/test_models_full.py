"""``omni-cache make-model --size full``: the released Qwen3-Omni-30B-A3B-Instruct shape, no weights."""

from __future__ import annotations

import json

from omni_cache.models.full import FULL_CONFIG, build_full


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


def test_gemma4_full_is_e4b_shape_and_vllm_reads_it(tmp_path):
    """`make-model --family gemma4 --size full`: the thinker vLLM parses is Gemma-4-E4B's text
    shape (published text_config: 42 layers, last 18 KV-shared, the self-decoder ending
    ``sliding, full`` as vLLM's KV-sharing targets need), the talker reads its 2,560-wide rows,
    no weights anywhere."""
    from transformers import AutoConfig
    from vllm.config import ModelConfig

    from omni_cache.cli import main
    from omni_cache.models.full import GEMMA4_E4B_TEXT

    out = tmp_path / "g4"
    assert main(["make-model", "--family", "gemma4", "--size", "full", "--out", str(out)]) == 0
    assert not list(out.rglob("*.safetensors"))
    mc = ModelConfig(model=str(out / "thinker"), tokenizer=str(out / "thinker"), max_model_len=16384)
    t = mc.hf_text_config
    assert mc.architectures == ["Gemma4ForConditionalGeneration"]
    assert (t.num_hidden_layers, t.num_kv_shared_layers, t.hidden_size, t.intermediate_size, t.num_attention_heads,
            t.num_key_value_heads, t.head_dim, t.global_head_dim, t.sliding_window, t.vocab_size) == \
        (42, 18, 2560, 10240, 8, 2, 256, 512, 512, 262144)
    first_shared = t.num_hidden_layers - t.num_kv_shared_layers
    assert t.layer_types[first_shared - 2:first_shared] == ["sliding_attention", "full_attention"]
    assert t.layer_types == GEMMA4_E4B_TEXT["layer_types"] and t.layer_types.count("full_attention") == 7
    assert t.rope_parameters["full_attention"]["rope_type"] == "proportional"
    pipe = AutoConfig.from_pretrained(out)
    assert pipe.talker_config.thinker_hidden_size == t.hidden_size
    assert pipe.talker_config.text_config.num_hidden_layers == 20  # Qwen3-Omni-30B-A3B's talker
    assert main(["make-model", "--family", "gemma3n", "--size", "full", "--out", str(tmp_path / "x")]) == 2
