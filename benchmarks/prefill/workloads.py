"""Prefill-benchmark workloads: request specs for ``text``, ``image``, ``audio``, multi-turn
``chat``, ``miss`` and ``floor`` (what each holds and why: docs/benchmarks.md, "Workloads").

A request spec is a JSON-able dict (``workload, round, index, system, text, image, audio,
max_tokens, measure, chat``, + ``media_copies``, ``concurrency``) that the worker turns into an
engine prompt. Rounds use distinct questions: a timed request never hits its own full prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from omni_cache.driver.inputs import DEFAULT_SYSTEM_PROMPT, load_audio, load_image, sample_path

WORKLOADS = ("text", "image", "audio", "chat", "miss", "floor")
WORDS = ("river stone cloud lantern meadow copper violin harbor orchard falcon ember "
         "glacier canyon thistle marble compass willow saffron beacon tundra").split()


def words(n: int, seed: int) -> str:
    """``n`` deterministic filler words; different ``seed`` → different sequence."""
    return " ".join(WORDS[(seed * 7 + i * 13 + (i * i) % 17 + (seed * i) % 11) % len(WORDS)] for i in range(n))


@dataclass
class WorkloadOptions:
    """Workload sizes. ``prefix_words`` ≈ 7 tokens per word with the embedded tokenizer."""

    requests: int = 20
    prefix_words: int = 400
    suffix_words: int = 12
    media_doc_words: int = 0
    image: str | None = None
    audio: str | None = None
    chat_answer_tokens: int = 48
    media_copies: int = 1
    #: thinker answer length of every request but chat turns, tokens; None: the variant's stage
    #: config (the harness writes 2: prefill + one decode step). 8 or more times the thinker's
    #: decode (``thinker_tpot_ms``, :data:`benchmarks.prefill.summary.MIN_TPOT_TOKENS`)
    answer_tokens: int | None = None
    #: requests per workload and round at c > 1 (not chat): at least this many, at least 2·c;
    #: None: ``requests``. More requests per batch average a c > 1 cell over more of them (on an
    #: H200 three batches of 32 scattered by more than a 2 % bar, docs/gpu.md "Twenty-fourth session")
    load_requests: int | None = None

    def media(self) -> tuple[str, str]:
        return (str(self.image or sample_path("astronaut.jpg")), str(self.audio or sample_path("speech.wav")))


def _question(r: int, i: int, n: int, c: int = 1) -> str:
    """Question ``i`` of round ``r``; at concurrency ``c`` > 1 its label names ``c`` too, so no
    request of one concurrency level repeats a prompt of another."""
    label = f"{r}.{i}" if c == 1 else f"{r}.{i}/c{c}"
    return f"Question {label}: " + words(n, 1000 + 37 * r + i) + "?"


def specs(workload: str, r: int, opts: WorkloadOptions, concurrency: int = 1) -> list[dict]:
    """The request specs of ``workload`` in round ``r`` (in send order) at ``concurrency`` c:
    ``opts.requests`` requests at c = 1, max(``opts.load_requests`` or ``opts.requests``, 2·c) at
    c > 1 (each of the c senders of
    the closed loop sends at least two: a loop, not a single burst of c); chat: one conversation
    of ``opts.requests`` turns, at c > 1 c of them (each turn 1 a miss), listed turn by turn.
    Prompts at one c repeat none of another c's (:func:`_question`).

    Raises:
        ValueError: unknown workload, or ``concurrency`` < 1.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    c = concurrency
    image, audio = opts.media()
    doc = words(opts.prefix_words, 1)
    n = opts.requests if c == 1 else max(opts.load_requests or opts.requests, 2 * c)
    q = lambda r, i: _question(r, i, opts.suffix_words, c)  # noqa: E731
    base = {"workload": workload, "round": r, "image": None, "audio": None, "max_tokens": opts.answer_tokens,
            "measure": True, "chat": None, "system": DEFAULT_SYSTEM_PROMPT, **({"concurrency": c} if c > 1 else {})}
    if workload == "text":
        return [{**base, "index": i, "text": f"{doc}\n\n{q(r, i)}"} for i in range(n)]
    if workload in ("image", "audio"):
        media = {"image": image} if workload == "image" else {"audio": audio}
        lead = f"{words(opts.media_doc_words, 2)}\n\n" if opts.media_doc_words else ""
        return [{**base, **media, "media_copies": opts.media_copies, "index": i,
                 "text": lead + q(r, i)} for i in range(n)]
    if workload == "chat":
        if c == 1:
            return _conversation(base, r, opts, doc, q, session=f"round{r}", opening=f"Conversation {r}.")
        convs = [_conversation(base, r, opts, doc, lambda rr, i, j=j: q(rr, 1000 * j + i),
                               session=f"round{r}-c{c}-conv{j}", opening=f"Conversation {r}.{j} (c{c}).",
                               index0=j * opts.requests) for j in range(c)]
        return [conv[t] for t in range(opts.requests) for conv in convs]
    if workload == "miss":
        tag = lambda r, i: f"{r}-{i}" if c == 1 else f"{r}-{i}-c{c}"  # noqa: E731
        return [{**base, "index": i, "system": f"[{tag(r, i)}] {words(3, 5000 + 97 * r + i)}. {DEFAULT_SYSTEM_PROMPT}",
                 "text": f"{words(opts.prefix_words, 50 + 31 * r + i)}\n\n{q(r, i)}"}
                for i in range(n)]
    if workload == "floor":
        return [{**base, "index": i, "system": "", "text": q(r, i)} for i in range(n)]
    raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")


def _conversation(base: dict, r: int, opts: WorkloadOptions, doc: str, q, *, session: str, opening: str,
                  index0: int = 0) -> list[dict]:
    """One chat conversation of ``opts.requests`` turns: turn 1 (untimed, a miss: its system
    prompt starts with ``opening``) carries the document and a question, turn k+1 a new
    question after turns 1..k (see :mod:`benchmarks.prefill.worker`)."""
    return [{**base, "index": index0 + i, "measure": i > 0, "max_tokens": opts.chat_answer_tokens,
             "system": f"{opening} {DEFAULT_SYSTEM_PROMPT}", "text": q(r, i) if i else f"{doc}\n\n{q(r, 0)}",
             "chat": {"session": session, "turn": i}} for i in range(opts.requests)]


#: untimed requests per workload at c = 1 (:func:`warmup_specs`)
WARMUP_REQUESTS = 4


def warmup_specs(workloads: list[str], opts: WorkloadOptions, concurrency: int = 1) -> list[dict]:
    """Untimed requests, per workload: at c = 1 :data:`WARMUP_REQUESTS` of round -1 — the first
    puts the workload's shared prefix in the cache (and warms the engine: first-request costs
    such as lazy imports are not timed), the others prefill as the timed requests do, a prefix
    hit's suffix for a variant with a cache. Why more than one (found on an H200, 2026-11-28,
    docs/gpu.md "Thirteenth session"): a cache variant's first request with a hit prefills a
    token count the one-request warm-up never met, and vLLM's fused-MoE Triton kernel compiled a
    new specialization for it inside that request (~1 s of a 1,166 ms TTFT), which cache off,
    whose warm-up prefilled the timed shape, never paid. At ``concurrency`` c > 1 one batch
    (round -2), so that a new batch size compiles and autotunes its kernels before timing (on an
    H100 the first variant at c = 16 lost 1/2 to 3/4 of its throughput in that batch:
    docs/benchmarks.md)."""
    if concurrency == 1:
        few = WorkloadOptions(**{**opts.__dict__, "requests": WARMUP_REQUESTS})
        return [dict(s, measure=False, index=-1, max_tokens=opts.answer_tokens)
                for w in workloads for s in specs(w, -1, few)]
    one = WorkloadOptions(**{**opts.__dict__, "requests": 1, "load_requests": None})
    return [{**s, "measure": False} for w in workloads for s in specs(w, -2, one, concurrency=concurrency)]


def image_copy(image, k: int):
    """Copy ``k`` of a PIL image: k = 0 the image itself, 1..7 its mirrors / rotations,
    k ≥ 8 the same with inverted colours (so copies differ in content and hash)."""
    ops = [None, Image.Transpose.FLIP_LEFT_RIGHT, Image.Transpose.FLIP_TOP_BOTTOM, Image.Transpose.ROTATE_90,
           Image.Transpose.ROTATE_180, Image.Transpose.ROTATE_270, Image.Transpose.TRANSPOSE,
           Image.Transpose.TRANSVERSE]
    op = ops[k % len(ops)]
    out = image if op is None else image.transpose(op)
    return ImageOps.invert(out) if (k // len(ops)) % 2 else out


def audio_copy(samples, k: int, copies: int):
    """Copy ``k`` of ``copies`` of a waveform (``[num_samples]`` float32): rotated by
    ``k / copies`` of its length."""
    return np.roll(samples, (k * len(samples)) // max(copies, 1))


def check_media(opts: WorkloadOptions) -> None:
    """Decode the image/audio files once in the driver so a bad file fails before any
    pipeline starts.

    Raises:
        omni_cache.driver.inputs.InputError: a file is missing or undecodable (names it).
    """
    image, audio = opts.media()
    load_image(Path(image))
    load_audio(Path(audio))
