"""One benchmark variant's pipeline in its own process (driven by :mod:`benchmarks.prefill.harness`).

Protocol: JSON commands on stdin, one per line; every answer is one stdout line
``@@RESULT {...}``; all other stdout/stderr lines are engine logs.

- ``{"op": "run", "specs": [spec, ...]}`` sends the requests one at a time (a spec is a
  :func:`benchmarks.prefill.workloads.RequestSpec` dict) and answers ``{"results": [...]}``.
- ``{"op": "mem"}`` answers ``{"mem": [...]}``: memory of this process and all its
  children (the stage processes), see :func:`process_tree_memory`.
- ``{"op": "quit"}`` stops the pipeline.

What is measured per request (times in ms, all from one request sent alone):

- ``prefill_ms``: vLLM's own per-request prefill time of the thinker: first-token time minus
  scheduled time, both stamped by the thinker's engine core (vLLM's
  ``vllm:request_prefill_time_seconds`` histogram of stage 0; the per-request value is the
  change of its sum across the request). Needs ``log_stats=True``.
- ``computed_tokens``: thinker prompt tokens computed (``vllm:request_prefill_kv_computed_tokens``).
- ``ttft_ms``: driver clock, ``generate`` called → first thinker output carrying a text
  token arrives in this process (thinker streamed with ``output_kind=DELTA``).
- ``vllm_ttft_ms``: vLLM-Omni's ``vllm_ttft_ms`` of stage 0 (arrival at the thinker → first token,
  orchestrator clock).
- ``ttfp_ms``: driver clock, ``generate`` called → first code2wav output carrying audio samples.
  Streaming (default; ``AsyncOmni``, the engine vLLM-Omni's server uses, with the stage
  config's ``async_chunk: true``): the first audio packet. ``--no-stream`` (synchronous
  ``Omni``, ``async_chunk: false``): code2wav emits the whole waveform in one output, so this
  is the time to the complete waveform.
- TTFP's parts, from vLLM's per-request histograms of each stage (engine-core clocks; the
  change of each sum across the request, None unless exactly one request of that stage
  finished): ``talker_prefill_ms`` (stage 1 ``vllm:request_prefill_time_seconds``),
  ``talker_decode_ms`` (stage 1 ``vllm:request_decode_time_seconds``: the codec frames after
  the first; with the benchmark's talker ``max_tokens`` = the first streamed chunk, this is the
  rest of the first codec chunk), ``code2wav_ms`` (stage 2 ``vllm:request_inference_time_seconds``:
  scheduled → finished). What TTFP holds beyond ``ttft_ms`` + these is hand-off and
  orchestration time (``handoff_ms``, derived in the summary). (vLLM's queue time of stages 1
  and 2 is no part: with ``async_chunk`` a downstream request is queued when the thinker
  starts and waits there for its first chunk, so it overlaps the thinker's prefill.)
- ``e2e_ms``: driver clock, ``generate`` called → last output of the request.
- ``stage_0_gen_ms``: vLLM-Omni's stage-0 time (submitted to the thinker → thinker finished),
  kept for comparison with earlier runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

RESULT_PREFIX = "@@RESULT "
STAGES = ("0", "1", "2")  # thinker, talker, code2wav (stage label of vLLM's metrics)


def process_tree_memory(pid: int | None = None) -> list[dict[str, Any]]:
    """Memory of process ``pid`` (default: this one) and all its descendants.

    Returns one dict per process: ``pid``, ``name`` (short command line), ``rss``, ``pss``,
    ``uss`` in bytes (Linux ``/proc/<pid>/smaps_rollup`` via psutil; PSS splits shared pages
    between the processes that map them, so the PSS column sums to what the tree really uses)
    and ``cpu_s``, the CPU seconds it has used so far (user + system).
    """
    import psutil

    root = psutil.Process(pid or os.getpid())
    out = []
    for p in [root] + root.children(recursive=True):
        try:
            mi = p.memory_full_info()
            ct = p.cpu_times()
            cmd = " ".join(p.cmdline())[:120]
            out.append({"pid": p.pid, "name": p.name(), "cmd": cmd,
                        "rss": int(mi.rss), "pss": int(getattr(mi, "pss", 0)), "uss": int(mi.uss),
                        "cpu_s": float(ct.user + ct.system)})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _hist_sums(stage: str = "0") -> dict[str, float]:
    """``{family: sum}`` of vLLM's per-request histograms for ``stage`` in this process."""
    from prometheus_client import REGISTRY

    want = {"vllm:request_prefill_time_seconds", "vllm:request_prefill_kv_computed_tokens",
            "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"}
    out: dict[str, float] = {}
    for fam in REGISTRY.collect():
        if fam.name not in want:
            continue
        for s in fam.samples:
            if s.name.endswith("_sum") and s.labels.get("stage") == stage:
                out[fam.name] = out.get(fam.name, 0.0) + float(s.value)
            if s.name.endswith("_count") and s.labels.get("stage") == stage:
                out[fam.name + ":count"] = out.get(fam.name + ":count", 0.0) + float(s.value)
    return out


class VariantWorker:
    """A started pipeline plus the per-request measurement described in the module doc."""

    def __init__(self, model: str, stage_config: str, *, stream: bool = True):
        from omni_cache.driver.engine_hooks import hooks_wanted, install_engine_hooks, prepare_environment
        from omni_cache.driver.stage_config import load_stage_config
        from omni_cache.engine.plugin import register

        cfg = load_stage_config(stage_config, model_dir=model)
        register()  # omni-cache's pipeline variants, resolved in this (driver) process
        if hooks_wanted(cfg):
            prepare_environment()  # the talker keys' signing secret, inherited by the stages
        self.stream = stream
        self.family = cfg.thinker_family  # the prompt's media placeholders
        self._loop = None
        t0 = time.perf_counter()
        if stream:
            # AsyncOmni: the only vLLM-Omni engine that hands the driver each audio packet
            # as it leaves code2wav (see omni_cache.driver.streaming)
            import asyncio

            self._loop = asyncio.new_event_loop()
            self.omni = self._loop.run_until_complete(self._start_async(model, str(cfg.path)))
        else:
            from vllm_omni import Omni

            self.omni = Omni(model=model, deploy_config=str(cfg.path), stage_init_timeout=900,
                             init_timeout=1200, log_stats=True)
        # what OmniPipeline / omni-cache serve install: without the talker's content identity
        # a talker with prefix caching on gets no keys and shares nothing
        self.hooks = install_engine_hooks(self.omni, cfg) if hooks_wanted(cfg) else None
        self.start_s = time.perf_counter() - t0
        self.model = model
        self._tok = None
        self._seq = 0
        self.sessions: dict[str, list[int]] = {}  # chat session → prompt + answer ids so far
        self._media: dict = {}  # decoded media copies, reused across requests

    @staticmethod
    async def _start_async(model: str, deploy_config: str):
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        return AsyncOmni(model=model, deploy_config=deploy_config, stage_init_timeout=900,
                         init_timeout=1200, log_stats=True)

    # ---- requests -------------------------------------------------------------------------

    def tokenizer(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model)
        return self._tok

    def engine_prompt(self, spec: dict) -> dict:
        """The engine prompt of a request spec (chat turns after the first are token ids that
        repeat the previous turn's prompt and answer exactly)."""
        from omni_cache.driver.inputs import build_request

        chat = spec.get("chat")
        if chat and chat["turn"] > 0:
            prev = self.sessions[chat["session"]]
            im_end = self.tokenizer().convert_tokens_to_ids("<|im_end|>")
            tail = self.tokenizer().encode(
                f"\n<|im_start|>user\n{spec['text']}<|im_end|>\n<|im_start|>assistant\n")
            return {"prompt_token_ids": prev + [im_end] + tail}
        k = int(spec.get("media_copies") or 1)
        if k > 1 and (spec.get("image") or spec.get("audio")):
            return self._media_copies_prompt(spec, k)
        req = build_request(spec["text"], image=spec.get("image"), audio=spec.get("audio"),
                            system=spec["system"], family=self.family)
        return req.to_engine_prompt()

    def _media_copies_prompt(self, spec: dict, k: int) -> dict:
        """System turn, then ``k`` user turns each carrying one copy of the media
        (:func:`benchmarks.prefill.workloads.image_copy` / ``audio_copy``), then the question."""
        from benchmarks.prefill.workloads import audio_copy, image_copy
        from omni_cache.driver.inputs import OmniRequest, Turn, load_audio, load_image

        key = (spec.get("image"), spec.get("audio"), k)
        if key not in self._media:
            img = load_image(spec["image"]) if spec.get("image") else None
            aud = load_audio(spec["audio"]) if spec.get("audio") else None
            self._media[key] = [Turn("user", f"Item {j + 1}.",
                                     image=image_copy(img, j) if img is not None else None,
                                     audio=(audio_copy(aud[0], j, k), aud[1]) if aud is not None else None)
                                for j in range(k)]
        turns = [Turn("system", spec["system"])] + self._media[key] + [Turn("user", spec["text"])]
        return OmniRequest(turns=turns, family=self.family).to_engine_prompt()

    def sampling_params(self, spec: dict) -> list:
        from vllm.sampling_params import RequestOutputKind

        params = [p.clone() if hasattr(p, "clone") else __import__("copy").deepcopy(p)
                  for p in self.omni.default_sampling_params_list]
        if spec.get("max_tokens"):
            params[0].max_tokens = int(spec["max_tokens"])
        params[0].output_kind = RequestOutputKind.DELTA
        return params

    def _each_output(self, prompt: dict, params: list, handle) -> None:
        """Send one request; call ``handle(output, perf_counter_time)`` for every output."""
        if not self.stream:
            for o in self.omni.generate([prompt], params, py_generator=True, use_tqdm=False):
                handle(o, time.perf_counter())
            return
        self._seq += 1

        async def drive():
            async for o in self.omni.generate(prompt, request_id=self._request_id(),
                                              sampling_params_list=params):
                handle(o, time.perf_counter())

        self._loop.run_until_complete(drive())

    def _request_id(self) -> str:
        return f"bench-{self._seq}"

    def run_one(self, spec: dict) -> dict:
        prompt = self.engine_prompt(spec)
        params = self.sampling_params(spec)
        before = {st: _hist_sums(st) for st in STAGES}
        t0 = time.perf_counter()
        st = {"ttft": None, "ttfp": None, "prompt_ids": [], "gen_ids": [], "cached": 0, "text": "",
              "audio_samples": 0, "packets": 0}
        durations: dict[str, float] = {}
        stage_metrics: dict = {}
        errors = []

        def handle(o, now: float) -> None:
            if getattr(o, "error", None):
                errors.append(str(o.error))
            durations.update(o.stage_durations or {})
            if isinstance(o.metrics, dict) and o.metrics.get("stage_metrics"):
                stage_metrics.update(o.metrics["stage_metrics"])
            if o.stage_id == 0:
                if o.prompt_token_ids:
                    st["prompt_ids"] = list(o.prompt_token_ids)
                st["cached"] = max(st["cached"], int(o.num_cached_tokens or 0))
                for c in o.outputs or []:
                    new = list(c.token_ids or [])
                    if new and st["ttft"] is None:
                        st["ttft"] = now
                    st["gen_ids"] += new  # DELTA outputs carry only new tokens
                    st["text"] += c.text or ""
            if o.final_output_type == "audio":
                n = _num_audio_samples(o)
                if n and st["ttfp"] is None:
                    st["ttfp"] = now
                st["audio_samples"] += n
                st["packets"] += 1 if n else 0

        self._each_output(prompt, params, handle)
        end = time.perf_counter()
        delta = {}
        for sid in STAGES:
            after = _hist_sums(sid)
            delta[sid] = {k: after.get(k, 0.0) - before[sid].get(k, 0.0) for k in after}
        prompt_ids, gen_ids = st["prompt_ids"], st["gen_ids"]
        if spec.get("chat"):
            self.sessions[spec["chat"]["session"]] = prompt_ids + [t for t in gen_ids if t != self._im_end()]
        talker_hit, talker_prompt = (self.hooks.talker_hit(self._request_id())
                                     if self.hooks is not None and self.stream else (None, None))
        s0 = stage_metrics.get("0", {})
        n_fin = delta["0"].get("vllm:request_prefill_time_seconds:count", 0.0)

        def per_request_ms(sid: str, family: str) -> float | None:
            d = delta[sid]
            return 1000.0 * d[family] if d.get(family + ":count", 0.0) == 1 and family in d else None

        ms = lambda t: 1000.0 * (t - t0) if t is not None else None  # noqa: E731
        return {
            "workload": spec["workload"], "round": spec.get("round"), "index": spec["index"],
            "measure": spec.get("measure", True),
            "streaming": self.stream,
            "num_prompt_tokens": len(prompt_ids),
            "num_cached_tokens": st["cached"],
            "hit_ratio": st["cached"] / len(prompt_ids) if prompt_ids else 0.0,
            "computed_tokens": delta["0"].get("vllm:request_prefill_kv_computed_tokens"),
            "num_output_tokens": len(gen_ids),
            "prefill_ms": 1000.0 * delta["0"]["vllm:request_prefill_time_seconds"] if n_fin == 1 else None,
            "prefill_source": "vllm:request_prefill_time_seconds (stage 0)" if n_fin == 1 else
                              f"unavailable ({n_fin:.0f} finished thinker requests observed)",
            "ttft_ms": ms(st["ttft"]),
            "vllm_ttft_ms": s0.get("vllm_ttft_ms"),
            "ttfp_ms": ms(st["ttfp"]),
            "talker_prefill_ms": per_request_ms("1", "vllm:request_prefill_time_seconds"),
            "talker_hit_tokens": talker_hit,        # talker prefix-hit tokens (None: talker cache off
            "talker_prompt_tokens": talker_prompt,  # or not streaming)
            "talker_decode_ms": per_request_ms("1", "vllm:request_decode_time_seconds"),
            "code2wav_ms": per_request_ms("2", "vllm:request_inference_time_seconds"),
            "e2e_ms": ms(end),
            "stage_0_gen_ms": durations.get("stage_0_gen_ms"),
            "stage_ms": {k: v for k, v in durations.items() if isinstance(v, (int, float))},
            "audio_samples": st["audio_samples"],
            "audio_packets": st["packets"],
            "text": st["text"][:80],
            "error": "; ".join(errors) or None,
        }

    def _im_end(self) -> int:
        return self.tokenizer().convert_tokens_to_ids("<|im_end|>")

    def close(self) -> None:
        omni, self.omni = self.omni, None
        if omni is not None:
            if self.stream:
                omni.shutdown()
            else:
                omni.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()


def _num_audio_samples(o) -> int:
    mm = getattr(o, "multimodal_output", None) or {}
    audio = mm.get("audio")
    if audio is None:
        audio = mm.get("model_outputs")
    if audio is None:
        return 0
    if isinstance(audio, (list, tuple)):
        return sum(_numel(a) for a in audio if a is not None)
    return _numel(audio)


def _numel(a) -> int:
    if hasattr(a, "numel"):
        return int(a.numel())
    if hasattr(a, "size"):
        return int(a.size)
    return 0


def _reply(obj: dict) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one benchmark variant's pipeline (stdin/stdout JSON)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--stage-config", required=True)
    ap.add_argument("--no-stream", action="store_true",
                    help="synchronous Omni (for a stage config with async_chunk: false); default AsyncOmni")
    args = ap.parse_args(argv)
    w = VariantWorker(args.model, args.stage_config, stream=not args.no_stream)
    _reply({"ready": True, "start_s": w.start_s, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            if op == "mem":
                _reply({"mem": process_tree_memory()})
            elif op == "run":
                out = []
                for spec in cmd["specs"]:
                    try:
                        out.append(w.run_one(spec))
                    except Exception as exc:  # one bad request must not stop the variant
                        out.append({"workload": spec.get("workload"), "index": spec.get("index"),
                                    "round": spec.get("round"), "measure": spec.get("measure", True),
                                    "error": f"{type(exc).__name__}: {exc}"})
                _reply({"results": out})
            else:
                _reply({"error": f"unknown op {op!r}"})
    finally:
        w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
