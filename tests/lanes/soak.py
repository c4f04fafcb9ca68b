"""Soak: a long mixed stream of requests on ``omni-cache serve``, with ``/dev/shm``, RSS and open
files sampled over time (issue 45).

One server gets ``--requests`` requests, ``--concurrency`` at a time, drawn (seeded) from
:data:`KIND_WEIGHTS` (text, audio out and in, streamed, photo, video, bad media that must be a
400, streams closed early, realtime turns with a duplex config). Every ``--sample-s`` seconds
:class:`Sampler` records this run's ``/dev/shm`` entries (named after the ``X-Request-Id``
``<tag>-<i>-<kind>``), the server tree's RSS and open files; after ``--drain-s`` the server is
stopped (timed) and what is left listed. Bars (:func:`_bars`, :func:`after_exit`):
docs/serving.md, "Shared memory and the soak". Writes ``result.json`` and ``soak.png``.

    .venv/bin/python -m tests.lanes.soak --requests 2000            # the issue's bar
    .venv/bin/python -m tests.lanes.soak --requests 120 --warmup 20 # a short run
    (the CI slice, 100 requests on the serve test's server: tests/pipeline/test_serve.py, :func:`drive`)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import io
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import openai
import psutil
import soundfile as sf
from PIL import Image

from benchmarks import lab
from omni_cache.driver.inputs import load_audio, sample_path
from omni_cache.driver.realtime import RealtimeSession, speech_clip

SHM = Path("/dev/shm")
#: the command's options that :func:`drive` takes as they are
DRIVE_OPTIONS = ("requests", "concurrency", "warmup", "max_tokens", "sample_s", "drain_s", "shm_slack", "report_every",
                 "seed")
KIND_WEIGHTS = {"text": 3, "text+audio": 2, "stream": 2, "image": 1, "audio-in": 1, "video": 1, "bad": 1,
                "abort": 1, "realtime": 1}
QUESTIONS = ("What do you see?", "Say hello.", "Count to three.", "What is the weather like?",
             "Describe a cat.", "Tell me a story.", "Name a colour.", "What time is it?")


def _wav_b64(samples: np.ndarray, rate: int = 16_000) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples.astype(np.float32), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def video_clip(pixel_seed: int, seconds: float = 2.0, size: int = 224, fps: int = 4) -> str:
    """A ``seconds`` mp4 (MPEG-4 video, ``size`` × ``size`` random pixels drawn from
    ``pixel_seed``; AAC audio: the bundled speech recording) as a data URL (``av``). Same
    arguments but the seed: same length and size, so the same prompt token ids."""
    import av

    wav, sr = sf.read(sample_path("speech.wav"), dtype="float32")
    wav = (wav.mean(axis=1) if wav.ndim > 1 else wav)[:int(seconds * sr)]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        v = c.add_stream("mpeg4", rate=fps)
        v.width = v.height = size
        v.pix_fmt = "yuv420p"
        a = c.add_stream("aac", rate=sr)
        a.layout = "mono"
        rng = np.random.default_rng(pixel_seed)
        for _ in range(int(seconds * fps)):
            img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for packet in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(packet)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wav[None, :]), format="flt", layout="mono")
        frame.sample_rate = sr
        for stream, item in ((v, None), (a, frame), (a, None)):
            for packet in stream.encode(item):
                c.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def _media() -> dict[str, str]:
    """The inputs: a 64×64 PNG, 1 s of speech (WAV), a 78-sample WAV, a truncated JPEG, two 1 s
    video clips (data URLs or base64)."""
    buf = io.BytesIO()
    Image.open(sample_path("astronaut.jpg")).convert("RGB").resize((64, 64)).save(buf, format="PNG")
    audio, sr = load_audio(sample_path("speech.wav"))
    jpeg = open(sample_path("astronaut.jpg"), "rb").read()[:4000]
    return {"image": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(),
            "speech": _wav_b64(np.asarray(audio)[:sr], sr), "short_wav": _wav_b64(np.zeros(78)),
            "truncated_jpeg": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode(),
            "video": [video_clip(seed, seconds=1.0, size=64, fps=2) for seed in (1, 2)]}


def shm_entries(tag: str, baseline: set[str]) -> dict:
    """``/dev/shm`` entries created since ``baseline``: segments (count, bytes) and lock files,
    all of them and those whose name holds ``tag``."""
    out = dict.fromkeys(("segments", "bytes", "lockfiles", "tagged_segments", "tagged_bytes", "tagged_lockfiles"), 0)
    with contextlib.suppress(OSError):
        for name in set(os.listdir(SHM)) - baseline:
            with contextlib.suppress(OSError):
                lock, size = name.endswith("_lockfile.lock"), (SHM / name).stat().st_size
                for pre in ("", "tagged_") if tag in name else ("",):
                    out[pre + ("lockfiles" if lock else "segments")] += 1
                    out[pre + "bytes"] += 0 if lock else size
    return out


def tree_usage(pid: int) -> dict:
    """RSS (bytes) and open file descriptors summed over process ``pid`` and its descendants."""
    rss = fds = n = 0
    for p in lab.process_tree(pid):
        with contextlib.suppress(psutil.Error):
            rss, fds, n = rss + p.memory_info().rss, fds + p.num_fds(), n + 1
    return {"rss": rss, "fds": fds, "processes": n}


class Sampler(threading.Thread):
    """Samples :func:`shm_entries` and :func:`tree_usage` every ``every_s`` seconds."""

    def __init__(self, pid: int, tag: str, baseline: set[str], every_s: float, progress):
        super().__init__(daemon=True)
        self.pid, self.tag, self.baseline, self.every_s, self.progress = pid, tag, baseline, every_s, progress
        self.samples: list[dict] = []
        self.t0, self._halt = time.perf_counter(), threading.Event()

    def sample(self) -> dict:
        self.samples.append(s := {"t_s": round(time.perf_counter() - self.t0, 2), "requests_done": self.progress(),
                                  **shm_entries(self.tag, self.baseline), **tree_usage(self.pid)})
        return s

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()


async def _one(client, model: str, kind: str, k: int, tag: str, media: dict, max_tokens: int,
               realtime_url: str | None) -> dict:
    rid = f"{tag}-{k}-{kind.replace('+', '_')}"
    rec = {"i": k, "kind": kind, "id": rid, "status": None, "ok": False, "error": None}
    t0 = time.perf_counter()
    q = QUESTIONS[k % len(QUESTIONS)] + f" ({k})"
    common = {"model": model, "max_tokens": max_tokens, "seed": k, "extra_headers": {"X-Request-Id": rid}}
    try:
        if kind in ("text", "text+audio", "audio-in", "image", "video"):
            part = {"audio-in": {"type": "input_audio", "input_audio": {"data": media["speech"], "format": "wav"}},
                    "image": {"type": "image_url", "image_url": {"url": media["image"]}},
                    "video": {"type": "video_url", "video_url": {"url": media["video"][k % 2]}}}.get(kind)
            content = [part, {"type": "text", "text": q}] if part else q
            audio_out = kind in ("text+audio", "audio-in")
            video = {"mm_processor_kwargs": {"use_audio_in_video": bool(k % 2)}}
            extra = {"extra_body": video} if kind == "video" else {}
            r = await client.chat.completions.create(messages=[{"role": "user", "content": content}],
                                                     modalities=["text", "audio"] if audio_out else ["text"],
                                                     **extra, **common)
            if audio_out:
                audio = r.choices[0].message.audio if r.choices else None
                rec["ok"] = audio is not None and len(audio.data or "") > 0
            else:
                rec["ok"] = bool(r.choices) and (kind != "text" or r.choices[0].message.content is not None)
        elif kind in ("stream", "abort"):
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": q}],
                                                          modalities=["text", "audio"], stream=True, **common)
            chunks = audio_chunks = 0
            async for chunk in stream:
                chunks += 1
                if (chunk.model_extra or {}).get("modality") == "audio":
                    audio_chunks += 1
                if kind == "abort" and chunks >= 1:
                    await stream.close()
                    break
            rec["ok"] = chunks >= 1 if kind == "abort" else audio_chunks >= 1
        elif kind == "bad":
            part = [{"type": "input_audio", "input_audio": {"data": media["short_wav"], "format": "wav"}},
                    {"type": "input_audio", "input_audio": {"data": "not*base64!!", "format": "wav"}},
                    {"type": "image_url", "image_url": {"url": media["truncated_jpeg"]}}][k % 3]
            try:
                await client.chat.completions.create(messages=[{"role": "user", "content": [
                    {"type": "text", "text": "What is this?"}, part]}], modalities=["text"], **common)
                rec["error"] = "a bad request was answered 200"
            except openai.BadRequestError as e:
                msg = e.body.get("message", "") if isinstance(e.body, dict) else str(e)
                rec.update(status=e.status_code, message_chars=len(msg), ok=e.status_code == 400)
        elif kind == "realtime":
            async with RealtimeSession(realtime_url, timeout=300, instructions="Soak.") as s:
                turn = await s.turn(speech_clip(1.0, offset_s=0.3 * k))
            rec["ok"] = len(turn.audio) > 0
        rec["status"] = rec["status"] or 200
    except openai.APIStatusError as e:
        rec["status"], rec["error"] = e.status_code, str(e)[:300]
    except Exception as e:  # noqa: BLE001 - a lost request, recorded
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["s"] = round(time.perf_counter() - t0, 3)
    return rec


async def _stream(base_url: str, model: str, kinds: list[str], concurrency: int, tag: str, media: dict,
                  max_tokens: int, realtime_url: str | None, done: list, report_every: int) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()

    async def run(k: int, kind: str) -> dict:
        async with sem:
            rec = await _one(client, model, kind, k, tag, media, max_tokens, realtime_url)
        done.append(rec)
        n = len(done)
        if n % report_every == 0 or n == len(kinds):
            lost = sum(1 for r in done if not r["ok"])
            print(f"[{time.perf_counter() - t0:6.0f} s] {n}/{len(kinds)} requests, {lost} lost", flush=True)
        return rec

    out = await asyncio.gather(*(run(k, kind) for k, kind in enumerate(kinds)))
    await client.close()
    return out


def _bars(samples: list[dict], drained: dict, records: list[dict], warmup: int, slack: int) -> dict:
    """The bars over the samples after ``warmup`` requests (``drained``: the sample after the
    drain). ``/dev/shm`` is *flat* when the median segment count of the last quarter of the
    samples exceeds the first quarter's by at most ``slack`` and the drain brings it back to
    (at most) its post-warm-up value; the peak in flight is recorded, not barred (a closed
    stream's hand-offs wait for the server's sweep, :data:`omni_cache.driver.shm_sweeper.SWEEP_AFTER_S`)."""
    after = [s for s in samples if s["requests_done"] >= warmup and s is not drained] or samples
    base = after[0]
    seg = np.array([s["tagged_segments"] for s in after])
    quarter = max(1, len(after) // 4)
    first_q, last_q = float(np.median(seg[:quarter])), float(np.median(seg[-quarter:]))
    tenth, rss = max(1, len(after) // 10), np.array([s["rss"] for s in after])
    rss_first, rss_last = float(np.median(rss[:tenth])), float(np.median(rss[-tenth:]))
    rss_growth = (rss_last - rss_first) / rss_first if rss_first else 0.0
    fds = [s["fds"] for s in after]
    lost = [r for r in records if not r["ok"]]
    return {
        "shm_segments_flat": {"post_warmup": base["tagged_segments"], "first_quarter_median": first_q,
                              "last_quarter_median": last_q, "peak": int(seg.max()),
                              "p99": float(np.percentile(seg, 99)), "after_drain": drained["tagged_segments"],
                              "slack": slack, "pass": last_q - first_q <= slack
                              and drained["tagged_segments"] <= base["tagged_segments"]},
        "shm_bytes_after_drain": {"post_warmup": base["tagged_bytes"], "after_drain": drained["tagged_bytes"],
                                  "max": max(s["tagged_bytes"] for s in after),
                                  "pass": drained["tagged_bytes"] <= base["tagged_bytes"]},
        "rss_growth_lt_2pct": {"first_tenth_median": rss_first, "last_tenth_median": rss_last,
                               "growth": rss_growth, "pass": rss_growth < 0.02},
        "open_fds": {"min": min(fds), "max": max(fds), "first": fds[0], "last": fds[-1],
                     "pass": fds[-1] - fds[0] <= slack},
        "no_lost_requests": {"lost": len(lost), "examples": lost[:5], "pass": not lost}}


def _plot(samples: list[dict], out: Path, warmup: int) -> None:
    panels = [("tagged_segments", "/dev/shm segments (this run)", 1), ("tagged_lockfiles", "lock files (this run)", 1),
              ("rss", "process tree RSS (MiB)", 2 ** 20), ("fds", "open file descriptors", 1)]
    with lab.figure(out, 2, 2, figsize=(11, 7), sharex=True, dpi=110,
                    title="omni-cache serve soak (dotted: end of warm-up)") as (fig, axes):
        for ax, (key, title, scale) in zip(axes.flat, panels):
            ax.plot([s["requests_done"] for s in samples], [s[key] / scale for s in samples], marker=".", lw=1)
            ax.axvline(warmup, color="grey", ls=":", lw=1)
            ax.set_title(title)
            ax.grid(alpha=0.3)
        for ax in axes[1]:
            ax.set_xlabel("requests answered")


def _stop_timed(srv) -> dict:
    """SIGTERM the server; seconds until every stage process (``VLLM::*``: engine cores and
    workers) and the server itself are gone."""
    kids = [p for p in lab.process_tree(srv.proc.pid)[1:] if p.name().startswith("VLLM")]
    t0 = time.perf_counter()
    srv.proc.send_signal(signal.SIGTERM)
    stages_down = None
    while srv.proc.poll() is None and time.perf_counter() - t0 < 120:
        if stages_down is None and not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in kids):
            stages_down = time.perf_counter() - t0
        time.sleep(0.05)
    exit_s = time.perf_counter() - t0
    rc = srv.stop()
    return {"stages_down_s": round(stages_down if stages_down is not None else exit_s, 2),
            "server_exit_s": round(exit_s, 2), "exit_code": rc}


def drive(srv, *, requests: int, concurrency: int = 4, warmup: int = 100, max_tokens: int = 8,
          sample_s: float = 2.0, drain_s: float = 5.0, shm_slack: int = 8, report_every: int = 50, seed: int = 0,
          tag: str | None = None, baseline: set[str] | None = None) -> dict:
    """Drive a ready :class:`~omni_cache.driver.server.OmniServer` (it keeps running) with
    ``requests`` of the mix, ``concurrency`` at a time, and sample it; ``warmup``: requests before
    the flatness bars start; ``tag``: names the request ids and so the ``/dev/shm`` entries
    (default ``soak<timestamp>``); ``baseline``: entries not this run's (default: those there now).
    Returns ``{"tag", "baseline", "records", "samples", "drained", "counts", "statuses", "wall_s",
    "bars"}`` (every bar but :func:`after_exit`'s)."""
    tag = tag or f"soak{dt.datetime.now().strftime('%Y%m%d%H%M%S')}"
    baseline = set(os.listdir(SHM)) if baseline is None else baseline
    media = _media()
    kinds_available = [k for k in KIND_WEIGHTS if k != "realtime" or srv.realtime_url]
    kinds = random.Random(seed).choices(kinds_available, weights=[KIND_WEIGHTS[k] for k in kinds_available], k=requests)
    done: list[dict] = []
    sampler = Sampler(srv.proc.pid, tag, baseline, sample_s, lambda: len(done))
    sampler.sample()
    sampler.start()
    t0 = time.perf_counter()
    try:
        records = asyncio.run(_stream(srv.base_url, srv.model_name(), kinds, concurrency, tag, media,
                                      max_tokens, srv.realtime_url, done, report_every))
    finally:
        sampler.stop()
    wall = time.perf_counter() - t0
    time.sleep(drain_s)
    drained = sampler.sample()
    counts = {k: {"n": sum(1 for r in records if r["kind"] == k),
                  "ok": sum(1 for r in records if r["kind"] == k and r["ok"])} for k in KIND_WEIGHTS}
    bars = _bars(sampler.samples, drained, records, warmup, shm_slack)
    bars["server_alive_after_stream"] = {"pass": srv.alive()}
    return {"tag": tag, "baseline": baseline, "records": records, "samples": sampler.samples, "drained": drained,
            "counts": counts, "wall_s": wall,
            "statuses": {str(s): sum(1 for r in records if r["status"] == s) for s in {r["status"] for r in records}},
            "bars": bars}


def after_exit(tag: str, baseline: set[str]) -> dict:
    """This run's ``/dev/shm`` entries left after the server exited, as a bar:
    ``{"left": [names], "pass": not left}``."""
    left = sorted(n for n in os.listdir(SHM) if n not in baseline and tag in n)
    return {"left": left[:50], "n_left": len(left), "pass": not left}


def run(args, argv: list[str] | None = None) -> dict:
    """Start a server, :func:`drive` it, stop it (timed), check :func:`after_exit`, write the
    result (``argv``: the command's, default this process's) and the plot; returns the result
    (with ``out_dir``)."""
    model_dir = lab.model_dir(args.size, args.model)
    out_dir = lab.results_dir(args.out, "soak")
    tag = f"soak{dt.datetime.now():%Y%m%d%H%M%S}"
    baseline = set(os.listdir(SHM))
    with lab.start("server", model_dir, args.stage_config, log=out_dir / "server.log", ready_timeout=1500,
                   label="soak") as srv:
        d = drive(srv, tag=tag, baseline=baseline, **{k: getattr(args, k) for k in DRIVE_OPTIONS})
        stop = _stop_timed(srv)
    time.sleep(1.0)
    bars = {**d["bars"], "shm_empty_after_exit": after_exit(tag, baseline)}
    result = {"benchmark": "soak", **lab.stamp("tests.lanes.soak", argv),
              "model": str(model_dir), "stage_config": str(args.stage_config), "args": lab.jsonable(args),
              "ready_s": round(srv.ready_s, 1), "stream_wall_s": round(d["wall_s"], 1),
              "requests_per_s": round(len(d["records"]) / d["wall_s"], 3), "counts": d["counts"],
              "statuses": d["statuses"], "stop": stop, "shm_after_exit": shm_entries(tag, baseline),
              "summary": {"pass": all(b["pass"] for b in bars.values()), "bars": bars},
              "samples": d["samples"], "requests": d["records"]}
    lab.write_result(out_dir, result, show={k: result[k] for k in ("counts", "statuses", "stop", "stream_wall_s")},
                     also=[out_dir / "soak.png"])
    _plot(d["samples"], out_dir / "soak.png", args.warmup)
    for name, bar in bars.items():
        print(f"{'PASS' if bar['pass'] else 'FAIL'}  {name}: "
              f"{ {k: v for k, v in bar.items() if k not in ('pass', 'examples')} }")
    result["out_dir"] = str(out_dir)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = lab.parser(__doc__, "soak", size="tiny", sizes=("tiny",))  # a duplex --stage-config adds realtime turns
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=100, help="requests before the flatness bars start")
    ap.add_argument("--max-tokens", type=int, default=8, help="thinker output tokens per request")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--drain-s", type=float, default=5.0, help="idle seconds before the last sample")
    ap.add_argument("--shm-slack", type=int, default=8, help="segments in flight the flatness bar allows")
    ap.add_argument("--report-every", type=int, default=50, help="progress line every N requests")
    ap.add_argument("--seed", type=int, default=0, help="the mix's seed")
    args = ap.parse_args(argv)
    if not SHM.is_dir():
        ap.error("/dev/shm is not a directory here")
    result = run(args, argv)
    return 0 if result["summary"]["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
