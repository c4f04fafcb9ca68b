"""ASGI middleware for vLLM-Omni's OpenAI-compatible server: request validation errors answer
HTTP 400, not 500.

vLLM raises :class:`vllm.exceptions.VLLMValidationError` (a ``VLLMClientError``: the request is
at fault) for bad requests it detects while rendering the prompt — e.g. a chat whose prompt is
longer than the thinker's ``max_model_len``: "This model's maximum context length is 8192
tokens. However, ... your prompt contains at least 8193 input tokens ... (parameter=input_tokens,
value=8193)". vLLM-Omni 0.30's ``/v1/chat/completions`` route does not catch that class
(``OmniOpenAIServingChat.create_chat_completion`` catches ``ValueError`` / ``TypeError`` /
``RuntimeError``; ``VLLMValidationError`` is none of them) and its catch-all turns it into
``HTTPException(500, detail=str(exc))``. The engine is not harmed — the request never reached
it — but the client is told the server failed.

:class:`ValidationErrorStatusMiddleware` is added through vLLM's documented ``--middleware``
option (``omni-cache serve`` passes it; see :data:`omni_cache.driver.server.DEFAULT_SERVE_ARGS`). It
buffers only ``500`` answers of ``/v1/*`` routes, and when the error message carries the
``(parameter=<name>[, value=<value>])`` suffix that only ``VLLMValidationError.__str__``
writes, re-sends vLLM's own message with status 400, ``type: BadRequestError`` and
``param: <name>``. Every other response passes through untouched (streamed responses, other
statuses, other routes). No vLLM / vLLM-Omni code is edited or patched.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: The tail ``VLLMValidationError.__str__`` appends (``vllm/exceptions.py``).
_VALIDATION_SUFFIX = re.compile(r"\(parameter=(?P<param>[A-Za-z_][\w.\[\]]*)(?:, value=.*)?\)\s*$", re.S)


def validation_error_param(message: str) -> str | None:
    """The ``parameter`` name if ``message`` is a ``VLLMValidationError`` text, else None."""
    m = _VALIDATION_SUFFIX.search(message or "")
    return m.group("param") if m else None


def rewrite_validation_500(body: bytes) -> bytes | None:
    """vLLM's 500 error JSON (``{"error": {"message", "type", "code", ...}}``) as a 400 body
    when its message is a request-validation error; None when it is not (or not JSON)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return None
    param = validation_error_param(str(err.get("message", "")))
    if param is None:
        return None
    err.update(type="BadRequestError", code=400, param=param)
    return json.dumps(data).encode()


class ValidationErrorStatusMiddleware:
    """Pure-ASGI middleware (``vllm serve --middleware
    omni_cache.driver.http_errors.ValidationErrorStatusMiddleware``): a 500 answer of a
    ``/v1/*`` route whose error is a ``VLLMValidationError`` becomes a 400 with the same
    message. See the module docstring for why."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        held_start: dict | None = None
        chunks: list[bytes] = []

        async def send_checked(message: dict) -> None:
            nonlocal held_start
            if message["type"] == "http.response.start" and message.get("status") == 500:
                held_start = message  # decide once the (small, JSON) body is complete
                return
            if held_start is not None and message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = b"".join(chunks)
                start = held_start
                new_body = rewrite_validation_500(body)
                if new_body is not None:
                    body = new_body
                    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                    headers.append((b"content-length", str(len(body)).encode()))
                    start = {**start, "status": 400, "headers": headers}
                await send(start)
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(message)

        await self.app(scope, receive, send_checked)
