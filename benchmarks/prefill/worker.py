"""One benchmark variant's pipeline in its own process (driven by :mod:`benchmarks.prefill.harness`).

Protocol: JSON commands on stdin, one per line; every answer is one stdout line
``@@RESULT {...}``; all other stdout/stderr lines are engine logs.

- ``{"op": "run", "specs": [spec, ...]}`` sends the requests one at a time (a spec is a
  :func:`benchmarks.prefill.workloads.RequestSpec` dict) and answers ``{"results": [...]}``.
- ``{"op": "run_concurrent", "specs": [...], "concurrency": c}`` sends them with ``c`` in
  flight (:meth:`VariantWorker.run_concurrent`) and answers ``{"results": [...], "wall_s",
  "throughput_rps", ...}``; streaming only.
- ``{"op": "mem"}`` answers ``{"mem": [...], "gpu": {...}}`` (:func:`process_tree_memory`,
  :func:`gpu_memory`); ``{"op": "quit"}`` stops the pipeline.

Per request (:class:`_Request`): the driver-clock times, hit ratio, tokens and audio counts; with
``run`` (one request alone) also vLLM's stage breakdown from the change of its histogram sums
(None under load, ``stage_breakdown`` says why). The fields:
:data:`benchmarks.prefill.harness.METRIC_DEFINITIONS` and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import os
import sys
import time
from typing import Any

import psutil

from benchmarks import lab
from benchmarks.prefill.workloads import audio_copy, image_copy
from omni_cache.driver.inputs import OmniRequest, Turn, build_request, load_audio, load_image

RESULT_PREFIX = "@@RESULT "
STAGES = ("0", "1", "2")  # thinker, talker, code2wav (stage label of vLLM's metrics)


def process_tree_memory(pid: int | None = None) -> list[dict[str, Any]]:
    """Memory of process ``pid`` (default: this one) and its descendants: per process ``pid``,
    ``name``, ``cmd``, ``rss`` / ``pss`` / ``uss`` in bytes (PSS splits shared pages, so it sums to
    what the tree uses) and ``cpu_s`` (user + system seconds so far)."""
    out = []
    for p in lab.process_tree(pid or os.getpid()):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            mi, ct = p.memory_full_info(), p.cpu_times()
            out.append({"pid": p.pid, "name": p.name(), "cmd": " ".join(p.cmdline())[:120], "rss": int(mi.rss),
                        "pss": int(getattr(mi, "pss", 0)), "uss": int(mi.uss), "cpu_s": float(ct.user + ct.system)})
    return out


def gpu_memory(pids: list[int]) -> dict[str, Any]:
    """GPU memory (bytes) of the processes ``pids`` (a variant's process tree), as NVML reports
    each process's use per device (CUDA context, allocator reserve, KV cache, device pools):
    ``{"gpu_bytes": total, "per_process": {pid: bytes}, "per_device": {index: bytes}, "reason":
    None}``, or ``{"gpu_bytes": None, "reason": why}`` without NVML, a GPU or a listed process (a
    process NVML cannot attribute, e.g. in another PID namespace, is left out)."""
    want, per, dev = set(pids), {}, {}
    try:
        with lab.nvml() as nv:
            for i in range(nv.nvmlDeviceGetCount()):
                for p in nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(i)):
                    if p.pid in want and p.usedGpuMemory is not None:
                        per[p.pid] = per.get(p.pid, 0) + int(p.usedGpuMemory)
                        dev[i] = dev.get(i, 0) + int(p.usedGpuMemory)
    except lab.NvmlMissing as exc:
        return {"gpu_bytes": None, "reason": str(exc)}
    if not per:
        return {"gpu_bytes": None, "per_process": {}, "reason": "NVML lists no process of this variant"}
    return {"gpu_bytes": sum(per.values()), "per_process": per, "per_device": dev, "reason": None}


def _hist_sums(stage: str = "0") -> dict[str, float]:
    """``{family: sum}`` of vLLM's per-request histograms for ``stage`` in this process."""
    from prometheus_client import REGISTRY

    want = {"vllm:request_prefill_time_seconds", "vllm:request_prefill_kv_computed_tokens",
            "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"}
    out: dict[str, float] = {}
    for fam in (f for f in REGISTRY.collect() if f.name in want):
        for s in fam.samples:
            if s.labels.get("stage") == stage and s.name.endswith(("_sum", "_count")):
                key = fam.name + (":count" if s.name.endswith("_count") else "")
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


class VariantWorker:
    """The driver's pipeline of one variant (:func:`benchmarks.lab.start`: ``streaming``, or
    ``pipeline`` with ``stream=False``; vLLM's stats on for the per-request histograms) plus the
    per-request measurement described in the module doc."""

    def __init__(self, model: str, stage_config: str, *, stream: bool = True):
        from omni_cache.driver.engine_hooks import hooks_wanted

        self._stack = contextlib.ExitStack()
        self.pipe = self._stack.enter_context(lab.start("streaming" if stream else "pipeline", model, stage_config,
                                                        engine_args={"log_stats": True}))
        self.stream = stream
        self.family = self.pipe.stage_config.thinker_family  # the prompt's media placeholders
        # the talker's hit is reported only where its content identity is installed (talker cache on)
        self.hooks = self.pipe.hooks if hooks_wanted(self.pipe.stage_config) else None
        self.start_s, self.model, self._seq = self.pipe.start_s, model, 0
        self.sessions: dict[str, list[int]] = {}  # chat session → prompt + answer ids so far
        self._media: dict = {}  # decoded media copies, reused across requests

    @property
    def omni(self):
        """vLLM-Omni's engine in the pipeline (``AsyncOmni`` or ``Omni``)."""
        return self.pipe.omni

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model)

    def engine_prompt(self, spec: dict) -> dict:
        """A request spec's engine prompt (a later chat turn: token ids, the previous turn's
        prompt and answer exactly)."""
        chat = spec.get("chat")
        if chat and chat["turn"] > 0:
            tail = self.tokenizer.encode(f"\n<|im_start|>user\n{spec['text']}<|im_end|>\n<|im_start|>assistant\n")
            return {"prompt_token_ids": self.sessions[chat["session"]] + [self._im_end()] + tail}
        k = int(spec.get("media_copies") or 1)
        if k > 1 and (spec.get("image") or spec.get("audio")):
            return self._media_copies_prompt(spec, k)
        req = build_request(spec["text"], image=spec.get("image"), audio=spec.get("audio"),
                            system=spec["system"], family=self.family)
        return req.to_engine_prompt()

    def _media_copies_prompt(self, spec: dict, k: int) -> dict:
        """System turn, then ``k`` user turns each carrying one copy of the media
        (:func:`benchmarks.prefill.workloads.image_copy` / ``audio_copy``), then the question."""
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

        params = [p.clone() if hasattr(p, "clone") else copy.deepcopy(p)
                  for p in self.omni.default_sampling_params_list]
        if spec.get("max_tokens"):
            params[0].max_tokens = int(spec["max_tokens"])
        params[0].output_kind = RequestOutputKind.DELTA
        return params

    def run_one(self, spec: dict) -> dict:
        """One request sent alone: the driver-clock times plus vLLM's per-request stage breakdown
        (changes of its histogram sums across the request: valid as nothing else runs)."""
        before = {st: _hist_sums(st) for st in STAGES}
        if self.stream:
            return self.pipe.run_async(self.request(spec, alone=True, before=before))[0]
        req = _Request(self, spec)
        for o in self.omni.generate([req.prompt], req.params, py_generator=True, use_tqdm=False):
            req.handle(o, time.perf_counter())
        return req.row(time.perf_counter(), _hist_delta(before), talker=(None, None))

    async def request(self, spec: dict, *, alone: bool, before: dict | None = None) -> tuple[dict, dict | None]:
        """``(row, delta)`` of one request through ``AsyncOmni``; ``alone`` (nothing else runs):
        the change of vLLM's histogram sums since ``before`` is this request's, else None."""
        req = _Request(self, spec)
        async for o in self.omni.generate(req.prompt, request_id=req.rid, sampling_params_list=req.params):
            req.handle(o, time.perf_counter())
        end, delta = time.perf_counter(), _hist_delta(before) if alone and before is not None else None
        talker = self.hooks.talker_hit(req.rid) if self.hooks is not None else (None, None)
        return req.row(end, delta, talker=talker), delta

    def run_concurrent(self, specs: list[dict], concurrency: int) -> dict:
        """A closed loop of ``concurrency`` senders (as ``vllm bench serve --max-concurrency``), each
        sending the next chain of :func:`request_chains` as soon as its last finished; streaming
        only. Answers ``{"results", "wall_s" (first sent → last output), "throughput_rps"
        (requests without error / wall_s), "n_requests", "n_errors", "concurrency"}``."""
        if not self.stream:
            raise ValueError("run_concurrent needs the streaming engine (AsyncOmni); --no-stream is one at a time")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        chains = request_chains(specs)

        async def batch():
            todo, results = list(reversed(chains)), []

            async def sender():
                while todo:
                    for spec in todo.pop():
                        try:
                            row, _ = await self.request(spec, alone=False)
                        except Exception as exc:  # one bad request must not stop the batch
                            row = _error_row(spec, exc)
                        row["concurrency"] = concurrency
                        results.append(row)

            t0 = time.perf_counter()
            await asyncio.gather(*(sender() for _ in range(min(concurrency, len(chains)) or 1)))
            return results, time.perf_counter() - t0

        results, wall = self.pipe.run_async(batch())
        ok = sum(1 for r in results if not r.get("error"))
        return {"results": results, "wall_s": wall, "throughput_rps": ok / wall if wall > 0 else None,
                "n_requests": len(results), "n_errors": len(results) - ok, "concurrency": concurrency}

    def _im_end(self) -> int:
        return self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def close(self) -> None:
        self._stack.close()


#: why the vLLM histogram-derived fields are None under load
UNDER_LOAD = "unavailable under concurrency: vLLM's histogram sums are per engine, not per request"


def _hist_delta(before: dict) -> dict:
    """Change of every stage's histogram sums/counts since ``before`` (:func:`_hist_sums`)."""
    return {sid: {k: v - before[sid].get(k, 0.0) for k, v in _hist_sums(sid).items()} for sid in STAGES}


def request_chains(specs: list[dict]) -> list[list[dict]]:
    """Request specs in chains that run in order: one per chat session (turns sorted), every other
    spec a chain of its own; chains in the order of their first spec."""
    chains: dict = {}
    for k, spec in enumerate(specs):
        chains.setdefault(spec["chat"]["session"] if spec.get("chat") else k, []).append(spec)
    return [sorted(ch, key=lambda s: s["chat"]["turn"]) if ch[0].get("chat") else ch for ch in chains.values()]


def _error_row(spec: dict, exc: BaseException) -> dict:
    return {"workload": spec.get("workload"), "index": spec.get("index"), "round": spec.get("round"),
            "measure": spec.get("measure", True), "error": f"{type(exc).__name__}: {exc}"}


class _Request:
    """One request's prompt, sampling parameters and the outputs seen so far (driver clock)."""

    def __init__(self, w: VariantWorker, spec: dict):
        w._seq += 1
        self.w, self.spec, self.rid = w, spec, f"bench-{w._seq}"
        self.prompt, self.params, self.t0 = w.engine_prompt(spec), w.sampling_params(spec), time.perf_counter()
        self.t_wall = time.time()  # host clock, to match the stage logs' lines (benchmarks.prefill.jit)
        self.ttft = self.ttfp = None  # perf_counter() at the first text token / audio packet
        self.t_last_text = None  # perf_counter() at the thinker's last output with new tokens
        self.prompt_ids, self.gen_ids, self.errors, self.text = [], [], [], ""
        self.cached = self.audio_samples = self.packets = 0
        self.durations, self.stage_metrics = {}, {}

    def handle(self, o, now: float) -> None:
        if getattr(o, "error", None):
            self.errors.append(str(o.error))
        self.durations.update(o.stage_durations or {})
        if isinstance(o.metrics, dict) and o.metrics.get("stage_metrics"):
            self.stage_metrics.update(o.metrics["stage_metrics"])
        if o.stage_id == 0:
            self.prompt_ids = list(o.prompt_token_ids or []) or self.prompt_ids
            self.cached = max(self.cached, int(o.num_cached_tokens or 0))
            for c in o.outputs or []:
                new = list(c.token_ids or [])
                if new and self.ttft is None:
                    self.ttft = now
                if new:
                    self.t_last_text = now
                self.gen_ids += new  # DELTA outputs carry only new tokens
                self.text += c.text or ""
        if o.final_output_type == "audio":
            n = _num_audio_samples(o)
            if n and self.ttfp is None:
                self.ttfp = now
            self.audio_samples += n
            self.packets += 1 if n else 0

    def row(self, end: float, delta: dict | None, *, talker: tuple) -> dict:
        """The request's result row; ``delta``: the histogram changes across the request when
        it ran alone, None under load (those fields are then None, ``stage_breakdown`` says why)."""
        spec, w = self.spec, self.w
        prompt_ids, gen_ids = self.prompt_ids, self.gen_ids
        if spec.get("chat"):
            w.sessions[spec["chat"]["session"]] = prompt_ids + [t for t in gen_ids if t != w._im_end()]
        talker_hit, talker_prompt = talker if w.stream else (None, None)
        s0 = self.stage_metrics.get("0", {})
        ms = lambda t: 1000.0 * (t - self.t0) if t is not None else None  # noqa: E731
        out = {"workload": spec["workload"], "round": spec.get("round"), "index": spec["index"],
               "measure": spec.get("measure", True), "streaming": w.stream, "request_id": self.rid,
               "started_unix": self.t_wall, "num_prompt_tokens": len(prompt_ids), "num_cached_tokens": self.cached,
               "hit_ratio": self.cached / len(prompt_ids) if prompt_ids else 0.0, "computed_tokens": None,
               "num_output_tokens": len(gen_ids), "prefill_ms": None, "prefill_source": UNDER_LOAD,
               "ttft_ms": ms(self.ttft), "thinker_last_ms": ms(self.t_last_text),
               "vllm_ttft_ms": s0.get("vllm_ttft_ms"), "ttfp_ms": ms(self.ttfp),
               "talker_prefill_ms": None, "talker_decode_ms": None, "code2wav_ms": None, "e2e_ms": ms(end),
               # talker prefix-hit tokens (None: talker cache off or not streaming)
               "talker_hit_tokens": talker_hit, "talker_prompt_tokens": talker_prompt,
               "stage_0_gen_ms": self.durations.get("stage_0_gen_ms"),
               "stage_ms": {k: v for k, v in self.durations.items() if isinstance(v, (int, float))},
               "audio_samples": self.audio_samples, "audio_packets": self.packets, "text": self.text[:80],
               "error": "; ".join(self.errors) or None}
        if chat := spec.get("chat"):
            out["session"], out["turn"] = chat["session"], chat["turn"]
        if delta is None:
            return {**out, "stage_breakdown": UNDER_LOAD}
        n_fin = delta["0"].get("vllm:request_prefill_time_seconds:count", 0.0)

        def per_request_ms(sid: str, family: str) -> float | None:
            d = delta[sid]
            return 1000.0 * d[family] if d.get(family + ":count", 0.0) == 1 and family in d else None

        out.update(computed_tokens=delta["0"].get("vllm:request_prefill_kv_computed_tokens"),
                   prefill_ms=1000.0 * delta["0"]["vllm:request_prefill_time_seconds"] if n_fin == 1 else None,
                   prefill_source="vllm:request_prefill_time_seconds (stage 0)" if n_fin == 1 else
                   f"unavailable ({n_fin:.0f} finished thinker requests observed)",
                   talker_prefill_ms=per_request_ms("1", "vllm:request_prefill_time_seconds"),
                   talker_decode_ms=per_request_ms("1", "vllm:request_decode_time_seconds"),
                   code2wav_ms=per_request_ms("2", "vllm:request_inference_time_seconds"))
        return out


def _num_audio_samples(o) -> int:
    """Audio samples in an output: its ``audio`` (else ``model_outputs``), a tensor / array or a list of them."""
    mm = getattr(o, "multimodal_output", None) or {}
    audio = mm.get("audio") if mm.get("audio") is not None else mm.get("model_outputs")
    parts = audio if isinstance(audio, (list, tuple)) else [audio]
    return sum(int(a.numel()) if hasattr(a, "numel") else int(getattr(a, "size", 0)) for a in parts if a is not None)


def _reply(obj: dict) -> None:
    print(RESULT_PREFIX + json.dumps(obj), flush=True)


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
            op, todo = cmd.get("op"), cmd.get("specs") or []
            if op == "quit":
                break
            if op == "mem":
                m = process_tree_memory()
                _reply({"mem": m, "gpu": gpu_memory([r["pid"] for r in m])})
            elif op == "run_concurrent":
                try:
                    _reply(w.run_concurrent(todo, int(cmd["concurrency"])))
                except Exception as exc:  # noqa: BLE001 - answered, the driver records it
                    _reply({"results": [_error_row(s, exc) for s in todo], "wall_s": None, "throughput_rps": None,
                            "n_requests": len(todo), "n_errors": len(todo), "concurrency": cmd.get("concurrency")})
            elif op == "run":
                out = []
                for spec in todo:
                    try:
                        out.append(w.run_one(spec))
                    except Exception as exc:  # one bad request must not stop the variant
                        out.append(_error_row(spec, exc))
                _reply({"results": out})
            else:
                _reply({"error": f"unknown op {op!r}"})
    finally:
        w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
