"""Unit tests of the request-validation status middleware (pure ASGI, no engine).

The end-to-end case (an over-long prompt on the real server answers 400) is in
tests/pipeline/test_serve.py; here a small Starlette app stands in for the routes' answers.
"""

from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from omni_cache.driver.http_errors import (
    ValidationErrorStatusMiddleware,
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
