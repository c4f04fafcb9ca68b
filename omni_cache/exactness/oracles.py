"""The oracles that judge what a stage received, cache on against three references.

Each works on recorded thinker → talker hand-offs (``omni_cache.engine.handoff``: one dict of
tensor name → CPU tensor per hand-off; non-streaming: ``hidden`` and
``hidden_states.layer_N`` ``[num_tokens, hidden_size]``; streaming: the first chunk's
``embed.prefill`` ``[num_prompt_tokens + 1, hidden_size]`` and ``hidden_states.output``, then
one ``embed.decode`` ``[1, hidden_size]`` per decode token) and returns the mismatches it
found as strings (empty: the oracle holds), so a fuzzer can report every one and a test can
assert on them.

(a) :func:`served_rows_mismatches` — every row served from the cache equals, bitwise, the row
    its writer computed (the writer: the request whose computation filled the block, logged
    by the engine with ``OMNI_CACHE_HIT_AUDIT``, :class:`omni_cache.engine.metrics.HitAudit`).
    :func:`read_rows_mismatches` is (a) for the rows a read returned (a digest per block,
    for reads no hand-off records: a resumed request's).
    :func:`talker_kv_mismatches` is (a) for the talker's served KV blocks (a digest of each
    block at its writer's step and at the read, :mod:`omni_cache.engine.talker_audit`).
(b) :func:`handoff_mismatches` — omni-cache against vLLM-Omni's built-in cache: every hand-off
    tensor bitwise (and, by the caller, tokens and audio), where both served the same hit.
(c) :func:`compare_prompt_rows` — against cache off: the embedding rows (position-independent:
    ``hidden_states.layer_0``, ``embed.prefill``) bitwise; every other prompt row within
    :data:`TOLERANCE_ULPS` row-scale ulps (:func:`row_ulps`), a bound a row of another prompt
    or a stale row cannot meet (the fuzzer measures how far those are and reports it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

#: position-independent rows: the token's (or media item's) embedding; equal bitwise whatever
#: the prefix, so a hit must not change them at all
EMBEDDING_KEYS = frozenset({"hidden_states.layer_0", "embed.prefill"})
#: (c)'s bound on a prompt row's difference from cache off, in row-scale ulps (:func:`row_ulps`).
#: vLLM's hit path (attention over cached KV) changes suffix rows in the last bits (measured:
#: docs/architecture.md "Integrity"); a row of another prompt or a stale row is off by about
#: the row's own scale (hundreds of row-scale ulps; the fuzzer reports the smallest it met).
TOLERANCE_ULPS = 16.0
#: mantissa bits of bfloat16 (the hand-off dtype): ulp(x) = 2 ** (floor(log2 |x|) - 7)
BF16_MANTISSA_BITS = 7


def prompt_rows(records: Sequence[Mapping[str, torch.Tensor]], num_prompt_tokens: int) -> dict[str, torch.Tensor]:
    """The token-aligned prompt rows of one request's recorded hand-offs: key →
    ``[num_prompt_tokens, width]`` (the recorded dtype).

    Non-streaming records: ``hidden`` and ``hidden_states.layer_N`` of the single hand-off.
    Streaming records: ``embed.prefill`` and ``hidden_states.output`` of the first chunk.

    Raises:
        ValueError: no records, or a tensor shorter than the prompt (names the key).
    """
    if not records:
        raise ValueError("no recorded hand-off")
    first = records[0]
    keys = ([k for k in ("embed.prefill", "hidden_states.output") if k in first] if "embed.prefill" in first
            else [k for k in first if k == "hidden" or k.startswith("hidden_states.layer_")])
    out = {}
    for k in keys:
        t = first[k].reshape(first[k].shape[0], -1) if first[k].dim() != 3 else first[k].reshape(-1, first[k].shape[-1])
        if t.shape[0] < num_prompt_tokens:
            raise ValueError(f"{k}: {t.shape[0]} rows for a prompt of {num_prompt_tokens} tokens")
        out[k] = t[:num_prompt_tokens]
    return out


def row_ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row, the largest element difference in units of the bfloat16 ulp at the reference
    row's scale: ``max_j |got_j - ref_j| / 2 ** (floor(log2 rms(ref)) - 7)``.

    Args:
        got, ref: ``[num_rows, width]`` (any float dtype).
    Returns:
        float32 ``[num_rows]``; 0 where equal. One bf16 rounding of an element of about the
        row's RMS is 0.5–1; an element four times the RMS rounded once is up to 4.
    """
    g, r = got.float(), ref.float()
    rms = r.pow(2).mean(dim=-1).sqrt().clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(rms)) - BF16_MANTISSA_BITS)
    return (g - r).abs().amax(dim=-1) / ulp


@dataclass
class RowDiff:
    """How one key's prompt rows of a request differ from a reference.

    Attributes:
        key: the hand-off tensor.
        rows: rows compared (the prompt, tokens).
        hit: the request's prefix hit (tokens; rows ``[0, hit)`` were served from the cache).
        differing: rows not bitwise equal.
        first_from_hit: first differing row minus ``hit`` (negative: inside the served
            prefix); None when all are equal.
        max_ulps: largest :func:`row_ulps` over the rows.
    """

    key: str
    rows: int
    hit: int
    differing: int
    first_from_hit: int | None
    max_ulps: float

    def as_dict(self) -> dict:
        return asdict(self)


def compare_prompt_rows(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], hit: int,
                        tolerance_ulps: float = TOLERANCE_ULPS) -> tuple[list[RowDiff], list[str]]:
    """Oracle (c): prompt rows (:func:`prompt_rows`) of a cache-on request against the same
    prompt's rows with cache off. Returns ``(per-key RowDiff, mismatches)``: a mismatch is a
    missing key, a shape difference, an embedding row (:data:`EMBEDDING_KEYS`) not bitwise
    equal, or a row beyond ``tolerance_ulps``."""
    diffs, bad = [], []
    if set(got) != set(ref):
        bad.append(f"keys {sorted(got)} != {sorted(ref)}")
    for k in sorted(set(got) & set(ref)):
        g, r = got[k], ref[k]
        if g.shape != r.shape:
            bad.append(f"{k}: shape {tuple(g.shape)} != {tuple(r.shape)}")
            continue
        neq = ~(g == r).all(dim=-1)
        ulps = row_ulps(g, r)
        first = int(neq.nonzero()[0, 0]) if bool(neq.any()) else None
        d = RowDiff(k, int(g.shape[0]), int(hit), int(neq.sum()), None if first is None else first - int(hit),
                    float(ulps.max()) if ulps.numel() else 0.0)
        diffs.append(d)
        if k in EMBEDDING_KEYS and d.differing:
            bad.append(f"{k}: {d.differing} embedding rows differ (first at row {first}); they must be bitwise equal")
        elif d.max_ulps > tolerance_ulps:
            worst = int(ulps.argmax())
            bad.append(f"{k}: row {worst} is {d.max_ulps:.1f} row-scale ulps from cache off (> {tolerance_ulps})")
    return diffs, bad


def handoff_mismatches(got: Sequence[Mapping[str, torch.Tensor]], ref: Sequence[Mapping[str, torch.Tensor]]
                       ) -> list[str]:
    """Oracle (b): two requests' recorded hand-offs are bitwise equal — the same number of
    hand-offs (streamed chunks), the same keys, every tensor the same dtype, shape and bits,
    every other value equal.

    ``embed.tts_*`` hold one row per thinker step (vLLM-Omni accumulates per-step side
    outputs; their count follows the steps a prompt took, so it may differ): both must hold
    at least one row of the same dtype and row shape, and each of ``got``'s rows must equal
    ``ref``'s first row, which the talker reads."""
    if len(got) != len(ref):
        return [f"{len(got)} hand-offs != {len(ref)}"]
    bad = []
    for i, (g, r) in enumerate(zip(got, ref)):
        if set(g) != set(r):
            bad.append(f"hand-off {i}: keys {sorted(g)} != {sorted(r)}")
            continue
        for k in r:
            gk, rk = g[k], r[k]
            if not isinstance(rk, torch.Tensor) or not isinstance(gk, torch.Tensor):
                ok = type(gk) is type(rk) and _values_equal(gk, rk)
            elif gk.dtype != rk.dtype:
                ok = False
            elif k.startswith("embed.tts_"):
                ok = (gk.dim() >= 1 and rk.dim() >= 1 and gk.shape[0] >= 1 and rk.shape[0] >= 1
                      and gk.shape[1:] == rk.shape[1:] and all(torch.equal(gk[j], rk[0]) for j in range(gk.shape[0])))
            else:
                ok = gk.shape == rk.shape and torch.equal(gk, rk)
            if not ok:
                bad.append(f"hand-off {i}: {k} differs")
    return bad


def _values_equal(a, b) -> bool:
    """Non-tensor hand-off values (ints, lists, nested containers of tensors) equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[x], b[x]) for x in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


#: a streamed first hand-off's keys → the thinker's hand-off key its rows are (vLLM-Omni's
#: ``thinker2talker_async_chunk``: layer 0 is the talker's text embedding input, the accept layer
#: its hidden input); a whole-prompt payload's keys are the hand-off keys themselves
STREAMED_KEYS = {"embed.prefill": "hidden_states.layer_0"}


def _digest_key(record_key: str, digests: Mapping[str, str]) -> str | None:
    """The hand-off key (of a writer's block digests) whose rows a recorded key holds."""
    if record_key in digests:
        return record_key
    if record_key in STREAMED_KEYS:
        return STREAMED_KEYS[record_key] if STREAMED_KEYS[record_key] in digests else None
    if record_key == "hidden_states.output":  # the accept layer: the one captured layer past layer 0
        layers = [k for k in digests if k.startswith("hidden_states.layer_") and k != "hidden_states.layer_0"]
        return layers[0] if len(layers) == 1 else None
    return None


def served_rows_mismatches(reader: Mapping[str, torch.Tensor], hit_tokens: int, writers: Sequence[str | None],
                           writer_rows: Mapping[str, Mapping[str, torch.Tensor]], block_size: int, *,
                           writer_digests: Mapping[tuple[str, int], Mapping[str, str]] | None = None
                           ) -> tuple[int, int, list[str]]:
    """Oracle (a): the rows a request received for its served prefix ``[0, hit_tokens)`` equal,
    block by block, the rows the block's writer computed.

    Args:
        reader: the reader's prompt rows (:func:`prompt_rows`), key → ``[>= hit_tokens, width]``.
        hit_tokens: the served hit (tokens, whole blocks).
        writers: per block of the hit, the request that wrote it (the engine's audit log).
        writer_rows: request → its prompt rows (:func:`prompt_rows`), compared bitwise.
        block_size: tokens per block.
        writer_digests: ``(writer, block index) → hand-off key → digest`` (or a list of such,
            one per time the writer computed the block: a preempted writer recomputes it; any
            one matching passes) of the rows the writer's forward computed for that block
            (:class:`omni_cache.engine.metrics.BlockDigestAudit`, :func:`omni_cache.engine.metrics.rows_digest`):
            the oracle for a block the writer's recorded prompt rows do not hold (filled by its
            decode). A block with neither (writer unknown, no digest, a key without a
            counterpart) is counted as unverified, not as a mismatch.

    Returns:
        ``(blocks verified, blocks unverified, mismatches)``.
    """
    from omni_cache.engine.metrics import rows_digest

    verified = unverified = 0
    bad = []
    writer_digests = writer_digests or {}
    for i, w in enumerate(writers[:hit_tokens // block_size]):
        lo, hi = i * block_size, (i + 1) * block_size
        rows = writer_rows.get(w) if w is not None else None
        if rows is None or any(rows[k].shape[0] < hi for k in reader if k in rows) or not set(reader) <= set(rows):
            digs = writer_digests.get((w, i)) if w is not None else None
            digs = [digs] if isinstance(digs, Mapping) else list(digs or [])
            keyed = [(d, {k: _digest_key(k, d) for k in reader}) for d in digs]
            keyed = [(d, ks) for d, ks in keyed if ks and all(v is not None for v in ks.values())]
            if not keyed:
                unverified += 1
                continue
            verified += 1
            got = {k: rows_digest(r[lo:hi]) for k, r in reader.items()}
            if not any(all(got[k] == d[ks[k]] for k in reader) for d, ks in keyed):
                bad.append(f"block {i} (rows {lo}-{hi}): served rows differ from the rows their writer {w} "
                           f"computed (block digest, {len(keyed)} write(s) of it)")
            continue
        verified += 1
        for k, r in reader.items():
            if not torch.equal(r[lo:hi], rows[k][lo:hi]):
                bad.append(f"block {i} ({k}, rows {lo}-{hi}): served rows differ from their writer {w}'s")
    return verified, unverified, bad


@dataclass(frozen=True)
class ReadBlocksCheck:
    """Oracle (a) over the rows a prefix hit's read returned (:func:`read_rows_mismatches`).

    Attributes:
        by_digest: blocks whose read rows hash, key by key, as one of the writer's block
            digests (every key the read returned).
        by_rows: blocks with no such digest, checked against the writer's recorded hand-off
            rows (the keys the record holds; a key it does not hold is not compared).
        unverified: blocks with neither (writer unknown, no digest, no recorded row of it).
        mismatches: one line per block whose rows differ from their writer's.
    """

    by_digest: int
    by_rows: int
    unverified: int
    mismatches: tuple[str, ...]


def read_rows_mismatches(read: Sequence[Mapping[str, str]], writers: Sequence[str | None],
                         writer_rows: Mapping[str, Mapping[str, torch.Tensor]], block_size: int, *,
                         writer_digests: Mapping[tuple[str, int], Sequence[Mapping[str, str]]] | None = None
                         ) -> ReadBlocksCheck:
    """Oracle (a) on the read side: the rows a prefix hit's read returned equal, block by
    block, the rows the block's writer computed — whatever became of them after the read (a
    request resumed after its prompt hand-off reads its prefix again; those rows feed its
    recompute and are not handed on, so no recorded hand-off holds them).

    Args:
        read: per block of the hit, hand-off key → :func:`omni_cache.engine.metrics.rows_digest`
            of the block's rows as the read returned them.
        writers: per block of the hit, the request that wrote it (the engine's hit audit).
        writer_rows: request → its recorded prompt rows (:func:`prompt_rows`; streamed record
            keys are mapped to hand-off keys, :data:`STREAMED_KEYS`).
        block_size: tokens per block.
        writer_digests: ``(writer, block index) → [hand-off key → digest, ...]``, one per time
            the writer computed the block (:class:`omni_cache.engine.metrics.BlockDigestAudit`).

    Returns:
        :class:`ReadBlocksCheck`.
    """
    from omni_cache.engine.metrics import rows_digest

    by_digest = by_rows = unverified = 0
    bad = []
    writer_digests = writer_digests or {}
    for i, (got, w) in enumerate(zip(read, writers)):
        digs = writer_digests.get((w, i), []) if w is not None else []
        digs = [d for d in ([digs] if isinstance(digs, Mapping) else digs) if set(got) <= set(d)]
        if digs:
            by_digest += 1
            if not any(all(d[k] == v for k, v in got.items()) for d in digs):
                bad.append(f"block {i}: rows read differ from every write of it by {w} ({len(digs)} block digest(s))")
            continue
        lo, hi = i * block_size, (i + 1) * block_size
        rows = writer_rows.get(w, {}) if w is not None else {}
        pairs = [(k, _digest_key(k, got)) for k, r in rows.items() if r.shape[0] >= hi]
        pairs = [(k, hk) for k, hk in pairs if hk is not None]
        if not pairs:
            unverified += 1
            continue
        by_rows += 1
        for k, hk in pairs:
            if rows_digest(rows[k][lo:hi]) != got[hk]:
                bad.append(f"block {i} ({hk}, rows {lo}-{hi}): rows read differ from their writer {w}'s hand-off")
    return ReadBlocksCheck(by_digest, by_rows, unverified, tuple(bad))


@dataclass(frozen=True)
class TalkerServedBlock:
    """A talker KV block a prefix hit served, tied to its writer by
    :func:`talker_kv_mismatches`: ``reader`` / ``writer`` (talker request ids), ``block`` (the
    block's index in both requests)."""

    reader: str
    writer: str
    block: int


def talker_kv_mismatches(events: Sequence[Mapping]
                         ) -> tuple[list[tuple[str, str]], list[TalkerServedBlock]]:
    """Oracle (a) for the talker's KV: every block a talker prefix hit served holds, bitwise,
    what its writer left in it.

    ``events``: the talker stage's audit lines in the order logged
    (:class:`omni_cache.engine.talker_audit.TalkerKVAudit`: ``kind`` ``write`` / ``read``,
    ``request``, ``block``, ``block_id``, ``digest``). A read must follow a write of the same
    KV block id (the last one before it: a block reused since then was rewritten) at the same
    block index, with the same digest (the writer may be the reader itself, resumed after
    preemption).

    Returns:
        ``(mismatches, served)``: one ``(reader request id, what is wrong)`` per violation; one
        :class:`TalkerServedBlock` per read that holds, so the caller can check that writer and
        reader had the same content up to the block's last row (the key's claim, judged without
        the key code: :func:`talker_content_mismatches`).
    """
    last: dict[int, Mapping] = {}
    bad: list[tuple[str, str]] = []
    served: list[TalkerServedBlock] = []
    for e in events:
        if e["kind"] == "error":
            bad.append(("", f"the talker's KV audit stopped: {e['message']}"))
            continue
        if e["kind"] == "write":
            last[int(e["block_id"])] = e
            continue
        w = last.get(int(e["block_id"]))
        where = f"talker request {e['request']} block {e['block']} (KV block {e['block_id']})"
        if w is None:
            bad.append((str(e["request"]), f"{where}: served, never written"))
        elif int(w["block"]) != int(e["block"]):
            bad.append((str(e["request"]), f"{where}: last written as block {w['block']} of {w['request']}"))
        elif w["digest"] != e["digest"]:
            bad.append((str(e["request"]), f"{where}: KV changed since {w['request']} wrote it"))
        else:
            served.append(TalkerServedBlock(str(e["request"]), str(w["request"]), int(e["block"])))
    return bad, served


@dataclass(frozen=True)
class ChatTokens:
    """The chat template's token ids the talker's row layout is read from (Qwen3-Omni's
    ``<|im_start|>``, ``user``, ``<|im_end|>``, ``\\n``); :meth:`of` reads them from a tokenizer."""

    im_start: int
    user: int
    im_end: int
    newline: int

    @classmethod
    def of(cls, tok) -> ChatTokens:
        (user,), (nl,) = tok.encode("user"), tok.encode("\n")
        return cls(tok.convert_tokens_to_ids("<|im_start|>"), user, tok.convert_tokens_to_ids("<|im_end|>"), nl)


def talker_user_rows(ids: Sequence[int], chat: ChatTokens) -> list[int]:
    """The thinker positions of the talker's prompt rows before its final assistant segment
    (vLLM-Omni's layout, ``_compute_talker_prompt_ids_length`` in its ``qwen3_omni.py``, read
    here without omni-cache's key code): the user segments' tokens, ``<|im_start|>user`` …
    ``<|im_end|>\\n``, in order. The talker's prompt is these rows plus 9 assistant rows."""
    pos, i = [], 0
    while i < len(ids) - 1:
        if ids[i] == chat.im_start and ids[i + 1] == chat.user:
            end = next((j for j in range(i, len(ids) - 1) if ids[j] == chat.im_end and ids[j + 1] == chat.newline),
                       len(ids) - 2) + 2
            pos += range(i, end)
            i = end
        else:
            i += 1
    return pos


def talker_content_mismatches(block: int, reader_ids: Sequence[int], writer_ids: Sequence[int],
                              reader_emb: torch.Tensor, writer_emb: torch.Tensor, chat: ChatTokens,
                              block_size: int) -> str | None:
    """The content half of the talker's oracle (a): a served talker block ``block`` stands for
    the reader's talker rows up to thinker position ``t`` (the last row of the block,
    :func:`talker_user_rows` on ``reader_ids``); its writer must have had the same thinker prompt
    ids ``[0, t]`` and the same embedding rows ``[0, t]`` (``hidden_states.layer_0`` /
    ``embed.prefill`` ``[tokens, hidden_size]``: each text token's embedding, each media item's
    encoder output), what the talker's rows up to ``t`` are computed from. Returns the
    mismatch, or None."""
    rows = talker_user_rows(reader_ids, chat)
    end = (block + 1) * block_size
    if end > len(rows):
        return f"block {block} is past the reader's {len(rows)} user rows"
    t = rows[end - 1] + 1
    if list(reader_ids[:t]) != list(writer_ids[:t]):
        return f"block {block}: prompt ids [0, {t}) differ from its writer's"
    if not torch.equal(reader_emb[:t], writer_emb[:t]):
        return f"block {block}: embedding rows [0, {t}) differ from its writer's"
    return None
