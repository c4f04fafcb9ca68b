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

The same middleware keeps bad input from reading as a crash in the server log. vLLM-Omni logs
a request it rejects with ``logger.exception`` (e.g. "Error in preprocessing prompt inputs"
for a truncated JPEG or text sent as WAV): a full ``ERROR ... Traceback`` per bad request,
which an operator's alerting takes for a server failure; and its 400 message repeats the cause
it already holds ("image file is truncated (...) image file is truncated (...)"). While a
``/v1/*`` request runs, :class:`HoldRequestErrorRecords` (a ``logging.Filter`` on the
server's log handlers) holds back the log records with a traceback that the request's own
task emits (a context variable marks the task); when the response starts:

- **4xx** (the client's fault): the held records are dropped and one ``WARNING`` line says
  ``rejected request <id>: <METHOD> <path>: HTTP <status>: <field>: <reason>`` (the id is
  the client's ``X-Request-Id`` or one made up and sent back in that header; the field is
  the error's ``param``, else the request's media parts the message names); a message that
  repeats its own tail is sent once (:func:`dedupe_message`);
- **anything else** (the server's own errors, 5xx): the held records are logged as they were,
  tracebacks included.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import uuid
from typing import Any

#: The tail ``VLLMValidationError.__str__`` appends (``vllm/exceptions.py``).
_VALIDATION_SUFFIX = re.compile(r"\(parameter=(?P<param>[A-Za-z_][\w.\[\]]*)(?:, value=.*)?\)\s*$", re.S)


def validation_error_param(message: str) -> str | None:
    """The ``parameter`` name if ``message`` is a ``VLLMValidationError`` text, else None."""
    m = _VALIDATION_SUFFIX.search(message or "")
    return m.group("param") if m else None


def dedupe_message(message: str, min_repeat: int = 8) -> str:
    """``message`` without a repeated tail: ``"<a> <b>"`` where ``<a>`` already ends with
    ``<b>`` (at least ``min_repeat`` characters) becomes ``"<a>"`` — vLLM-Omni appends an
    exception's cause to its message even when the message is the cause's. Else unchanged."""
    for i, ch in enumerate(message):
        if ch == " ":
            head, tail = message[:i], message[i + 1:]
            if len(tail) >= min_repeat and head.endswith(tail):
                return head
    return message


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


#: content-part types of each modality, and the words of an error message that name it
_MEDIA_PARTS = {("image", "jpeg", "png"): ("image_url", "image"),
                ("audio", "wav", "sound"): ("input_audio", "audio_url", "audio"),
                ("video", "mp4"): ("video_url", "video")}


def media_fields(body: bytes, message: str) -> list[str]:
    """The request's media parts (``messages[i].content[j].<type>``) of each modality (image,
    audio, video) that ``message`` names (e.g. "wav" names audio); [] when the body is not a
    chat request or the message names none."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []
    msg = message.lower()
    kinds = {t for words, types in _MEDIA_PARTS.items() if any(w in msg for w in words) for t in types}
    out = []
    for i, m in enumerate((data.get("messages") or []) if isinstance(data, dict) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in kinds:
                out.append(f"messages[{i}].content[{j}].{part['type']}")
    return out


class _RequestLog:
    """One ``/v1/*`` request's held log records (see :class:`HoldRequestErrorRecords`)."""

    def __init__(self) -> None:
        self.held: list[logging.LogRecord] = []
        self.decided = False  # the response started: records pass from now on

    def release(self) -> None:
        """Log the held records as they were (tracebacks included)."""
        self.decided = True
        for record in self.held:
            record.omni_cache_released = True
            logging.getLogger(record.name).handle(record)
        self.held.clear()


_CURRENT: contextvars.ContextVar[_RequestLog | None] = contextvars.ContextVar("omni_cache_request_log", default=None)


class HoldRequestErrorRecords(logging.Filter):
    """Holds back a record with a traceback (``exc_info``) emitted inside a ``/v1/*``
    request's task before its response starts; the middleware then drops it (4xx) or logs it
    (anything else). Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _CURRENT.get()
        if ctx is None or ctx.decided or not record.exc_info or getattr(record, "omni_cache_released", False):
            return True
        if not any(r is record for r in ctx.held):  # a record reaches each handler's filter
            ctx.held.append(record)
        return False


_log = logging.getLogger("omni_cache.server")


def install_log_filter() -> None:
    """Add :class:`HoldRequestErrorRecords` to the handlers of vLLM's ``vllm`` logger (every
    ``vllm`` / ``vllm_omni`` record goes there) and of the root logger, once each; and let
    :data:`_log` write through vLLM's handlers (same format) when nothing else would."""
    vllm_handlers = logging.getLogger("vllm").handlers
    for h in [*vllm_handlers, *logging.getLogger().handlers]:
        if not any(isinstance(f, HoldRequestErrorRecords) for f in h.filters):
            h.addFilter(HoldRequestErrorRecords())
    if not _log.handlers and not logging.getLogger().handlers and vllm_handlers:
        _log.handlers = list(vllm_handlers)
        _log.propagate = False
        _log.setLevel(logging.INFO)


class ValidationErrorStatusMiddleware:
    """Pure-ASGI middleware (``vllm serve --middleware
    omni_cache.driver.http_errors.ValidationErrorStatusMiddleware``) for ``/v1/*`` routes: a
    500 answer whose error is a ``VLLMValidationError`` becomes a 400 with the same message;
    a rejected request (4xx) logs one ``WARNING`` line, no traceback, and its message is not
    repeated; the server's own errors keep their tracebacks. See the module docstring."""

    def __init__(self, app: Any):
        self.app = app
        install_log_filter()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        install_log_filter()  # handlers configured after the app was built
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = headers.get("x-request-id")
        body_parts: list[bytes] = []

        async def receive_teed() -> dict:
            message = await receive()
            if message.get("type") == "http.request":
                body_parts.append(message.get("body", b""))
            return message

        ctx = _RequestLog()
        token = _CURRENT.set(ctx)
        held_start: dict | None = None
        chunks: list[bytes] = []

        async def send_checked(message: dict) -> None:
            nonlocal held_start, request_id
            if message["type"] == "http.response.start" and message.get("status", 200) >= 400:
                held_start = message  # decide once the (small, JSON) body is complete
                return
            if message["type"] == "http.response.start":
                ctx.release()
            if held_start is not None and message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start, body = self._error_answer(held_start, b"".join(chunks))
                if 400 <= start["status"] < 500:
                    if request_id is None:
                        request_id = f"rejected-{uuid.uuid4().hex[:12]}"
                        start = {**start, "headers": [*start.get("headers", []),
                                                      (b"x-request-id", request_id.encode())]}
                    ctx.held.clear()
                    ctx.decided = True
                    self._log_rejected(scope, start["status"], request_id, body, b"".join(body_parts))
                else:
                    ctx.release()
                await send(start)
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(message)

        try:
            await self.app(scope, receive_teed, send_checked)
        finally:
            ctx.release()
            _CURRENT.reset(token)

    @staticmethod
    def _error_answer(start: dict, body: bytes) -> tuple[dict, bytes]:
        """The error response to send: a validation 500 as a 400, a 4xx message without its
        repeated tail; ``content-length`` fixed when the body changed."""
        new_body = rewrite_validation_500(body) if start.get("status") == 500 else None
        status = 400 if new_body is not None else start["status"]
        if 400 <= status < 500:
            try:
                data = json.loads(new_body or body)
                err = data["error"]
                once = dedupe_message(str(err["message"]))
                if once != err["message"]:
                    err["message"] = once
                    new_body = json.dumps(data).encode()
            except (ValueError, UnicodeDecodeError, KeyError, TypeError):
                pass
        if new_body is None:
            return start, body
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_body)).encode()))
        return {**start, "status": status, "headers": headers}, new_body

    @staticmethod
    def _log_rejected(scope: dict, status: int, request_id: str, body: bytes, request_body: bytes) -> None:
        try:
            err = json.loads(body).get("error") or {}
            reason, param = str(err.get("message", "")), err.get("param")
        except (ValueError, UnicodeDecodeError, AttributeError):
            reason, param = body.decode("utf-8", "replace")[:500], None
        field = param or ", ".join(media_fields(request_body, reason)) or "-"
        reason = " ".join(reason.split())  # one line
        _log.warning("rejected request %s: %s %s: HTTP %d: %s: %s", request_id, scope.get("method", ""),
                     scope.get("path", ""), status, field, reason[:1000])
