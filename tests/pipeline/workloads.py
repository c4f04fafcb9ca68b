"""The cache-on vs cache-off workload shared by the equality tests (streaming and not)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omni_cache.driver.inputs import build_request, sample_path
from tests.util import placeholder_talker_keys, records_of

BLOCK = 32
SENTENCE = "Look carefully and listen to every detail before you answer my questions today. "
LONG = SENTENCE * 5
# Same-step hit: a ~1,450-token shared prefix is longer than one step's token budget (the
# thinker's max_num_batched_tokens, 1024 in these pipelines; every other prompt here fits one
# step), so request A prefills in two steps and request B, sent with it, is admitted in A's
# second step and hits blocks that A completes in that step. (Both then reach the talker in
# the same step; on CPU a talker prompt must not be chunked — vLLM's seeded sampling fails
# with "CPU Generator does not use offset" — so both together stay under its budget of 4096.)
STEP_BUDGET = 1024
SAME_STEP_DOC = "Chapter two. " + SENTENCE * 17
FIRST, REPEAT = "text:What is first?", "text:What is first? (again)"
FIRST_PROMPT = LONG + "What is first?"


def _two_turn_ids(tok, answer_ids: list[int] | None):
    """Token-id prompts of a text conversation; turn 1's prompt ends 20 tokens into a
    block so its answer crosses a block boundary (that block is filled by decode)."""
    for pad in range(BLOCK):  # "y" is one byte-level token: pad to the wanted offset
        t1 = tok.encode(f"<|im_start|>system\n{LONG}<|im_end|>\n<|im_start|>user\nTell me a story{'y' * pad}."
                        "<|im_end|>\n<|im_start|>assistant\n")
        if len(t1) % BLOCK == 20:
            break
    assert len(t1) % BLOCK == 20
    if answer_ids is None:
        return t1
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tail = tok.encode("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    return t1 + [t for t in answer_ids if t != im_end] + [im_end] + tail


def send(pipe, requests: list, sampling_params_list=None) -> list:
    """``requests`` as one batch through ``pipe`` — an :class:`~omni_cache.driver.pipeline.OmniPipeline`
    (one ``generate`` call) or a :class:`~omni_cache.driver.streaming.StreamingPipeline` (in
    flight together) — with ``sampling_params_list`` (None: the stage config's defaults)."""
    if hasattr(pipe, "run_many"):
        return pipe.run_many(requests, sampling_params_list=sampling_params_list)
    return pipe.generate(requests, sampling_params_list)


def run_workload(pipe, model_dir, sampling_params_list=None, replay: list | None = None):
    """Text, image, audio (each twice, the second hitting the first), a two-turn chat, the
    first request again (a whole-prompt hit; same audio), a batch of two with a same-step hit.

    ``replay``: the ``sent`` list of an earlier call: the same prompts again (e.g. as cache-off
    references with ``sampling_params_list`` from :func:`tests.pipeline.engines.reference_params`).
    Returns ``(named results, turn-1 prompt length, batch results sorted by prompt length,
    sent)``; ``sent``: ``[(name, [request, ...])]`` in the order sent (the batch is ``"batch"``)."""
    sent: list = []

    def go(name: str, requests: list) -> list:
        sent.append((name, requests))
        return send(pipe, requests, sampling_params_list)

    if replay is not None:
        named, batch = [], []
        for name, requests in replay:
            results = go(name, requests)
            if name == "batch":
                batch = results
            else:
                named.append((name, results[0]))
        t1 = next(r for n, r in replay if n == "chat:turn1")[0]["prompt_token_ids"]
        return named, len(t1), sorted(batch, key=lambda r: r.num_prompt_tokens), sent

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    img, wav = sample_path("astronaut.jpg"), sample_path("speech.wav")
    named = []
    for name, media in (("text", {}), ("image", {"image": img}), ("audio", {"audio": wav})):
        for q in ("What is first?", "And what comes second, please?"):
            (r,) = go(f"{name}:{q}", [build_request(LONG + q, **media)])
            named.append((f"{name}:{q}", r))
    t1 = _two_turn_ids(tok, None)
    (r1,) = go("chat:turn1", [{"prompt_token_ids": t1}])
    named.append(("chat:turn1", r1))
    t2 = _two_turn_ids(tok, r1.token_ids)
    (r2,) = go("chat:turn2", [{"prompt_token_ids": t2}])
    named.append(("chat:turn2", r2))
    # the first request again, after every other one: its talker samples from its own seeded
    # generators (omni_cache.engine.talker), so its audio must be the first one's
    (r,) = go(REPEAT, [build_request(FIRST_PROMPT)])
    named.append((REPEAT, r))
    batch = go("batch", [build_request(SAME_STEP_DOC + "Why?"),
                         build_request(SAME_STEP_DOC + "And which of the details did you notice first, and why?")])
    return named, len(t1), sorted(batch, key=lambda r: r.num_prompt_tokens), sent


def prefix_hit(ids: list[int], earlier: list[list[int]], block: int = BLOCK) -> int:
    """vLLM's prefix hit for the prompt ``ids`` after the token sequences ``earlier`` (whose KV
    was computed), computed from token ids alone: the longest common prefix with any of them,
    in whole blocks, leaving at least the last token to compute. (Media identifiers are in
    vLLM's hash too: callers use it where equal token ids carry the same media.)"""
    from omni_cache.exactness.realtime import common_prefix_len

    longest = max((common_prefix_len(ids, e) for e in earlier), default=0)
    return min(longest, len(ids) - 1) // block * block


def with_media(ids: list[int], images: list, audios: list, *, markers: bool = False) -> list[tuple[int, object]]:
    """The prompt ``ids`` as vLLM's block hashes see them, for :func:`prefix_hit`: each token id
    with, on a photo's or a clip's placeholder range, that item's content — ``images`` /
    ``audios``: a content key per item (:func:`media_key`), in prompt order (the k-th run of
    ``<|image_pad|>`` is the k-th image, of ``<|audio_pad|>`` the k-th clip: the Qwen3-Omni and
    Gemma-4 pipelines' ids). A photo or clip of the same size and other content has the same
    ids, and a hit must stop at the block holding its range's first token. The range is the
    pads (Qwen3-Omni: vLLM replaces the pad token by pads) or, with ``markers``, the pads with
    the begin and end marker around them (Gemma 4: vLLM replaces the pad token by ``boi + pads
    + eoi``, ``vllm/model_executor/models/gemma4_mm.py``)."""
    from omni_cache.models.qwen3 import SPECIAL_TOKENS

    items = {SPECIAL_TOKENS["<|image_pad|>"]: list(images), SPECIAL_TOKENS["<|audio_pad|>"]: list(audios)}
    runs = dict.fromkeys(items, 0)
    tags: list = [None] * len(ids)
    for i, x in enumerate(ids):
        if x in items:
            first = i == 0 or ids[i - 1] != x
            runs[x] += first
            tags[i] = items[x][runs[x] - 1]
            if markers and first and i > 0:
                tags[i - 1] = tags[i]
            if markers and i + 1 < len(ids) and ids[i + 1] != x:
                tags[i + 1] = tags[i]
    assert runs == {pad: len(v) for pad, v in items.items()}, (runs, {pad: len(v) for pad, v in items.items()})
    return list(zip(ids, tags))


def media_key(item) -> bytes:
    """A content key of a photo (PIL image) or a clip (a sample array, or ``(samples, rate)``)
    for :func:`with_media`."""
    import numpy as np

    if isinstance(item, tuple):
        item = item[0]
    return np.ascontiguousarray(np.asarray(item)).tobytes()


def expected_hits(prompts: list[list[int]], results: list, *, together: int = 0) -> list[int]:
    """Each request's thinker hit, from token ids (:func:`prefix_hit`): ``prompts`` (token ids)
    and ``results`` in the order sent, each hitting what the requests before it computed —
    their prompts and the answer tokens whose KV they computed (all but the last sampled one:
    the chat's second turn hits the first answer's decode-filled blocks). The last
    ``together`` requests were sent in one batch: each sees only the prompts of the batch's
    earlier requests (vLLM hashes a prompt's blocks when it schedules them; the workload's
    batch admits its second request while the first computes the shared prefix)."""
    seen, out = [], []
    n = len(prompts)
    for i, (ids, r) in enumerate(zip(prompts, results, strict=True)):
        out.append(prefix_hit(ids, seen))
        seen.append(ids if i >= n - together else ids + list(r.token_ids[:-1]))
    return out


def processor_prompt_ids(model_dir, sent: list) -> list[list[int]]:
    """The thinker prompt's token ids of every request of ``sent`` (:func:`run_workload`'s),
    in order, from the model's own HF processor (what vLLM's input processing runs,
    placeholders expanded); a token-id prompt as sent."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    out = []
    for _, requests in sent:
        for req in requests:
            if isinstance(req, dict):
                out.append(list(req["prompt_token_ids"]))
                continue
            p = req.to_engine_prompt()
            mm = p.get("multi_modal_data", {})
            kw = {}
            if "image" in mm:
                kw["images"] = mm["image"]
            if "audio" in mm:
                kw["audio"], kw["sampling_rate"] = [mm["audio"][0]], mm["audio"][1]
            out.append(proc(text=[p["prompt"]], return_tensors="pt", **kw)["input_ids"][0].tolist())
    return out


def assert_served_rows(served: dict, named: list, batch: list, t1_len: int, block: int = BLOCK) -> None:
    """Oracle (a) over the hits of a workload with a two-turn chat — :func:`run_workload`'s, or
    the YOCO pipeline's — (``served``: :func:`omni_cache.exactness.fuzz.served_rows_report` of
    the named and batch results; ``t1_len``: ``chat:turn1``'s prompt length): no mismatch;
    every hit request audited, every one of its served blocks verified against its writer —
    bitwise against the writer's recorded rows, and the chat's decode-filled blocks
    (``chat:turn2`` hits turn 1's answer, whose rows turn 1 computed while decoding and its
    recorded hand-off does not hold) against the digest of the rows the writer's forward
    computed (:class:`omni_cache.engine.metrics.BlockDigestAudit`); ``chat:turn2``'s hit
    reaches at least one such block."""
    assert all(not bad for _, _, bad in served.values()), {k: b for k, (_, _, b) in served.items() if b}
    results = [r for _, r in named] + list(batch)
    hit = [r for r in results if r.num_cached_tokens]
    assert set(served) == {r.request_id for r in hit}, (sorted(served), [r.request_id for r in hit])
    for r in hit:
        ver, unver, _ = served[r.request_id]
        assert unver == 0 and ver >= r.num_cached_tokens // block, (r.request_id, ver, unver, r.num_cached_tokens)
    turn2 = dict(named)["chat:turn2"]
    # turn 2 reaches a decode-filled block
    assert turn2.num_cached_tokens // block > t1_len // block, (turn2.num_cached_tokens, t1_len)


# ---- talker prefix caching (content-keyed talker blocks) ----

TALKER_CHAT = [  # a voice chat: text, then a photo, then speech, each turn's history the turns before
    (LONG + "Tell me what you notice first.", {}),
    ("And what is in this picture?", {"image": "astronaut.jpg"}),
    ("And what do you hear in this recording?", {"audio": "speech.wav"}),
]
NEGATIVE_QUESTION = "Which detail of the picture do you notice first and why?"


def _same_length_swap(tok, text: str, pairs: list[tuple[str, str]]) -> str:
    """``text`` with the first word swap of ``pairs`` that keeps its token count."""
    n = len(tok.encode(text))
    for a, b in pairs:
        if a in text and len(tok.encode(text.replace(a, b, 1))) == n:
            return text.replace(a, b, 1)
    raise AssertionError(f"no same-length swap among {pairs} for {text!r}")


def talker_negative_requests(tok):
    """Conversation A (a long text turn, a short answer, then a photo with a question) and
    three of the same token lengths that differ once: the system prompt, the photo (mirrored:
    same size, other pixels), the question's words; and A itself under another tenant's
    ``cache_salt`` (same content: shares no block, thinker or talker — vLLM's isolation).
    Returns ``[(name, OmniRequest)]``."""
    from PIL import Image

    from omni_cache.driver.inputs import DEFAULT_SYSTEM_PROMPT, Turn, load_image

    img = load_image(sample_path("astronaut.jpg"))
    history = [Turn("user", LONG + "Remember these words."), Turn("assistant", "I will.")]

    def conv(system=DEFAULT_SYSTEM_PROMPT, image=img, question=NEGATIVE_QUESTION, cache_salt=None):
        from omni_cache.driver.inputs import OmniRequest

        return OmniRequest(turns=[Turn("system", system), *history, Turn("user", question, image=image)],
                           cache_salt=cache_salt)

    swaps = [("virtual", "digital"), ("human", "person"), ("capable", "able"), ("detail", "object"),
             ("first", "most"), ("notice", "see")]
    return [("A", conv()),
            ("B:system", conv(system=_same_length_swap(tok, DEFAULT_SYSTEM_PROMPT, swaps))),
            ("B:image", conv(image=img.transpose(Image.Transpose.FLIP_LEFT_RIGHT))),
            ("B:words", conv(question=_same_length_swap(tok, NEGATIVE_QUESTION, swaps[3:]))),
            ("B:salt", conv(cache_salt="tenant-b"))]


def _talker_keys_of(hook, request_id: str) -> list[str] | None:
    """The talker block keys the hook attached for ``request_id`` (the engine may add a suffix
    to a request id the driver chose, e.g. ``run-3`` → ``run-3-<hex>``)."""
    import re

    if request_id in hook.keys:
        return hook.keys[request_id]
    pat = re.compile(rf"{re.escape(request_id)}[-_].*")
    found = [v for k, v in hook.keys.items() if pat.fullmatch(k)]
    assert len(found) <= 1, (request_id, [k for k in hook.keys if pat.fullmatch(k)])
    return found[0] if found else None


def run_talker_workload(pipe, model_dir, *, placeholder_demo: bool = False, sampling_params_list=None,
                        replay: list | None = None):
    """The voice chat (3 turns) and the negative conversations, one request at a time.
    ``placeholder_demo``: then, with the talker identity hook keying blocks by index only
    (vLLM's hash of placeholder prompts), A and the B's again. ``replay``/``sampling_params_list``:
    as for :func:`run_workload` (a replay sends no placeholder demo). Returns ``(named results,
    {name: talker block keys}, sent)``; the demo's results are named ``placeholder:<name>``."""
    hook = pipe.hooks.talker_identity
    named, keys, sent = [], {}, []

    def go(name, req):
        sent.append((name, req))
        (r,) = send(pipe, [req], sampling_params_list)
        named.append((name, r))
        if hook is not None:
            keys[name] = _talker_keys_of(hook, r.request_id)
        return r

    if replay is not None:
        for name, req in replay:
            if not name.startswith("placeholder:"):
                go(name, req)
        return named, keys, sent

    from transformers import AutoTokenizer

    from omni_cache.driver.inputs import Turn

    tok = AutoTokenizer.from_pretrained(model_dir)
    history: list = []
    for k, (text, media) in enumerate(TALKER_CHAT):
        req = build_request(text, history=history, **{m: sample_path(f) for m, f in media.items()})
        r = go(f"talker-chat:turn{k + 1}", req)
        history = req.turns[1:] + [Turn("assistant", r.text)]
    negatives = talker_negative_requests(tok)
    for name, req in negatives:
        go(name, req)
    if placeholder_demo and hook is not None:
        with placeholder_talker_keys(hook):
            for name, req in negatives:
                if name in ("A", "B:image", "B:words"):
                    go(f"placeholder:{name}", req)
    return named, keys, sent


def recorded_by_request(out_dir, sub: str = "codec") -> list[list[dict]]:
    """Hand-off records of ``out_dir/sub`` grouped per request (``[[record0, ...], ...]``),
    requests in the order of their first record, records in the order sent."""
    import re
    from collections import defaultdict

    import torch

    by_req: dict[str, list] = defaultdict(list)
    for p in (out_dir / sub).glob("*.pt"):
        m = re.match(r"(\d+)-(.+)\.pt$", p.name)
        by_req[m.group(2)].append((int(m.group(1)), torch.load(p)))
    reqs = sorted(by_req.values(), key=lambda recs: min(s for s, _ in recs))
    return [[r for _, r in sorted(recs, key=lambda x: x[0])] for recs in reqs]


def talker_user_rows(tok, ids: list[int]) -> list[int]:
    """The thinker positions of the talker's prompt rows before its final assistant segment
    (:func:`omni_cache.exactness.oracles.talker_user_rows`: vLLM-Omni's layout, read without
    omni-cache's key code); the talker's prompt is these rows plus 9 assistant rows."""
    from omni_cache.exactness.oracles import ChatTokens
    from omni_cache.exactness.oracles import talker_user_rows as rows

    return rows(ids, ChatTokens.of(tok))


def expected_talker_blocks(model_dir, block: int = BLOCK) -> dict[str, tuple[int, int]]:
    """For each negative conversation (:func:`talker_negative_requests`), computed here
    without omni-cache's key code: ``(talker prompt rows, full talker blocks it shares with
    A)``.

    The thinker prompt's token ids come from the model's own HF processor (what vLLM's input
    processing runs, placeholders expanded); the talker's prompt rows are the user segments'
    tokens (``<|im_start|>user`` … ``<|im_end|>\\n``) plus 9 assistant rows (vLLM-Omni's
    layout, checked against the talker's reported prompt length by the caller); a talker block
    is shared iff the thinker position of its last row is before the first difference from A
    (the first differing token id, or, where the ids are equal, the first image token: the
    photo's pixels differ)."""
    from transformers import AutoProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = AutoProcessor.from_pretrained(model_dir)
    image = tok.convert_tokens_to_ids("<|image_pad|>")

    def thinker_ids(req) -> list[int]:
        p = req.to_engine_prompt()
        mm = p.get("multi_modal_data", {})
        return proc(text=[p["prompt"]], images=mm.get("image"), return_tensors="pt")["input_ids"][0].tolist()

    reqs = dict(talker_negative_requests(tok))
    a = thinker_ids(reqs["A"])
    out = {}
    for name, req in reqs.items():
        ids = thinker_ids(req)
        assert len(ids) == len(a), (name, len(ids), len(a))
        diff = next((i for i, (x, y) in enumerate(zip(ids, a)) if x != y), None)
        if req.cache_salt != reqs["A"].cache_salt:
            diff = 0  # another tenant: nothing shared, whatever the content
        elif diff is None:
            diff = ids.index(image) if name != "A" else len(ids)
        rows = talker_user_rows(tok, ids)
        shared = 0
        while (shared + 1) * block <= len(rows) and rows[(shared + 1) * block - 1] < diff:
            shared += 1
        out[name] = (len(rows) + 9, shared)
    return out


def talker_kv_served(out_dir, results, tok, block: int = BLOCK) -> tuple[int, dict[str, list[str]]]:
    """Oracle (a) for the talker's served KV, with what each served block stands for.

    Reads the talker's KV audit (``out_dir/audit/talker-kv-*.jsonl``,
    :class:`omni_cache.engine.talker_audit.TalkerKVAudit`) and asserts
    :func:`omni_cache.exactness.oracles.talker_kv_mismatches` finds nothing: every served talker
    block is bitwise the KV its writer left in it. Then, without omni-cache's key code, each
    served block's writer and reader must have had the same content up to the thinker position
    ``t`` of the block's last talker row (:func:`talker_user_rows` on the reader's prompt ids):
    the same thinker prompt ids ``[0, t]`` and the same embedding rows ``[0, t]`` in the
    recorded thinker → talker hand-off (``hidden_states.layer_0`` / ``embed.prefill``: a text
    token's embedding or a media item's encoder output, position-independent) — what the
    talker's rows up to ``t`` are computed from.

    ``results``: every :class:`~omni_cache.driver.pipeline.RequestResult` the engine answered
    (served blocks of other readers — another test's, on a shared engine — are held to the KV
    check only; a writer that is not among them fails the check).
    Returns ``(blocks of these readers checked, {reader request id: [content mismatch, ...]})``.
    """
    import json

    from omni_cache.exactness.oracles import EMBEDDING_KEYS, ChatTokens, talker_content_mismatches, talker_kv_mismatches

    files = sorted((Path(out_dir) / "audit").glob("talker-kv-*.jsonl"))
    assert len(files) == 1, files  # one talker process
    events = [json.loads(line) for line in files[0].read_text().splitlines()]
    bad, served = talker_kv_mismatches(events)
    assert not bad, bad[:5]
    by_id = {r.request_id: r for r in results}

    def result(talker_id: str):
        ids = [rid for rid in by_id if talker_id == rid or talker_id.startswith(rid + "-")]
        assert ids, f"talker request {talker_id}: not a request of this run"
        return by_id[max(ids, key=len)]

    def embedding(r):
        rec = records_of(out_dir, r.request_id)[0]
        return rec[next(k for k in rec if k in EMBEDDING_KEYS)]

    content: dict[str, list[str]] = {}
    mine = [s for s in served if any(s.reader == rid or s.reader.startswith(rid + "-") for rid in by_id)]
    chat = ChatTokens.of(tok)
    for s in mine:  # the readers of this run (a shared engine also served other tests' requests)
        reader, writer = result(s.reader), result(s.writer)
        why = talker_content_mismatches(s.block, reader.prompt_token_ids, writer.prompt_token_ids,
                                        embedding(reader), embedding(writer), chat, block)
        if why is not None:
            content.setdefault(reader.request_id, []).append(f"{why} ({writer.request_id})")
    return len(mine), content


def assert_talker_kv_oracle(out_dir, results, on: dict, model_dir, block: int = BLOCK) -> None:
    """:func:`talker_kv_served` over every request of a run whose talker workload (``on``:
    name → result) included the placeholder demo: every talker hit block of the run is checked
    (none skipped), no reader's content differs from its writer's — except the demo's B:image
    and B:words, whose index-only keys serve A's blocks past their first difference: the oracle
    must name them (the fault it exists to catch, planted by the test itself)."""
    from transformers import AutoTokenizer

    checked, content = talker_kv_served(out_dir, results, AutoTokenizer.from_pretrained(model_dir), block)
    hit_blocks = sum(r.talker_num_cached_tokens // block for r in results)
    assert checked == hit_blocks > 0, (checked, hit_blocks)
    demo = {on[f"placeholder:{b}"].request_id for b in ("B:image", "B:words")}
    assert not {rid: why for rid, why in content.items() if rid not in demo}, content
    assert demo <= set(content), ("the placeholder demo's foreign blocks were not named", content)
    print(f"talker KV oracle (a): {checked} served blocks = their writers' KV, content = theirs; "
          f"placeholder demo flagged: {sorted(content)}")


def assert_talker_workload(on: dict, off: dict, keys: dict, block: int = BLOCK, *,
                           expected: dict[str, tuple[int, int]] | None = None) -> None:
    """The talker-cache checks shared by the streaming and non-streaming equality tests.

    ``on`` / ``off``: name → result of :func:`run_talker_workload` with the talker's prefix
    cache on / off; ``keys``: name → the talker block keys of the on run.

    - every request: thinker tokens and audio equal cache off bitwise (on CUDA: audio after a
      talker hit of equal length, tokens not compared, :func:`tests.util.assert_audio_vs_cache_off`);
    - the voice chat from turn 2 on: the talker hits at least every full block of the earlier
      turns' user rows and computes only the new user segment, the 9 assistant positions and
      the rest of a partial block;
    - the negatives: each B hits exactly the blocks it shares with A — ``expected``
      (:func:`expected_talker_blocks`: from the processor's token ids and the talker's row
      layout, computed without omni-cache's key code; none for another system prompt, fewer
      for another photo than for other words), never a block after its first difference; the
      hook's keys agree (the same common prefix); and under the placeholder scheme
      (index-only keys, what vLLM's hash of ``[0] * n`` amounts to) the same B's hit past it
      and their audio differs from cache off: the test can tell a wrong block from a right one.
    """
    import numpy as np

    from tests.device import CACHE_OFF_BITWISE
    from tests.util import assert_audio_vs_cache_off

    for name, r in on.items():
        if name.startswith("placeholder:"):
            continue
        r_off = off[name]
        assert r.error is None and r_off.error is None, name
        if CACHE_OFF_BITWISE:
            assert r.token_ids == r_off.token_ids, name
        assert_audio_vs_cache_off(r, r_off, name, handoff_bitwise=r.token_ids == r_off.token_ids)
        assert r_off.talker_num_cached_tokens == 0, name  # the off run caches nothing
        assert r.talker_num_prompt_tokens > 0, name
    for k in (2, 3):
        prev, cur = on[f"talker-chat:turn{k - 1}"], on[f"talker-chat:turn{k}"]
        user_prev, user_cur = prev.talker_num_prompt_tokens - 9, cur.talker_num_prompt_tokens - 9
        assert cur.talker_num_cached_tokens >= user_prev // block * block > 0, (k, cur.talker_num_cached_tokens)
        computed = cur.talker_num_prompt_tokens - cur.talker_num_cached_tokens
        assert computed <= (user_cur - user_prev) + 9 + block - 1, (k, computed)

    def common(a: str, b: str) -> int:
        n = 0
        for x, y in zip(keys[a], keys[b]):
            if x != y:
                break
            n += 1
        return n

    assert expected is not None and len(keys["A"]) >= 3, keys["A"]
    for name, (rows, _) in expected.items():  # the layout, against vLLM-Omni's talker prompt
        assert on[name].talker_num_prompt_tokens == rows, (name, on[name].talker_num_prompt_tokens, rows)
    assert len(keys["A"]) == (expected["A"][0] - 9) // block, (len(keys["A"]), expected["A"])
    shared = {b: expected[b][1] for b in ("B:system", "B:image", "B:words", "B:salt")}
    assert shared["B:system"] == shared["B:salt"] == 0, shared
    assert 0 < shared["B:image"] < shared["B:words"] < len(keys["A"]), shared
    # another tenant's salt: A's content, and no block of A's served, thinker (vLLM) or talker (ours)
    assert on["B:salt"].num_cached_tokens == 0, on["B:salt"].num_cached_tokens
    assert {b: common("A", b) for b in shared} == shared, ({b: common("A", b) for b in shared}, shared)
    for b, n in shared.items():
        assert on[b].talker_num_prompt_tokens == on["A"].talker_num_prompt_tokens, b
        assert on[b].talker_num_cached_tokens == n * block, (b, on[b].talker_num_cached_tokens, n)
    for b in ("B:image", "B:words"):
        demo = on[f"placeholder:{b}"]
        assert demo.talker_num_cached_tokens > shared[b] * block, (b, demo.talker_num_cached_tokens)
        assert demo.token_ids == off[b].token_ids  # the thinker is not affected
        assert not np.array_equal(demo.audio, off[b].audio), b


# ---- the read audit: what a prefix hit's read returned, for reads no hand-off records ----------

#: set in an engine process, :func:`audit_reads` logs every read (test code only)
READ_AUDIT_ENV = "TEST_READ_AUDIT"
#: the entry point's distribution name (a throw-away ``*.dist-info`` directory)
READ_AUDIT_DIST = "omni_cache_test_read_audit"


def audit_reads() -> None:
    """A ``vllm.general_plugins`` entry point (:func:`read_audit_dist`): with
    :data:`READ_AUDIT_ENV` set and ``OMNI_CACHE_HIT_AUDIT`` on the stage, omni-cache's stage
    manager also logs each read's rows, per served hit, as the read returned them —
    ``<audit>/reads-<pid>.jsonl``: ``{"request", "hit_tokens", "blocks": [{hand-off key:
    rows_digest}, ...]}``, in the hit audit's order — and returns them unchanged. A resumed
    request's rows read after its prompt hand-off feed its recompute only (the resumed step's
    chunk is cut to its last row, :func:`omni_cache.engine.handoff.thinker2talker_async_chunk`):
    this log is the one record of them (:func:`omni_cache.exactness.oracles.read_rows_mismatches`)."""
    if not os.environ.get(READ_AUDIT_ENV):
        return
    from omni_cache import settings
    from omni_cache.engine.metrics import rows_digest
    from omni_cache.engine.stage_manager import OmniCacheStageManager

    orig = OmniCacheStageManager.read_hits
    if getattr(orig, "read_audit", False):
        return

    def read_hits(self, plan):
        prefixes = orig(self, plan)
        out = settings.HIT_AUDIT.get()
        if out and prefixes:
            bs = self.block_size
            lines = [{"request": str(rid), "hit_tokens": int(plan.hits[rid]),
                      "blocks": [{k: rows_digest(v[i * bs:(i + 1) * bs]) for k, v in rows.items()}
                                 for i in range(int(plan.hits[rid]) // bs)]}
                     for rid, rows in prefixes.items()]
            with (Path(out) / f"reads-{os.getpid()}.jsonl").open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        return prefixes

    read_hits.read_audit = True
    OmniCacheStageManager.read_hits = read_hits


def read_audit_dist(directory: Path) -> Path:
    """A ``*.dist-info`` in ``directory`` declaring :func:`audit_reads` a ``vllm.general_plugins``
    entry point (put ``directory`` on ``PYTHONPATH`` before an engine starts). Returns it."""
    d = Path(directory) / f"{READ_AUDIT_DIST}-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {READ_AUDIT_DIST}\nVersion: 0\n")
    (d / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{READ_AUDIT_DIST} = tests.pipeline.workloads:audit_reads\n")
    return d


def read_lines(engine_dir) -> list[dict]:
    """The reads :func:`audit_reads` logged into ``engine_dir/audit``, in order."""
    lines = []
    for p in sorted((Path(engine_dir) / "audit").glob("reads-*.jsonl")):
        lines += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return lines
