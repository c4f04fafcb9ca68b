"""Randomized stress (seeded) on the production path — vLLM-Omni's async engine
(``AsyncOmni``, the one its server uses) with the streaming hand-off (``async_chunk: true``):
many concurrent requests, mixed modalities, a KV pool small enough to force eviction and
preemption (requests preempted after their first chunk went to the talker, then resumed),
chunked prefill, client aborts at random moments and right after a request's first audio
packet — omni-cache (``stress_omni``: its thinker KV pool is 512 KiB) vs the real cache-off
engine ``stream_off`` (shared with ``test_streaming_equality``), the same seeded workload on both.

Every request that was not aborted must hand the talker the same rows with omni-cache as
without a cache: its first streamed hand-off (prompt rows, exactly one per request — a
resumed request handing its prompt twice fails) and its decode chunks — one row per sampled
token, compared while both runs sampled the same tokens (a preempted request's first step
after its resume must still hand on its token's row: ``omni_cache.engine.handoff``). Only
``stress_omni`` preempts (``stream_off``'s pool is large), so a row lost or doubled around a
resume shows. Concurrency changes batch composition, and on CPU a bf16 GEMM row can differ
in its last bits with the batch it ran in, so rows are compared with a tolerance far below
what a wrong row (another prompt's, or a stale one) would show; the test also reports how
many were bitwise equal. Preemptions are counted by omni-cache's scheduler (its metrics
file), so the test fails if the pool stops forcing them. The engine must be alive at the end.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from omni_cache.driver.inputs import build_request, sample_path

pytestmark = pytest.mark.pipeline

SEED = 20261122
N_REQUESTS = 32
CONCURRENCY = 6
ABORT_FRACTION = 0.25
FIRST_PACKET = "first audio packet"  # abort as soon as the request's first audio packet arrives
PREFIXES = [
    "You are a careful observer. Describe what you perceive in detail, step by step. " * 4,
    "Answer briefly and precisely, as a museum guide would, without speculation please. " * 4,
    "Translate your impressions into a short poem with vivid images and clear rhythm. " * 4,
]


def _workload():
    """``[(request_id, text, media, abort_after_s | None)]``, seeded."""
    rng = random.Random(SEED)
    reqs = []
    for i in range(N_REQUESTS):
        media = rng.choice([{}, {"image": sample_path("astronaut.jpg")}, {"audio": sample_path("speech.wav")}])
        u = rng.random()
        abort = rng.uniform(0.0, 3.0) if u < ABORT_FRACTION else FIRST_PACKET if u < 1.5 * ABORT_FRACTION else None
        reqs.append((f"stress{i:03d}", rng.choice(PREFIXES) + f" Item {rng.randint(0, 3)}.", media, abort))
    return reqs


async def _one(omni, sem, rid, text, media, abort_after, sps=None):
    """Run one request; ``abort_after`` seconds after submission (or, with
    :data:`FIRST_PACKET`, when its first audio packet arrives) the client aborts it.
    Returns ``(completed, num_cached_tokens, num_prompt_tokens, thinker token ids)``."""
    async with sem:
        prompt = build_request(text, **media).to_engine_prompt()
        outs = []
        first_packet = asyncio.Event()

        async def consume():
            async for o in omni.generate(prompt, request_id=rid, **({"sampling_params_list": sps} if sps else {})):
                outs.append(o)
                if o.final_output_type == "audio":
                    first_packet.set()

        task = asyncio.ensure_future(consume())
        if abort_after is not None:
            if abort_after == FIRST_PACKET:
                waiter = asyncio.ensure_future(first_packet.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                done = task.done()
            else:
                done, _ = await asyncio.wait({task}, timeout=abort_after)
            if not done:
                await omni.abort(rid)
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
                return False, 0, 0, []
        await task
        thinker = [o for o in outs if o.stage_id == 0]
        cached = max((int(o.num_cached_tokens or 0) for o in thinker), default=0)
        errors = [o.error for o in outs if o.error]
        assert not errors, f"request {rid}: {errors}"
        # AsyncOmni streams the thinker's tokens as deltas (its stage defaults are coerced to
        # RequestOutputKind.DELTA): the answer is their concatenation
        tokens = [t for o in thinker if o.outputs for t in (o.outputs[0].token_ids or [])]
        n_prompt = max((len(o.prompt_token_ids or []) for o in thinker), default=0)
        return any(o.final_output_type == "audio" for o in outs), cached, n_prompt, tokens


async def _drive(omni, sps=None):
    """The seeded workload at :data:`CONCURRENCY`, then one request alone; ``sps``: the
    per-stage sampling params (None: the engine's defaults)."""
    sem = asyncio.Semaphore(CONCURRENCY)
    work = _workload()
    res = await asyncio.gather(*(_one(omni, sem, *w, sps=sps) for w in work))
    status = {w[0]: r for w, r in zip(work, res)}
    alive = await _one(omni, asyncio.Semaphore(1), "alive", "Still alive?", {}, None, sps=sps)
    return status, alive


def _chunks_for(d, request_id) -> tuple[dict, torch.Tensor | None]:
    """A request's streamed hand-off: (first chunk, its decode chunks' ``embed.decode`` rows
    concatenated ``[num_decode_chunks, hidden]``); exactly one first chunk (prompt rows)."""
    files = sorted((p for p in (d / "handoff").glob("*.pt") if p.name.split("-", 1)[1].startswith(request_id + "-")),
                   key=lambda p: int(p.name.split("-", 1)[0]))
    chunks = [torch.load(p) for p in files]
    firsts = [c for c in chunks if "embed.prefill" in c]
    assert len(firsts) == 1, f"{request_id}: {len(firsts)} prompt hand-offs in {len(chunks)} chunks"
    assert "embed.prefill" in chunks[0], f"{request_id}: a decode chunk before the prompt hand-off"
    dec = [c["embed.decode"] for c in chunks[1:] if "embed.decode" in c]
    return chunks[0], torch.cat(dec) if dec else None


@pytest.fixture(scope="session")
def stress(stress_omni, stream_off):
    runs = {"omni_cache": (stress_omni.dir, *stress_omni.pipe.run_async(_drive(stress_omni.pipe.omni)))}
    # the cache-off engine answers with the stress engine's thinker budget (max_tokens 48)
    sps = stream_off.pipe.default_sampling_params()
    sps[0].max_tokens = stress_omni.pipe.default_sampling_params()[0].max_tokens
    runs["off"] = (stream_off.dir, *stream_off.pipe.run_async(_drive(stream_off.pipe.omni, sps)))
    return runs


def _scheduler_metrics(d):
    files = list((d / "metrics").glob("scheduler-*.json"))
    assert files, "omni-cache's scheduler wrote no metrics file"
    return json.loads(files[0].read_text())


def test_stress_no_mismatched_rows_and_engine_alive(stress):
    d_off, off, alive_off = stress["off"]
    d_on, on, alive_on = stress["omni_cache"]
    assert alive_on[0] and alive_off[0], "engine not serving after the stress run"
    assert alive_on[3] == alive_off[3], "the last request's tokens differ"
    aborted = [rid for rid, r in on.items() if not r[0]]
    assert aborted, "no request was aborted mid-flight"
    after_packet = [w[0] for w in _workload() if w[3] == FIRST_PACKET]
    assert after_packet, "the workload aborts no request at its first audio packet"
    assert sum(r[1] for r in on.values()) > 0, "the stress run produced no prefix hit"
    sched = _scheduler_metrics(d_on)
    assert sched["preemptions"] > 0, f"the small KV pool forced no preemption: {sched}"
    rows = bitwise = compared = 0
    # the request sent alone after the stress (and after the first-packet aborts) is compared too
    on, off = {**on, "alive": alive_on}, {**off, "alive": alive_off}
    for rid, (done_on, _, n_prompt, toks_on) in on.items():
        done_off, _, n_prompt_off, toks_off = off[rid]
        if not (done_on and done_off):
            continue
        compared += 1
        assert n_prompt == n_prompt_off, (rid, n_prompt, n_prompt_off)
        # rows of positions whose tokens agree: the prompt, then the sampled tokens up to the
        # first one where batching's last-bit differences flipped a near-tie (rare)
        same = next((i for i, (x, y) in enumerate(zip(toks_on, toks_off)) if x != y), min(len(toks_on), len(toks_off)))
        (h_off, dec_off), (h_on, dec_on) = _chunks_for(d_off, rid), _chunks_for(d_on, rid)
        assert set(h_off) == set(h_on)
        pairs = [(k, h_off[k], h_on[k]) for k in h_off if isinstance(h_off[k], torch.Tensor)]
        if dec_off is not None and dec_on is not None:
            pairs.append(("embed.decode", dec_off, dec_on))
        for k, a, b in pairs:
            a, b = a.float(), b.float()
            if k.startswith("ids."):
                # token ids of the prompt (and what was sampled so far): exact
                if toks_on == toks_off:
                    assert torch.equal(a, b), (rid, k)
                continue
            if k.startswith("embed.tts"):
                # request-invariant TTS embeddings, one row per thinker step: the talker reads one
                a, b = a[:1], b[:1]
            elif k == "embed.decode":
                # one row per sampled token after the first; compare while the tokens agree
                limit = min(a.shape[0], b.shape[0], max(same - 1, 0))
                a, b = a[:limit], b[:limit]
            elif a.dim() >= 2 and a.shape[0] > 1:
                # prompt rows (+ the first sampled token's): one per position in both runs
                assert a.shape == b.shape, (rid, k, a.shape, b.shape, n_prompt)
            if a.dim() < 2 or a.shape[0] == 0:
                assert torch.equal(a, b), (rid, k)
                continue
            assert a.shape == b.shape, (rid, k)
            err = (a - b).abs().amax(dim=-1) / a.abs().amax(dim=-1).clamp_min(1e-6)
            bad = int((err > 0.05).sum())
            assert bad == 0, f"{rid} {k}: {bad} mismatched rows (max rel err {float(err.max()):.3g})"
            rows += a.shape[0]
            bitwise += int((a == b).all(dim=-1).sum())
    assert compared >= N_REQUESTS // 2, f"only {compared} requests completed in both runs"
    print(f"stress: {compared} requests, {rows} rows compared, {bitwise} bitwise equal, 0 mismatched; "
          f"{len(aborted)} aborted; hit tokens {sum(r[1] for r in on.values())}; scheduler {sched}")
