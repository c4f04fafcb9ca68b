"""vLLM's real scheduler pieces for the capped-scheduler tests (no model, no engine)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import scheduler_overhead as _bench

BS = _bench.BLOCK_SIZE


def vllm_config(d: Path, *, num_blocks: int, max_num_batched_tokens: int, async_scheduling: bool):
    """A ``VllmConfig`` of a tiny Llama (config only) with prefix caching, ``num_blocks`` KV
    blocks of :data:`BS` tokens (:func:`benchmarks.scheduler_overhead.vllm_config`)."""
    return _bench.vllm_config(d, num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
                              async_scheduling=async_scheduling)


def scheduler_kwargs(cfg, num_blocks: int) -> dict:
    """Constructor arguments of a vLLM(-Omni) scheduler over one full-attention KV group."""
    return _bench.scheduler_kwargs(cfg, num_blocks)


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
