"""The exactness fuzzer's engine-free parts: seeded conversations and the oracles (each oracle
shown to catch a wrong row, a stale row and a shifted row, and to pass the right one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_cache.exactness import oracles
from omni_cache.exactness.conversations import Knobs, make_group
from omni_cache.exactness.fuzz import _owner, _smaller, repro_command


def _same_request(a, b) -> bool:
    pa, pb = a.to_engine_prompt(), b.to_engine_prompt()
    if pa["prompt"] != pb["prompt"]:
        return False
    ma, mb = pa.get("multi_modal_data", {}), pb.get("multi_modal_data", {})
    if set(ma) != set(mb):
        return False
    for k in ma:
        xa = ma[k] if isinstance(ma[k], list) else [ma[k]]
        xb = mb[k] if isinstance(mb[k], list) else [mb[k]]
        for u, v in zip(xa, xb, strict=True):
            u, v = (u[0], v[0]) if k == "audio" else (np.asarray(u), np.asarray(v))
            if u.shape != v.shape or not np.array_equal(u, v):
                return False
    return True


def test_a_seed_gives_the_same_group_bit_for_bit():
    g1, g2 = make_group(7), make_group(7)
    assert g1.describe() == g2.describe() and g1.waves == g2.waves
    for c1, c2 in zip(g1.conversations, g2.conversations, strict=True):
        for t in range(len(c1.turns)):
            assert _same_request(c1.request(t), c2.request(t))
    assert not _same_request(make_group(8).conversations[0].request(0), g1.conversations[0].request(0))


def test_variants_change_one_thing_and_keep_the_layout(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    changes = set()
    for seed in range(40):
        g = make_group(seed, Knobs(turns=3, variants=2, system_words=20))
        base = g.conversations[0]
        assert 1 <= len(base.turns) <= 3 and g.num_requests == 3 * len(base.turns)
        last = len(base.turns) - 1
        for var in g.conversations[1:]:
            changes.add(var.change.split("@")[0])
            rb, rv = base.request(last).to_engine_prompt(), var.request(last).to_engine_prompt()
            assert len(tok.encode(rb["prompt"])) == len(tok.encode(rv["prompt"])), var.change
            for k in ("audio", "image"):
                xb, xv = rb.get("multi_modal_data", {}).get(k), rv.get("multi_modal_data", {}).get(k)
                xb, xv = (x if isinstance(x, list) else [x] for x in (xb, xv))
                for u, v in zip(xb, xv, strict=True):
                    if u is not None:
                        su = u[0].shape if k == "audio" else u.size
                        sv = v[0].shape if k == "audio" else v.size
                        assert su == sv, var.change
            assert not _same_request(base.request(last), var.request(last)), var.change
        # every turn's requests are scheduled exactly once, turn by turn
        sent = [x for wave in g.waves for batch in wave for x in batch]
        assert sorted(sent) == sorted((c, t) for c in range(3) for t in range(len(base.turns)))
    assert {"word_swap", "audio_scale", "image_mirror"} <= changes, changes


def test_row_ulps_scale():
    ref = torch.ones(2, 8, dtype=torch.bfloat16)
    got = ref.clone()
    got[1, 3] = torch.tensor(1.0078125, dtype=torch.bfloat16)  # one bf16 ulp above 1.0
    u = oracles.row_ulps(got, ref)
    assert u.tolist() == [0.0, 1.0]


def _rows(seed: int, n: int = 96, w: int = 16) -> torch.Tensor:
    return torch.randn(n, w, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _last_bits(t: torch.Tensor, rows: slice) -> torch.Tensor:
    out = t.clone()
    out[rows] = (out[rows].float() * (1 + 2 ** -8)).to(torch.bfloat16)  # about one rounding
    return out


def test_oracle_c_tolerates_last_bits_and_catches_wrong_stale_and_shifted_rows():
    ref = {"hidden": _rows(0), "hidden_states.layer_0": _rows(1)}
    near = {"hidden": _last_bits(ref["hidden"], slice(64, 96)), "hidden_states.layer_0": ref["hidden_states.layer_0"]}
    diffs, bad = oracles.compare_prompt_rows(near, ref, hit=64)
    assert not bad, bad
    d = next(x for x in diffs if x.key == "hidden")
    assert d.differing > 0 and d.first_from_hit >= 0 and d.max_ulps <= oracles.TOLERANCE_ULPS
    wrong = dict(ref, hidden=torch.cat([ref["hidden"][:64], _rows(9)[64:]]))  # another prompt's rows
    stale = dict(ref, hidden=torch.cat([ref["hidden"][:63], ref["hidden"][62:95]]))  # one row shifted
    emb = dict(ref, **{"hidden_states.layer_0": _last_bits(ref["hidden_states.layer_0"], slice(0, 1))})
    for case in (wrong, stale, emb):
        assert oracles.compare_prompt_rows(case, ref, hit=64)[1]


def test_oracle_b_is_bitwise_and_reads_tts_rows_like_the_talker():
    r = [{"embed.prefill": _rows(0), "embed.tts_bos": _rows(2)[:1].reshape(1, 1, -1)}, {"embed.decode": _rows(3)[:1]}]
    same = [dict(x) for x in r]
    same[0]["embed.tts_bos"] = torch.cat([r[0]["embed.tts_bos"]] * 2)  # one row per prefill step
    assert oracles.handoff_mismatches(same, r) == []
    off = [dict(x) for x in r]
    off[1] = {"embed.decode": _last_bits(r[1]["embed.decode"], slice(0, 1))}
    assert oracles.handoff_mismatches(off, r) == ["hand-off 1: embed.decode differs"]
    assert oracles.handoff_mismatches(r[:1], r)


def test_oracle_b_rejects_empty_or_reshaped_tts_rows_other_dtypes_and_other_values():
    """What (b) used to wave through: an ``embed.tts_*`` with no row (``all`` over zero rows),
    rows of another width, another dtype, and a non-tensor value that differs."""
    r = [{"embed.prefill": _rows(0), "embed.tts_bos": _rows(2)[:1].reshape(1, 1, -1), "meta": [1, 2]}]
    assert oracles.handoff_mismatches([dict(x) for x in r], r) == []
    cases = {"no tts row": {"embed.tts_bos": r[0]["embed.tts_bos"][:0]},
             "other row shape": {"embed.tts_bos": r[0]["embed.tts_bos"].reshape(1, 2, -1)},
             "ref without rows": None,
             "other dtype": {"embed.prefill": r[0]["embed.prefill"].to(torch.float16)},
             "other value": {"meta": [1, 3]},
             "tensor for a value": {"meta": torch.tensor([1, 2])}}
    for name, change in cases.items():
        if change is None:  # the reference holds no row: nothing the talker could read
            got, ref = r, [dict(r[0], **{"embed.tts_bos": r[0]["embed.tts_bos"][:0]})]
        else:
            got, ref = [dict(r[0], **change)], r
        assert oracles.handoff_mismatches(got, ref), name


def test_oracle_a_checks_each_served_block_against_its_writer():
    writer = {"hidden": _rows(0, n=64)}
    reader = {"hidden": torch.cat([writer["hidden"][:64], _rows(5, n=32)])}
    ver, unver, bad = oracles.served_rows_mismatches(reader, 64, ["w", "w"], {"w": writer}, 32)
    assert (ver, unver, bad) == (2, 0, [])
    wrong = {"hidden": torch.cat([writer["hidden"][:32], _rows(6, n=64)])}
    ver, unver, bad = oracles.served_rows_mismatches(wrong, 64, ["w", "w"], {"w": writer}, 32)
    assert ver == 2 and len(bad) == 1 and bad[0].startswith("block 1")
    # a block its writer filled by decode (beyond its prompt) cannot be checked: counted, not passed
    short = {"hidden": writer["hidden"][:32]}
    assert oracles.served_rows_mismatches(reader, 64, ["w", "w"], {"w": short}, 32)[:2] == (1, 1)
    assert oracles.served_rows_mismatches(reader, 64, [None, "x"], {"w": writer}, 32)[:2] == (0, 2)


def test_oracle_a_checks_a_decode_filled_block_against_its_writers_digest(tmp_path, monkeypatch):
    """A block the writer filled while decoding (its recorded prompt rows end before it) is
    checked against the digest of the rows the writer's forward computed, logged by the engine's
    BlockDigestAudit step by step; planted: a served row off by one bit is a mismatch."""
    from omni_cache.engine.metrics import BlockDigestAudit, rows_digest
    from omni_cache.exactness.fuzz import block_digest_lines

    monkeypatch.setenv("OMNI_CACHE_HIT_AUDIT", str(tmp_path / "audit"))
    audit = BlockDigestAudit(block_size=32)
    full = {"hidden_states.layer_0": _rows(0, n=64), "hidden_states.layer_24": _rows(1, n=64)}
    audit.add("w-0", 0, {k: v[:40] for k, v in full.items()}, [0])  # prefill: 40 tokens, block 0 full
    for p in range(40, 64):  # decode, one row a step; block 1 full at the last
        audit.add("w-0", p, {k: v[p:p + 1] for k, v in full.items()}, [1] if p == 63 else [])
    lines = block_digest_lines(tmp_path)
    assert [(x["writer"], x["block"]) for x in lines] == [("w-0", 0), ("w-0", 1)]
    digests = {("w", x["block"]): x["digests"] for x in lines}
    assert digests[("w", 1)]["hidden_states.layer_24"] == rows_digest(full["hidden_states.layer_24"][32:64])
    recorded = {"embed.prefill": full["hidden_states.layer_0"][:40],
                "hidden_states.output": full["hidden_states.layer_24"][:40]}
    reader = {"embed.prefill": full["hidden_states.layer_0"], "hidden_states.output": full["hidden_states.layer_24"]}
    got = oracles.served_rows_mismatches(reader, 64, ["w", "w"], {"w": recorded}, 32, writer_digests=digests)
    assert got == (2, 0, [])
    flipped = reader["hidden_states.output"].clone()
    flipped.view(torch.int16)[50, 3] ^= 1
    bad = oracles.served_rows_mismatches(dict(reader, **{"hidden_states.output": flipped}), 64, ["w", "w"],
                                         {"w": recorded}, 32, writer_digests=digests)
    assert bad[:2] == (2, 0) and len(bad[2]) == 1 and "block 1" in bad[2][0] and "digest" in bad[2][0]
    # without the digests the block stays unverified, as before
    assert oracles.served_rows_mismatches(reader, 64, ["w", "w"], {"w": recorded}, 32)[:2] == (1, 1)



def test_oracle_a_checks_each_read_block_against_its_writers_digest_or_rows():
    """The read side of (a) (rows a read returned, as digests per block: what a resumed
    request reads after its hand-off is recorded nowhere else): each block against one of its
    writer's block digests (any of its writes: a preempted writer recomputes), else its recorded
    hand-off rows; planted: a read block off by one bit, and a block read from another writer."""
    from omni_cache.engine.metrics import rows_digest

    full = {"hidden_states.layer_0": _rows(0, n=64), "hidden_states.layer_24": _rows(1, n=64)}
    blocks = [{k: rows_digest(v[i * 32:(i + 1) * 32]) for k, v in full.items()} for i in range(2)]
    recomputed = {k: rows_digest(_rows(7, n=32)) for k in full}  # an earlier write of block 1
    digests = {("w", 1): [recomputed, blocks[1]]}
    recorded = {"embed.prefill": full["hidden_states.layer_0"][:40],  # block 0 in its hand-off, 1 not
                "hidden_states.output": full["hidden_states.layer_24"][:40]}
    got = oracles.read_rows_mismatches(blocks, ["w", "w"], {"w": recorded}, 32, writer_digests=digests)
    assert (got.by_digest, got.by_rows, got.unverified, got.mismatches) == (1, 1, 0, ())
    flipped = full["hidden_states.layer_24"].clone()
    flipped.view(torch.int16)[50, 3] ^= 1
    wrong = [blocks[0], dict(blocks[1], **{"hidden_states.layer_24": rows_digest(flipped[32:64])})]
    got = oracles.read_rows_mismatches(wrong, ["w", "w"], {"w": recorded}, 32, writer_digests=digests)
    assert len(got.mismatches) == 1 and got.mismatches[0].startswith("block 1")
    assert "2 block digest" in got.mismatches[0]
    other = [{k: rows_digest(_rows(9, n=32)) for k in full}, blocks[1]]
    got = oracles.read_rows_mismatches(other, ["w", "w"], {"w": recorded}, 32, writer_digests=digests)
    assert len(got.mismatches) == 2 and all(m.startswith("block 0") for m in got.mismatches)  # both keys
    # no digest, no recorded row of the block, or no writer: counted unverified, not passed
    got = oracles.read_rows_mismatches(blocks, [None, "w"], {"w": recorded}, 32)
    assert (got.by_digest, got.by_rows, got.unverified) == (0, 0, 2)

def test_prompt_rows_reads_both_record_layouts():
    n = 40
    full = [{"hidden": _rows(0, n=n + 5), "hidden_states.layer_0": _rows(1, n=n + 5), "other": torch.zeros(3)}]
    assert set(oracles.prompt_rows(full, n)) == {"hidden", "hidden_states.layer_0"}
    streamed = [{"embed.prefill": _rows(0, n=n + 1), "hidden_states.output": _rows(1, n=n + 1),
                 "embed.tts_bos": torch.zeros(1, 1, 16)}, {"embed.decode": _rows(3, n=1)}]
    rows = oracles.prompt_rows(streamed, n)
    assert set(rows) == {"embed.prefill", "hidden_states.output"} and rows["embed.prefill"].shape == (n, 16)
    with pytest.raises(ValueError, match="rows for a prompt"):
        oracles.prompt_rows(full, n + 10)


def test_shrink_steps_and_repro_command():
    k = Knobs(turns=2, variants=1, system_words=32, media=True, concurrent=True)
    smaller = _smaller(k)
    assert Knobs(turns=1, variants=1, system_words=32) in smaller and all(s != k for s in smaller)
    cmd = repro_command(3, Knobs(turns=2, media=False), "thinker", True)
    assert "--seed 3" in cmd and "--no-media" in cmd and "--modes streaming" in cmd
    assert _owner("run-5-abc", ["run-50", "run-5"]) == "run-5" and _owner("run-50", ["run-5"]) is None


def test_shrink_finds_the_smallest_failing_knobs():
    """The shrinker on a failure that needs two turns and media (a stand-in for a run; the
    fuzzer's ``fails`` runs the group on the engines): it ends at two turns, no variant, no
    concurrency, media kept, short prose — and every group it tried was freshly salted."""
    from omni_cache.exactness.fuzz import shrink

    salts = []

    def fails(group):
        salts.append(group.conversations[0].system.split(".")[0])
        base = group.conversations[0]
        return len(base.turns) >= 2 and any(t.audio is not None or t.image is not None for t in base.turns)

    start = Knobs(turns=4, variants=2, system_words=64)
    assert fails(make_group(11, start))
    small, runs = shrink(11, start, fails, budget=30)
    assert small.variants == 0 and not small.concurrent and small.media and small.system_words == 16
    assert small.turns <= 3 and fails(make_group(11, small))
    assert runs <= 30 and len(set(salts[1:-1])) == len(salts[1:-1])


def _record_session(tmp_path, prompts: dict[str, tuple[list[int], torch.Tensor]], audit: list[dict]) -> None:
    """Streaming hand-off records (first chunk: ``ids.prompt``, ``embed.prefill``,
    ``hidden_states.output``) and an audit log as a recording duplex server writes them."""
    import json

    (tmp_path / "handoff").mkdir()
    (tmp_path / "audit").mkdir()
    for seq, (rid, (ids, embed)) in enumerate(prompts.items()):
        torch.save({"ids.prompt": torch.tensor(ids), "embed.prefill": embed, "hidden_states.output": embed * 2},
                   tmp_path / "handoff" / f"{seq:05d}-{rid}.pt")
    (tmp_path / "audit" / "hits-1.jsonl").write_text("".join(json.dumps(x) + "\n" for x in audit))


def test_realtime_judge_catches_a_block_served_for_other_tokens_and_other_audio(tmp_path):
    """``judge_session``: the expected hit stops where tokens *or* embedding rows (another audio
    clip under the same placeholder ids) differ; a block served for other tokens is a mismatch
    even when its rows are the writer's bit for bit."""
    import base64

    from omni_cache.exactness.realtime import judge_session

    sid = "duplex-abc"
    tag = base64.b64encode(sid.encode()).decode().rstrip("=")
    writer, same_ids, other_ids = (f"duplex-s.{tag}.e.0.r.stage0-turn{k}" for k in range(3))
    g = torch.Generator().manual_seed(0)
    w_embed = torch.randn(80, 8, generator=g).to(torch.bfloat16)
    ids = list(range(80))
    # turn 1: the writer's tokens, another audio clip from row 40 (same placeholder ids)
    clip = w_embed.clone()
    clip[40:] = torch.randn(40, 8, generator=g).to(torch.bfloat16)
    # turn 2: tokens differ from 50 on, yet 64 tokens served: rows copied from the writer, so
    # (a)'s row check alone would pass
    served = w_embed.clone()
    _record_session(tmp_path, {writer: (ids, w_embed), same_ids: (ids, clip),
                               other_ids: (ids[:50] + [999] * 30, served)},
                    [{"request": same_ids, "hit_tokens": 32, "writers": [writer]},
                     {"request": other_ids, "hit_tokens": 64, "writers": [writer, writer]}])
    first, turn1, turn2 = judge_session(tmp_path, sid)
    assert (first.hit, first.expected_hit) == (0, 0)
    assert (turn1.hit, turn1.expected_hit, turn1.mismatches) == (32, 32, [])  # ids alone would say 64
    assert (turn2.hit, turn2.expected_hit, turn2.verified) == (64, 32, 2)
    assert len(turn2.mismatches) == 1 and "block 1: served for tokens that differ" in turn2.mismatches[0]
