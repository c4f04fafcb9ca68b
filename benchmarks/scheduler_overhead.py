"""The scheduler's host time per decode step, engine-free: vLLM's real ``AsyncScheduler`` (vLLM-Omni's
``OmniARAsyncScheduler``, the thinker's under async scheduling, vLLM-Omni's default on GPUs) and its KV
cache manager, driven as the engine core drives them — ``schedule()`` then ``update_from_output()``
with one sampled token per request — in three variants side by side:

- ``off``: prefix caching off (cache off's thinker);
- ``builtin``: prefix caching on, vLLM-Omni's scheduler (the built-in cache's thinker: vLLM hashes
  every block a request fills, ``Request.block_hashes``, and caches it in the KV cache manager);
- ``omni_cache``: prefix caching on, omni-cache's capped scheduler
  (:class:`omni_cache.engine.scheduler.OmniCacheARAsyncScheduler`: the rows ledger of the blocks
  completed per step, pending decode-filled blocks confirmed by the worker's report).

Why: on the H200 omni-cache's thinker decoded ~5 % slower than cache off's at c = 1 while its
model runner's own host time was no larger (docs/gpu.md, "Twenty-second session"); the rest of a
step's host time is the scheduler's. This splits that time into what prefix caching itself
costs (``builtin`` − ``off``) and what omni-cache adds to it (``omni_cache`` − ``builtin``).

    .venv/bin/python -m benchmarks.scheduler_overhead --batch 1,16 --steps 256 --rounds 5

Rounds alternate the variants (rotated order); per batch and variant: µs per decode step
(median over rounds, min, max) of ``schedule()`` and of ``update_from_output()``; ratios to
``off``. Writes ``result.json`` and ``scheduler_overhead.png`` under ``--out``. An absolute time
holds for the machine it ran on (the result names it); the ratios are what carries over.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import lab

BLOCK_SIZE = 16
VARIANTS = ("off", "builtin", "omni_cache")


def vllm_config(d: Path, *, num_blocks: int, max_num_batched_tokens: int, async_scheduling: bool,
                prefix_caching: bool = True, max_num_seqs: int = 4, max_model_len: int = 1024):
    """A ``VllmConfig`` of a tiny Llama (``config.json`` written to ``d``; no weights) with
    ``num_blocks`` KV blocks of :data:`BLOCK_SIZE` tokens. vLLM's CPU platform turns async
    scheduling off inside ``VllmConfig``; it is set back afterwards, as a GPU stage has it."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 5000, "max_position_embeddings": max(4096, max_model_len),
        "torch_dtype": "float32"}))
    model = ModelConfig(model=str(d), skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=max_model_len)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, enable_chunked_prefill=True,
                            async_scheduling=async_scheduling, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    cache.num_gpu_blocks = num_blocks
    cfg = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


def scheduler_kwargs(cfg, num_blocks: int) -> dict:
    """Constructor arguments of a vLLM(-Omni) scheduler over one full-attention KV cache group."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return dict(vllm_config=cfg, kv_cache_config=kv, block_size=BLOCK_SIZE,
                structured_output_manager=StructuredOutputManager(cfg))


def make_scheduler(variant: str, d: Path, *, batch: int, prompt: int, steps: int):
    """A fresh scheduler of ``variant`` (:data:`VARIANTS`) with room for ``batch`` requests of
    ``prompt + steps`` tokens (no preemption)."""
    from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler

    from omni_cache.engine.scheduler import capped_ar_scheduler

    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {', '.join(VARIANTS)}")
    num_blocks = batch * ((prompt + steps) // BLOCK_SIZE + 2) + 1
    cfg = vllm_config(d, num_blocks=num_blocks, max_num_batched_tokens=max(2048, batch * prompt),
                      async_scheduling=True, prefix_caching=variant != "off", max_num_seqs=max(4, batch),
                      max_model_len=prompt + steps + BLOCK_SIZE)
    kwargs = scheduler_kwargs(cfg, num_blocks)
    return capped_ar_scheduler(**kwargs) if variant == "omni_cache" else OmniARAsyncScheduler(**kwargs)


def decode_step_us(variant: str, batch: int, steps: int, *, prompt: int = 128) -> tuple[float, float]:
    """Mean µs per decode step of ``schedule()`` and of ``update_from_output()`` (``batch`` requests
    with distinct ``prompt``-token prompts, prefilled first, then ``steps`` decode steps of one
    token each; vLLM's own block hasher, sha256, as ``Request`` gets it from the engine)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    with tempfile.TemporaryDirectory() as d:
        s = make_scheduler(variant, Path(d), batch=batch, prompt=prompt, steps=steps)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    for i in range(batch):
        s.add_request(Request(f"r{i}", [(i * 7919 + p) % 4999 + 1 for p in range(prompt)],
                              SamplingParams(max_tokens=steps + 8, ignore_eos=True), None, block_hasher=hasher))
    t_sched = t_update = 0.0
    for k in range(steps + 1):  # step 0: the prefill (not timed)
        t0 = time.perf_counter()
        out = s.schedule()
        t1 = time.perf_counter()
        ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                                   sampled_token_ids=[[(k * 31 + j) % 4999 + 1] for j in range(len(ids))])
        t2 = time.perf_counter()
        s.update_from_output(out, result)
        t3 = time.perf_counter()
        if k == 0:
            if sum(out.num_scheduled_tokens.values()) != batch * prompt:
                raise RuntimeError(f"{variant}: the prefill step scheduled {sum(out.num_scheduled_tokens.values())} "
                                   f"tokens, not {batch * prompt}")
            continue
        if len(ids) != batch:
            raise RuntimeError(f"{variant}: decode step {k} scheduled {len(ids)} requests, not {batch}")
        t_sched += t1 - t0
        t_update += t3 - t2
    return t_sched / steps * 1e6, t_update / steps * 1e6


def summarise(samples: dict[str, list[tuple[float, float]]]) -> dict:
    """Per variant: median / min / max over rounds of schedule, update and their sum (µs per step),
    and the sum's median ratio to ``off``'s."""
    out = {}
    for v, rounds in samples.items():
        total = [a + b for a, b in rounds]
        out[v] = {"schedule_us": statistics.median(a for a, _ in rounds),
                  "update_us": statistics.median(b for _, b in rounds),
                  "total_us_median": statistics.median(total), "total_us_min": min(total),
                  "total_us_max": max(total), "rounds": [{"schedule_us": a, "update_us": b} for a, b in rounds]}
    if "off" in out:
        for v in out:
            out[v]["ratio_to_off"] = out[v]["total_us_median"] / out["off"]["total_us_median"]
    return out


def plot(result: dict, path: Path) -> None:
    """Bars of µs per decode step (schedule + update stacked) per variant, one group per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(result["batches"])
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        cells = result["batches"][b]
        names = [v for v in VARIANTS if v in cells]
        sched = [cells[v]["schedule_us"] for v in names]
        upd = [cells[v]["update_us"] for v in names]
        ax.bar(names, sched, label="schedule()")
        ax.bar(names, upd, bottom=sched, label="update_from_output()")
        for i, v in enumerate(names):
            ax.text(i, sched[i] + upd[i], f"{cells[v].get('ratio_to_off', 1):.2f}×", ha="center", va="bottom")
        ax.set_title(f"batch {b}: µs per decode step (× off)")
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,16", help="requests per decode step, comma-separated (default 1,16)")
    ap.add_argument("--steps", type=int, default=256, help="timed decode steps per round (default 256)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, variants alternated (default 5)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated (default {','.join(VARIANTS)})")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/scheduler-overhead-<time>)")
    args = ap.parse_args(argv)
    batches = lab.positive_int_list(args.batch, "--batch")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants: {bad or 'none'}; choose from {', '.join(VARIANTS)}")
    if args.steps < 1 or args.prompt < 1 or args.rounds < 1:
        ap.error("--steps, --prompt and --rounds must be positive")
    samples = {b: {v: [] for v in variants} for b in batches}
    for k in range(args.rounds):
        for b in batches:
            order = variants[k % len(variants):] + variants[:k % len(variants)]  # rotated per round
            for v in order:
                samples[b][v].append(decode_step_us(v, b, args.steps, prompt=args.prompt))
                a, u = samples[b][v][-1]
                print(f"[round {k + 1}/{args.rounds}] batch {b} {v}: schedule {a:.1f} + update {u:.1f} µs "
                      "per decode step", flush=True)
    result = {**lab.stamp("benchmarks.scheduler_overhead", argv), "args": lab.jsonable(args),
              "block_size": BLOCK_SIZE, "batches": {str(b): summarise(samples[b]) for b in batches}}
    out = lab.results_dir(args.out, "scheduler-overhead")
    plot(result, out / "scheduler_overhead.png")
    print(f"result: {lab.write_result(out, result)}")
    for b, cells in result["batches"].items():
        print(f"batch {b}: " + ", ".join(f"{v} {c['total_us_median']:.1f} µs ({c.get('ratio_to_off', 1):.2f}× off)"
                                         for v, c in cells.items()))
    return result


if __name__ == "__main__":
    main()
