"""Exactness of realtime (duplex) sessions, from what the talker received.

A recording server (:func:`omni_cache.exactness.fuzz.recording_stage_config` on a duplex stage
config) records every thinker → talker hand-off as ``<seq>-<request id>.pt``; vLLM-Omni names a
realtime turn's thinker request ``duplex-s.<base64 session id>.e.<epoch>.r.stage0-turn<n>``.
This module finds a session's requests in the order they ran and judges each against:

- the hit it should get: whole blocks of the longest common prefix of its prompt with any
  earlier request's prompt — the same token and the same embedding row, bitwise (an audio
  placeholder token is the same id for every clip; its embedding row tells the clips apart, as
  the block hash's multimodal hash does) — at most ``len - 1`` (vLLM recomputes the last
  prompt token). A lower bound: a writer's decode tokens are not compared;
- oracle (a) (:func:`~omni_cache.exactness.oracles.served_rows_mismatches`): every served
  block's rows equal its writer's, and its tokens equal the writer's tokens there (a row
  served for a different token would be a wrong row however equal its bits);
- oracle (c) against a cache-off reference session of the same conversation
  (``omni_cache_reference``: :mod:`omni_cache.engine.duplex`): the same prompt tokens, the
  embedding rows bitwise, the other prompt rows within tolerance.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omni_cache.exactness import oracles
from omni_cache.exactness.fuzz import audit_lines, records

_FILE = re.compile(r"(\d+)-(duplex-s\.([A-Za-z0-9_-]+)\.e\.\d+\.r\.stage0-turn\d+)\.pt")


def session_requests(engine_dir: str | Path, session_id: str) -> list[str]:
    """The thinker request ids (as recorded) of realtime session ``session_id``, in the
    order they ran (their first hand-off's sequence number). The ids' turn numbers are not
    turn indexes: a ``response.cancel`` starts a new epoch (``e.<n>``) and the count goes on
    from there."""
    tag = base64.b64encode(session_id.encode()).decode().rstrip("=")
    first: dict[str, int] = {}
    for p in (Path(engine_dir) / "handoff").glob("*.pt"):
        m = _FILE.fullmatch(p.name)
        if m and m.group(3).rstrip("_") == tag:
            first[m.group(2)] = min(first.get(m.group(2), 1 << 62), int(m.group(1)))
    return sorted(first, key=first.get)


@dataclass
class Prompt:
    """A thinker request's prompt as recorded: ``seq`` (its first hand-off's sequence number),
    ``ids`` (prompt token ids), ``embed`` (``[num_prompt_tokens, hidden_size]`` embedding rows)."""

    seq: int
    ids: list[int]  # prompt token ids
    embed: object  # [num_prompt_tokens, hidden_size] embedding rows (torch.Tensor) or None


def first_prompts(engine_dir: str | Path) -> dict[str, Prompt]:
    """Every thinker request's prompt, from its first hand-off (request id → prompt)."""
    import torch

    first: dict[str, tuple[int, Path]] = {}
    for p in (Path(engine_dir) / "handoff").glob("*.pt"):
        m = re.fullmatch(r"(\d+)-(.+)\.pt", p.name)
        if m and (m.group(2) not in first or int(m.group(1)) < first[m.group(2)][0]):
            first[m.group(2)] = (int(m.group(1)), p)
    seen: dict[str, Prompt] = {}
    for rid, (seq, p) in first.items():
        rec = torch.load(p)
        if "ids.prompt" in rec:
            ids = rec["ids.prompt"].tolist()
            key = next((k for k in sorted(oracles.EMBEDDING_KEYS) if k in rec), None)
            embed = rec[key].reshape(-1, rec[key].shape[-1])[:len(ids)] if key else None
            seen[rid] = Prompt(seq, ids, embed)
    return seen


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (items compared with ``==``)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_prompt_tokens(a: Prompt, b: Prompt) -> int:
    """Tokens of the longest common prefix of two prompts: same id and same embedding row."""
    n = common_prefix_len(a.ids, b.ids)
    if a.embed is None or b.embed is None or n == 0:
        return n
    same = (a.embed[:n] == b.embed[:n]).all(dim=-1)
    return n if bool(same.all()) else int((~same).nonzero()[0, 0])


def _same_request(a: str, b: str) -> bool:
    """Two recorded request ids name one request (vLLM-Omni may append ``-<suffix>``)."""
    return a == b or any(x.startswith(y + sep) for x, y in ((a, b), (b, a)) for sep in "-_")


@dataclass
class TurnVerdict:
    """One realtime turn's thinker request, judged (module docstring). ``hit``: served
    tokens (0 without an audit line); ``expected_hit``: the lower bound; ``verified`` /
    ``unverified``: served blocks checked against / without their writer's record."""

    request_id: str
    prompt_tokens: int
    hit: int
    expected_hit: int
    verified: int = 0
    unverified: int = 0
    mismatches: list[str] = field(default_factory=list)


def judge_session(engine_dir: str | Path, session_id: str, *, block_size: int = 32) -> list[TurnVerdict]:
    """Every thinker request of a session (:func:`session_requests`), with its hit, the hit
    it should get and oracle (a) over rows and tokens (module docstring)."""
    engine_dir = Path(engine_dir)
    prompts = first_prompts(engine_dir)
    hits = {}
    for line in audit_lines(engine_dir):
        hits[re.sub(r"[^A-Za-z0-9_.-]", "_", line["request"])] = line
    rows_cache: dict[str, dict] = {}

    def rows(rid: str) -> dict:
        if rid not in rows_cache:
            recs = records(engine_dir, rid)
            n = int(recs[0]["ids.prompt"].numel()) if recs and "ids.prompt" in recs[0] else 0
            rows_cache[rid] = oracles.prompt_rows(recs, n) if n else {}
        return rows_cache[rid]

    out = []
    for rid in session_requests(engine_dir, session_id):
        me = prompts[rid]
        prompt, n = me.ids, len(me.ids)
        best = max((common_prompt_tokens(me, p) for p in prompts.values() if p.seq < me.seq), default=0)
        line = hits.get(rid) or next((v for k, v in hits.items() if _same_request(k, rid)), None)
        v = TurnVerdict(rid, n, int(line["hit_tokens"]) if line else 0, (min(best, n - 1) // block_size) * block_size)
        if line:
            writers = [re.sub(r"[^A-Za-z0-9_.-]", "_", w) if w else None for w in line["writers"]]
            writer_rows = {w: rows(w) for w in writers if w and w in prompts}
            v.verified, v.unverified, v.mismatches = oracles.served_rows_mismatches(
                rows(rid), v.hit, writers, writer_rows, block_size)
            for i, w in enumerate(writers[:v.hit // block_size]):
                lo, hi = i * block_size, (i + 1) * block_size
                if w in prompts and len(prompts[w].ids) >= hi and prompts[w].ids[lo:hi] != prompt[lo:hi]:
                    v.mismatches.append(f"block {i}: served for tokens that differ from its writer {w}'s")
        out.append(v)
    return out


def reference_mismatches(engine_dir: str | Path, request_id: str, reference_id: str, hit: int) -> list[str]:
    """Oracle (c): a realtime turn's thinker request against the same turn of a cache-off
    reference session — the same prompt tokens, then
    :func:`~omni_cache.exactness.oracles.compare_prompt_rows`."""
    got, ref = records(engine_dir, request_id), records(engine_dir, reference_id)
    if not got or not ref:
        return [f"no recorded hand-off for {request_id if not got else reference_id}"]
    a, b = got[0]["ids.prompt"].tolist(), ref[0]["ids.prompt"].tolist()
    if a != b:
        return [f"prompt tokens differ from the reference's at token {common_prefix_len(a, b)}"]
    _, bad = oracles.compare_prompt_rows(oracles.prompt_rows(got, len(a)), oracles.prompt_rows(ref, len(b)), hit)
    return bad
