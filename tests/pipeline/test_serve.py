"""vLLM-Omni's OpenAI-compatible server with omni-cache, driven by the official ``openai`` client.

One real server: the bundled CPU stage config (thinker prefix cache on, omni-cache; the
talker's content-keyed prefix cache on), started by :class:`omni_cache.driver.server.OmniServer`
on 127.0.0.1 (free port), exactly as ``omni-cache serve`` starts it, in vLLM's default process
layout. The cache-off references are requests to the same server: vLLM-Omni's per-stage
``sampling_params_list`` with ``skip_reading_prefix_cache`` on the thinker and the talker (no
cached block read, every prompt row computed; a real cache-off engine is compared on the
streaming path in ``test_streaming_equality.py``). Checked:

- text, text+image, text+audio chat completions answer with text and a WAV;
- a two-turn chat (system prompt, image, audio, turn 1's answer repeated in turn 2) gets a
  thinker prefix hit that covers the first answer's tokens — the exact hit expected from the
  token ids the server returns — and the same hit shows in ``/metrics`` (stage 0 counters), as
  does the talker's exact hit on turn 1's user rows (stage 1; streamed too);
- that chat's text and audio are bitwise equal to its cache-off reference's (same seed);
- streamed (``stream=True``, the bundled config's ``async_chunk: true``): text, text+image and
  text+audio chat completions answer with text deltas and audio packets (a WAV each, the first
  one — the initial codec chunk — arriving before the rest); the same two-turn chat streamed
  gets the same exact hit and its text, token ids and every audio packet are bitwise equal to
  its cache-off reference's;
- a non-image in ``image_url``, a truncated JPEG, undecodable audio, a prompt longer than
  ``max_model_len``, a WAV of 78 samples and audio that is not base64 answer HTTP 400 with one
  line (≤ 300 characters, no arrays) that starts with the field at fault and names the problem
  (said once), the server log has one ``WARNING`` line per rejected request (its
  ``X-Request-Id``) with the same line, root cause included, and no ``Traceback``, and the
  next request is served;
- video with its audio track (``video_url`` + ``mm_processor_kwargs.use_audio_in_video``, a
  2 s 224×224 clip with speech) and without it: each reply is bitwise equal to its cache-off
  reference; two same-size clips with other pixels (same token ids) share hits only up to the
  last whole block before the clip, the same clip again hits through it;
- a 100-request slice of the soak (``tests/lanes/soak.py``: text only, text + audio, photo, video and
  speech in, bad media, streams closed after the first chunk), after everything else: no request
  lost, ``/dev/shm`` flat and drained, nothing of it left in ``/dev/shm`` after exit (issue 45);
- the server stops cleanly (exit code 0, port closed).

Two properties of the setup the checks depend on:

- The embedded tokenizer cannot re-encode the random model's pseudo-words (they are
  vocabulary entries without merges, docs/cpu.md), so a free answer never re-tokenizes to the
  ids it was sampled as and turn 2 could not hit past turn 1's prompt. The two-turn chat
  therefore restricts the thinker to digit tokens through vLLM-Omni's per-stage
  ``sampling_params_list`` (``allowed_token_ids``); digits re-encode one token each.
- vLLM-Omni's Qwen3-Omni talker samples the residual codebooks from the process-wide torch
  RNG; omni-cache's talker gives each request its own generator (``tts_local_seed`` in the
  bundled config's talker defaults, kept in the references' talker params), so a request's
  audio does not depend on the requests served before it.
"""

from __future__ import annotations

import base64
import io
import os
import time

import numpy as np
import pytest
import soundfile as sf

from omni_cache.driver.http_errors import MAX_MESSAGE_CHARS, dedupe_message
from omni_cache.driver.inputs import sample_path
from omni_cache.driver.server import OmniServer
from tests.device import device_stage_config
from tests.pipeline.proctree import judge_force_kills
from tests.pipeline.workloads import prefix_hit, talker_user_rows
from tests.util import CPU_STAGE_CONFIG

pytestmark = pytest.mark.pipeline
#: full pipeline starts in this module (the suite's time table, tests/conftest.py)
PIPELINE_STARTS = 1  # one OmniServer

BLOCK = 32  # thinker and talker block_size in the bundled CPU stage config
TALKER_ASSISTANT_ROWS = 9  # talker rows of the final assistant segment (vLLM-Omni's layout)
SEED = 1234
SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
          "perceiving auditory and visual inputs, as well as generating text and speech. ") * 3


def _data_url(path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(open(path, "rb").read()).decode()


IMAGE_URL = _data_url(sample_path("astronaut.jpg"), "image/jpeg")
AUDIO_B64 = base64.b64encode(open(sample_path("speech.wav"), "rb").read()).decode()


def _client(server: OmniServer):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)


def _stage_params(thinker_params: dict | None, reference: bool) -> list | None:
    """vLLM-Omni's per-stage ``sampling_params_list`` of a request: the thinker's parameters
    (None: the stage config's defaults) and, for a cache-off ``reference``, the talker's
    stage-config defaults, both with ``skip_reading_prefix_cache`` (code2wav keeps its
    defaults)."""
    import yaml

    if not reference:
        return None if thinker_params is None else [thinker_params]
    stages = {st["stage_id"]: st for st in yaml.safe_load(CPU_STAGE_CONFIG.read_text())["stages"]}
    thinker = dict(thinker_params if thinker_params is not None else stages[0]["default_sampling_params"])
    talker = dict(stages[1]["default_sampling_params"])
    return [{**thinker, "skip_reading_prefix_cache": True}, {**talker, "skip_reading_prefix_cache": True}]


def _chat(server: OmniServer, messages: list, max_tokens: int | None = None, thinker_params: dict | None = None,
          reference: bool = False, extra_body: dict | None = None, request_id: str | None = None) -> dict:
    """One non-streaming chat completion with text + audio out; the response as a dict.
    ``thinker_params``: the thinker's sampling parameters (vLLM-Omni's ``sampling_params_list``;
    the talker and code2wav keep their stage-config defaults); ``reference``: a cache-off
    reference (:func:`_stage_params`)."""
    kw = {"max_tokens": max_tokens} if max_tokens else {}
    extra = {"return_token_ids": True, **(extra_body or {})}
    params = _stage_params(thinker_params, reference)
    if params is not None:
        extra["sampling_params_list"] = params
    if request_id is not None:
        kw["extra_headers"] = {"X-Request-Id": request_id}
    r = _client(server).chat.completions.create(
        model=server.model_name(), messages=messages, modalities=["text", "audio"], seed=SEED,
        extra_body=extra, **kw)
    return r.model_dump()


def _chat_stream(server: OmniServer, messages: list, thinker_params: dict | None = None,
                 reference: bool = False) -> dict:
    """One streamed chat completion (``stream=True``) with text + audio out, collected:
    ``prompt_token_ids``, ``token_ids`` and ``text`` (text deltas joined), ``packets`` (each audio
    delta decoded: int16 ``[num_samples]``), ``sample_rate``, ``cached_tokens`` (final usage
    chunk), and the client-clock seconds ``t_first_text``, ``t_first_audio``, ``t_end``.
    ``reference``: as for :func:`_chat`."""
    extra = {"return_token_ids": True}
    params = _stage_params(thinker_params, reference)
    if params is not None:
        extra["sampling_params_list"] = params
    t0 = time.perf_counter()
    out = {"prompt_token_ids": None, "token_ids": [], "text": "", "packets": [], "sample_rate": None,
           "cached_tokens": None, "t_first_text": None, "t_first_audio": None, "modalities": []}
    stream = _client(server).chat.completions.create(
        model=server.model_name(), messages=messages, modalities=["text", "audio"], seed=SEED, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        now = time.perf_counter() - t0
        d = chunk.model_dump()
        if d.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = d["prompt_token_ids"]
        details = (d.get("usage") or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            out["cached_tokens"] = details["cached_tokens"]
        modality = d.get("modality")
        if modality and modality not in out["modalities"]:
            out["modalities"].append(modality)
        for c in d.get("choices") or []:
            content = (c.get("delta") or {}).get("content") or ""
            if modality == "audio" and content:
                audio, sr = sf.read(io.BytesIO(base64.b64decode(content)), dtype="int16")
                out["packets"].append(audio)
                out["sample_rate"] = sr
                if out["t_first_audio"] is None:
                    out["t_first_audio"] = now
            elif modality == "text":
                out["token_ids"] += c.get("token_ids") or []
                out["text"] += content
                if content and out["t_first_text"] is None:
                    out["t_first_text"] = now
    out["t_end"] = time.perf_counter() - t0
    return out


def _digit_params(model_dir, max_tokens: int) -> dict:
    """Thinker sampling parameters (the stage config's defaults) restricted to digit tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    assert all(tok.encode(str(i)) == [d] for i, d in enumerate(digits))
    return {"temperature": 0.0, "seed": SEED, "max_tokens": max_tokens, "detokenize": True,
            "allowed_token_ids": digits}


def _wav(resp: dict) -> tuple[np.ndarray, int, bytes]:
    raw = base64.b64decode(resp["choices"][0]["message"]["audio"]["data"])
    audio, sr = sf.read(io.BytesIO(raw), dtype="int16")
    return audio, sr, raw


def _check_text_and_audio(resp: dict) -> None:
    msg = resp["choices"][0]["message"]
    assert isinstance(msg["content"], str) and msg["content"].strip(), resp
    audio, sr, _ = _wav(resp)
    assert sr == 24_000 and audio.ndim == 1 and audio.shape[0] > 1000 and np.abs(audio).max() > 0


def _turn1(stream: bool = False) -> list:
    # the streamed chat has its own system prompt: it must not hit the non-streamed one's blocks
    return [
        {"role": "system", "content": ("Streamed. " if stream else "") + SYSTEM},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": IMAGE_URL}},
            {"type": "input_audio", "input_audio": {"data": AUDIO_B64, "format": "wav"}},
            {"type": "text", "text": "Describe the picture and answer the spoken question."},
        ]},
    ]


def _two_turn_chat(server: OmniServer, model_dir, stream: bool = False, reference: bool = False) -> dict:
    """Turn 1, then turn 2 repeating system prompt, media and turn 1's answer; /metrics read
    around turn 2. ``stream``: both turns streamed (:func:`_chat_stream`); ``reference``: both
    turns as cache-off references (no /metrics read)."""
    ask = _chat_stream if stream else _chat
    # 48 > BLOCK: turn 1's answer fills at least one block by decode.
    r1 = ask(server, _turn1(stream), thinker_params=_digit_params(model_dir, 48), reference=reference)
    answer = r1["text"] if stream else r1["choices"][0]["message"]["content"]
    turn2 = _turn1(stream) + [{"role": "assistant", "content": answer},
                              {"role": "user", "content": "And what would you do next?"}]
    if reference:
        return {"r1": r1, "r2": ask(server, turn2, thinker_params=_digit_params(model_dir, 16), reference=True)}
    before, talker_before = _prefix_counters(server), _prefix_counters(server, stage="1")
    r2 = ask(server, turn2, thinker_params=_digit_params(model_dir, 16))
    after = _prefix_counters(server, wait_for_change_from=before)
    talker_after = _prefix_counters(server, stage="1", wait_for_change_from=talker_before)
    return {"r1": r1, "r2": r2, "metrics_before": before, "metrics_after": after,
            "talker_metrics_before": talker_before, "talker_metrics_after": talker_after}


def _prefix_counters(server: OmniServer, stage: str = "0", wait_for_change_from=None,
                     timeout=20.0) -> tuple[float, float]:
    """(queries, hits) of vLLM's prefix cache on ``stage`` (0: the thinker, 1: the talker) from
    ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    t0 = time.time()
    while True:
        status, body = server.get("/metrics")
        assert status == 200
        vals = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}
        for fam in text_string_to_metric_families(body.decode()):
            if fam.name in vals:
                vals[fam.name] = sum(s.value for s in fam.samples
                                     if s.name.endswith("_total") and s.labels.get("stage") == stage)
        got = (vals["vllm:prefix_cache_queries"], vals["vllm:prefix_cache_hits"])
        if wait_for_change_from is None or got != wait_for_change_from or time.time() - t0 > timeout:
            return got
        time.sleep(0.5)


def _expected_hit(p1: list[int], o1: list[int], p2: list[int]) -> int:
    """The prefix hit turn 2 must get (:func:`~tests.pipeline.workloads.prefix_hit`): whole
    blocks of the longest common prefix of turn 2's prompt and what turn 1 left in the KV cache
    (its prompt and all but its last sampled token), at most ``len(p2) - 1`` (vLLM recomputes
    the last prompt token)."""
    return prefix_hit(p2, [p1 + o1[:-1]], BLOCK)


def _expected_talker(model_dir, p1: list[int], p2: list[int]) -> tuple[int, int]:
    """Turn 2's talker prompt length and talker prefix hit, from the thinker's token ids
    (:func:`~tests.pipeline.workloads.talker_user_rows`: the user segments' rows, then 9
    assistant rows): turn 2 hits every full talker block of turn 1's user rows (the same thinker
    content: turn 2's prompt starts with turn 1's), none past them (turn 1's next rows are its
    assistant rows, whose blocks are never shared)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows1, rows2 = talker_user_rows(tok, p1), talker_user_rows(tok, p2)
    assert rows2[:len(rows1)] == rows1 and p2[:rows1[-1] + 1] == p1[:rows1[-1] + 1], (rows1, rows2)
    return len(rows2) + TALKER_ASSISTANT_ROWS, len(rows1) // BLOCK * BLOCK


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server_on(tiny_model_dir, tmp_path_factory):
    """The bundled CPU stage config (omni-cache on the thinker), as `omni-cache serve` runs it."""
    log = tmp_path_factory.mktemp("serve_on") / "server.log"
    srv = OmniServer(tiny_model_dir, device_stage_config(CPU_STAGE_CONFIG), log_path=log).start()
    try:
        srv.wait_ready(timeout=1500)
        # The first requests this server answers (same history as the cache-off server's).
        srv.first_chat = _two_turn_chat(srv, tiny_model_dir)
        srv.streamed_chat = _two_turn_chat(srv, tiny_model_dir, stream=True)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def chat_on(server_on):
    return server_on.first_chat


@pytest.fixture(scope="module")
def streamed_on(server_on):
    return server_on.streamed_chat


@pytest.fixture(scope="module")
def chat_off(server_on, chat_on, streamed_on, tiny_model_dir):
    """The same two-turn chats as cache-off references on the same server, after them."""
    result = _two_turn_chat(server_on, tiny_model_dir, reference=True)
    result["streamed"] = _two_turn_chat(server_on, tiny_model_dir, stream=True, reference=True)
    return result


@pytest.fixture(scope="module")
def stopped(server_on, chat_off):
    """``(exit code, 1-minute load average at the signal)``: the server stopped by SIGTERM after
    every request."""
    load = os.getloadavg()[0]
    return server_on.stop(), load


# ----------------------------------------------------------------------------- tests
# Order matters: ``stopped`` stops the server, so it is taken by the last test only (pytest
# runs a module's tests in file order).
def test_models_and_health(server_on):
    assert server_on.get("/health")[0] == 200
    assert server_on.model_name() == str(server_on.model)


def _question(kind: str) -> list:
    """System prompt + a question with the media of ``kind`` (text, text+image, text+audio)."""
    content: list = [{"type": "text", "text": "What do you see and hear?"}]
    if kind == "text+image":
        content.insert(0, {"type": "image_url", "image_url": {"url": IMAGE_URL}})
    if kind == "text+audio":
        content.insert(0, {"type": "input_audio", "input_audio": {"data": AUDIO_B64, "format": "wav"}})
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


@pytest.mark.parametrize("kind", ["text", "text+image", "text+audio"])
def test_chat_answers_text_and_audio(server_on, kind):
    resp = _chat(server_on, _question(kind))
    _check_text_and_audio(resp)
    mm = resp["usage"]["prompt_tokens_details"].get("multimodal_tokens") or {}
    if kind == "text+image":
        assert mm.get("image", 0) > 0, resp["usage"]
    if kind == "text+audio":
        assert mm.get("audio", 0) > 0, resp["usage"]


def _check_streamed(r: dict) -> None:
    assert r["modalities"] == ["text", "audio"], r["modalities"]
    assert r["text"].strip() and r["token_ids"], r["text"]
    assert r["sample_rate"] == 24_000 and len(r["packets"]) >= 2, [p.shape for p in r["packets"]]
    assert all(p.ndim == 1 and p.shape[0] > 0 for p in r["packets"])
    # the initial codec chunk arrives as its own packet, before the rest of the waveform
    assert r["packets"][0].shape[0] < sum(p.shape[0] for p in r["packets"])
    assert r["t_first_text"] <= r["t_first_audio"] < r["t_end"]


@pytest.mark.parametrize("kind", ["text", "text+image", "text+audio"])
def test_streamed_chat_answers_text_deltas_and_audio_packets(server_on, kind):
    _check_streamed(_chat_stream(server_on, _question(kind)))


def test_two_turn_chat_hit_covers_first_answer(chat_on):
    r1, r2 = chat_on["r1"], chat_on["r2"]
    _check_text_and_audio(r1)
    _check_text_and_audio(r2)
    p1, o1 = r1["prompt_token_ids"], r1["choices"][0]["token_ids"]
    p2 = r2["prompt_token_ids"]
    assert len(o1) > BLOCK, "turn 1's answer must be long enough to fill a block by decode"
    expected = _expected_hit(p1, o1, p2)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == expected, (cached, expected, len(p1), len(o1), len(p2))
    # The hit reaches past turn 1's prompt into its answer (a block filled by decode).
    assert cached > len(p1), (cached, len(p1), len(o1))


@pytest.mark.parametrize("chat", ["chat_on", "streamed_on"])
def test_metrics_endpoint_shows_the_hit(request, chat, tiny_model_dir):
    """Turn 2's thinker and talker prefix-cache queries and hits in ``/metrics`` (stage 0 and
    stage 1 counters), exactly: the thinker's hit is the one the reply reports; the talker's own
    prefix cache (content-keyed, on in the bundled config) hits every full block of turn 1's
    user rows (photo, speech, question: turn 2's talker prompt starts with them)."""
    run = request.getfixturevalue(chat)
    (q0, h0), (q1, h1) = run["metrics_before"], run["metrics_after"]
    p1, p2 = _prompt_ids(run["r1"]), _prompt_ids(run["r2"])
    assert q1 - q0 == len(p2)
    assert h1 - h0 == _cached(run["r2"]) == _expected_hit(p1, _output_ids(run["r1"]), p2), (h0, h1)
    (tq0, th0), (tq1, th1) = run["talker_metrics_before"], run["talker_metrics_after"]
    talker_prompt, talker_hit = _expected_talker(tiny_model_dir, p1, p2)
    assert talker_hit >= BLOCK, talker_hit
    assert (tq1 - tq0, th1 - th0) == (talker_prompt, talker_hit), (run["talker_metrics_before"],
                                                                    run["talker_metrics_after"])


def _prompt_ids(r: dict) -> list[int]:
    return r["prompt_token_ids"]


def _output_ids(r: dict) -> list[int]:
    """The answer's token ids (a completion's, or a collected stream's)."""
    return r["token_ids"] if "token_ids" in r else r["choices"][0]["token_ids"]


def _cached(r: dict) -> int:
    """The thinker's prefix hit a reply reports (a completion's usage, or a stream's last usage)."""
    return r["cached_tokens"] if "cached_tokens" in r else r["usage"]["prompt_tokens_details"]["cached_tokens"]


def _short_wav_b64(samples: int) -> str:
    """A 16 kHz mono WAV of ``samples`` samples, base64 (shorter than the audio processor's STFT
    padding: vLLM's answer was 1,100-3,200 characters, the whole sample array, before the cause)."""
    buf = io.BytesIO()
    sf.write(buf, np.zeros(samples, dtype=np.float32), 16_000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


BAD = {
    "non-image in image_url": (
        [{"type": "image_url",
          "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"plain text, no image").decode()}},
         {"type": "text", "text": "What is this?"}],
        ("image",)),
    "truncated JPEG": (
        [{"type": "image_url",
          "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(
              open(sample_path("astronaut.jpg"), "rb").read()[:4000]).decode()}},
         {"type": "text", "text": "What is this?"}],
        ("image",)),
    "undecodable audio": (
        [{"type": "input_audio",
          "input_audio": {"data": base64.b64encode(b"RIFF....WAVEnot audio").decode(), "format": "wav"}},
         {"type": "text", "text": "What is said?"}],
        ("audio", "wav")),
    "prompt longer than max_model_len": ("word " * 9000, ("maximum context length",)),
    "audio of 78 samples": (
        [{"type": "text", "text": "What is said?"},
         {"type": "input_audio", "input_audio": {"data": _short_wav_b64(78), "format": "wav"}}],
        ("audio too short",)),
    "audio that is not base64": (
        [{"type": "text", "text": "What is said?"},
         {"type": "input_audio", "input_audio": {"data": "not*base64!!", "format": "wav"}}],
        ("invalid base64",)),
}
#: the field each bad request's message and log line start with
BAD_FIELD = {"non-image in image_url": "messages[0].content[0].image_url",
             "truncated JPEG": "messages[0].content[0].image_url",
             "undecodable audio": "messages[0].content[0].input_audio",
             "prompt longer than max_model_len": "input_tokens",
             "audio of 78 samples": "messages[0].content[1].input_audio",
             "audio that is not base64": "messages[0].content[1].input_audio"}
#: the root cause the server's log line must carry (not cut before it)
BAD_CAUSE = {"audio of 78 samples": "Padding size should be less than the corresponding input dimension",
             "audio that is not base64": "Non-base64 digit found"}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_request_is_4xx_and_server_keeps_serving(server_on, name):
    import openai

    content, words = BAD[name]
    with pytest.raises(openai.BadRequestError) as ei:
        _chat(server_on, [{"role": "user", "content": content}], request_id=_bad_id(name))
    assert ei.value.status_code == 400
    message = ei.value.body["message"] if isinstance(ei.value.body, dict) else str(ei.value)
    assert any(w in message.lower() for w in words), message
    assert dedupe_message(message) == message, f"the message repeats itself: {message!r}"
    # one line, the field first, no arrays, short (issue 45)
    assert message.startswith(BAD_FIELD[name] + ": "), message
    assert len(message) <= MAX_MESSAGE_CHARS and "\n" not in message and "array(" not in message, message
    assert server_on.alive() and server_on.get("/health")[0] == 200
    _check_text_and_audio(_chat(server_on, [{"role": "user", "content": "Still there?"}]))


def _bad_id(name: str) -> str:
    return "bad-" + name.replace(" ", "-")


def test_bad_requests_log_one_warning_each_and_no_traceback(server_on):
    """After the bad-request cases: one WARNING line per rejected request, naming it; no
    traceback anywhere in the server log (bad input is not a server failure)."""
    log = server_on.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:log.index("Traceback") + 2000]
    for name in BAD:
        lines = [ln for ln in log.splitlines() if f"rejected request {_bad_id(name)}:" in ln]
        assert len(lines) == 1 and "WARNING" in lines[0], (name, lines)
        assert f": HTTP 400: {BAD_FIELD[name]}: " in lines[0], lines[0]
        said = lines[0].split(": HTTP 400: ", 1)[1]
        assert len(said) <= MAX_MESSAGE_CHARS and "array(" not in said, said
        assert BAD_CAUSE.get(name, "") in said, said


VISION_START, AUDIO_PAD = 151652, 151675  # the real Qwen3-Omni ids (omni_cache.models.qwen3.SPECIAL_TOKENS)


def _video_chat(server: OmniServer, clip: str, audio_in_video: bool, reference: bool = False) -> dict:
    messages = [{"role": "system", "content": "Video. " + SYSTEM},
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                             {"type": "text", "text": "What happens in this clip?"}]}]
    return _chat(server, messages, reference=reference,
                 extra_body={"mm_processor_kwargs": {"use_audio_in_video": audio_in_video}})


@pytest.fixture(scope="module")
def video_chats(server_on):
    """Clip A with its audio track, clip B (other pixels, same size) with it, clip A again,
    clip A without it; then each as a cache-off reference."""
    from tests.lanes.soak import video_clip

    a, b = video_clip(1), video_clip(2)
    cases = {"a": (a, True), "b": (b, True), "a again": (a, True), "a, no audio": (a, False)}
    on = {k: _video_chat(server_on, clip, audio) for k, (clip, audio) in cases.items()}
    off = {k: _video_chat(server_on, clip, audio, reference=True) for k, (clip, audio) in cases.items()}
    return on, off


@pytest.mark.parametrize("case", ["a", "b", "a again", "a, no audio"])
def test_video_with_and_without_its_audio_equals_cache_off(video_chats, case):
    on, off = video_chats[0][case], video_chats[1][case]
    _check_text_and_audio(on)
    assert on["prompt_token_ids"] == off["prompt_token_ids"]
    # the audio track is in the prompt exactly when use_audio_in_video is on
    assert (AUDIO_PAD in on["prompt_token_ids"]) == (case != "a, no audio")
    assert off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"], case
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"], case
    a_on, sr_on, _ = _wav(on)
    a_off, sr_off, _ = _wav(off)
    assert sr_on == sr_off and a_on.shape == a_off.shape and np.array_equal(a_on, a_off), case


def test_video_hits_stop_where_the_clips_part(video_chats):
    on = video_chats[0]
    p = on["a"]["prompt_token_ids"]
    assert on["b"]["prompt_token_ids"] == p  # same size: only the pixels differ
    first_media = p.index(VISION_START) + 1  # the clip's placeholder starts after <|vision_start|>
    cached = {k: r["usage"]["prompt_tokens_details"]["cached_tokens"] for k, r in on.items()}
    # other pixels: the hit ends at the last whole block before the clip ...
    assert cached["b"] == (first_media // BLOCK) * BLOCK > 0, (cached, first_media)
    # ... the same clip again hits through it (all whole blocks but vLLM's last token)
    assert cached["a again"] == ((len(p) - 1) // BLOCK) * BLOCK > first_media, (cached, len(p))


def test_cache_off_reference_gives_identical_text_and_audio(chat_on, chat_off):
    for turn in ("r1", "r2"):
        on, off = chat_on[turn], chat_off[turn]
        assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"], turn
        assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"], turn
        a_on, sr_on, _ = _wav(on)
        a_off, sr_off, _ = _wav(off)
        assert sr_on == sr_off and a_on.shape == a_off.shape and np.array_equal(a_on, a_off), turn
    assert chat_off["r2"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r1, r2 = chat_on["r1"], chat_on["r2"]
    assert _cached(r2) == _expected_hit(_prompt_ids(r1), _output_ids(r1), _prompt_ids(r2)) > 0


def test_streamed_two_turn_chat_hit_and_equal_to_cache_off(streamed_on, chat_off):
    r1, r2 = streamed_on["r1"], streamed_on["r2"]
    _check_streamed(r1)
    _check_streamed(r2)
    expected = _expected_hit(r1["prompt_token_ids"], r1["token_ids"], r2["prompt_token_ids"])
    assert r2["cached_tokens"] == expected > len(r1["prompt_token_ids"]), (r2["cached_tokens"], expected)
    (_, h0), (_, h1) = streamed_on["metrics_before"], streamed_on["metrics_after"]
    assert h1 - h0 == expected
    off = chat_off["streamed"]
    assert off["r2"]["cached_tokens"] == 0
    for turn in ("r1", "r2"):
        on_t, off_t = streamed_on[turn], off[turn]
        assert on_t["prompt_token_ids"] == off_t["prompt_token_ids"], turn
        assert on_t["token_ids"] == off_t["token_ids"] and on_t["text"] == off_t["text"], turn
        assert len(on_t["packets"]) == len(off_t["packets"]), turn
        for k, (a, b) in enumerate(zip(on_t["packets"], off_t["packets"])):
            assert a.shape == b.shape and np.array_equal(a, b), (turn, k)


@pytest.fixture(scope="module")
def soak_slice(server_on, chat_off):
    """100 requests of the soak's mixed stream (``tests/lanes/soak.py``: text only, text + audio
    streamed and not, photo, video and speech in, bad media, streams the client closes after the first
    chunk), 4 at a time, after every other request of this module; ``/dev/shm`` and the process
    tree sampled every second."""
    from tests.lanes.soak import drive

    return drive(server_on, requests=100, concurrency=4, warmup=20, max_tokens=8, sample_s=1.0, drain_s=8.0,
                 shm_slack=8, report_every=50)


def test_soak_slice_keeps_dev_shm_flat(soak_slice):
    """Issue 45: every good request answered, every bad one a 400; this run's ``/dev/shm``
    segments stay within a few in flight after warm-up and are back to their post-warm-up count
    after the drain. Before the fixes every text-only request and most closed streams left a
    segment (and a lock file) until the server exited."""
    bars, counts = soak_slice["bars"], soak_slice["counts"]
    assert counts["text"]["n"] >= 10 and min(counts[k]["n"] for k in ("abort", "bad", "video")) >= 5, counts
    assert bars["no_lost_requests"]["pass"], bars["no_lost_requests"]
    assert bars["server_alive_after_stream"]["pass"]
    assert bars["shm_segments_flat"]["pass"], bars["shm_segments_flat"]
    assert bars["shm_bytes_after_drain"]["pass"], bars["shm_bytes_after_drain"]
    assert soak_slice["drained"]["tagged_segments"] == 0, soak_slice["drained"]


def test_server_stopped_cleanly(server_on, stopped):
    """Exit code 0 after SIGTERM, nothing answering, and every stage exited within vLLM's fixed
    5 s grace (``vllm.v1.utils.shutdown``: none force-killed) — a wall-clock bar on a shared
    2-core host, judged as the stop tests judge it (:func:`tests.pipeline.proctree.stop_and_check`):
    on an overloaded host a force kill is a warning with the load, else a failure
    (:func:`tests.pipeline.proctree.judge_force_kills`). Idle here, each stage stops in ~2 s
    (2026-11-30: with two busy loops beside the server too); ca53e73's landing CI (54 min for a
    23-min suite) saw the thinker force-killed."""
    rc, load = stopped
    assert rc == 0, f"the server exited with {rc}"
    assert not server_on.alive()
    assert server_on.get("/health")[0] == 0
    judge_force_kills([ln for ln in server_on.log_path.read_text(errors="replace").splitlines()
                       if "force killing" in ln], load)


def test_no_shared_memory_left_after_exit(soak_slice, stopped):
    """Nothing of the soak slice's requests (segments or the connector's lock files) stays in
    ``/dev/shm`` after the server exited (issue 45: an empty lock file per leaked segment did)."""
    from tests.lanes.soak import after_exit

    left = after_exit(soak_slice["tag"], soak_slice["baseline"])
    assert left["pass"], left
