"""vLLM's real scheduler pieces for the capped-scheduler tests (no model, no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BS = 16


def vllm_config(d: Path, *, num_blocks: int, max_num_batched_tokens: int, async_scheduling: bool):
    """A ``VllmConfig`` of a tiny Llama (config only) with prefix caching, ``num_blocks`` KV
    blocks of :data:`BS` tokens. vLLM's CPU platform turns async scheduling off inside
    ``VllmConfig``; it is set back afterwards, as a GPU stage would have it."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 5000, "max_position_embeddings": 4096,
        "torch_dtype": "float32"}))
    model = ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=1024)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, max_model_len=1024,
                            enable_chunked_prefill=True, async_scheduling=async_scheduling,
                            is_encoder_decoder=False)
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    cfg = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


def scheduler_kwargs(cfg, num_blocks: int) -> dict:
    """Constructor arguments of a vLLM(-Omni) scheduler over one full-attention KV group."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return dict(vllm_config=cfg, kv_cache_config=kv, block_size=BS,
                structured_output_manager=StructuredOutputManager(cfg))


def request(rid: str, prompt: list[int], max_tokens: int, *, forget_rows: bool = False):
    """A vLLM ``Request`` with vLLM's own block hasher (sha256); ``forget_rows``: marked for the
    capped scheduler's fault injection (:data:`omni_cache.engine.scheduler.FORGET_ROWS`)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    from omni_cache.engine.scheduler import FORGET_ROWS

    extra = {FORGET_ROWS: True} if forget_rows else None
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def step(s):
    """One scheduler step answered with one sampled token per scheduled request (as vLLM's
    own scheduler tests do); returns the scheduler output."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                sampled_token_ids=[[7] for _ in ids]))
    return out
