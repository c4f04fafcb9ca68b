"""The cache-on vs cache-off workload shared by the equality tests (streaming and not)."""

from __future__ import annotations

from omni_cache.driver.inputs import build_request, sample_path

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
        t1 = tok.encode(f"<|im_start|>system\n{LONG}<|im_end|>\n<|im_start|>user\nTell me a story{'y' * pad}.<|im_end|>\n<|im_start|>assistant\n")
        if len(t1) % BLOCK == 20:
            break
    assert len(t1) % BLOCK == 20
    if answer_ids is None:
        return t1
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tail = tok.encode("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    return t1 + [t for t in answer_ids if t != im_end] + [im_end] + tail


def run_workload(pipe, model_dir):
    """Text, image, audio (each twice, the second hitting the first), a two-turn chat, the
    first request again (a whole-prompt hit; same audio), a batch of two with a same-step hit. Returns ``(named results, turn-1 prompt length, batch
    results sorted by prompt length)``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    img, wav = sample_path("astronaut.jpg"), sample_path("speech.wav")
    named = []
    for name, media in (("text", {}), ("image", {"image": img}), ("audio", {"audio": wav})):
        for q in ("What is first?", "And what comes second, please?"):
            (r,) = pipe.generate([build_request(LONG + q, **media)])
            named.append((f"{name}:{q}", r))
    t1 = _two_turn_ids(tok, None)
    (r1,) = pipe.generate([{"prompt_token_ids": t1}])
    named.append(("chat:turn1", r1))
    t2 = _two_turn_ids(tok, r1.token_ids)
    (r2,) = pipe.generate([{"prompt_token_ids": t2}])
    named.append(("chat:turn2", r2))
    # the first request again, after every other one: its talker samples from its own seeded
    # generators (omni_cache.engine.talker), so its audio must be the first one's
    (r,) = pipe.generate([build_request(FIRST_PROMPT)])
    named.append((REPEAT, r))
    batch = pipe.generate([build_request(SAME_STEP_DOC + "Why?"),
                           build_request(SAME_STEP_DOC + "And which of the details did you notice first, and why?")])
    return named, len(t1), sorted(batch, key=lambda r: r.num_prompt_tokens)
