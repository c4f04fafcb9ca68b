"""Layer plan of a KV-shared (YOCO) thinker: pure Python, no engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_cache.yoco import FINAL, LayerPlan, YocoConfigError, parse_accept_layer, stage_plan

CFG = {  # the tiny embedded thinker's shape (omni_cache.models.gemma, size tiny)
    "num_hidden_layers": 8,
    "num_kv_shared_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
}


def test_split_and_full_length_rule():
    p = LayerPlan.from_hf_config(CFG, fast_prefill=True)
    assert p.first_kv_shared_layer == p.self_decoder_output == 4
    assert list(p.self_decoder_layers) == [0, 1, 2, 3]
    assert list(p.cross_decoder_layers) == [4, 5, 6, 7]
    assert p.truncates
    assert [p.is_full_length(i) for i in range(9)] == [True] * 5 + [False] * 4
    assert not p.is_full_length(FINAL)
    off = LayerPlan.from_hf_config(CFG, fast_prefill=False)
    assert not off.truncates and off.is_full_length(FINAL) and off.is_full_length(8)


def test_no_kv_sharing_never_truncates():
    p = LayerPlan.from_hf_config({"num_hidden_layers": 4}, fast_prefill=True, needs_final=True)
    assert p.first_kv_shared_layer == 4 and not p.truncates
    p.check()


def test_text_config_is_used_for_multimodal_configs():
    p = LayerPlan.from_hf_config({"text_config": CFG})
    assert p.num_kv_shared_layers == 4


@pytest.mark.parametrize("bad", [{"num_hidden_layers": 0}, {"num_hidden_layers": 4, "num_kv_shared_layers": 4}, {}])
def test_bad_model_config(bad):
    with pytest.raises(YocoConfigError):
        LayerPlan.from_hf_config(bad)


def test_final_hidden_with_fast_prefill_names_settings_and_fix():
    plan, accept = stage_plan(CFG, True, {"OMNI_CACHE_YOCO_ACCEPT_LAYER": "final"})
    assert accept == FINAL and plan.needs_final
    with pytest.raises(YocoConfigError) as e:
        plan.check("cfg.yaml: stage 0")
    msg = str(e.value)
    for needle in ("cfg.yaml: stage 0", "kv_sharing_fast_prefill", "OMNI_CACHE_YOCO_ACCEPT_LAYER",
                   "self-decoder output", "kv_sharing_fast_prefill: false", ": 4"):
        assert needle in msg, (needle, msg)
    stage_plan(CFG, False, {"OMNI_CACHE_YOCO_ACCEPT_LAYER": "final"})[0].check()  # slow path: fine


def test_cross_decoder_capture_is_refused_self_decoder_capture_allowed():
    with pytest.raises(YocoConfigError, match="captured layer 6 is in the cross-decoder"):
        stage_plan(CFG, True, {"OMNI_CACHE_YOCO_CAPTURE_LAYERS": "2,6"})[0].check()
    plan, accept = stage_plan(CFG, True, {"OMNI_CACHE_YOCO_CAPTURE_LAYERS": "2"})
    plan.check()
    assert accept == 4 and plan.captured_layers == (0, 2, 4)
    with pytest.raises(YocoConfigError, match="outside"):
        stage_plan(CFG, False, {"OMNI_CACHE_YOCO_ACCEPT_LAYER": "9"})[0].check()


def test_parse_accept_layer():
    assert parse_accept_layer(None, 4) == 4
    assert parse_accept_layer("self_decoder_output", 4) == 4
    assert parse_accept_layer(" 3 ", 4) == 3
    with pytest.raises(YocoConfigError):
        parse_accept_layer("last", 4)


def test_plan_prints_roles_and_captures():
    text = str(stage_plan(CFG, True, {})[0])
    assert "self-decoder 0..3" in text and "cross-decoder (KV-shared) 4..7" in text
    assert "layer   5 [S] cross: logit rows only" in text
    assert "capture 4 (self-decoder output): all rows  <- handed downstream" in text


def test_yoco_package_imports_no_engine():
    check = ("import sys; import omni_cache.yoco; "
             "assert not any(m.split('.')[0] in ('vllm','vllm_omni') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", check], check=True, cwd=Path(__file__).parents[2])


def _gemma_variant(tmp_path, **s0):
    import yaml

    raw = yaml.safe_load((Path(__file__).parents[2] / "stage_configs" / "gemma3n_yoco_cpu.yaml").read_text())
    for k, v in s0.items():
        if k == "env":
            raw["stages"][0]["env"].update(v)
        else:
            raw["stages"][0][k] = v
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    return p


def test_stage_config_check_at_start_up(tmp_path):
    """Rule 2 at start-up (``load_stage_config``, called by ``OmniPipeline`` and ``omni-cache
    validate`` before any engine starts): final hidden states + fast prefill is refused with
    both settings and the fix named; the shipped config and the slow path pass."""
    from omni_cache.driver.stage_config import StageConfigError, load_stage_config
    from omni_cache.models.gemma import build_gemma_omni, default_gemma_dir

    model = build_gemma_omni(default_gemma_dir("tiny"), "tiny")
    load_stage_config(Path(__file__).parents[2] / "stage_configs" / "gemma3n_yoco_cpu.yaml", model_dir=model)
    bad = _gemma_variant(tmp_path, env={"OMNI_CACHE_YOCO_ACCEPT_LAYER": "final"})
    with pytest.raises(StageConfigError) as e:
        load_stage_config(bad, model_dir=model)
    msg = str(e.value)
    assert e.value.stage_id == 0 and e.value.key == "kv_sharing_fast_prefill"
    for needle in (str(bad), "kv_sharing_fast_prefill: true", "OMNI_CACHE_YOCO_ACCEPT_LAYER",
                   "self-decoder output", "kv_sharing_fast_prefill: false"):
        assert needle in msg, (needle, msg)
    with pytest.raises(StageConfigError, match="captured layer 6 is in the cross-decoder"):
        load_stage_config(_gemma_variant(tmp_path, env={"OMNI_CACHE_YOCO_CAPTURE_LAYERS": "6"}), model_dir=model)
    load_stage_config(_gemma_variant(tmp_path, kv_sharing_fast_prefill=False,
                                     env={"OMNI_CACHE_YOCO_ACCEPT_LAYER": "final"}), model_dir=model)


def test_embedded_gemma4_layout():
    """The embedded Gemma-4 thinker: an E2B-like share of KV-shared layers, a self-decoder that
    ends sliding, full (vLLM's KV-sharing targets), a full last layer, and media token ids that
    are Qwen3-Omni's (the talker finds media rows and chat markers by them)."""
    from omni_cache.models.gemma import GEMMA4_MEDIA_TOKENS, GEMMA4_SIZES, gemma4_config_dict
    from omni_cache.models.qwen3 import SPECIAL_TOKENS
    from omni_cache.yoco import LayerPlan

    for size in GEMMA4_SIZES:
        cfg = gemma4_config_dict(size)
        text = cfg["text_config"]
        plan = LayerPlan.from_hf_config(cfg, fast_prefill=True)
        f = plan.first_kv_shared_layer
        assert 0.5 < text["num_kv_shared_layers"] / text["num_hidden_layers"] < 0.65  # E2B: 20/35
        assert text["layer_types"][f - 2:f] == ["sliding_attention", "full_attention"]
        assert text["layer_types"][-1] == "full_attention"
        assert cfg["image_token_id"] == SPECIAL_TOKENS[GEMMA4_MEDIA_TOKENS["image_token"]] == 151655
        assert cfg["audio_token_id"] == SPECIAL_TOKENS[GEMMA4_MEDIA_TOKENS["audio_token"]]
        assert cfg["boi_token_id"] == SPECIAL_TOKENS[GEMMA4_MEDIA_TOKENS["boi_token"]]
        assert cfg["eoa_token_index"] == SPECIAL_TOKENS[GEMMA4_MEDIA_TOKENS["eoa_token"]]
        assert cfg["vision_config"]["default_output_length"] in (70, 140, 280, 560, 1120)


def test_thinker_reads_the_tts_token_ids_from_its_config():
    """The KV-shared thinker stage takes the TTS tokens whose embeddings it hands the talker
    from its own config (not from the model builder): the embedded configs of both families —
    and the at-size Gemma-4 one — carry Qwen3-Omni's ids, and a config without them is refused
    at start-up rather than embedding other tokens."""
    from transformers import Gemma3nTextConfig, Gemma4Config

    from omni_cache.engine.gemma_thinker import tts_token_ids
    from omni_cache.models.full import gemma4_e4b_config
    from omni_cache.models.gemma import GEMMA4_SIZES, GEMMA_SIZES, gemma3n_config_dict, gemma4_config_dict
    from omni_cache.models.qwen3 import SPECIAL_TOKENS

    want = [SPECIAL_TOKENS[t] for t in ("<tts_text_bos>", "<tts_text_eod>", "<tts_pad>")]
    assert want == [151672, 151673, 151671]
    configs = [Gemma4Config(**gemma4_config_dict(s)) for s in GEMMA4_SIZES]
    configs += [Gemma3nTextConfig(**gemma3n_config_dict(s)) for s in GEMMA_SIZES.values()]
    configs.append(Gemma4Config(**gemma4_e4b_config()))
    for cfg in configs:
        assert tts_token_ids(cfg) == want, type(cfg).__name__
    bare = {k: v for k, v in gemma4_config_dict("tiny").items() if k != "tts_eos_token_id"}
    with pytest.raises(ValueError, match="tts_eos_token_id"):
        tts_token_ids(Gemma4Config(**bare))


def test_gemma4_prompt_placeholders_and_family():
    """A Gemma-4 prompt carries one bare media token per item (its processor adds the markers);
    the stage config names the family."""
    from omni_cache.driver.inputs import PLACEHOLDERS, OmniRequest, Turn
    from omni_cache.driver.stage_config import load_stage_config
    from tests.util import REPO

    turns = [Turn("user", "Hi.", image=object(), audio=object())]
    g4 = OmniRequest(turns, family="gemma4").prompt_text()
    qw = OmniRequest(turns).prompt_text()
    assert "<|image_pad|><|audio_pad|>Hi." in g4 and "<|vision_start|>" not in g4
    assert "<|vision_start|><|image_pad|><|vision_end|>" in qw
    with pytest.raises(KeyError):
        OmniRequest(turns, family="nope").prompt_text()
    assert set(PLACEHOLDERS) == {"qwen3-omni", "gemma4"}
    assert load_stage_config(REPO / "stage_configs" / "gemma4_yoco_cpu.yaml").thinker_family == "gemma4"
    assert load_stage_config(REPO / "stage_configs" / "qwen3_omni_cpu.yaml").thinker_family == "qwen3-omni"
