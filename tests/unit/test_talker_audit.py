"""The talker's KV audit (omni_cache.engine.talker_audit) and its oracle
(omni_cache.exactness.oracles.talker_kv_mismatches), on small fakes of a runner's KV and a
scheduler output; the real engine runs it in tests/pipeline/test_cache_equality.py
(``test_talker_prefix_cache_exact_and_content_keyed``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from omni_cache.engine.talker_audit import TalkerKVAudit, _block_dim, kv_block_digests
from omni_cache.exactness.oracles import talker_kv_mismatches

BS, NUM_BLOCKS = 4, 9


def _kv(layout: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BS, 2, 3) if layout == "flash" else (NUM_BLOCKS, 2, BS, 2, 3)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(3)]


@pytest.mark.parametrize("layout", ["flash", "flashinfer"])
def test_block_digest_sees_one_changed_value_in_any_layer(layout):
    kv = _kv(layout)
    before = kv_block_digests(kv, [1, 5, 7], NUM_BLOCKS)
    assert len(set(before)) == 3
    dim = 1 if layout == "flash" else 0
    kv[2].select(dim, 5)[-1, -1, -1, -1] += 1  # the last value of block 5 in the last layer
    after = kv_block_digests(kv, [1, 5, 7], NUM_BLOCKS)
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]


def test_block_dimension_must_be_unambiguous():
    with pytest.raises(ValueError, match="block dimension"):
        kv_block_digests([torch.zeros(NUM_BLOCKS, NUM_BLOCKS)], [0], NUM_BLOCKS)


def _so(new=(), cached=(), scheduled=None):
    """A scheduler output: ``new`` (req_id, block_ids, num_computed_tokens), ``cached`` (req_id,
    num_computed_tokens), ``scheduled`` req_id → tokens."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled or {})


def _talker_runner(**more):
    return SimpleNamespace(model_config=SimpleNamespace(model_stage="talker"),
                           cache_config=SimpleNamespace(block_size=BS), **more)


def test_audit_logs_a_steps_writes_then_its_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_HIT_AUDIT", str(tmp_path))
    kv = _kv("flash")
    runner = _talker_runner(kv_cache_config=SimpleNamespace(num_blocks=NUM_BLOCKS), kv_caches=kv,
                            requests={"w": SimpleNamespace(block_ids=([3, 4, 6],)),
                                      "r": SimpleNamespace(block_ids=([3, 8],))})
    audit = TalkerKVAudit.for_runner(runner)
    # step 1: the writer prefills 10 tokens (blocks 0 and 1 full, block 2 partial)
    step1 = _so(new=[("w", [3, 4, 6], 0)], scheduled={"w": 10})
    audit.after_step(runner, step1)
    # step 2: the writer decodes 2 tokens (block 2 fills); the reader arrives with a 4-token hit
    step2 = _so(new=[("r", [3, 8], 4)], cached=[("w", 10)], scheduled={"w": 2, "r": 3})
    audit.after_step(runner, step2)
    events = [json.loads(line) for line in next(tmp_path.glob("talker-kv-*.jsonl")).read_text().splitlines()]
    got = [(e["kind"], e["request"], e["block"], e["block_id"]) for e in events]
    assert got == [("write", "w", 0, 3), ("write", "w", 1, 4), ("write", "w", 2, 6), ("read", "r", 0, 3)]
    bad, served = talker_kv_mismatches(events)
    assert not bad and [(s.reader, s.writer, s.block) for s in served] == [("r", "w", 0)]


def test_a_same_step_hit_is_read_after_its_write(tmp_path, monkeypatch):
    """vLLM caches a block when it allocates it, so a request scheduled in the writer's own step
    is served the block in that step (the CPU CI's flaky "served, never written", 2026-11-27):
    the read is logged after the step's writes and digests the KV the writer left."""
    monkeypatch.setenv("OMNI_CACHE_HIT_AUDIT", str(tmp_path))
    kv = _kv("flash")
    runner = _talker_runner(kv_cache_config=SimpleNamespace(num_blocks=NUM_BLOCKS), kv_caches=kv,
                            requests={"w": SimpleNamespace(block_ids=([3, 4],)),
                                      "r": SimpleNamespace(block_ids=([3, 8],))})
    audit = TalkerKVAudit.for_runner(runner)
    step = _so(new=[("w", [3, 4], 0), ("r", [3, 8], 4)], scheduled={"w": 6, "r": 2})
    for layer in kv:  # the step's forward: w's KV written into block 3, r attends to it
        layer.select(_block_dim(layer, NUM_BLOCKS), 3).fill_(1.5)
    audit.after_step(runner, step)
    events = [json.loads(line) for line in next(tmp_path.glob("talker-kv-*.jsonl")).read_text().splitlines()]
    assert [(e["kind"], e["request"], e["block_id"]) for e in events] == [("write", "w", 3), ("read", "r", 3)]
    bad, served = talker_kv_mismatches(events)
    assert not bad and [(s.reader, s.writer) for s in served] == [("r", "w")]


def test_audit_is_off_unless_set_and_on_the_talker(monkeypatch, tmp_path):
    runner = _talker_runner()
    monkeypatch.delenv("OMNI_CACHE_HIT_AUDIT", raising=False)
    assert TalkerKVAudit.for_runner(runner) is None
    monkeypatch.setenv("OMNI_CACHE_HIT_AUDIT", str(tmp_path))
    runner.model_config.model_stage = "thinker"
    assert TalkerKVAudit.for_runner(runner) is None


def _e(kind, req, block, block_id, digest):
    return {"kind": kind, "request": req, "block": block, "block_id": block_id, "digest": digest}


@pytest.mark.parametrize("events, reason", [
    ([_e("read", "r", 0, 3, "a")], "never written"),
    ([_e("write", "w", 0, 3, "a"), _e("read", "r", 0, 3, "b")], "KV changed"),
    ([_e("write", "w", 1, 3, "a"), _e("read", "r", 0, 3, "a")], "last written as block 1"),
    # block 3 reused by another request since w wrote it: a read is held to the last write
    ([_e("write", "w", 0, 3, "a"), _e("write", "x", 2, 3, "c"), _e("read", "r", 0, 3, "a")], "last written as block 2"),
])
def test_oracle_names_each_violation(events, reason):
    bad, served = talker_kv_mismatches(events)
    assert len(bad) == 1 and bad[0][0] == "r" and reason in bad[0][1] and not served


def test_oracle_accepts_a_resumed_request_reading_its_own_blocks():
    bad, served = talker_kv_mismatches([_e("write", "w", 0, 3, "a"), _e("read", "w", 0, 3, "a")])
    assert not bad and served[0].writer == served[0].reader == "w"


def test_audit_of_a_layout_it_cannot_index_stops_and_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_HIT_AUDIT", str(tmp_path))
    runner = _talker_runner(kv_cache_config=SimpleNamespace(num_blocks=NUM_BLOCKS),
                            kv_caches=[torch.zeros(2, NUM_BLOCKS * 2, BS)], requests={})
    audit = TalkerKVAudit.for_runner(runner)
    audit.after_step(runner, _so(new=[("r", [3], 4)]))
    audit.after_step(runner, _so(new=[("s", [4], 4)]))  # stopped: nothing more is logged
    events = [json.loads(line) for line in next(tmp_path.glob("talker-kv-*.jsonl")).read_text().splitlines()]
    assert [e["kind"] for e in events] == ["error"]
    bad, _ = talker_kv_mismatches(events)
    assert len(bad) == 1 and "audit stopped" in bad[0][1]
