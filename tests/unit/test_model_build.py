"""The embedded model is the same model on every build: no weight left as allocated memory.

transformers 5.14 leaves the Qwen3-Omni talker's fused MoE expert weights uninitialised; before
``init_talker_experts`` two builds differed there, and some builds' talker produced no audio.
"""

from __future__ import annotations

import torch


def _build(seed: int):
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omni_cache.models.qwen3 import SIZES, init_talker_experts, qwen3_omni_config_dict

    torch.manual_seed(seed)
    junk = torch.full((1 << 20,), 3.0e38)  # memory the allocator may hand out again
    del junk
    model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**qwen3_omni_config_dict(SIZES["tiny"])))
    assert init_talker_experts(model, seed) > 0
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_two_builds_are_bitwise_the_same_model_with_finite_talker_experts():
    a, b = _build(1234), _build(1234)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
    experts = [v for k, v in a.items() if k.startswith("talker.") and ".mlp.experts." in k]
    assert experts and all(torch.isfinite(v).all() for v in experts)
    std = torch.cat([v.flatten().float() for v in experts]).std().item()
    assert 0.015 < std < 0.025, std  # the config's initializer_range, like the other linear weights
