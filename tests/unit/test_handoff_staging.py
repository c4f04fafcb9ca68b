"""The hand-off staged at save time (:mod:`omni_cache.core.staging`), as the stage manager
uses it on CUDA — here with the stager's CPU mode (same contract, no stream).

What it must hold, oracle: the rows a full recompute gives (:func:`expected`, as in
``test_stage_manager``), bitwise, also when

- vLLM-Omni's payload builder materializes a step one step late (async omni output, its GPU
  default) and the forward wrote into a buffer the next step reuses (a CUDA graph's static
  output): the staged rows were copied off the buffer at save time;
- decode tokens are placeholders on the host (async scheduling): the step's input ids are kept
  once per step (:class:`~omni_cache.core.staging.KeptIds`) and resolve the block hashes.

The CUDA half (pinned memory, the side stream, the event) is ``test_staging_cuda_*`` below,
skipped without a GPU (the GPU lane's unit group runs it).
"""

from __future__ import annotations

import pytest
import torch

from omni_cache.core.staging import HostStager, KeptIds, KeptIdsRing
from omni_cache.engine.stage_manager import HIDDEN_KEY

from .test_stage_manager import FakeEngine, assert_rows, expected, prefix_rows, scheduler_output


class StaticBufferEngine(FakeEngine):
    """A fake forward that writes every step's outputs into the same buffers (as a CUDA-graph
    replay does) and materializes each step only after the next step's forward (as vLLM-Omni's
    async omni output does)."""

    def __init__(self, staged: bool):
        super().__init__()
        if staged:
            self.manager._stager = HostStager(torch.device("cpu"))
        self.buf = {k: torch.zeros(64, 6) for k in self.keys}
        self.pending = None
        self.own = {}

    def save(self, *, new=(), cached=()):
        """Schedule and save a step; materialize the previous one (returns its hand-off)."""
        from types import SimpleNamespace as NS

        self.manager.new_step_starts(scheduler_output(new, cached))
        order = [r for r, *_ in (*new, *cached)]
        self.runner.input_batch.req_ids = order
        spans = {r: (c, c + n) for r, _, c, n in (*new, *cached)}
        self.runner.input_ids = NS(gpu=torch.tensor([t for r in order for t in self.tokens(r)[slice(*spans[r])]]))
        rows = torch.cat([prefix_rows(self.tokens(r), *spans[r]) for r in order])
        n = rows.shape[0]
        self.buf[HIDDEN_KEY][:n] = rows  # the forward writes into the static buffers
        for k in self.keys:
            if k != HIDDEN_KEY:
                self.buf[k][:n] = rows * 2 + 1
        mm = {k: self.buf[k][:n] for k in self.keys if k != HIDDEN_KEY}
        step_id = self.manager.save_outputs(self.buf[HIDDEN_KEY][:n], mm, num_tokens_unpadded=n,
                                            num_tokens_padded=n)
        # vLLM-Omni's own copy of the step's multimodal outputs, which its payload builder
        # slices per request when the prefix cache hands over none (a step without a hit)
        batch, off = {}, 0
        for r in order:
            batch[r], off = (off, off + spans[r][1] - spans[r][0]), off + spans[r][1] - spans[r][0]
        self.own[step_id] = (batch, {k: v.clone() for k, v in mm.items()})
        previous, self.pending = self.pending, (step_id, order)
        return None if previous is None else self.flush(previous)

    def flush(self, pending=None):
        step_id, order = pending or self.pending
        out = self.manager.materialize(step_id, order)
        batch, own = self.own.pop(step_id)
        if not out.mm_outputs:
            return {r: {HIDDEN_KEY: out.hidden_states[r], **{k: v[slice(*batch[r])] for k, v in own.items()}}
                    for r in order}
        return {r: {HIDDEN_KEY: out.hidden_states[r], **{k: v[r] for k, v in out.mm_outputs.items()}}
                for r in order}


def _one_step_late(eng: StaticBufferEngine):
    a, b = list(range(100, 111)), list(range(100, 108)) + [7, 8, 9]
    eng.add("A", a)
    eng.add("B", b)
    eng.save(new=[("A", [3, 7, 9], 0, 11)])           # A's prefill; its hand-off is built later
    got_a = eng.save(new=[("B", [3, 7, 11], 8, 3)])["A"]  # B hits A's two blocks; the buffer is reused
    got_b = eng.flush()["B"]
    return (got_a, expected(a, 0, 11)), (got_b, expected(b, 0, 11))


def test_staged_hand_off_survives_the_next_forward_reusing_the_buffer():
    for got, want in _one_step_late(StaticBufferEngine(staged=True)):
        assert_rows(got, want)


def test_views_of_the_forward_buffer_would_hand_off_the_next_steps_rows():
    """The fault the staging removes, shown by the same scenario on the merge path (views of
    the live buffer): the one-step-late hand-off of A carries B's rows."""
    (got_a, want_a), _ = _one_step_late(StaticBufferEngine(staged=False))
    assert not torch.equal(got_a[HIDDEN_KEY], want_a[HIDDEN_KEY])


def test_staged_path_hands_off_what_the_merge_path_does_with_hits_and_decode():
    outs = []
    for staged in (False, True):
        eng = FakeEngine()
        if staged:
            eng.manager._stager = HostStager(torch.device("cpu"))
        a = list(range(100, 110))
        eng.add("A", a)
        steps = [eng.step(new=[("A", [3, 7, 9], 0, 10)])]
        eng.sample("A", 55)
        steps.append(eng.step(cached=[("A", None, 10, 1)]))
        b = a[:8] + [1, 2]
        eng.add("B", b)
        steps.append(eng.step(new=[("B", [3, 7, 11], 8, 2)]))
        assert_rows(steps[-1]["B"], expected(b, 0, 10))
        outs.append(steps)
    for merged, staged in zip(*outs):
        for rid in merged:
            assert_rows(staged[rid], merged[rid])


def test_async_placeholders_resolve_from_one_kept_copy_per_step():
    eng = FakeEngine(async_tokens=True)
    a = list(range(100, 106))  # 6 tokens: decode fills block 1 at position 7
    eng.add("A", a)
    eng.add("C", list(range(200, 206)))
    eng.step(new=[("A", [3, 7], 0, 6), ("C", [4, 8], 0, 6)])
    for i, (ta, tc) in enumerate([(55, 65), (56, 66)]):
        eng.sample("A", ta)
        eng.sample("C", tc)
        eng.step(cached=[("A", None, 6 + i, 1), ("C", None, 6 + i, 1)])
        if i == 0:  # one kept copy of the step's ids serves both requests
            (_, ka, sa, _), (_, kc, sc, _) = (eng.manager.reqs[r].device_inputs[0] for r in ("A", "C"))
            assert ka is kc and (sa, sc) == (0, 1) and ka.values(0, 2) == [55, 65]
    # block 1 (positions 4..7) is full after the second decode step: hashed from the real tokens
    hashes = eng.manager.block_hashes("A", 8)
    eng2 = FakeEngine()
    eng2.add("A", a)
    eng2.step(new=[("A", [3, 7], 0, 6)])
    for i, t in enumerate([55, 56]):
        eng2.sample("A", t)
        eng2.step(cached=[("A", None, 6 + i, 1)])
    assert hashes == eng2.manager.block_hashes("A", 8)


def test_kept_ids_read_back_the_slice():
    k = KeptIds(torch.tensor([5, 6, 7, 8]))
    assert k.values(1, 3) == [6, 7]


def test_kept_ids_ring_slices_until_a_lap_passes_them():
    """Steps' ids go to consecutive slices of one ring (no allocation per step); a slice that
    would cross the end starts the next lap; a slice the ring went a full lap past is lost —
    never read (``ready`` False, ``values`` raises) — while the others read back their own ids."""
    ring = KeptIdsRing(torch.device("cpu"), entries=16)
    a, b = ring.keep(torch.arange(6)), ring.keep(torch.arange(10, 16))
    assert a.values(0, 6) == list(range(6)) and b.values(0, 6) == list(range(10, 16))
    c = ring.keep(torch.arange(20, 26))  # 12 + 6 > 16: the next lap, over a's entries
    assert a.lost and not a.ready() and not b.lost and b.ready() and c.ready()
    with pytest.raises(RuntimeError, match="overwritten"):
        a.values(0, 6)
    assert b.values(0, 6) == list(range(10, 16)) and c.values(0, 6) == list(range(20, 26))
    d = ring.keep(torch.arange(3))  # entries 6..8 of the ring: over b's first three
    assert d.values(0, 3) == [0, 1, 2] and b.lost and not c.lost
    assert ring.keep(torch.arange(2)).ring is ring and not ring.keep(torch.arange(3, dtype=torch.int32)).ring


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU lane's unit group)")


@cuda
def test_staging_cuda_rows_survive_overwrite_and_land_pinned():
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16)
    want = buf[:3000].cpu()
    st = HostStager(dev).stage(["h"], ["a", "b"], {"a": [{"h": buf[:1000]}], "b": [{"h": buf[1000:3000]}]})
    buf.fill_(0)  # the next replay overwrites the static buffer before the builder reads
    st.wait()
    assert st.host["h"].is_pinned()
    assert torch.equal(torch.cat([st.rows("a")["h"], st.rows("b")["h"]]), want)


@cuda
def test_kept_ids_cuda_copy_without_sync():
    ids = torch.arange(10, device="cuda")
    k = KeptIds(ids)
    ring_k = KeptIdsRing(ids.device, entries=64).keep(ids)
    ids.fill_(-1)
    assert k.values(2, 5) == [2, 3, 4] and ring_k.values(2, 5) == [2, 3, 4] and ring_k.host.is_pinned()


class SnapshotEngine(StaticBufferEngine):
    """As :class:`StaticBufferEngine`, with ``OMNI_CACHE_HANDOFF_STAGING=snapshot`` (the CUDA
    default): the manager stages only hits' prefixes; the fresh rows come from the copy
    vLLM-Omni's runner takes of every step's outputs (here: a clone of the static buffers at
    save time, nested as the model returns them), handed over as its payload builder starts."""

    def __init__(self, attach: bool = True):
        super().__init__(staged=True)
        self.manager._from_snapshot = True
        self.attach = attach
        self.snapshots = {}

    def save(self, *, new=(), cached=()):
        """As vLLM's worker: the step (forward, save, vLLM-Omni's snapshot) under
        ``torch.inference_mode``; the previous step's hand-off built outside it, as vLLM-Omni's
        async-output thread does (found on an H100: an in-place copy into a pinned buffer made
        at save time raised "Inplace update to inference tensor outside InferenceMode")."""
        previous, self.pending = self.pending, None
        with torch.inference_mode():
            super().save(new=new, cached=cached)
            step_id, _ = self.pending
            n = sum(c for *_, c in (*new, *cached))
            layers = {int(k.rsplit("_", 1)[1]): self.buf[k][:n].clone() for k in self.keys if k != HIDDEN_KEY}
            self.snapshots[step_id] = (self.buf[HIDDEN_KEY].clone(), {"hidden_states": {"layers": layers}})
        return None if previous is None else self.flush(previous)

    def flush(self, pending=None):
        step_id, order = pending or self.pending
        if pending is None:
            self.pending = None  # flushed now, not again at the next save
        if self.attach:
            self.manager.attach_snapshot(step_id, *self.snapshots.pop(step_id))
        return super().flush((step_id, order))


def test_snapshot_hand_off_equals_a_recompute_one_step_late():
    """Oracle: a full recompute's rows, bitwise — A's fresh rows from its step's snapshot,
    B's cached prefix staged at save time plus its fresh rows from the snapshot."""
    eng = SnapshotEngine()
    for got, want in _one_step_late(eng):
        assert_rows(got, want)
    assert eng.manager.metrics()["hits_served"] == 1


def test_snapshot_hand_off_stages_only_hit_steps():
    eng = SnapshotEngine()
    a = list(range(100, 111))
    eng.add("A", a)
    eng.save(new=[("A", [3, 7, 9], 0, 11)])
    assert eng.manager._steps[eng.pending[0]].staged is None  # no hit: nothing copied by omni-cache
    eng.flush()
    eng.add("B", a[:8] + [1, 2, 3])
    eng.save(new=[("B", [3, 7, 11], 8, 3)])
    st = eng.manager._steps[eng.pending[0]].staged
    assert st.prefix == {"B": 8} and st.spans == {"B": (0, 11)}
    assert_rows(eng.flush()["B"], expected(a[:8] + [1, 2, 3], 0, 11))


def test_snapshot_hand_off_refuses_a_step_without_its_snapshot():
    """The seam moved (the builder no longer hands the snapshot over): a clear error, never
    rows from somewhere else."""
    eng = SnapshotEngine(attach=False)
    eng.add("A", list(range(100, 111)))
    eng.save(new=[("A", [3, 7, 9], 0, 11)])
    with pytest.raises(RuntimeError, match="without vLLM-Omni's output snapshot"):
        eng.flush()


def test_snapshot_missing_a_key_is_named():
    eng = SnapshotEngine()
    eng.add("A", list(range(100, 111)))
    eng.save(new=[("A", [3, 7, 9], 0, 11)])
    with pytest.raises(RuntimeError, match="hidden_states.layer_0"):
        eng.manager.attach_snapshot(eng.pending[0], eng.buf[HIDDEN_KEY], {})


@cuda
def test_stage_prefixes_cuda_lands_pinned_with_room_for_fresh_rows():
    dev = torch.device("cuda", torch.cuda.current_device())
    pool_read = torch.randn(96, 2048, device=dev, dtype=torch.bfloat16)
    fresh = torch.randn(5, 2048, dtype=torch.bfloat16).pin_memory()
    want = torch.cat([pool_read.cpu(), fresh])
    st = HostStager(dev).stage_prefixes(["h"], [("a", {"h": pool_read}, 5)])
    assert st.host["h"].is_pinned()
    assert torch.equal(st.complete("a", {"h": fresh})["h"], want)


@cuda
def test_snapshot_of_live_device_tensors_hands_off_host_rows():
    """Without async omni output vLLM-Omni's "snapshot" is the forward's live device tensors;
    the hand-off must still be host rows for every request, hit or not (found on an H100:
    vLLM-Omni's payload accumulation concatenated a hit step's host rows with a hit-free step's
    device rows: "Expected all tensors to be on the same device")."""
    eng = SnapshotEngine()
    a = list(range(100, 111))
    eng.add("A", a)
    eng.save(new=[("A", [3, 7, 9], 0, 11)])
    step_id = eng.pending[0]
    hidden, mm = eng.snapshots[step_id]
    layers = {i: t.cuda() for i, t in mm["hidden_states"]["layers"].items()}
    eng.snapshots[step_id] = (hidden.cuda(), {"hidden_states": {"layers": layers}})
    got = eng.flush()["A"]
    assert all(t.device.type == "cpu" for t in got.values())
    assert_rows(got, expected(a, 0, 11))


def test_a_builder_holding_device_tensors_gets_every_key(monkeypatch):
    """Without vLLM-Omni's async output (no streaming) its payload builder holds the forward's
    device tensors: a step without a hit must still hand over every key (host rows), or a
    request's accumulated payload mixes device and host rows (the engine died on an H200 when
    it did not). Here the snapshot's tensors are made to look like device tensors."""
    from omni_cache.engine import stage_manager

    assert stage_manager._all_on_host([torch.zeros(1), "not a tensor"])
    assert not stage_manager._all_on_host([torch.zeros(1), torch.zeros(1, device="meta")])
    eng = SnapshotEngine()
    a = list(range(100, 111))
    eng.add("A", a)
    eng.save(new=[("A", [3, 7, 9], 0, 11)])
    monkeypatch.setattr(stage_manager, "_all_on_host", lambda values: False)
    step_id, order = eng.pending
    eng.manager.attach_snapshot(step_id, *eng.snapshots.pop(step_id))
    out = eng.manager.materialize(step_id, order)
    assert set(out.mm_outputs) == {"hidden_states.layer_0"}
    assert_rows({HIDDEN_KEY: out.hidden_states["A"], **{k: v["A"] for k, v in out.mm_outputs.items()}},
                expected(a, 0, 11))


def test_snapshot_step_without_a_hit_hands_each_request_its_own_rows():
    """Three requests without a hit in one snapshot step (the hidden rows split once for the
    batch, in the builder's order) and the same step asked for in another order (sliced per
    request): each request gets a recompute's rows, bitwise."""
    prompts = {"A": list(range(100, 111)), "C": list(range(300, 305)), "D": list(range(400, 409))}
    for order in (None, ["D", "A", "C"]):
        eng = SnapshotEngine()
        for r, p in prompts.items():
            eng.add(r, p)
        eng.save(new=[("A", [3, 7, 9], 0, 11), ("C", [4, 8], 0, 5), ("D", [5, 10, 11], 0, 9)])
        step_id, saved = eng.pending
        eng.pending = (step_id, order or saved)
        got = eng.flush()
        for r, p in prompts.items():
            assert_rows(got[r], expected(p, 0, len(p)))
