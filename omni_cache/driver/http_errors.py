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

- **4xx** (the client's fault): the answer's message becomes one line a person reads
  (:func:`rejection_message`: ``<field>: <reason>``, cause first, at most
  :data:`MAX_MESSAGE_CHARS` characters, no array or tensor printed, a repeated tail said once;
  the field is the error's ``param``, else the parts whose base64 does not decode, else the
  request's media parts of the modality the reason names — and becomes ``param``), the held
  records are dropped, and one ``WARNING`` line says ``rejected request <id>: <METHOD> <path>:
  HTTP <status>: <the same line>`` (the id is the client's ``X-Request-Id`` or one made up and
  sent back in that header);
- **anything else** (the server's own errors, 5xx): the held records are logged as they were,
  tracebacks included.
"""

from __future__ import annotations

import base64
import binascii
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
    msg = message.lower()
    kinds = {t for words, types in _MEDIA_PARTS.items() if any(w in msg for w in words) for t in types}
    return [f"messages[{i}].content[{j}].{part['type']}" for i, j, part in _content_parts(body)
            if part["type"] in kinds]


#: The longest message a rejected request gets (and its log line after the request id).
MAX_MESSAGE_CHARS = 300

#: vLLM's wrapper around a failing Hugging Face processor (``vllm/multimodal/processing/context.py``):
#: ``Failed to apply <Processor> on data={...} with kwargs={...}``; vLLM-Omni's chat route appends
#: the cause after a space (``f"{e} {e.__cause__}"``).
_PROCESSOR_CALL = re.compile(r"Failed to apply (?P<proc>\w+) on data=")
#: torch's reflect-pad error for a clip shorter than the STFT's padding (Whisper-style features).
_PAD_TOO_LONG = re.compile(r"padding \((?P<left>\d+), (?P<right>\d+)\) at dimension \d+ "
                           r"of input \[(?:\d+, )*(?P<n>\d+)\]")
#: An array or tensor repr: the name and its balanced parentheses are replaced.
_ARRAY_START = re.compile(r"\b(?P<kind>array|tensor|ndarray)\(")
#: Messages of a base64 decoder (pybase64 / binascii) that name no field.
_BASE64_WORDS = ("base64", "incorrect padding", "invalid character", "excess data after padding")
_PROCESSOR_DATA_MODALITIES = {"audio": "audio", "audios": "audio", "images": "image", "image": "image",
                              "videos": "video", "video": "video"}


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]`` (``(``, ``[`` or ``{``),
    skipping quoted strings; ``len(text)`` when it never closes."""
    depth, quote, i = 0, "", start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def drop_arrays(text: str) -> str:
    """``text`` with every ``array(...)`` / ``tensor(...)`` repr replaced by ``<array>`` /
    ``<tensor>`` (balanced parentheses; quoted strings inside are skipped)."""
    out, pos = [], 0
    for m in _ARRAY_START.finditer(text):
        if m.start() < pos:
            continue
        out.append(text[pos:m.start()])
        out.append("<tensor>" if m.group("kind") == "tensor" else "<array>")
        pos = _balanced_end(text, m.end() - 1)
    out.append(text[pos:])
    return "".join(out)


def processor_failure(message: str) -> tuple[str, set[str], str] | None:
    """Split vLLM's "Failed to apply <Processor> on data={...} with kwargs={...} <cause>" into
    (processor name, the modalities in ``data`` — ``{"audio", "image", "video"}`` — and the
    cause text); None when ``message`` is not one. The data (sample arrays, pixels) is dropped."""
    m = _PROCESSOR_CALL.search(message)
    if m is None or m.end() >= len(message) or message[m.end()] != "{":
        return None
    data_end = _balanced_end(message, m.end())
    data = message[m.end():data_end]
    rest = message[data_end:]
    if rest.startswith(" with kwargs={"):
        rest = rest[_balanced_end(rest, len(" with kwargs=")):]
    keys = set(re.findall(r"'(\w+)':", drop_arrays(data)))
    modalities = {_PROCESSOR_DATA_MODALITIES[k] for k in keys if k in _PROCESSOR_DATA_MODALITIES}
    return m.group("proc"), modalities, rest.strip()


def _short_audio_hint(cause: str) -> str | None:
    """"audio too short (N samples; the processor needs ≥ M)" when ``cause`` is torch's
    reflect-padding error of a clip shorter than the feature extractor's STFT padding."""
    m = _PAD_TOO_LONG.search(cause)
    if m is None:
        return None
    need = max(int(m.group("left")), int(m.group("right"))) + 1
    return f"audio too short ({m.group('n')} samples at the processor's rate; it needs ≥ {need})"


def _data_url_payload(url: str) -> str | None:
    """The base64 payload of a ``data:...;base64,...`` URL, else None."""
    head, sep, payload = url.partition(",")
    return payload if sep and head.startswith("data:") and head.endswith(";base64") else None


def _media_payload(part: dict) -> str | None:
    """The base64 text a chat content part carries (``input_audio.data``, or the payload of a
    ``data:`` URL in ``image_url`` / ``audio_url`` / ``video_url``), else None."""
    kind = part.get("type")
    inner = part.get(kind) if isinstance(kind, str) else None
    if kind == "input_audio" and isinstance(inner, dict):
        data = inner.get("data")
        return data if isinstance(data, str) else None
    url = inner.get("url") if isinstance(inner, dict) else inner
    return _data_url_payload(url) if isinstance(url, str) else None


def _content_parts(body: bytes):
    """``(i, j, part)`` for every dict content part of a chat request body."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return
    for i, m in enumerate((data.get("messages") or []) if isinstance(data, dict) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and isinstance(part.get("type"), str):
                yield i, j, part


def undecodable_base64_fields(body: bytes) -> list[str]:
    """The request's media parts (``messages[i].content[j].<type>``) whose base64 payload does
    not decode (strict alphabet and padding, as vLLM's ``pybase64.b64decode(validate=True)``)."""
    out = []
    for i, j, part in _content_parts(body):
        payload = _media_payload(part)
        if payload is None:
            continue
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            out.append(f"messages[{i}].content[{j}].{part['type']}")
    return out


def rejection_message(message: str, param: str | None, request_body: bytes) -> tuple[str, str | None]:
    """A rejected request's message as one line a person reads, and the field it names.

    The line is ``<field>: <reason>`` (just ``<reason>`` when no field is known), at most
    :data:`MAX_MESSAGE_CHARS` characters, cause first: vLLM's "Failed to apply <Processor> on
    data={...} with kwargs={...}" wrapper is replaced by the processor's name and its cause (a
    clip shorter than the STFT padding gets "audio too short (N samples ...; it needs ≥ M)"
    in front), array / tensor reprs become ``<array>`` / ``<tensor>``, a repeated tail is said
    once (:func:`dedupe_message`), ``VLLMValidationError``'s ``(parameter=...)`` suffix is
    dropped (the field says it), whitespace is collapsed; only then is it cut, at the end.

    Args:
        message: the error message the server answered with.
        param: the error's ``param`` (e.g. ``input_tokens``), if any.
        request_body: the request's JSON body (to name the media part at fault).

    Returns:
        ``(line, field)``; ``field`` is None when neither ``param``, a part whose base64 does
        not decode, nor a media part of the modality the reason names was found.
    """
    reason = " ".join(message.split())
    modalities: set[str] = set()
    failure = processor_failure(reason)
    if failure is not None:
        proc, modalities, cause = failure
        hint = _short_audio_hint(cause) if "audio" in modalities else None
        what = "/".join(sorted(modalities)) or "input"
        reason = f"{hint}: {proc}: {cause}" if hint else f"{proc} failed on the {what}: {cause}"
    reason = dedupe_message(_VALIDATION_SUFFIX.sub("", drop_arrays(reason)).strip())
    field = param
    if field is None and any(w in reason.lower() for w in _BASE64_WORDS):
        bad = undecodable_base64_fields(request_body)
        if bad:
            field, reason = ", ".join(bad), f"invalid base64 data: {reason}"
    if field is None:
        named = media_fields(request_body, reason)
        if not named and modalities:
            named = media_fields(request_body, " ".join(modalities))
        field = ", ".join(named) or None
    line = f"{field}: {reason}" if field else reason
    if len(line) > MAX_MESSAGE_CHARS:
        line = line[:MAX_MESSAGE_CHARS - 1] + "…"
    return line, field


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
                start, body, line = self._error_answer(held_start, b"".join(chunks), b"".join(body_parts))
                if 400 <= start["status"] < 500:
                    if request_id is None:
                        request_id = f"rejected-{uuid.uuid4().hex[:12]}"
                        start = {**start, "headers": [*start.get("headers", []),
                                                      (b"x-request-id", request_id.encode())]}
                    ctx.held.clear()
                    ctx.decided = True
                    _log.warning("rejected request %s: %s %s: HTTP %d: %s", request_id, scope.get("method", ""),
                                 scope.get("path", ""), start["status"], line)
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
    def _error_answer(start: dict, body: bytes, request_body: bytes) -> tuple[dict, bytes, str]:
        """The error response to send, and its one-line message: a validation 500 becomes a
        400; a 4xx message becomes :func:`rejection_message`'s line (its ``param`` the field
        it names when the error had none); ``content-length`` fixed when the body changed."""
        new_body = rewrite_validation_500(body) if start.get("status") == 500 else None
        status = 400 if new_body is not None else start["status"]
        line = " ".join(body.decode("utf-8", "replace").split())[:MAX_MESSAGE_CHARS]
        if 400 <= status < 500:
            try:
                data = json.loads(new_body or body)
                err = data["error"]
                param = err.get("param") if isinstance(err.get("param"), str) else None
                line, field = rejection_message(str(err["message"]), param, request_body)
                if line != err["message"] or (field and field != param):
                    err["message"] = line
                    err["param"] = field
                    new_body = json.dumps(data).encode()
            except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                pass
        if new_body is None:
            return start, body, line
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_body)).encode()))
        return {**start, "status": status, "headers": headers}, new_body, line
