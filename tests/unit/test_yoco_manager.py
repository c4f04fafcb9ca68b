"""omni-cache's stage manager under KV-sharing fast prefill (engine-independent parts, small
fakes for the runner and scheduler output): final hidden rows of a fast-prefill chunk are
never marked valid, captured keys are, and a hit serves only the keys handed downstream."""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from omni_cache.engine.stage_manager import HIDDEN_KEY, OmniCacheStageManager

BS, H = 4, 8
LAYER = "hidden_states.layer_4"


def _runner(fast: bool, prompts: dict[str, list[int]]):
    return NS(
        cache_config=NS(kv_sharing_fast_prefill=fast),
        kv_sharing_fast_prefill_eligible_layers={"model.layers.7.self_attn.attn"},
        model=NS(omni_pooler_payload_include_hidden=False),
        requests={r: NS(prompt_token_ids=p, output_token_ids=[], mm_features=None) for r, p in prompts.items()},
        input_batch=NS(req_ids=list(prompts)),
    )


def _sched(new: dict[str, tuple[list[int], int]], n: dict[str, int]):
    return NS(
        finished_req_ids=set(),
        scheduled_new_reqs=[NS(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, (b, c) in new.items()],
        scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens=n,
    )


def _rows(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=g), {LAYER: torch.randn(n, H, generator=g)}


def test_fast_prefill_chunk_writes_captured_keys_only_and_hits_serve_them():
    prompt = list(range(10))
    runner = _runner(True, {"a": prompt})
    m = OmniCacheStageManager(runner, block_size=BS, num_blocks=8)
    m.new_step_starts(_sched({"a": ([0, 1, 2], 0)}, {"a": 10}))
    hidden, mm = _rows(10, 0)
    m.save_outputs(hidden, mm, num_tokens_unpadded=10, num_tokens_padded=10)
    block_hashes = m.reqs["a"].block_hashes
    assert m.cache.covered_prefix_tokens([0, 1], block_hashes, [LAYER]) == 8
    assert m.cache.covered_prefix_tokens([0, 1], block_hashes, [HIDDEN_KEY]) == 0  # truncated rows: never valid

    # a second request hits the first 8 tokens; only the captured key is read and merged
    runner.requests["b"] = NS(prompt_token_ids=prompt[:8] + [50, 51, 52], output_token_ids=[], mm_features=None)
    runner.input_batch.req_ids = ["b"]
    m.new_step_starts(_sched({"b": ([0, 1, 3], 8)}, {"b": 3}))
    h2, mm2 = _rows(3, 1)
    step = m.save_outputs(h2, mm2, num_tokens_unpadded=3, num_tokens_padded=3)
    merged = m._steps[step].merged["b"]
    assert set(merged) == {LAYER}  # the final hidden states are not handed downstream
    assert torch.equal(merged[LAYER], torch.cat([mm[LAYER][:8].to(merged[LAYER].dtype), mm2[LAYER]]))
    assert m.cache.metrics.hits_served == 1 and m.cache.metrics.hits_refused == 0


def test_slow_path_and_single_token_steps_write_the_final_hidden_states():
    prompt = list(range(8))
    m = OmniCacheStageManager(_runner(False, {"a": prompt}), block_size=BS, num_blocks=8)
    m.new_step_starts(_sched({"a": ([0, 1], 0)}, {"a": 8}))
    hidden, mm = _rows(8, 2)
    m.save_outputs(hidden, mm, num_tokens_unpadded=8, num_tokens_padded=8)
    assert m.cache.covered_prefix_tokens([0, 1], m.reqs["a"].block_hashes, [HIDDEN_KEY, LAYER]) == 8

    # fast prefill on, but a one-token step (decode) is a logit row: exact, written
    m2 = OmniCacheStageManager(_runner(True, {"a": [1]}), block_size=1, num_blocks=4)
    m2.new_step_starts(_sched({"a": ([0], 0)}, {"a": 1}))
    h, mm = _rows(1, 3)
    m2.save_outputs(h, mm, num_tokens_unpadded=1, num_tokens_padded=1)
    assert m2.cache.covered_prefix_tokens([0], m2.reqs["a"].block_hashes, [HIDDEN_KEY]) == 1
