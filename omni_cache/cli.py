"""``omni-cache`` command line: make-model | validate | run | serve.

``omni-cache run`` with no arguments builds (once) the embedded tiny Qwen3-Omni, starts the
real three-stage vLLM-Omni pipeline (thinker → talker → code2wav, streaming as the shipped
deploy does) from ``stage_configs/qwen3_omni_cpu.yaml`` through vLLM-Omni's async engine, sends
the bundled photograph and speech recording with a text question, then a second request
sharing the long prefix, prints each request's time to the first text token (TTFT) and to the
first audio packet (TTFP), and writes each request's ``.wav`` as its packets arrive, plus a
``summary.json``, under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from omni_cache import settings

DEFAULT_STAGE_CONFIG = "qwen3_omni_cpu.yaml"


def stage_config_path(name_or_path: str) -> Path:
    """A stage config by path, or by file name among the bundled ones
    (:func:`~omni_cache.driver.stage_config.bundled_stage_config`)."""
    from omni_cache.driver.stage_config import bundled_stage_config

    p = Path(name_or_path)
    if p.exists():
        return p
    return bundled_stage_config(name_or_path) or p  # else the loader reports "file not found"


def _cmd_make_model(args: argparse.Namespace) -> int:
    from omni_cache.models import build_qwen3_omni, default_model_dir

    family = getattr(args, "family", "qwen3-omni")
    if family in ("gemma4", "gemma3n"):
        from omni_cache.models.gemma import build_gemma_omni, default_gemma_dir

        if args.size not in ("tiny", "bench") and (family, args.size) != ("gemma4", "full"):
            print(f"error: --family {family} has sizes tiny and bench{' and full' if family == 'gemma4' else ''}, "
                  f"not {args.size!r}", file=sys.stderr)
            return 2
        out = Path(args.out) if args.out else default_gemma_dir(args.size, family=family)
        if args.size == "full":
            from omni_cache.models.full import build_gemma4_full

            return _build("Gemma-4-E4B's text shape as the YOCO thinker + Qwen3-Omni-30B-A3B's talker and code2wav "
                          "(configs + tokenizers, no weights: load_format dummy)",
                          out, lambda: build_gemma4_full(out, force=args.force))
        what = ("the embedded multimodal KV-shared Gemma-4 thinker" if family == "gemma4"
                else "the embedded KV-shared Gemma-3n text thinker")
        return _build(f"{what} + Qwen3-Omni talker ({args.size})", out,
                      lambda: build_gemma_omni(out, args.size, force=args.force, family=family))
    layers = getattr(args, "thinker_layers", None)
    if layers is not None and (args.size != "full" or family != "qwen3-omni"):
        print("error: --thinker-layers applies to --size full of qwen3-omni only", file=sys.stderr)
        return 2
    if layers is not None and not 2 <= layers <= 48:
        print(f"error: --thinker-layers {layers}: Qwen3-Omni-30B-A3B's thinker has 48 layers; give 2..48",
              file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_model_dir(args.size)
    if args.size == "full":
        from omni_cache.models.full import build_full

        if layers is not None and layers != 48 and not args.out:
            out = out.with_name(f"{out.name}-l{layers}")
        what = ("Qwen3-Omni-30B-A3B-Instruct's shape" + ("" if layers in (None, 48) else
                f" with {layers} of its 48 thinker layers (profiling)"))
        return _build(f"{what} (config + tokenizer, no weights: load_format dummy)",
                      out, lambda: build_full(out, force=args.force, thinker_layers=layers))
    return _build(f"the embedded Qwen3-Omni ({args.size})", out,
                  lambda: build_qwen3_omni(out, args.size, force=args.force))


def _build(what: str, out: Path, build) -> int:
    """Run ``build`` with progress lines; says whether it built or found ``out`` up to date
    (the builders skip a directory whose build stamp ``*.json`` matches)."""
    def stamps() -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in out.glob("omni_cache_*.json")} if out.is_dir() else {}

    before = stamps()
    t0 = time.perf_counter()
    print(f"{what}: {out} ...", flush=True)
    build()
    if before and stamps() == before:
        print(f"up to date (build stamp matches), checked in {time.perf_counter() - t0:.1f} s")
    else:
        print(f"built in {time.perf_counter() - t0:.1f} s: {out}")
    _print_model_notice(out)
    return 0


def _print_model_notice(model: str | Path) -> None:
    """Say so when ``model`` is the embedded seeded-random model
    (:data:`omni_cache.models.EMBEDDED_MODEL_NOTICE`); nothing for a real checkpoint."""
    from omni_cache.models import EMBEDDED_MODEL_NOTICE, ModelKind, model_kind

    if model_kind(model) is ModelKind.EMBEDDED:
        print(EMBEDDED_MODEL_NOTICE, flush=True)


def _cmd_validate(args: argparse.Namespace) -> int:
    from omni_cache.driver.stage_config import StageConfigError, load_stage_config

    try:
        cfg = load_stage_config(stage_config_path(args.stage_config), model_dir=args.model)
    except StageConfigError as exc:
        _print_errors(exc)
        n = len(exc.problems)
        print(f"{exc.path}: {n} problem{'s' if n > 1 else ''}", file=sys.stderr)
        return 2
    for sid in cfg.stage_ids:
        print(f"stage {sid}: prefix cache = {cfg.prefix_cache_backend(sid) or 'off'}")
    for note in cfg.notes:
        print(f"note: {note}")
    print(f"{cfg.path}: OK")
    return 0


def _print_errors(exc: Exception) -> None:
    """``error: <problem>`` on stderr, one line per problem of a
    :class:`~omni_cache.driver.stage_config.StageConfigError` (else one line)."""
    for problem in getattr(exc, "problems", None) or [exc]:
        print(f"error: {problem}", file=sys.stderr)


def _default_model(cfg) -> Path:
    """The embedded tiny model a stage config's pipeline runs (built on first use): the
    Gemma-4 / Gemma-3n thinker's pipeline directory for the YOCO pipelines, else Qwen3-Omni."""
    from omni_cache.engine.plugin import GEMMA4_PIPELINE, GEMMA_PIPELINE

    family = {GEMMA4_PIPELINE: "gemma4", GEMMA_PIPELINE: "gemma3n"}.get(cfg.raw.get("pipeline"))
    if family:
        from omni_cache.models.gemma import build_gemma_omni, default_gemma_dir

        return build_gemma_omni(default_gemma_dir("tiny", family=family), "tiny", family=family)
    from omni_cache.models import build_qwen3_omni, default_model_dir

    return build_qwen3_omni(default_model_dir("tiny"), "tiny")


def _cmd_run(args: argparse.Namespace) -> int:
    from omni_cache.driver.inputs import InputError, build_request, sample_path
    from omni_cache.driver.stage_config import StageConfigError, load_stage_config

    image = args.image if args.image is not None else (None if args.no_image else sample_path("astronaut.jpg"))
    audio = args.audio if args.audio is not None else (None if args.no_audio else sample_path("speech.wav"))
    try:
        cfg = load_stage_config(stage_config_path(args.stage_config))
        model = Path(args.model) if args.model else _default_model(cfg)
        cfg = load_stage_config(cfg.path, model_dir=model)
        requests = [build_request(args.text, image=image, audio=audio, system=args.system, family=cfg.thinker_family)
                    for _ in range(args.repeat)]
    except (StageConfigError, InputError) as exc:
        _print_errors(exc)
        return 2

    from omni_cache.driver.streaming import StreamingPipeline
    from omni_cache.models import ModelKind, model_kind

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = model_kind(model)
    _print_model_notice(model)
    print(f"starting the pipeline ({cfg.path.name}, model {model}) — about 2-3 min on CPU ...", flush=True)
    summary = []
    with StreamingPipeline(model, cfg.path) as pipe:
        print(f"pipeline started in {pipe.start_s:.1f} s", flush=True)
        for i, req in enumerate(requests):
            wav = out_dir / f"request{i}.wav"
            with _PacketWriter(wav) as writer:
                res = pipe.run(req, on_audio=writer.write)
            stages = ", ".join(f"{k.removesuffix('_ms')} {v:.0f} ms" for k, v in sorted(res.stage_durations.items()))
            ms = lambda t: "-" if t is None else f"{1000 * t:.0f} ms"  # noqa: E731
            print(f"[request {i}] TTFT {ms(res.ttft_s)}, first audio packet (TTFP) {ms(res.ttfp_s)}, "
                  f"{res.wall_s:.2f} s wall; thinker prompt {res.num_prompt_tokens} tokens, "
                  f"prefix hit {res.num_cached_tokens} tokens; talker prompt {res.talker_num_prompt_tokens} "
                  f"tokens, prefix hit {res.talker_num_cached_tokens}" + (f"; stages: {stages}" if stages else ""))
            print(f"  text: {res.text!r}")
            audio = ("none" if res.audio is None else
                     f"{res.audio.shape[0]} samples @ {res.sample_rate} Hz in {res.audio_packets} packets -> {wav}")
            print(f"  audio: {audio}")
            if res.error:
                print(f"  error: {res.error}")
            summary.append({
                "request_id": res.request_id, "text": res.text, "wall_s": res.wall_s,
                "ttft_s": res.ttft_s, "ttfp_s": res.ttfp_s, "audio_packets": res.audio_packets,
                "num_prompt_tokens": res.num_prompt_tokens, "num_cached_tokens": res.num_cached_tokens,
                "talker_num_prompt_tokens": res.talker_num_prompt_tokens,
                "talker_num_cached_tokens": res.talker_num_cached_tokens,
                "audio_samples": 0 if res.audio is None else int(res.audio.shape[0]),
                "audio_s": 0.0 if res.audio is None else res.audio.shape[0] / res.sample_rate,
                "stage_durations": res.stage_durations, "wav": str(wav) if res.audio is not None else None,
                "error": res.error,
            })
            # after every request, so a run stopped early keeps what it has done
            (out_dir / "summary.json").write_text(json.dumps(
                {"model": {"path": str(model), "kind": kind.value}, "start_s": pipe.start_s,
                 "requests": summary}, indent=2))
    print(f"wrote {out_dir}/summary.json")
    if kind is ModelKind.EMBEDDED:
        print("(embedded model: its text is not language and its audio near-silent noise by design; "
              "see the note above)")
    return 0


class _PacketWriter:
    """A WAV file written packet by packet as audio arrives (``soundfile``); opened at the first
    packet, so a request without audio leaves no file."""

    def __init__(self, path: Path):
        self.path, self._f = path, None

    def write(self, packet, sample_rate: int) -> None:
        import soundfile as sf

        if self._f is None:
            self._f = sf.SoundFile(self.path, "w", samplerate=sample_rate, channels=1, subtype="FLOAT")
        self._f.write(packet)
        self._f.flush()

    def __enter__(self) -> _PacketWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._f is not None:
            self._f.close()


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal

    from omni_cache.driver.server import OmniServer, ServeError
    from omni_cache.driver.stage_config import StageConfigError
    from omni_cache.models import build_qwen3_omni, default_model_dir

    model = args.model or str(default_model_dir("tiny"))
    if not args.model:
        build_qwen3_omni(model, "tiny")
    _print_model_notice(model)
    extra = list(args.vllm_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        server = OmniServer(model, stage_config_path(args.stage_config), host=args.host, port=args.port,
                            log_path=args.log, extra_args=extra)
    except StageConfigError as exc:
        _print_errors(exc)
        return 2
    print("server command: " + " ".join(server.command()), flush=True)
    print(f"server log (appended): {server.log_path.resolve()}", flush=True)
    # SIGTERM to us stops the server too (Ctrl-C arrives as KeyboardInterrupt).
    def _interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    server.start()
    try:
        print(f"starting vLLM-Omni's server ({server.stage_config.path.name}, model {model}) "
              "- about 2-3 min on CPU ...", flush=True)
        ready = server.wait_ready(timeout=args.ready_timeout, progress=lambda s: print(s, flush=True))
        print(f"ready in {ready:.0f} s: {server.url}", flush=True)
        print(f"  OpenAI base_url: {server.base_url}   model: {server.model_name()}", flush=True)
        print(f"  metrics: {server.url}/metrics   health: {server.url}/health", flush=True)
        if server.realtime_url:
            if not args.no_warmup:
                w = server.warm_up_realtime()
                print(f"  realtime warm-up turn: first audio after {w['first_audio_s']:.1f} s "
                      f"({w['wall_s']:.1f} s in all)", flush=True)
            print(f"  realtime (OpenAI Realtime protocol, voice sessions): {server.realtime_url}", flush=True)
        print("  stop with Ctrl-C", flush=True)
        rc = server.proc.wait()
        print(f"server exited with code {rc}; log {server.log_path}", file=sys.stderr)
        return 1
    except ServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping the server ...", flush=True)
        return 0
    finally:
        server.stop()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="omni-cache", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    mm = sub.add_parser("make-model", help="build the embedded Qwen3-Omni model directory (no downloads)")
    mm.add_argument("--size", default="tiny", choices=["tiny", "bench", "bench-voice", "full"],
                    help="tiny (tests), bench (benchmarks), bench-voice (qwen3-omni only: the bench "
                         "thinker with a talker proportioned like Qwen3-Omni's), full (no weights: load it with "
                         "load_format: dummy; qwen3-omni: Qwen3-Omni-30B-A3B-Instruct's published config, "
                         "stage_configs/qwen3_omni_30b_a3b_*_dummy.yaml; gemma4: Gemma-4-E4B's text shape "
                         "as the thinker, stage_configs/gemma4_e4b_yoco_h200_dummy.yaml)")
    mm.add_argument("--family", default="qwen3-omni", choices=["qwen3-omni", "gemma4", "gemma3n"],
                    help="qwen3-omni (default); gemma4: a multimodal KV-shared (YOCO) thinker with vision and "
                         "audio towers in thinker/ feeding the Qwen3-Omni talker "
                         "(stage_configs/gemma4_yoco_cpu.yaml); gemma3n: a KV-shared text thinker "
                         "(stage_configs/gemma3n_yoco_cpu.yaml)")
    mm.add_argument("--out", help=f"target directory (default: ${settings.HOME.name}/models/<family>-omni-<size>; "
                                  "qwen3-omni: qwen3-omni-<size>)")
    mm.add_argument("--thinker-layers", type=int, default=None,
                    help="--size full (qwen3-omni) only: the same widths with this many thinker layers (2..48; the "
                         "talker's accept_hidden_layer becomes half of it): the profiling shape for one 80 GB card; "
                         "default directory qwen3-omni-full-l<N>")
    mm.add_argument("--force", action="store_true", help="rebuild even if up to date")
    mm.set_defaults(func=_cmd_make_model)

    va = sub.add_parser("validate", help="validate a stage config without starting engines")
    va.add_argument("stage_config", nargs="?", default=DEFAULT_STAGE_CONFIG)
    va.add_argument("--model", help="also check this model directory")
    va.set_defaults(func=_cmd_validate)

    from omni_cache.driver.inputs import DEFAULT_SYSTEM_PROMPT, DEFAULT_TEXT

    run = sub.add_parser("run", help="start the pipeline and answer a text+image+audio request")
    run.add_argument("--stage-config", default=DEFAULT_STAGE_CONFIG, help="deploy YAML (path or bundled name)")
    run.add_argument("--model", help="model directory (default: the embedded tiny model the stage config's pipeline "
                                     "runs — Qwen3-Omni, or the Gemma-4 / Gemma-3n YOCO pipeline directory — built on "
                                     "first use)")
    run.add_argument("--text", default=DEFAULT_TEXT)
    run.add_argument("--system", default=DEFAULT_SYSTEM_PROMPT)
    run.add_argument("--image", help="image file (default: bundled astronaut.jpg)")
    run.add_argument("--audio", help="audio file (default: bundled speech.wav)")
    run.add_argument("--no-image", action="store_true")
    run.add_argument("--no-audio", action="store_true")
    run.add_argument("--repeat", type=int, default=2, help="send the request N times (the 2nd+ hit the prefix cache)")
    run.add_argument("--out", default="out", help="output directory for .wav files and summary.json")
    run.set_defaults(func=_cmd_run)

    sv = sub.add_parser("serve", help="serve the model with vLLM-Omni's OpenAI-compatible server (omni-cache on)",
                        description="Start vLLM-Omni's OpenAI-compatible server (vllm-omni serve --omni) with "
                                    "omni-cache's pipeline variants registered, wait until /health answers, "
                                    "print the URL, and run until Ctrl-C. Arguments after '--' go to vllm serve.")
    sv.add_argument("--stage-config", default=DEFAULT_STAGE_CONFIG, help="deploy YAML (path or bundled name)")
    sv.add_argument("--model", help="model directory or id (default: the embedded tiny model, built on first use)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    sv.add_argument("--port", type=int, default=8091, help="TCP port (0: a free one)")
    sv.add_argument("--log", default="out/serve.log", help="server log file")
    sv.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    sv.add_argument("--no-warmup", action="store_true",
                    help="duplex stage configs: skip the throwaway realtime turn run before the URL is printed")
    sv.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- followed by more `vllm serve` arguments")
    sv.set_defaults(func=_cmd_serve)

    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one command. SIGTERM and Ctrl-C end it like an error would: pipelines and servers
    are closed, and no process it started is left behind
    (:func:`omni_cache.driver.process_tree.stop_descendants_on_exit`); the exit code is
    143 / 130."""
    from omni_cache.driver.process_tree import stop_descendants_on_exit

    logging.basicConfig(level=settings.LOG_LEVEL.get())
    args = build_parser().parse_args(argv)
    with stop_descendants_on_exit():
        try:
            return int(args.func(args) or 0)
        except KeyboardInterrupt:
            print("interrupted; stopping ...", file=sys.stderr, flush=True)
            return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
