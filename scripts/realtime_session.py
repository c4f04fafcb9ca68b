"""A realtime voice session against ``omni-cache serve --stage-config qwen3_omni_cpu_duplex.yaml``
(vLLM-Omni's ``/v1/realtime?duplex=1``, OpenAI Realtime events over a websocket; the client is
:mod:`omni_cache.driver.realtime`): N voice turns of the bundled speech recording, each
committed explicitly, answered, and its playback acknowledged; prints per turn the time from
commit to the first text and the first audio delta, and the thinker's and talker's prefix-hit
tokens from the server's ``/metrics``.

    .venv/bin/python scripts/realtime_session.py --url ws://127.0.0.1:8091/v1/realtime?duplex=1 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json


async def session(url: str, turns: int, seconds: float, window: str, instructions: str) -> list[dict]:
    """One session of ``turns`` voice turns; per turn the timings (seconds) and /metrics deltas."""
    from omni_cache.driver.realtime import RealtimeSession, http_url, prefix_cache_counters, speech_clip

    rows = []
    async with RealtimeSession(url, instructions=instructions, extra_body={"omni_cache_window": window}) as s:
        for k in range(turns):
            before = prefix_cache_counters(http_url(url))
            t = await s.turn(speech_clip(seconds, offset_s=1.7 * k))
            after = prefix_cache_counters(http_url(url))
            d = {key: after.get(key, 0) - before.get(key, 0) for key in after}
            rows.append({"turn": k + 1, "commit_to_first_text_s": t.first_text_s,
                         "commit_to_first_audio_s": t.first_audio_s, "answer_audio_ms": t.audio_ms,
                         "thinker_hit": d.get("hits_0"), "thinker_queried": d.get("queries_0"),
                         "talker_hit": d.get("hits_1"), "talker_queried": d.get("queries_1"), "text": t.text})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8091/v1/realtime?duplex=1")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0, help="speech per turn")
    ap.add_argument("--window", choices=("omni_cache", "stock"), default="omni_cache",
                    help="conversation window (session.extra_body.omni_cache_window)")
    ap.add_argument("--instructions", default="You are a helpful voice assistant. Answer briefly.")
    args = ap.parse_args(argv)
    asyncio.run(session(args.url, args.turns, args.seconds, args.window, args.instructions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
