"""Helpers for tests that drive the real pipeline with a variant of the CPU stage config."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_STAGE_CONFIG = REPO / "stage_configs" / "qwen3_omni_cpu.yaml"


def variant_stage_config(out_dir: Path, variant: str, thinker: dict | None = None, *,
                         streaming: bool = False) -> Path:
    """The CPU stage config for ``variant`` — ``off`` (thinker and talker caches off),
    ``builtin`` (vLLM-Omni's own cache, talker cache off), ``omni_cache`` (and the talker's
    content-keyed cache, as the bundled config) — with hand-offs recorded into
    ``out_dir/handoff`` and ``out_dir/codec``, metrics into ``out_dir/metrics`` and served
    hits into ``out_dir/audit``: :func:`omni_cache.exactness.fuzz.recording_stage_config`."""
    from omni_cache.exactness.fuzz import recording_stage_config

    return recording_stage_config(out_dir, variant, streaming=streaming, thinker=thinker, base=CPU_STAGE_CONFIG)


def in_process_stages(cfg: Path) -> Path:
    """``cfg`` rewritten in place with vLLM's ``uni`` executor on every stage (the worker runs
    inside the stage's engine-core process; the pipelines start it with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, :func:`omni_cache.driver.pipeline.engine_start_environment`).
    Returns ``cfg``."""
    import yaml

    from omni_cache.driver.variants import derive_stage_config

    ids = [s["stage_id"] for s in yaml.safe_load(Path(cfg).read_text())["stages"]]
    return derive_stage_config(cfg, cfg, stages={i: {"distributed_executor_backend": "uni"} for i in ids})


def assert_handoff_equal(got: dict, ref: dict, name: str) -> None:
    """Two recorded thinker→talker hand-offs (tensor name → tensor) are bitwise equal: oracle
    (b), :func:`omni_cache.exactness.oracles.handoff_mismatches` (``embed.tts_*``: every row
    equals ``ref``'s first, the row the talker reads; every other tensor same shape, same bits).
    """
    from omni_cache.exactness.oracles import handoff_mismatches

    bad = handoff_mismatches([got], [ref])
    assert not bad, (name, bad)


#: per-row relative error allowed between cache on and off for requests of a concurrent batch
#: (also tests/pipeline/test_stress.py): batch-variant CPU kernels change the last bf16 bits;
#: a wrong row (another prompt's, a stale one) is off by O(1)
BATCH_ROW_RTOL = 0.05


def assert_batch_rows(on, off, name: str, *, writer=None, hit: int = 0) -> int:
    """Rows ``[num_tokens, ...]`` of one request of a concurrent batch, cache on vs off.

    Bitwise where the cache is the reason: with ``writer`` (the rows of the request that
    computed B's hit blocks in the same step, same run), B's hit rows ``[:hit]`` must equal
    them bitwise — what the cache served is exactly what was computed. Against cache off, rows
    are compared within :data:`BATCH_ROW_RTOL`: cache on changes the batch a step runs (a hit
    shortens prefill) and the CPU kernels are not batch-invariant — with cache off, B's
    recompute of A's prefix differed from A's own rows (measured: 3 of 1,440 captured-layer
    rows in the last bf16 bit, 185 final-layer rows). Returns the number of bitwise-equal rows.
    """
    import torch

    from tests.device import CACHE_OFF_BITWISE

    assert on.shape == off.shape, (name, on.shape, off.shape)
    if writer is not None and hit:
        assert torch.equal(on[:hit], writer[:hit]), f"{name}: hit rows differ from the rows their writer computed"
    if not CACHE_OFF_BITWISE:  # on CUDA a batch's rows vs cache off are not bounded
        return int((on == off).reshape(on.shape[0], -1).all(dim=-1).sum())  # (measured 5.9 % rel, H100)
    x, y = on.float().reshape(on.shape[0], -1), off.float().reshape(off.shape[0], -1)
    err = (x - y).abs().amax(dim=-1) / y.abs().amax(dim=-1).clamp_min(1e-6)
    bad = int((err > BATCH_ROW_RTOL).sum())
    assert bad == 0, (f"{name}: {bad} rows differ from cache off beyond batch variance "
                      f"(max rel err {float(err.max()):.3g})")
    return int((x == y).all(dim=-1).sum())


def assert_audio_vs_cache_off(r_on, r_off, name: str, *, handoff_bitwise: bool = True) -> bool:
    """A request's waveform (``.audio``, float32 ``[num_samples]``) against its cache-off
    reference's, at the precision oracle (c) has on this device (:mod:`tests.device`).

    Bitwise where :data:`tests.device.CACHE_OFF_BITWISE` (the CPU), and on CUDA too where the
    talker received the same bits and computed every row (``handoff_bitwise`` and no talker
    prefix hit). Otherwise (on CUDA: a talker hit, or hand-off rows within tolerance only) the
    sampled codes may diverge: the same number of samples, finite, not silent. Returns whether
    it was compared bitwise.
    """
    import numpy as np

    from tests.device import CACHE_OFF_BITWISE

    assert r_on.audio is not None and r_off.audio is not None, name
    assert np.isfinite(r_on.audio).all() and float(np.abs(r_on.audio).max()) > 0, name
    bitwise = CACHE_OFF_BITWISE or (handoff_bitwise and not (getattr(r_on, "talker_num_cached_tokens", 0) or 0))
    if bitwise:
        assert np.array_equal(r_on.audio, r_off.audio), name
    else:
        assert r_on.audio.shape == r_off.audio.shape, (name, r_on.audio.shape, r_off.audio.shape)
    return bitwise


def recorded_chunks(out_dir) -> list[list[dict]]:
    """Recorded chunks per request (``[[chunk0, chunk1, ...], ...]``), requests in the order
    of their first chunk."""
    import re
    from collections import defaultdict

    import torch

    by_req: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for p in (out_dir / "handoff").glob("*.pt"):
        m = re.match(r"(\d+)-(.+)\.pt$", p.name)
        by_req[m.group(2)].append((int(m.group(1)), torch.load(p)))
    reqs = sorted(by_req.values(), key=lambda chunks: min(s for s, _ in chunks))
    return [[c for _, c in sorted(chunks, key=lambda x: x[0])] for chunks in reqs]


def assert_same_chunks(got: list[dict], ref: list[dict], name: str) -> None:
    """Every streamed chunk a request sent (first hand-off and decode chunks, recorded by
    :func:`omni_cache.engine.handoff.record_thinker2talker_async_chunk`) equals ``ref``'s
    bitwise, same count and keys."""
    import torch

    assert len(got) == len(ref), (name, len(got), len(ref))
    assert "embed.prefill" in ref[0] and "hidden_states.output" in ref[0], (name, sorted(ref[0]))
    for i, (g, r) in enumerate(zip(got, ref)):
        assert set(g) == set(r), (name, i, sorted(g), sorted(r))
        for k in r:
            assert g[k].shape == r[k].shape and torch.equal(g[k], r[k]), (name, i, k)


def assert_chunks_vs_cache_off(got: list[dict], ref: list[dict], name: str, *, num_prompt_tokens: int,
                               hit: int, same_tokens: bool = True) -> bool:
    """A request's streamed chunks (cache on, ``got``) against its cache-off reference's, at the
    precision oracle (c) has on this device (:mod:`tests.device`).

    Bitwise (:func:`assert_same_chunks`) where :data:`tests.device.CACHE_OFF_BITWISE`. On CUDA's
    CUDA: the first chunk's prompt rows (``embed.prefill``, ``hidden_states.output``
    ``[:num_prompt_tokens]``) by :func:`omni_cache.exactness.oracles.compare_prompt_rows`
    (embedding rows bitwise, the rest within ``TOLERANCE_ULPS``; ``hit``: the prefix hit,
    tokens), its other tensors (ids, TTS embeddings) by ``handoff_mismatches`` (bitwise), and,
    where the tokens are the same (``same_tokens``), as many chunks as the reference's. Returns
    whether every chunk was bitwise equal.
    """
    import torch

    from omni_cache.exactness import oracles
    from tests.device import CACHE_OFF_BITWISE

    if CACHE_OFF_BITWISE:
        assert_same_chunks(got, ref, name)
        return True
    assert got and ref and set(got[0]) == set(ref[0]), (name, len(got), len(ref))
    if same_tokens:
        assert len(got) == len(ref), (name, len(got), len(ref))
    _, bad = oracles.compare_prompt_rows(oracles.prompt_rows(got, num_prompt_tokens),
                                         oracles.prompt_rows(ref, num_prompt_tokens), hit)
    assert not bad, (name, bad)
    rest = [k for k in ref[0] if k not in ("embed.prefill", "hidden_states.output")]
    assert not oracles.handoff_mismatches([{k: got[0][k] for k in rest}], [{k: ref[0][k] for k in rest}]), name
    return len(got) == len(ref) and all(
        set(g) == set(r) and all(g[k].shape == r[k].shape and torch.equal(g[k], r[k]) for k in r)
        for g, r in zip(got, ref))


def records_of(out_dir, request_id: str, sub: str = "handoff") -> list[dict]:
    """The hand-off records (tensor name → tensor) a stage wrote for ``request_id`` into
    ``out_dir/sub``, in the order written (:func:`omni_cache.exactness.fuzz.records`)."""
    from omni_cache.exactness.fuzz import records

    return records(out_dir, request_id, sub)


def read_metrics(out_dir, prefix: str, until=None, timeout: float = 20.0) -> dict:
    """The one ``<prefix>-<pid>.json`` counters file an engine process publishes into
    ``out_dir/metrics`` (:class:`omni_cache.engine.metrics.MetricsFile`). ``until``: a
    predicate on the counters to wait for (the engine may still be running and publishes at
    most every ``min_interval_s``): polled for up to ``timeout`` seconds, then the last
    counters are returned as they are, for the caller's assertion to report."""
    import json
    import time

    deadline = time.monotonic() + timeout
    while True:
        files = list((Path(out_dir) / "metrics").glob(f"{prefix}-*.json"))
        if not files and time.monotonic() <= deadline:  # an engine's first write is a timer thread's
            time.sleep(0.2)
            continue
        assert len(files) == 1, (prefix, files)
        counters = json.loads(files[0].read_text())
        if until is None or until(counters) or time.monotonic() > deadline:
            return counters
        time.sleep(0.2)


def same_bits(a, b) -> bool:
    """Two tensors have the same dtype, shape and bytes (bitwise equal: NaN payloads and
    signed zeros included)."""
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def placeholder_talker_keys(hook):
    """A context manager: while it is open, ``hook`` (a running
    :class:`omni_cache.driver.talker_identity.TalkerIdentity`) keys every full talker block by
    its index alone — what vLLM's own hash of the talker's placeholder prompt ``[0] * n``
    amounts to — so a test can show that scheme sharing KV between different conversations of
    equal lengths (test-only: the instance's ``block_keys`` is replaced, then restored)."""
    import contextlib

    @contextlib.contextmanager
    def scheme():
        def block_keys(request_id, thinker, talker_ids, req_state):
            return hook.signed([f"placeholder/{j}" for j in range(len(talker_ids) // hook.block_size)])

        hook.block_keys = block_keys
        try:
            yield hook
        finally:
            del hook.block_keys  # the class's content keys again

    return scheme()
