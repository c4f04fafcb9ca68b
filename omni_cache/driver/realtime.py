"""A client of vLLM-Omni's realtime (duplex) endpoint, ``/v1/realtime?duplex=1``: OpenAI
Realtime events over a websocket (``websockets``), the way a voice assistant talks to
Qwen3-Omni. Used by ``scripts/realtime_session.py``, ``benchmarks/realtime_bench.py`` and the
serving tests; docs/serving.md ("Realtime voice sessions") walks through the events.

A well-behaved client, per voice turn: ``input_audio_buffer.append`` (pcm16, 16 kHz, base64)
… ``input_audio_buffer.commit`` → ``response.create`` → ``response.output_audio.delta`` … →
``response.done`` → ``playback.ack`` (how much of the answer was played; vLLM-Omni's session
refuses the next ``response.create`` with ``response_already_active`` until the answer is
acknowledged, its default overlap policy being listen-only). An interrupted answer:
``response.cancel`` then ``conversation.item.truncate`` (the assistant item, ``audio_end_ms``
played). A dropped connection: reconnect with ``?resume=1`` and send ``session.resume``
(``session_id``, ``resume_token`` from ``session.created``, the last ``server_event_seq`` seen).
The end of a session: ``session.close`` → ``session.closed``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: input sample rate of the realtime protocol's ``pcm16`` format (Hz)
INPUT_RATE = 16_000
#: sample rate of the ``pcm16`` audio deltas vLLM-Omni's Qwen3-Omni sends back (Hz)
OUTPUT_RATE = 24_000


def pcm16(audio: np.ndarray) -> bytes:
    """Float audio in [-1, 1] (``[num_samples]``, 16 kHz mono) as little-endian 16-bit PCM, the
    protocol's ``pcm16`` input format."""
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def speech_clip(seconds: float, offset_s: float = 0.0) -> bytes:
    """``seconds`` of the bundled speech recording (16 kHz mono) from ``offset_s`` (wrapping
    around), as :func:`pcm16` bytes."""
    from omni_cache.driver.inputs import load_audio, sample_path

    audio, sr = load_audio(sample_path("speech.wav"))
    n = int(seconds * sr)
    start = int(offset_s * sr) % max(len(audio) - n, 1)
    return pcm16(audio[start:start + n])


def http_url(ws_url: str) -> str:
    """The server's HTTP base (``http://host:port``) of a realtime URL."""
    return ws_url.replace("wss://", "https://").replace("ws://", "http://").split("/v1/")[0]


#: error codes of a ``response.cancel`` that arrived after the answer had ended: a race of a
#: barge-in with a short answer, not a failure (seen in CI: "response_not_active: Response is
#: already complete")
LATE_CANCEL = frozenset({"response_not_active"})


class RealtimeError(RuntimeError):
    """The server answered an ``error`` event (``.error``: its ``error`` object) where the
    client expected something else."""

    def __init__(self, error: dict):
        super().__init__(f"{error.get('code') or error.get('type')}: {error.get('message')}")
        self.error = error


@dataclass
class Turn:
    """What one committed voice turn got back. Times in seconds from the commit
    (``input_audio_buffer.commit`` sent); ``audio``: the answer's pcm16 bytes (24 kHz)."""

    response_id: str | None = None
    item_id: str | None = None
    status: str | None = None
    first_text_s: float | None = None
    first_audio_s: float | None = None
    done_s: float | None = None
    text: str = ""
    audio: bytes = b""
    errors: list[dict] = field(default_factory=list)

    @property
    def audio_ms(self) -> int:
        """Milliseconds of answer audio received."""
        return int(len(self.audio) / 2 / OUTPUT_RATE * 1000)


class RealtimeSession:
    """One realtime session over one websocket (reconnectable with :meth:`resume`).

    ``session``: the ``session.update`` body (``turn_detection`` defaults to ``None``:
    explicit commits); omni-cache's keys go under ``extra_body`` (``omni_cache_window``).
    Use as ``async with RealtimeSession(url, instructions=...) as s: turn = await s.turn(pcm)``.

    Raises (``open``):
        RealtimeError: the server refused the session (its ``error`` event).
    """

    def __init__(self, url: str, *, timeout: float = 300.0, ping_interval: float | None = 20.0, **session: Any):
        self.url = url
        self.timeout = timeout
        self.ping_interval = ping_interval  # websockets keepalive (None: off, for a server that may be paused)
        self.session = {"turn_detection": None, **session}
        self.ws = None
        self.session_id: str | None = None
        self.resume_token: str | None = None
        self.last_seq = 0
        self.events: list[dict] = []  # every server event received (audio deltas without audio)

    async def __aenter__(self) -> RealtimeSession:
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> dict:
        """Connect, send ``session.update``, wait for ``session.created``; returns it."""
        import websockets

        self.ws = await websockets.connect(self.url, max_size=None, ping_interval=self.ping_interval)
        await self.send({"type": "session.update", "session": self.session})
        created = await self.until("session.created")
        self.session_id = (created.get("session") or {}).get("id")
        self.resume_token = created.get("resume_token")
        return created

    async def close(self) -> None:
        """End the session for good (``session.close`` → ``session.closed``), then close the
        connection. A bare websocket close would park the session in vLLM-Omni's disconnect
        grace (``duplex_session.disconnect_grace_s``, for a resume), where it keeps a
        ``max_sessions`` slot."""
        if self.ws is None:
            return
        try:
            await self.send({"type": "session.close"})
            await self.until("session.closed", timeout=10)
        except Exception:  # noqa: BLE001 - an error, a timeout or a closed socket: the session ends anyway
            pass
        finally:
            await self.ws.close()
            self.ws = None

    async def drop(self) -> None:
        """Drop the connection without a close handshake (a network failure, as the server
        sees it)."""
        if self.ws is not None:
            self.ws.transport.abort()
            self.ws = None

    async def resume(self) -> dict:
        """Reconnect (``?resume=1``) and re-attach with ``session.resume``; returns the
        server's first answer (``session.resumed`` or similar).

        Raises:
            RealtimeError: the server refused the resume.
        """
        import websockets

        sep = "&" if "?" in self.url else "?"
        self.ws = await websockets.connect(self.url + sep + "resume=1", max_size=None, ping_interval=self.ping_interval)
        await self.send({"type": "session.resume", "session_id": self.session_id, "resume_token": self.resume_token,
                         "last_received_server_event_seq": self.last_seq})
        return await self.recv()

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout: float | None = None) -> dict:
        """The next server event (``RealtimeError`` for an ``error`` event)."""
        raw = await asyncio.wait_for(self.ws.recv(), timeout=timeout or self.timeout)
        event = json.loads(raw)
        self.last_seq = max(self.last_seq, int(event.get("server_event_seq") or 0))
        self.events.append({k: v for k, v in event.items() if k != "delta" or "audio" not in event.get("type", "")})
        if event.get("type") == "error":
            raise RealtimeError(event.get("error") or {})
        return event

    async def until(self, kind: str, timeout: float | None = None) -> dict:
        """Receive events until one of type ``kind``; returns it."""
        while True:
            event = await self.recv(timeout)
            if event.get("type") == kind:
                return event

    async def append(self, audio: bytes, chunk_bytes: int = 32_000) -> None:
        """``input_audio_buffer.append`` of pcm16 ``audio`` in chunks (1 s each by default)."""
        for i in range(0, len(audio), chunk_bytes):
            await self.send({"type": "input_audio_buffer.append",
                             "audio": base64.b64encode(audio[i:i + chunk_bytes]).decode()})

    async def turn(self, audio: bytes, *, ack: bool = True, stop_after_audio_ms: int | None = None) -> Turn:
        """One voice turn: append ``audio`` (pcm16), commit, ``response.create``, collect the
        answer until ``response.done``; then acknowledge its playback (``ack``).

        ``stop_after_audio_ms``: barge in once that much answer audio arrived —
        ``response.cancel``, then ``conversation.item.truncate`` at the audio received — and
        return the cut answer (``status`` as the server reports it).

        A ``response_not_active`` error (a cancel that arrived after the answer ended) is kept
        in ``Turn.errors`` instead.

        Raises:
            RealtimeError: any other ``error`` event before ``response.done``.
        """
        await self.append(audio)
        t0 = time.perf_counter()
        await self.send({"type": "input_audio_buffer.commit"})
        await self.send({"type": "response.create"})
        turn = Turn()
        cancelled = False
        while True:
            try:
                event = await self.recv()
            except RealtimeError as exc:
                if (exc.error or {}).get("code") not in LATE_CANCEL:
                    raise
                # a cancel that reached the server after the answer had ended (this turn's or,
                # arriving now, the previous turn's): benign, kept on the turn
                turn.errors.append(exc.error)
                continue
            kind, now = event.get("type", ""), time.perf_counter() - t0
            turn.response_id = event.get("response_id") or turn.response_id
            turn.item_id = event.get("item_id") or turn.item_id
            if kind == "response.output_audio.delta":
                turn.first_audio_s = turn.first_audio_s if turn.first_audio_s is not None else now
                turn.audio += base64.b64decode(event.get("delta", ""))
            elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
                if event.get("delta") and turn.first_text_s is None:
                    turn.first_text_s = now
                turn.text += event.get("delta", "")
            elif kind == "response.done":
                turn.done_s = now
                turn.status = (event.get("response") or {}).get("status")
                break
            if (stop_after_audio_ms is not None and not cancelled and turn.audio_ms >= stop_after_audio_ms):
                cancelled = True
                await self.send({"type": "response.cancel"})
                await self.send({"type": "conversation.item.truncate", "item_id": turn.item_id,
                                 "content_index": 0, "audio_end_ms": turn.audio_ms})
        if ack:
            await self.send({"type": "playback.ack", "played_ms": turn.audio_ms, "response_id": turn.response_id})
        return turn


def prefix_cache_counters(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """vLLM's prefix-cache counters per stage from the server's ``/metrics``:
    ``{"hits_<stage>": tokens, "queries_<stage>": tokens}`` (``vllm:prefix_cache_hits_total``,
    ``vllm:prefix_cache_queries_total``; summed over label sets). ``base_url``: ``http://host:port``.

    Raises:
        urllib.error.URLError: the server did not answer.
    """
    import re
    import urllib.request

    text = urllib.request.urlopen(base_url + "/metrics", timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^vllm:prefix_cache_(hits|queries)_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        stage = re.search(r'stage="(\d+)"', m.group(2))
        key = f"{m.group(1)}_{stage.group(1) if stage else '?'}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out
