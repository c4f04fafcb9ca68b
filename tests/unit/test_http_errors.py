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
    ValidationErrorStatusMiddleware,
    dedupe_message,
    media_fields,
    rewrite_validation_500,
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
    assert r.json()["error"]["message"] == TOO_LONG
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
    assert r.json()["error"]["message"] == TRUNCATED  # said once
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
