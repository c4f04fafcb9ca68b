"""KV-shared (YOCO) thinkers on the real pipeline: fast prefill and the hidden-state cache
compose exactly, per modality.

**Gemma 4** (the multimodal YOCO thinker, ``stage_configs/gemma4_yoco_cpu.yaml``, streaming as
shipped): the embedded Gemma-4-style thinker (4 of 7 layers KV-shared, sliding + full KV
groups, vision and audio towers, Gemma 4's processor) feeds the Qwen3-Omni talker and
code2wav through the streamed stage-input adapter, in all four combinations of
{``kv_sharing_fast_prefill`` off/on} x {prefix caching + omni-cache off/on}, chosen per request
in one engine (``gemma4``: fast prefill and the cache on): fast prefill off = omni-cache's
per-request opt-out (``NO_FAST_PREFILL``: every step that schedules the request runs
untruncated), cache off = vLLM's ``skip_reading_prefix_cache`` on the thinker and the talker
(no cached block read). Each combination is one pass of the workload; the passes with the
cache on run on their own prompts and media (a "salt": another system-prompt opening, other
pixels and samples of the same sizes), so their hits and encodes are those of a fresh cache,
and each is compared with the slow-path pass (fast off, cache off) of the same prompts. The
same sequential workload — text, image, audio, image + audio (each twice, the second
hitting the first), an image of the same size but other pixels and an audio of the same length
but other samples after the first (no hit past the media start: the media identifier is in the
block hashes), a two-turn chat over an image whose second turn hits the first answer's
decode-filled block, a prefill chunked over several steps with an image inside it (then hit),
a request with prompt logprobs (served, equal) — must give bitwise-equal sampled tokens, every
streamed thinker→talker chunk (first hand-off: captured layer 0 = embeddings incl. the towers'
soft tokens, and the self-decoder output, for every prompt row; then every decode row) and
audio in every combination. The runs also prove they exercised what they claim: truncated
cross-decoder forwards with fast prefill on; hits served by omni-cache with the cache on; and
the towers not run for media inside a hit. (With the cache off, vLLM's own encoder cache also
skips the towers for an item it encoded recently — measured: the repeats here were not
encoded with the cache off either — so the comparison cannot show that skip as the prefix
cache's doing; what it shows is that a hit never re-runs the towers for its media.)

**Gemma 3n** (text only, ``stage_configs/gemma3n_yoco_cpu.yaml``, non-streamed adapter) is
kept for what Gemma 4 lacks: AltUp (its captured rows are the active stream of a
``[altup_num_inputs, tokens, hidden]`` state). One engine (``gemma3n``) with fast prefill and the cache on:
per prompt (a single request, a chunked prefill, a two-turn chat) the fast-prefill request and
a full hit are compared with a slow-path request of the same prompt in the same pipeline (with
prompt logprobs: no prefix-cache read, fast prefill disarmed for its batch).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from omni_cache.engine.runner import NO_FAST_PREFILL
from omni_cache.exactness.fuzz import served_rows_report
from omni_cache.exactness.oracles import compare_prompt_rows
from tests.device import CACHE_OFF_BITWISE
from tests.pipeline.engines import reference_params, thinker_params
from tests.pipeline.workloads import assert_served_rows, media_key, prefix_hit, with_media
from tests.util import (
    assert_audio_vs_cache_off,
    assert_chunks_vs_cache_off,
    assert_handoff_equal,
    assert_same_chunks,
    records_of,
)

pytestmark = pytest.mark.pipeline

BLOCK = 32
LONG = "Look carefully and listen to every detail before you answer my questions today. " * 5
AFTER = " Keep in mind what you just saw and heard, then answer in one short and kind sentence. " * 2
OTHER = "Here is a different shared preamble about rivers, bridges and the old harbour town. " * 4
CAPTAIN = "Answer as a careful ship's captain who has sailed through many storms at night. " * 6
STORY = "Once upon a time a small robot learned to paint the sky in many colours each night. " * 15
COMBOS = [(f, c) for f in ("off", "on") for c in ("off", "on")]  # (fast prefill, cache)
#: pass order in the one engine: (combination, salt); a cache-on pass has its own salt
#: the system prompt's opening per salt
OPENINGS = ("", "This is the second pass. ")
PASSES = [(("on", "on"), 0), (("on", "off"), 0), (("off", "off"), 0), (("off", "on"), 1), (("off", "off"), 1)]

# ---- Gemma 4: multimodal, streamed ---------------------------------------------------

#: requests whose media lie wholly inside their prefix hit (cache on: the towers must not run)
MEDIA_HITS = ("image:second", "audio:second", "image+audio:second", "chunked:second", "chat:turn2")


def _metrics(d, prefix: str) -> dict:
    files = list((d / "metrics").glob(f"{prefix}-*.json"))
    assert len(files) == 1, (prefix, files)
    return json.loads(files[0].read_text())


def _media(salt: int = 0):
    """``(image, other image, (audio, rate), (other audio, rate))``; ``salt`` 1: other pixels
    and samples of the same sizes (upside down, half amplitude), so vLLM's encoder cache has
    not seen them."""
    from PIL import ImageOps

    from omni_cache.driver.inputs import load_audio, load_image, sample_path

    img = load_image(sample_path("astronaut.jpg"))
    wav, sr = load_audio(sample_path("speech.wav"))
    if salt:
        img, wav = ImageOps.flip(img), np.ascontiguousarray(wav * 0.5)
    # same size / same length, other content: only the media identifier can tell them apart
    return img, ImageOps.mirror(img), (wav, sr), (np.ascontiguousarray(wav[::-1]), sr)


def _combo_params(pipe, combo) -> list | None:
    """Per-stage sampling params of a combination (fast prefill, cache) in the one engine."""
    fast, cache = combo
    opt_out = {} if fast == "on" else {NO_FAST_PREFILL: True}
    if cache == "off":
        return reference_params(pipe, thinker_extra=opt_out)
    return thinker_params(pipe, **opt_out) if opt_out else None


def _yoco_counters(pipe, d) -> dict:
    """The thinker's YOCO counters, current: a one-token request with fast prefill opted out
    first (its untruncated step publishes the counters at once; they are otherwise published
    at most every 0.5 s)."""
    from omni_cache.driver.inputs import OmniRequest, Turn

    flush = reference_params(pipe, thinker_extra={NO_FAST_PREFILL: True}, max_tokens=2)
    (r,) = pipe.generate([OmniRequest([Turn("user", "Counters, please.")], family="gemma4")], flush)
    assert r.error is None, r.error
    return _metrics(d, "yoco")


def _g4_workload(pipe, model_dir, out_dir, sps=None, salt: int = 0):
    """One pass: ``sps`` the per-stage sampling params of every request (:func:`_combo_params`),
    ``salt`` its prompts and media (0 or 1). Returns ``[(name, result, media items sent, media
    items the towers encoded for it, (its images' and clips' content keys:
    :func:`~tests.pipeline.workloads.media_key`))]`` and the thinker tokenizer."""
    from transformers import AutoTokenizer

    from omni_cache.driver.inputs import OmniRequest, Turn

    tok = AutoTokenizer.from_pretrained(model_dir / "thinker")
    img, img_other, wav, wav_other = _media(salt)
    opening = OPENINGS[salt]
    named = []

    def encoded() -> int:
        f = list((out_dir / "metrics").glob("yoco-*.json"))
        return json.loads(f[0].read_text()).get("encoder_items", 0) if f else 0

    def send(name, request, params=None):
        mm = request.to_engine_prompt() if isinstance(request, OmniRequest) else request
        items = {k: v if isinstance(v, list) else [v] for k, v in mm.get("multi_modal_data", {}).items()}
        media = tuple([media_key(x) for x in items.get(k, [])] for k in ("image", "audio"))
        before = encoded()
        (r,) = pipe.generate([request], params or sps)
        assert r.error is None, (name, r.error)
        named.append((name, r, sum(map(len, media)), encoded() - before, media))
        return r

    def req(text, system=LONG, image=None, audio=None, history=()):
        turns = [Turn("system", opening + system), *history, Turn("user", text, image=image, audio=audio)]
        return OmniRequest(turns=turns, family="gemma4")

    send("text:first", req("What is first?"))
    send("text:second", req("And what comes second, please?"))
    for name, media in (("image", {"image": img}), ("audio", {"audio": wav}),
                        ("image+audio", {"image": img, "audio": wav})):
        send(f"{name}:first", req(AFTER + "What is first?", **media))
        send(f"{name}:second", req(AFTER + "And what comes second, please?", **media))
    send("image:other", req(AFTER + "What is first?", image=img_other))
    send("audio:other", req(AFTER + "What is first?", audio=wav_other))
    # two turns over an image: turn 2 = turn 1's prompt + its answer + a new user turn (token
    # ids; vLLM expands turn 1's single image token again). Turn 1's prompt ends 24 tokens
    # into a block, so its answer (12 tokens, 11 of them computed) fills that block in decode.
    image_first = next(r for n, r, *_ in named if n == "image:first")
    expansion = image_first.num_prompt_tokens - len(tok.encode(req(AFTER + "What is first?", image=img).prompt_text()))
    for pad in range(BLOCK):  # "y" is one byte-level token
        t1 = req(f"Tell me a story about this picture{'y' * pad}.", image=img)
        if (len(tok.encode(t1.prompt_text())) + expansion) % BLOCK == 24:
            break
    r1 = send("chat:turn1", t1)
    assert r1.num_prompt_tokens % BLOCK == 24 and len(r1.token_ids) == 12, (r1.num_prompt_tokens, r1.token_ids)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = (tok.encode(t1.prompt_text()) + [t for t in r1.token_ids if t != im_end] + [im_end]
           + tok.encode("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"))
    send("chat:turn2", {"prompt_token_ids": ids, "multi_modal_data": {"image": img}})
    # a prompt of ~1,500 tokens prefilled over several steps of STEP_BUDGET, an image inside
    send("chunked:first", req(AFTER + "Continue the story.", system=STORY, image=img))
    send("chunked:second", req(AFTER + "Who is the hero?", system=STORY, image=img))
    # vLLM computes prompt logprobs only for the tokens it computes, so such a request must
    # not hit (SamplingParams derives skip_reading_prefix_cache only at construction)
    logprobs = reference_params(pipe, prompt_logprobs=1)
    logprobs[0].extra_args = (sps[0].extra_args if sps else None) or {}
    send("logprobs", req(AFTER + "Score this prompt.", image=img), logprobs)
    send("after-logprobs", req(AFTER + "Still there?", image=img))
    return named, tok


@pytest.fixture(scope="session")
def g4_runs(gemma4):
    """Every pass of :data:`PASSES` on the one engine: ``{(combination, salt): (named, chunks
    per request, tokenizer, YOCO counter deltas of the pass)}``."""
    pipe, d = gemma4.pipe, gemma4.dir
    out = {}
    before = _yoco_counters(pipe, d)
    for combo, salt in PASSES:
        named, tok = _g4_workload(pipe, gemma4.model_dir, d, _combo_params(pipe, combo), salt)
        after = _yoco_counters(pipe, d)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        delta["fallback_forwards"] -= 1  # the flush request's own untruncated step
        delta["full_forwards"] = delta.get("full_forwards", 0) - 1
        out[(combo, salt)] = (named, [records_of(d, r.request_id) for _, r, *_ in named], tok, delta)
        before = after
    return out


def _pass(g4_runs, combo):
    """The pass of ``combo`` and the slow-path pass of the same prompts."""
    salt = next(s for c, s in PASSES if c == combo)
    return g4_runs[(combo, salt)], g4_runs[(("off", "off"), salt)]


@pytest.mark.parametrize("combo", COMBOS[1:], ids=lambda c: f"fast-{c[0]}_cache-{c[1]}")
def test_gemma4_equal_to_slow_path_bitwise(g4_runs, combo):
    """Per modality: sampled tokens, every streamed thinker→talker chunk, prompt logprobs and
    audio equal fast-off/cache-off bitwise. On CUDA (tests/device.py) fast prefill alone is
    still held to the slow path bitwise; a pass with the cache on, whose hits compute their
    suffix over cached KV, is held to oracle (c)'s stated precision
    (:func:`tests.util.assert_chunks_vs_cache_off`, :func:`tests.util.assert_audio_vs_cache_off`)."""
    (got, got_chunks, _, _), (ref, ref_chunks, _, _) = _pass(g4_runs, combo)
    assert [n for n, *_ in ref] == [n for n, *_ in got]
    assert len(ref_chunks) == len(got_chunks) == len(ref), (len(ref_chunks), len(got_chunks))
    exact = CACHE_OFF_BITWISE or combo[1] == "off"
    for (name, r0, *_), (_, r1, *_), c0, c1 in zip(ref, got, ref_chunks, got_chunks):
        assert r1.num_prompt_tokens == r0.num_prompt_tokens and r0.token_ids, name
        # the first hand-off carries every prompt row, cached prefix included
        assert c1[0]["hidden_states.output"].shape[0] >= r0.num_prompt_tokens, name
        if not exact:
            same = assert_chunks_vs_cache_off(c1, c0, name, num_prompt_tokens=r1.num_prompt_tokens,
                                              hit=r1.num_cached_tokens, same_tokens=r1.token_ids == r0.token_ids)
            assert_audio_vs_cache_off(r1, r0, name, handoff_bitwise=same)
            if r1.num_cached_tokens:
                continue  # (prompt logprobs: below, where nothing was read from the cache)
        else:
            assert r1.token_ids == r0.token_ids, name
            assert_same_chunks(c1, c0, name)
            assert r0.audio is not None and r1.audio is not None and np.array_equal(r1.audio, r0.audio), name
        if name == "logprobs":
            assert r0.prompt_logprobs is not None and r1.prompt_logprobs is not None
            assert len(r1.prompt_logprobs) == r1.num_prompt_tokens
            for p0, p1 in zip(r0.prompt_logprobs, r1.prompt_logprobs):
                assert (p0 is None) == (p1 is None)
                if p0 is not None:
                    assert {t: lp.logprob for t, lp in p0.items()} == {t: lp.logprob for t, lp in p1.items()}


def _g4_expected_hits(g4_runs) -> dict:
    """Every request's thinker hit, per pass (``{(combination, salt): {name: tokens}}``),
    computed from token ids and media (:func:`~tests.pipeline.workloads.prefix_hit` over
    :func:`~tests.pipeline.workloads.with_media`, media ranges with their markers; ids as
    vLLM-Omni handed them to the talker, ``ids.prompt``): each request, sent alone, hits what
    every request before it in the engine computed (prompts and answers, of every earlier
    pass), except with the cache off and the prompt-logprobs request (no cached block read: 0).
    The engine's flush requests share no block with these prompts (another first turn)."""
    seen, out = [], {}
    for (combo, salt), (named, chunks, *_) in g4_runs.items():
        exp = out[(combo, salt)] = {}
        for (name, r, _, _, media), c in zip(named, chunks, strict=True):
            ids = c[0]["ids.prompt"].tolist()
            assert len(ids) == r.num_prompt_tokens, (name, len(ids), r.num_prompt_tokens)
            seq = with_media(ids, *media, markers=True)  # Gemma 4: boi + soft tokens + eoi
            exp[name] = 0 if combo[1] == "off" or name == "logprobs" else prefix_hit(seq, seen, BLOCK)
            seen.append(seq + [(t, None) for t in r.token_ids[:-1]])
    return out


def _media_start(tok, request_text: str, placeholder: str) -> int:
    """Prompt position of the first soft token of the medium whose bare placeholder is
    ``placeholder`` (the processor puts a begin marker before it)."""
    return len(tok.encode(request_text[: request_text.index(placeholder)])) + 1


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"fast-{c[0]}_cache-{c[1]}")
def test_gemma4_runs_exercise_fast_prefill_hits_and_towers(g4_runs, combo):
    """Not vacuous: fast prefill truncated the cross-decoder (and ran untruncated for the
    prompt-logprob request); every hit is the one computed from token ids and media
    (:func:`_g4_expected_hits`); with the cache on, the dependent requests hit, omni-cache served
    every hit, media wholly inside a hit were not encoded again, and media of the same size
    but other content got no hit past their start. Media never sent to the engine before are
    encoded (the cache-on passes' first and other media)."""
    from omni_cache.driver.inputs import PLACEHOLDERS

    fast, cache = combo
    (named, _, tok, y), _ = _pass(g4_runs, combo)
    if fast == "on":
        assert y["truncated_forwards"] > 0 and y["rows_skipped_by_cross_decoder"] > 0, y
        assert y["fallback_forwards"] > 0, y  # the prompt-logprobs request
    else:  # every forward of the pass ran untruncated (the opt-out)
        assert y["truncated_forwards"] == 0 and y["fallback_forwards"] == y["full_forwards"] > 0, y
    hits = {n: r.num_cached_tokens for n, r, *_ in named}
    enc = {n: e for n, _, _, e, _ in named}
    n_media = {n: k for n, _, k, *_ in named}
    assert n_media["image+audio:first"] == 2 and n_media["chat:turn2"] == 1, n_media
    # a repeat may be served by vLLM's own encoder cache (outputs of recently encoded items, by
    # content hash) whatever the prefix cache does, so every pass encodes at most what it was
    # sent; a cache-on pass's media were never sent before, so its first ones are encoded (a
    # cache-off pass repeats media the engine already encoded in the cache-on pass of its salt)
    assert all(enc[n] <= n_media[n] for n in enc), (enc, n_media)
    salt = next(s for c, s in PASSES if c == combo)
    expected = _g4_expected_hits(g4_runs)[(combo, salt)]
    assert hits == expected, {n: (h, expected[n]) for n, h in hits.items() if h != expected[n]}
    if cache == "off":
        assert not any(hits.values()), hits
        return
    for n in ("image:first", "audio:first", "image:other", "audio:other"):
        assert enc[n] == n_media[n], (n, enc)
    for n in ("text:second", "image:second", "audio:second", "image+audio:second", "chunked:second",
              "after-logprobs", "image:other", "audio:other"):
        assert hits[n] >= BLOCK, (n, hits)
    turn1 = next(r for n, r, *_ in named if n == "chat:turn1")
    assert hits["chat:turn2"] > turn1.num_prompt_tokens, hits  # the answer's decode-filled block
    assert hits["logprobs"] == 0, hits
    for n in MEDIA_HITS:
        assert enc[n] == 0, (n, enc)  # the towers did not run for media inside the hit
    # no hit past the start of a medium that only its identifier tells apart
    image_ph, audio_ph = PLACEHOLDERS["gemma4"]
    from omni_cache.driver.inputs import OmniRequest, Turn

    def text(**media):
        turns = [Turn("system", OPENINGS[salt] + LONG), Turn("user", AFTER, **media)]
        return OmniRequest(turns, family="gemma4").prompt_text()

    assert hits["image:other"] <= _media_start(tok, text(image=object()), image_ph) // BLOCK * BLOCK, hits
    assert hits["audio:other"] <= _media_start(tok, text(audio=object()), audio_ph) // BLOCK * BLOCK, hits


def test_gemma4_omni_cache_served_every_hit(g4_runs, gemma4):
    """omni-cache's counters over the whole engine: every hit of the cache-on passes served
    (none refused); the cache-off passes and the flush requests read nothing; every served
    row is its writer's (oracle (a)), none unverified: the chat's decode-filled block against
    its writer's block digest."""
    hits = sum(r.num_cached_tokens for (combo, _), (named, *_) in g4_runs.items() for _, r, *_ in named)
    m = _metrics(gemma4.dir, "metrics")
    assert m["hits_refused"] == 0 and m["hits_served"] >= 16, m
    assert m["hit_tokens"] == hits, (m, hits)
    # oracle (a): every served row equals bitwise the row its writer computed (fast prefill on
    # or off for either: the rows handed off are the self-decoder's, exact either way)
    served = served_rows_report(gemma4.dir, [r for (named, *_) in g4_runs.values() for _, r, *_ in named])
    assert sum(v for v, _, _ in served.values()) >= 16, served
    assert all(not bad for _, _, bad in served.values()), {k: b for k, (_, _, b) in served.items() if b}
    # every hit request audited, every served block verified against its writer (the pass's
    # own requests: each cache-on pass has its own prompts): its recorded rows, or for the
    # chat's turn 2, which hits turn 1's answer (filled while decoding; the hand-off holds
    # prompt rows only), the digest of the rows turn 1's forward computed (BlockDigestAudit)
    for (combo, _), (named, *_) in g4_runs.items():
        mine = {r.request_id for _, r, *_ in named}
        if combo[1] == "off":
            assert not mine & set(served), sorted(mine & set(served))
            continue
        t1_len = next(r for n, r, *_ in named if n == "chat:turn1").num_prompt_tokens
        assert_served_rows({k: v for k, v in served.items() if k in mine}, [(n, r) for n, r, *_ in named], [], t1_len)


# ---- Gemma 3n: text, AltUp, non-streamed, one pipeline -----------------------------------



def _chat(tok, system: str, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                      "<|im_start|>assistant\n")


def _g3n_workload(pipe, model_dir, out_dir):
    """Per prompt three requests, one at a time: ``fast`` (fast prefill, a miss or a partial
    hit), ``slow`` (the same prompt with prompt logprobs: vLLM does not read the prefix cache
    for it and omni-cache's runner disarms fast prefill for its batch — the slow path's
    computation, in the same pipeline) and ``hit`` (the same prompt again: every full block
    served from the cache). ``batch:<i>``: three prompts sharing a fresh system prompt, each
    kind sent as one concurrent batch (several requests' logit rows in one truncated step; the
    shared prefix computed in the same steps). Returns ``({prompt name: {kind: (result,
    hand-off)}}, {prompt name: token ids})``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir / "thinker")
    seen: set = set()
    out: dict = {}
    prompts: dict = {}
    slow = pipe.default_sampling_params()
    slow[0].prompt_logprobs = 1
    slow[0].skip_reading_prefix_cache = True  # SamplingParams derives it only at construction

    def triple(name, prompt):
        prompts[name] = prompt
        for kind, sps in (("fast", None), ("slow", slow), ("hit", None)):
            (r,) = pipe.generate([{"prompt_token_ids": prompt}], sps)
            files = [f for f in sorted((out_dir / "handoff").glob("*.pt")) if f.name not in seen]
            seen.update(f.name for f in files)
            assert len(files) == 1 and r.error is None, (name, kind, files, r.error)
            out.setdefault(name, {})[kind] = (r, torch.load(files[0]))
        return out[name]["fast"][0]

    def batch(batch_prompts):
        prompts.update((f"batch:{i}", p) for i, p in enumerate(batch_prompts))
        for kind, sps in (("fast", None), ("slow", slow), ("hit", None)):
            rs = pipe.generate([{"prompt_token_ids": p} for p in batch_prompts], sps)
            files = [f for f in sorted((out_dir / "handoff").glob("*.pt")) if f.name not in seen]
            seen.update(f.name for f in files)
            assert len(files) == len(batch_prompts), (kind, files)
            for i, r in enumerate(rs):
                assert r.error is None, (kind, i, r.error)
                rid = re.sub(r"[^A-Za-z0-9_.-]", "_", r.request_id)
                (f,) = [f for f in files if rid in f.name]
                out.setdefault(f"batch:{i}", {})[kind] = (r, torch.load(f))

    triple("single", _chat(tok, LONG, "What is first?"))
    batch([_chat(tok, CAPTAIN, q) for q in ("Where are we?", "What is the weather like?", "Who steers?")])
    triple("chunked", _chat(tok, STORY, "Continue the story."))  # ~1,300 tokens, steps of 512
    t1 = _chat(tok, LONG, "Tell me a story.")
    r1 = triple("chat:turn1", t1)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    triple("chat:turn2", t1 + [t for t in r1.token_ids if t != im_end] + [im_end]
           + tok.encode("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"))
    return out, prompts


@pytest.fixture(scope="session")
def g3n_run(gemma3n):
    return (gemma3n.dir, *_g3n_workload(gemma3n.pipe, gemma3n.model_dir, gemma3n.dir))


def _g3n_expected_hits(runs: dict, prompts: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """Each request's thinker hit, ``(name, kind) → (least, most)``, from token ids
    (:func:`~tests.pipeline.workloads.prefix_hit`, sent in :func:`_g3n_workload`'s order): a
    request hits what the requests before it computed (prompts and answers), the ``slow`` ones
    nothing (no cached block read); a ``fast`` request of the batch sent together may hit its
    batch mates' prompts too, or not, by timing (the thinker's cap serves only rows already
    written): ``least == most`` for every other request."""
    seen, out = [], {}
    names = [n for n in runs if not n.startswith("batch:")]
    order = [[n] for n in names[:1]] + [[n for n in runs if n.startswith("batch:")]] + [[n] for n in names[1:]]
    for group in order:
        for kind in ("fast", "slow", "hit"):
            done = {n: prompts[n] + list(runs[n][kind][0].token_ids[:-1]) for n in group}
            for n in group:
                mates = [done[m] for m in group if m != n] if kind == "fast" else []
                out[(n, kind)] = ((0, 0) if kind == "slow" else
                                  (prefix_hit(prompts[n], seen, BLOCK), prefix_hit(prompts[n], seen + mates, BLOCK)))
            seen += done.values()
    return out


def test_gemma3n_fast_prefill_and_hits_equal_the_slow_path_bitwise(g3n_run):
    """Gemma 3n (AltUp): for each prompt, the fast-prefill request and the full-hit request hand
    the talker bitwise what the slow-path request (untruncated, no cache read) hands it —
    captured layers 0 and 4 (the active AltUp stream), TTS embeddings — with the same tokens
    and audio; and the run exercised what it claims: truncated forwards, fallback forwards for
    the slow requests, hits served by omni-cache (none refused). On CUDA a request with a hit
    is held to oracle (c)'s stated precision against the slow path instead (tests/device.py),
    and its served rows bitwise to their writer's (oracle (a), every device)."""
    d, runs, prompts = g3n_run
    # every hit as computed from token ids (a full hit: every whole block of the prompt bar
    # vLLM's last token; the chat's turn 2: turn 1's prompt and the answer blocks it filled)
    expected = _g3n_expected_hits(runs, prompts)
    got = {(n, k): runs[n][k][0].num_cached_tokens for n, k in expected}
    assert {k: v for k, v in got.items() if not expected[k][0] <= v <= expected[k][1]} == {}, (got, expected)
    assert sum(lo == hi for lo, hi in expected.values()) >= len(expected) - 3, expected  # all but the batch's fast
    assert all(expected[(n, "hit")][0] > 0 for n in runs), expected
    for name, by_kind in runs.items():
        r_slow, h_slow = by_kind["slow"]
        assert r_slow.prompt_logprobs is not None and r_slow.num_cached_tokens == 0, name
        for kind in ("fast", "hit"):
            r, h = by_kind[kind]
            assert "hidden" not in h and {"hidden_states.layer_0", "hidden_states.layer_4"} <= set(h), sorted(h)
            n_rows = r.num_prompt_tokens + len(r.token_ids) - 1  # the last sampled token is never fed back
            assert h["hidden_states.layer_4"].shape[0] == n_rows, (name, kind)
            if kind == "hit" and not name.startswith("batch"):
                # oracle (a), bitwise on every device: the hit's served rows are their writer's.
                # The prompt's blocks were written by its ``fast`` request (sent first) or by the
                # requests whose rows that one was served, so the hit's first rows equal what
                # ``fast`` handed off (the batch's blocks may be its mates', computed in a batch)
                hit, fast_h = r.num_cached_tokens, by_kind["fast"][1]
                for k in ("hidden_states.layer_0", "hidden_states.layer_4"):
                    assert torch.equal(h[k][:hit], fast_h[k][:hit]), \
                        f"{name}: served rows of {k} differ from their writer's"
            if r.num_cached_tokens and not CACHE_OFF_BITWISE:
                # CUDA (tests/device.py): a hit's suffix over cached KV, to oracle (c)'s stated
                # precision (embedding rows bitwise); tokens may flip on near-ties. Fast prefill
                # without a hit stays bitwise.
                n, keys = r.num_prompt_tokens, ("hidden_states.layer_0", "hidden_states.layer_4")
                _, bad = compare_prompt_rows({k: h[k][:n] for k in keys}, {k: h_slow[k][:n] for k in keys},
                                             r.num_cached_tokens)
                assert not bad and r.token_ids, (name, kind, bad)
                continue
            assert r.token_ids == r_slow.token_ids and r.token_ids, (name, kind)
            assert_handoff_equal(h, h_slow, f"{name}:{kind}")
            if not name.startswith("batch"):  # the talker's batched forward is batch-variant on this CPU
                assert r.audio is not None and np.array_equal(r.audio, r_slow.audio), (name, kind)
        assert r_slow.num_prompt_tokens == len(prompts[name]), name
    turn1 = runs["chat:turn1"]["fast"][0]
    assert runs["chat:turn2"]["fast"][0].num_cached_tokens >= turn1.num_prompt_tokens // BLOCK * BLOCK
    y = _metrics(d, "yoco")
    assert y["truncated_forwards"] > 0 and y["rows_skipped_by_cross_decoder"] > 0, y
    solo = sum(not n.startswith("batch") for n in runs)
    assert y["fallback_forwards"] >= solo + 1, y  # each slow request's (or batch's) step ran untruncated
    m = _metrics(d, "metrics")
    assert m["hits_refused"] == 0 and m["hits_served"] >= len(runs), m
