"""Unit tests of the request-validation status middleware (pure ASGI, no engine).

The end-to-end case (an over-long prompt on the real server answers 400) is in
tests/pipeline/test_serve.py; here a small Starlette app stands in for the routes' answers.
"""

from __future__ import annotations

import json
import logging

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from omni_cache.driver.http_errors import (
    MAX_MESSAGE_CHARS,
    ValidationErrorStatusMiddleware,
    dedupe_message,
    drop_arrays,
    media_fields,
    processor_failure,
    rejection_message,
    rewrite_validation_500,
    undecodable_base64_fields,
    validation_error_param,
)

TOO_LONG = ("This model's maximum context length is 8192 tokens. However, you requested 0 output tokens "
            "and your prompt contains at least 8193 input tokens, for a total of at least 8193 tokens. "
            "Please reduce the length of the input prompt or the number of requested output tokens. "
            "(parameter=input_tokens, value=8193)")


def _err(message: str, code: int) -> dict:
    return {"error": {"message": message, "type": "InternalServerError", "param": None, "code": code}}


def _app() -> TestClient:
    async def too_long(request):
        return JSONResponse(_err(TOO_LONG, 500), status_code=500)

    async def crash(request):
        return JSONResponse(_err("CUDA error: device-side assert triggered", 500), status_code=500)

    async def ok(request):
        return JSONResponse({"ok": True})

    async def stream(request):
        async def gen():
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", too_long, methods=["POST"]),
                            Route("/v1/crash", crash), Route("/v1/ok", ok), Route("/v1/stream", stream),
                            Route("/other", too_long)])
    app.add_middleware(ValidationErrorStatusMiddleware)
    return TestClient(app)


def test_validation_error_param():
    assert validation_error_param(TOO_LONG) == "input_tokens"
    assert validation_error_param("bad (parameter=temperature)") == "temperature"
    assert validation_error_param("Engine loop has died") is None
    assert validation_error_param("") is None


def test_rewrite_only_validation_errors():
    body = json.loads(rewrite_validation_500(json.dumps(_err(TOO_LONG, 500)).encode()))
    assert body["error"] == {"message": TOO_LONG, "type": "BadRequestError", "param": "input_tokens", "code": 400}
    assert rewrite_validation_500(json.dumps(_err("boom", 500)).encode()) is None
    assert rewrite_validation_500(b"not json") is None
    assert rewrite_validation_500(b'{"detail": "x"}') is None


def test_middleware_maps_validation_500_to_400_and_passes_the_rest():
    c = _app()
    r = c.post("/v1/chat/completions", json={})
    assert r.status_code == 400
    short = TOO_LONG.removesuffix(" (parameter=input_tokens, value=8193)")
    assert r.json()["error"]["message"] == "input_tokens: " + short
    assert r.json()["error"]["param"] == "input_tokens"
    assert int(r.headers["content-length"]) == len(r.content)
    r = c.get("/v1/crash")  # a real server error stays a 500
    assert r.status_code == 500 and "device-side" in r.json()["error"]["message"]
    assert c.get("/v1/ok").json() == {"ok": True}
    assert c.get("/v1/stream").text == "data: 1\n\ndata: [DONE]\n\n"
    assert c.get("/other").status_code == 500  # only /v1/* routes are looked at


TRUNCATED = "image file is truncated (6 bytes not processed)"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def logged():
    """A handler on vLLM's ``vllm`` logger (where vLLM-Omni's records go), added before the
    middleware is built (it puts its filter on that logger's handlers)."""
    h = _Records()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(h)
    yield h
    vllm_logger.removeHandler(h)


def _logging_app() -> TestClient:
    log = logging.getLogger("vllm.omni_cache_test")

    async def bad_image(request):  # as vLLM-Omni's chat route answers a truncated JPEG
        await request.json()
        try:
            raise ValueError(TRUNCATED) from OSError(TRUNCATED)
        except ValueError as e:
            log.exception("Error in preprocessing prompt inputs")
            return JSONResponse(_err(f"{e} {e.__cause__}", 400), status_code=400)

    async def server_bug(request):
        try:
            raise RuntimeError("engine core died")
        except RuntimeError:
            log.exception("Error in chat completion")
            return JSONResponse(_err("engine core died", 500), status_code=500)

    async def ok(request):
        log.warning("served")
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/chat/completions", bad_image, methods=["POST"]),
                            Route("/v1/bug", server_bug), Route("/v1/ok", ok)])
    app.add_middleware(ValidationErrorStatusMiddleware)
    return TestClient(app)


def test_dedupe_message():
    assert dedupe_message(f"{TRUNCATED} {TRUNCATED}") == TRUNCATED
    assert dedupe_message(f"Failed to load image: {TRUNCATED} {TRUNCATED}") == f"Failed to load image: {TRUNCATED}"
    assert dedupe_message(TRUNCATED) == TRUNCATED
    assert dedupe_message("no no") == "no no"  # too short to be a repeated cause


def test_rejected_request_logs_one_warning_without_traceback(logged, caplog):
    c = _logging_app()
    image = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/"}}
    with caplog.at_level(logging.WARNING, logger="omni_cache.server"):
        r = c.post("/v1/chat/completions", headers={"X-Request-Id": "req-42"},
                   json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"messages[0].content[1].image_url: {TRUNCATED}"  # said once
    assert int(r.headers["content-length"]) == len(r.content)
    assert not [x for x in logged.records if x.exc_info], "the traceback reached the log"
    warnings = [x.getMessage() for x in caplog.records if x.name == "omni_cache.server"]
    assert warnings == ["rejected request req-42: POST /v1/chat/completions: HTTP 400: "
                        f"messages[0].content[1].image_url: {TRUNCATED}"], warnings
    assert all(x.levelno == logging.WARNING for x in caplog.records if x.name == "omni_cache.server")


def test_rejected_request_without_an_id_gets_one_in_the_log_and_the_answer(logged, caplog):
    c = _logging_app()
    with caplog.at_level(logging.WARNING, logger="omni_cache.server"):
        r = c.post("/v1/chat/completions", json={"messages": []})
    rid = r.headers["x-request-id"]
    assert r.status_code == 400 and rid.startswith("rejected-")
    assert [x.getMessage().split(":")[0] for x in caplog.records if x.name == "omni_cache.server"] == \
        [f"rejected request {rid}"]


def test_server_errors_keep_their_traceback_and_other_records_pass(logged):
    c = _logging_app()
    assert c.get("/v1/bug").status_code == 500
    tb = [x for x in logged.records if x.exc_info]
    assert len(tb) == 1 and tb[0].getMessage() == "Error in chat completion"
    assert c.get("/v1/ok").status_code == 200
    assert [x.getMessage() for x in logged.records][-1] == "served"


def test_media_fields_names_the_parts_of_the_modality_the_message_names():
    body = json.dumps({"messages": [
        {"role": "system", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "x"},
                                     {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                     {"type": "image_url", "image_url": {"url": ""}}]}]}).encode()
    assert media_fields(body, "Error opening <_io.BytesIO object>: Error in WAV file.") == \
        ["messages[1].content[1].input_audio"]
    assert media_fields(body, "Failed to load image: cannot identify image file") == \
        ["messages[1].content[2].image_url"]
    assert media_fields(body, "maximum context length") == []
    assert media_fields(b"not json", "image") == []


# ----------------------------------------------------------------------------- one line a person reads
# The real texts, as vLLM-Omni 0.30's chat route answered them on the CPU server (2026-11-26,
# issue 45): vLLM wraps the processor's failure as "Failed to apply <P> on data={...} with
# kwargs={...}" (vllm/multimodal/processing/context.py) and vLLM-Omni appends the cause.
PAD_CAUSE = ("Argument #4: Padding size should be less than the corresponding input dimension, but got: "
             "padding (200, 200) at dimension 2 of input [1, 1, 160]")
KWARGS = "{'audio_kwargs': {}, 'text_kwargs': {}, 'truncation': False, 'return_tensors': 'pt'}"


def _short_wav_message(samples) -> str:
    return (f"Failed to apply Qwen3OmniMoeProcessor on data={{'text': '<|audio_pad|>', 'audio': [{samples!r}]}} "
            f"with kwargs={KWARGS} {PAD_CAUSE}")


def _chat_body(*parts) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}).encode()


WAV_PART = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def test_short_audio_is_named_with_its_cause_and_no_array():
    import numpy as np

    # zeros (the server's answer: 1,133 characters) and a real-looking clip (the 3,187)
    for samples in (np.zeros(160, dtype=np.float32), np.sin(np.arange(160, dtype=np.float32)) * 0.3):
        message = _short_wav_message(samples)
        assert len(message) > 1000
        line, field = rejection_message(message, None, _chat_body(WAV_PART))
        assert field == "messages[0].content[1].input_audio"
        assert line == ("messages[0].content[1].input_audio: audio too short (160 samples at the processor's "
                        f"rate; it needs ≥ 201): Qwen3OmniMoeProcessor: {PAD_CAUSE}"), line
        assert len(line) <= MAX_MESSAGE_CHARS and "array" not in line and "\n" not in line


def test_processor_failure_parts():
    import numpy as np

    proc, modalities, cause = processor_failure(_short_wav_message(np.zeros(4, dtype=np.float32)))
    assert (proc, modalities, cause) == ("Qwen3OmniMoeProcessor", {"audio"}, PAD_CAUSE)
    assert processor_failure("image file is truncated") is None
    # another cause: the processor and the modality are named, the data is not
    msg = ("Failed to apply Qwen3OmniMoeProcessor on data={'text': 'a {b}', 'images': [tensor([[1, 2], [3, 4]])]} "
           f"with kwargs={KWARGS} height and width must be > 28")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    line, field = rejection_message(msg, None, _chat_body(WAV_PART, image))
    assert line == ("messages[0].content[2].image_url: Qwen3OmniMoeProcessor failed on the image: "
                    "height and width must be > 28")
    assert field == "messages[0].content[2].image_url"


def test_drop_arrays():
    assert drop_arrays("x [array([1., 2.],\n dtype=float32), tensor([[1, 2]])] y") == "x [<array>, <tensor>] y"
    assert drop_arrays("no arrays (here)") == "no arrays (here)"


def test_bad_base64_names_the_part():
    bad_audio = {"type": "input_audio", "input_audio": {"data": "not*base64!!", "format": "wav"}}
    bad_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,not*base64!!"}}
    good_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    url_image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = _chat_body(good_image, bad_audio, url_image)
    assert undecodable_base64_fields(body) == ["messages[0].content[2].input_audio"]
    line, field = rejection_message("Non-base64 digit found", None, body)  # the server's whole answer
    assert line == "messages[0].content[2].input_audio: invalid base64 data: Non-base64 digit found"
    assert field == "messages[0].content[2].input_audio"
    assert rejection_message("Non-base64 digit found", None, _chat_body(bad_image))[0] == \
        "messages[0].content[1].image_url: invalid base64 data: Non-base64 digit found"
    assert rejection_message("Incorrect padding", None, _chat_body({"type": "input_audio", "input_audio": {
        "data": "AAA", "format": "wav"}}))[1] == "messages[0].content[1].input_audio"


def test_rejection_message_is_cut_at_the_end_only():
    line, field = rejection_message("x" * 1000, "temperature", b"{}")
    assert field == "temperature" and len(line) == MAX_MESSAGE_CHARS
    assert line.startswith("temperature: xxx") and line.endswith("…")
    assert rejection_message("nothing to name", None, b"not json") == ("nothing to name", None)
    # an array in any other message is not printed either
    assert rejection_message("bad samples: array([1., 2.],\n dtype=float32)", "x", b"{}") == \
        ("x: bad samples: <array>", "x")


def test_middleware_answers_and_logs_the_same_short_line(logged, caplog):
    import numpy as np

    message = _short_wav_message(np.sin(np.arange(160, dtype=np.float32)))

    async def short_wav(request):
        await request.json()
        return JSONResponse(_err(message, 400), status_code=400)

    app = Starlette(routes=[Route("/v1/chat/completions", short_wav, methods=["POST"])])
    app.add_middleware(ValidationErrorStatusMiddleware)
    with caplog.at_level(logging.WARNING, logger="omni_cache.server"):
        r = TestClient(app).post("/v1/chat/completions", headers={"X-Request-Id": "short"},
                                 content=_chat_body(WAV_PART))
    err = r.json()["error"]
    assert r.status_code == 400 and len(err["message"]) <= MAX_MESSAGE_CHARS, err
    assert err["param"] == "messages[0].content[1].input_audio"
    assert err["message"].startswith("messages[0].content[1].input_audio: audio too short (160 samples")
    assert int(r.headers["content-length"]) == len(r.content)
    warnings = [x.getMessage() for x in caplog.records if x.name == "omni_cache.server"]
    assert warnings == [f"rejected request short: POST /v1/chat/completions: HTTP 400: {err['message']}"]
