"""A realtime voice session against ``omni-cache serve --stage-config qwen3_omni_cpu_duplex.yaml``
(vLLM-Omni's ``/v1/realtime?duplex=1``, OpenAI Realtime events over a websocket): N voice
turns of the bundled speech recording, each committed explicitly, answered, and its playback
acknowledged; prints per turn the time from commit to the first text and the first audio
delta, and the thinker's and talker's prefix-hit tokens from the server's ``/metrics``.

    .venv/bin/python scripts/realtime_session.py --url ws://127.0.0.1:8091/v1/realtime?duplex=1 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import time
import urllib.request

import numpy as np


def pcm16(seconds: float, offset_s: float = 0.0) -> bytes:
    """``seconds`` of the bundled speech (16 kHz mono) from ``offset_s`` as little-endian
    16-bit PCM — the realtime protocol's ``pcm16`` input format."""
    from omni_cache.driver.inputs import load_audio, sample_path

    audio, sr = load_audio(sample_path("speech.wav"))
    start = int(offset_s * sr) % max(len(audio) - int(seconds * sr), 1)
    clip = audio[start:start + int(seconds * sr)]
    return (np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes()


def prefix_hits(http_url: str) -> dict[str, float]:
    """``vllm:prefix_cache_hits_total`` / ``queries_total`` per stage from ``/metrics``."""
    text = urllib.request.urlopen(http_url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^vllm:prefix_cache_(hits|queries)_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        stage = re.search(r'stage="(\d+)"', m.group(2))
        key = f"{m.group(1)}_{stage.group(1) if stage else '?'}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def session(url: str, turns: int, seconds: float) -> list[dict]:
    """One session of ``turns`` voice turns; per turn the timings (seconds) and /metrics deltas."""
    import websockets

    http_url = re.sub(r"^ws", "http", url.split("/v1/")[0])
    rows = []
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        for turn in range(turns):
            before = prefix_hits(http_url)
            audio = base64.b64encode(pcm16(seconds, offset_s=1.7 * turn)).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            first_text = first_audio = None
            audio_bytes, response_id, errors = 0, None, []
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), timeout=300))
                kind = ev.get("type", "")
                now = time.perf_counter() - t0
                if kind == "error":
                    errors.append(ev.get("error"))
                    break
                if kind.endswith("audio.delta") and first_audio is None:
                    first_audio = now
                if kind.endswith("audio.delta"):
                    audio_bytes += len(base64.b64decode(ev.get("delta", "")))
                if ("text" in kind or "transcript" in kind) and kind.endswith(".delta") and first_text is None:
                    first_text = now
                if kind == "response.done":
                    response_id = (ev.get("response") or {}).get("id")
                    break
            played_ms = int(audio_bytes / 2 / 24_000 * 1000)
            await ws.send(json.dumps({"type": "playback.ack", "played_ms": played_ms, "response_id": response_id}))
            after = prefix_hits(http_url)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            rows.append({"turn": turn + 1, "commit_to_first_text_s": first_text, "commit_to_first_audio_s": first_audio,
                         "thinker_hit": delta.get("hits_0"), "thinker_queried": delta.get("queries_0"),
                         "talker_hit": delta.get("hits_1"), "talker_queried": delta.get("queries_1"),
                         "errors": errors})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8091/v1/realtime?duplex=1")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0, help="speech per turn")
    args = ap.parse_args(argv)
    rows = asyncio.run(session(args.url, args.turns, args.seconds))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
