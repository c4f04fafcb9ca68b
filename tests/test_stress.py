"""Randomized stress (seeded): many concurrent requests, mixed modalities, a KV pool small
enough to force eviction and preemption, chunked prefill — omni-cache vs cache off.

Concurrency changes batch composition, and on CPU a bf16 GEMM row can differ in its last bits
with the batch it ran in, so rows are compared with a tolerance far below what a wrong row
(another prompt's, or a stale one) would show; the test also reports how many were bitwise
equal. The engine must be alive at the end.
"""

from __future__ import annotations

import random

import pytest
import torch
import yaml

from omni_cache.inputs import build_request, sample_path
from tests.pipeline_util import variant_stage_config

pytestmark = pytest.mark.pipeline

SEED = 20261122
N_REQUESTS = 24
CONCURRENCY = 6
PREFIXES = [
    "You are a careful observer. Describe what you perceive in detail, step by step. " * 4,
    "Answer briefly and precisely, as a museum guide would, without speculation please. " * 4,
    "Translate your impressions into a short poem with vivid images and clear rhythm. " * 4,
]


def _small_pool(path):
    raw = yaml.safe_load(path.read_text())
    s0 = raw["stages"][0]
    s0["kv_cache_memory_bytes"] = 1 << 20  # 1 MiB: ~2k tokens of the tiny thinker's KV
    s0["max_model_len"] = 1536
    s0["max_num_batched_tokens"] = 256  # chunked prefill
    s0["default_sampling_params"]["max_tokens"] = 12
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _workload():
    rng = random.Random(SEED)
    reqs = []
    for i in range(N_REQUESTS):
        media = rng.choice([{}, {"image": sample_path("astronaut.jpg")}, {"audio": sample_path("speech.wav")}])
        reqs.append((rng.choice(PREFIXES) + f" Item {rng.randint(0, 3)}.", media))
    return reqs


def _run(pipe):
    out = []
    work = _workload()
    for i in range(0, len(work), CONCURRENCY):
        batch = [build_request(t, **m) for t, m in work[i: i + CONCURRENCY]]
        out.extend(pipe.generate(batch))
    alive = pipe.generate([build_request("Still alive?")])[0]
    return out, alive


def _dump_for(d, request_id):
    files = [p for p in (d / "handoff").glob("*.pt") if p.name.split("-", 1)[1].startswith(request_id)]
    assert len(files) == 1, (request_id, len(files))
    return torch.load(files[0])


@pytest.fixture(scope="module")
def stress(tmp_path_factory, tiny_model_dir):
    from omni_cache.vllm_omni.pipeline import OmniPipeline

    runs = {}
    for variant in ("off", "omni_cache"):
        d = tmp_path_factory.mktemp(f"stress_{variant}")
        cfg = _small_pool(variant_stage_config(d, variant))
        with OmniPipeline(tiny_model_dir, cfg) as pipe:
            runs[variant] = (d, *_run(pipe))
    return runs


def test_stress_no_mismatched_rows_and_engine_alive(stress):
    d_off, off, alive_off = stress["off"]
    d_on, on, alive_on = stress["omni_cache"]
    assert alive_on.error is None and alive_on.token_ids and alive_on.audio is not None
    assert sum(r.num_cached_tokens for r in on) > 0, "the stress run produced no prefix hit"
    rows = bitwise = 0
    for r_off, r_on in zip(off, on):
        assert r_on.error is None and r_off.error is None
        h_off, h_on = _dump_for(d_off, r_off.request_id), _dump_for(d_on, r_on.request_id)
        assert set(h_off) == set(h_on)
        for k in h_off:
            a, b = h_off[k].float(), h_on[k].float()
            if k.startswith("embed."):
                # request-invariant TTS embeddings, appended once per engine step: the number
                # of steps differs when a hit shortens chunked prefill; the talker uses one
                a, b = a[:1], b[:1]
            assert a.shape == b.shape, k
            err = (a - b).abs().amax(dim=-1) / a.abs().amax(dim=-1).clamp_min(1e-6)
            bad = int((err > 0.05).sum())
            assert bad == 0, f"{k}: {bad} mismatched rows (max rel err {float(err.max()):.3g})"
            rows += a.shape[0]
            bitwise += int((a == b).all(dim=-1).sum())
    print(f"stress: {rows} rows compared, {bitwise} bitwise equal, 0 mismatched; "
          f"hit tokens {sum(r.num_cached_tokens for r in on)}")
