"""``python -m benchmarks.prefill``: thinker prefill time per modality, cache off vs vLLM-Omni's
built-in cache vs omni-cache, on the real three-stage pipeline.

Each variant's pipeline runs in its own process (:mod:`benchmarks.prefill.worker`); the stage
configs differ only in the thinker's prefix cache (:mod:`omni_cache.driver.variants`). Options,
alternation and every number: docs/benchmarks.md, "How to run the prefill benchmark".
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from tqdm import tqdm

from benchmarks import lab
from benchmarks.prefill import jit as jit_log
from benchmarks.prefill import summary as S
from benchmarks.prefill.worker import RESULT_PREFIX
from benchmarks.prefill.workloads import WORKLOADS, WorkloadOptions, check_media, specs, warmup_specs
from omni_cache.driver.variants import VARIANTS, YOCO_VARIANTS, MemorySettings, variant_stage_config
from omni_cache.models.qwen3 import SIZES

GiB = 1 << 30
MiB = 1 << 20


class WorkerDied(RuntimeError):
    pass


class Variant:
    """A variant's worker process; ``call`` sends one JSON command and waits for its answer."""

    def __init__(self, name: str, model: str, cfg: Path, log: Path, *, env: dict[str, str], stream: bool = True):
        self.name, self.log_path, self.log, self.frozen = name, log, open(log, "a", buffering=1), False
        cmd = [sys.executable, "-m", "benchmarks.prefill.worker", "--model", model, "--stage-config", str(cfg)]
        self.proc = subprocess.Popen(cmd + ([] if stream else ["--no-stream"]), cwd=lab.REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                self._q.put(json.loads(line[len(RESULT_PREFIX):]))
            else:
                self.log.write(line)  # line-buffered: the log is current when the worker dies
        self._q.put(None)

    def read(self, timeout: float) -> dict:
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise WorkerDied(f"variant {self.name}: no answer in {timeout:.0f} s; see {self.log_path}") from None
        if msg is None:
            raise WorkerDied(f"variant {self.name}: worker exited (rc={self.proc.wait()}); see {self.log_path}")
        return msg

    def wait_ready(self) -> dict:
        return self.read(1800)

    def send(self, cmd: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(f"variant {self.name}: worker gone ({exc}); see {self.log_path}") from None

    def call(self, cmd: dict, timeout: float = 900) -> dict:
        self.send(cmd)
        return self.read(timeout)

    def run(self, batch: list[dict]) -> list[dict]:
        return self.call({"op": "run", "specs": batch}, timeout=600 + 300 * len(batch))["results"]

    def run_concurrent(self, batch: list[dict], concurrency: int) -> dict:
        """The worker's ``run_concurrent`` answer: ``results``, ``wall_s``, ``throughput_rps``, ..."""
        return self.call({"op": "run_concurrent", "specs": batch, "concurrency": concurrency},
                         timeout=600 + 300 * len(batch))

    def mem(self) -> tuple[list[dict], dict]:
        """Process-tree memory rows and GPU memory (:func:`benchmarks.prefill.worker.gpu_memory`)."""
        ans = self.call({"op": "mem"}, timeout=120)
        return ans["mem"], ans.get("gpu") or {"gpu_bytes": None, "reason": "not reported by the worker"}

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by the worker and its stage processes."""
        total = 0.0
        for p in lab.process_tree(self.proc.pid):
            with contextlib.suppress(Exception):
                total += sum(p.cpu_times()[:2])
        return total

    def freeze(self, paused: bool = True) -> None:
        """Pause (continue) the worker's process tree (:func:`benchmarks.lab.pause_tree`), so that
        it does not compete with the pipeline being timed."""
        lab.pause_tree(self.proc.pid, paused)
        self.frozen = paused
        # in the variant's log, among vLLM's lines: a death's traceback can be read against it
        self.log.write(f"{lab.HARNESS_MARK} {'frozen' if paused else 'continued'} at {time.strftime('%H:%M:%S')}\n")

    def thaw(self) -> None:
        self.freeze(False)

    def close(self) -> None:
        if self.frozen:
            self.thaw()
        try:
            self.send({"op": "quit"})
            self.proc.wait(timeout=180)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def gpu_inventory() -> list[dict]:
    """The host's NVIDIA GPUs (NVML, not torch: this driver keeps torch out): per device ``index``,
    ``name``, ``memory_total`` / ``memory_free`` (bytes) and ``driver``; ``[]`` on a CPU host."""
    def text(x):
        return x.decode() if isinstance(x, bytes) else x

    try:
        with lab.nvml() as nv:
            hs = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            return [{"index": i, "name": text(nv.nvmlDeviceGetName(h)), "memory_total": int(m.total),
                     "memory_free": int(m.free), "driver": text(nv.nvmlSystemGetDriverVersion())}
                    for i, h in enumerate(hs) for m in [nv.nvmlDeviceGetMemoryInfo(h)]]
    except lab.NvmlMissing:
        return []


def gpu_fit(one: dict | None, gpus: list[dict], others: int, margin: int) -> tuple[bool, str]:
    """Whether ``others`` more pipelines like ``one`` (its ``gpu`` memory row: ``per_device``
    index → bytes) fit each device's free memory (``gpus``: :func:`gpu_inventory` with ``one``
    up) with ``margin`` bytes to spare; and why, in words."""
    if not (per := (one or {}).get("per_device") or {}):
        return False, "the first pipeline's GPU memory is unknown (NVML); one pipeline at a time"
    free = {g["index"]: g["memory_free"] for g in gpus}
    lines, ok = [], True
    for dev, used in sorted(per.items(), key=lambda kv: int(kv[0])):
        need = used * others + margin
        have = free.get(int(dev), 0)
        ok = ok and have >= need
        lines.append(f"GPU {dev}: free {have / GiB:.1f} GiB {'≥' if have >= need else '<'} {need / GiB:.1f} GiB "
                     f"({others} more × {used / GiB:.1f} GiB + margin)")
    return ok, "; ".join(lines)


@contextlib.contextmanager
def awake(var):
    """``var`` thawed for the block if it was frozen, frozen again after it."""
    frozen = var.frozen
    if frozen:
        var.thaw()
    try:
        yield var
    finally:
        if frozen:
            var.freeze()


def parse_concurrency(text: str) -> list[int]:
    """``--concurrency`` (:func:`benchmarks.lab.positive_int_list`)."""
    return lab.positive_int_list(text, "--concurrency", "1,4,16,64")


def parse_variant_devices(text: str | None, variants: list[str]) -> dict[str, str]:
    """``--variant-devices``: ``variant=devices`` pairs separated by ``;`` (``omni_cache=0;off=1``,
    ``=0,1`` for two cards): each variant's ``CUDA_VISIBLE_DEVICES`` (its stage config's
    ``devices`` index into it). ``None`` / empty: ``{}``, every pipeline sees the launcher's.

    Raises:
        ValueError: a pair without ``=``, an unknown or repeated variant, a variant of ``variants``
            left without devices, devices that are not comma-separated integers, or two variants
            sharing a card.
    """
    if not text:
        return {}
    out: dict[str, str] = {}
    for pair in (p.strip() for p in text.split(";") if p.strip()):
        name, sep, devs = (x.strip() for x in pair.partition("="))
        if not sep or name not in variants or name in out:
            raise ValueError(f"--variant-devices: {pair!r} is not <variant>=<devices> for one of {variants} "
                             "(each once)")
        ids = [d.strip() for d in devs.split(",")]
        if not ids or not all(d.isdigit() for d in ids):
            raise ValueError(f"--variant-devices: {name}'s devices {devs!r} are not comma-separated integers")
        out[name] = ",".join(ids)
    if missing := [v for v in variants if v not in out]:
        raise ValueError(f"--variant-devices: no devices for {missing}")
    cards = [d for devs in out.values() for d in devs.split(",")]
    if len(cards) != len(set(cards)):
        raise ValueError(f"--variant-devices: variants share a card ({text!r}); give each its own")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    add = ap.add_argument
    add("--modalities", default="text,image,audio,chat,miss,floor", help=f"workloads among {','.join(WORKLOADS)}")
    add("--requests", type=int, default=20, help="requests per workload and round (chat: turns); at c > 1 "
        "max(N, 2c) (chat: c conversations of N turns)")
    add("--load-requests", type=int, default=None, help="requests per workload and round at c > 1 (not chat; "
        "default --requests; at least 2c): more averages each c > 1 cell over more requests")
    add("--concurrency", default="1", help="comma list, e.g. 1,4,16,64: c = 1 one request at a time with vLLM's "
        "stage breakdown; c > 1 a closed loop of c in flight (driver clock; streaming only)")
    add("--repeats", type=int, default=3, help="rounds (each request of a round is new)")
    add("--variants", default=",".join(VARIANTS), help="subset/order of off,builtin,omni_cache; for a KV-shared "
        "(YOCO) thinker: off,fast,omni_cache,fast+omni_cache (the composition bar is checked)")
    add("--model", help="model directory (default: the embedded model of --size, built if missing)")
    add("--size", default="bench", choices=sorted(SIZES), help="embedded model size (without --model)")
    add("--image", help="image file for the image workload (default: bundled astronaut.jpg)")
    add("--audio", help="audio file for the audio workload (default: bundled speech.wav)")
    add("--prefix-words", type=int, default=400, help="shared document length in words (~7 tokens each)")
    add("--media-doc-words", type=int, default=0, help="words of shared text after the image/audio")
    add("--media-copies", type=int, default=1, help="image/audio items in the shared prefix (mirrors/rotations)")
    add("--chat-answer-tokens", type=int, default=48, help="thinker answer length per chat turn")
    add("--answer-tokens", type=int, help="thinker answer length of the other workloads' requests (default 2: "
        "prefill + one decode step); 8 or more also times the thinker's decode (thinker_tpot_ms)")
    add("--stage-config", default=str(lab.BASE_CONFIG), help="base stage config the variants are derived from")
    add("--alternation", default="auto", choices=["auto", "concurrent", "restart"])
    add("--variant-devices", help="GPU host: CUDA_VISIBLE_DEVICES per variant ('omni_cache=0;off=1'): concurrent")
    add("--mem-margin-gib", type=float, default=1.5, help="auto: memory to leave free with all pipelines up")
    add("--freeze-idle", action=argparse.BooleanOptionalAction, default=True,
        help="concurrent: SIGSTOP the pipelines not being timed (default on)")
    add("--idle-probe-s", type=float, default=10.0, help="concurrent: seconds to measure idle pipelines' CPU use")
    for stage in ("thinker", "talker", "code2wav"):
        add(f"--{stage}-kv-mib", type=int, default=None, help=f"{stage} KV cache, MiB (default: "
            f"{getattr(MemorySettings, stage + '_kv_bytes') // MiB} on the CPU, the stage config's on a GPU host)")
    add("--max-num-seqs", type=int, default=None,
        help=f"max_num_seqs of every stage (default {MemorySettings.max_num_seqs} on the CPU, the stage config's on a "
        "GPU host: vLLM's CUDA-graph capture range follows it; under load give >= the largest --concurrency)")
    add("--cpu-executor", default=None, choices=["uni", "mp"],
        help="each stage's vLLM executor (default uni on the CPU, the stage config's on a GPU host)")
    add("--no-stream", action="store_true", help="synchronous Omni, async_chunk false (TTFP = the whole waveform); "
        "default AsyncOmni, async_chunk true (TTFP = the first audio packet)")
    add("--thinker-cache-only", action="store_true", help="omni-cache variants without the talker's prefix cache")
    add("--out", default=str(lab.RESULTS), help="results root; a run dir is made in it")
    add("--name", help="run directory name (default: prefill-<timestamp>)")


def talker_cache(stage_config: str | Path, variant: str, *, thinker_cache_only: bool = False) -> bool:
    """Whether ``variant`` runs the talker's prefix cache: an omni-cache variant where the base
    config ``stage_config`` turns it on, unless ``thinker_cache_only`` (``--thinker-cache-only``);
    never ``off`` / ``builtin`` / ``fast`` (vLLM's own cache on the talker would match
    placeholder ids: docs/talker-cache.md). Shared with ``benchmarks.profile_stage``."""
    if thinker_cache_only or "omni_cache" not in variant:
        return False
    raw = _yaml(stage_config)
    talker = [st for st in raw.get("stages", []) if st.get("stage_id") == 1]
    return bool(talker and talker[0].get("enable_prefix_caching", raw.get("enable_prefix_caching")))


def _yaml(stage_config) -> dict:
    """The stage config's YAML alone (``load_stage_config`` imports vLLM, which this driver keeps out)."""
    import yaml

    return yaml.safe_load(Path(stage_config).read_text())


def base_max_num_seqs(stage_config) -> int:
    """The smallest ``max_num_seqs`` of the stage config's stages (vLLM's default, 256, where a
    stage sets none)."""
    return min(int(st.get("max_num_seqs", 256)) for st in _yaml(stage_config).get("stages", [{}]))


def capture_note(seqs: int | None, base: int) -> str | None:
    """A note when ``--max-num-seqs`` (``seqs``) shrinks vLLM's CUDA-graph capture range below the
    stage config's (``base``): ``min(2 × max_num_seqs, 512)`` tokens where a config sets no capture
    size (vLLM's ``VllmConfig``); a prefill over it runs without graphs. None when it does not."""
    def reach(n: int) -> int:
        return min(2 * n, 512)

    if seqs is None or reach(seqs) >= reach(base):
        return None
    return (f"--max-num-seqs {seqs} shrinks vLLM's CUDA-graph capture range to {reach(seqs)} tokens (the stage "
            f"config's {base}: {reach(base)}); prefills over it run without graphs, unlike the deploy")


def _memory_settings(args, gpu_host: bool) -> MemorySettings:
    """The variants' memory knobs: what the command gives, else the CPU defaults on the CPU and
    the stage config's own (KV sizes, max_num_seqs, executor) on a GPU host."""
    d = MemorySettings()
    kv = {f"{st}_kv_bytes": mib * MiB if (mib := getattr(args, f"{st}_kv_mib")) is not None
          else (None if gpu_host else getattr(d, f"{st}_kv_bytes")) for st in ("thinker", "talker", "code2wav")}
    seqs = args.max_num_seqs if args.max_num_seqs is not None else (None if gpu_host else d.max_num_seqs)
    return MemorySettings(**kv, max_num_seqs=seqs,
                          cpu_executor=args.cpu_executor or (None if gpu_host else d.cpu_executor))


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    workloads = [w.strip() for w in args.modalities.split(",") if w.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    opts = WorkloadOptions(**{k: getattr(args, k) for k in ("requests", "prefix_words", "image", "audio",
                                                            "media_doc_words", "chat_answer_tokens", "media_copies",
                                                            "answer_tokens", "load_requests")})
    try:  # everything checked before a model is built or a pipeline starts
        bad = [w for w in workloads if w not in WORKLOADS] + [v for v in variants if v not in VARIANTS + YOCO_VARIANTS]
        if (bad or not workloads or not variants or args.requests < 1 or args.repeats < 1
                or (args.load_requests is not None and args.load_requests < 1)):
            raise ValueError(f"unknown workloads / variants {bad}, or empty selection, or requests/repeats/"
                             "load-requests < 1")
        if args.answer_tokens is not None and args.answer_tokens < 2:
            raise ValueError(f"--answer-tokens {args.answer_tokens}: at least 2 (one token breaks vLLM-Omni's talker "
                             "hand-off, omni_cache.driver.variants)")
        conc = parse_concurrency(args.concurrency)
        devices = parse_variant_devices(args.variant_devices, variants)
        loads = [c for c in conc if c > 1]
        if loads and args.no_stream:
            raise ValueError(f"--concurrency {','.join(map(str, loads))} needs streaming (AsyncOmni); --no-stream "
                             "(synchronous Omni) sends one request at a time")
        if "chat" in workloads and args.requests < 2:
            raise ValueError("the chat workload needs --requests ≥ 2 (turn 1 is a miss and is not timed)")
        check_media(opts)
        if args.model and not (Path(args.model) / "config.json").is_file():
            raise ValueError(f"--model {Path(args.model).resolve()}: no config.json (build one with "
                             "`omni-cache make-model`)")
    except ValueError as exc:  # omni_cache.driver.inputs.InputError included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = str(lab.model_dir(args.size, args.model and Path(args.model).resolve(), child=True))

    out = lab.results_dir(Path(args.out) / (args.name or time.strftime("prefill-%Y%m%d-%H%M%S")), "prefill")
    gpus = gpu_inventory()
    stamp = lab.stamp("benchmarks.prefill", argv, gpus=gpus)
    mem = _memory_settings(args, gpu_host=bool(gpus))
    load_note = None
    if loads and max(loads) > (seqs := mem.max_num_seqs or base_max_num_seqs(args.stage_config)):
        load_note = (f"max_num_seqs {seqs} < concurrency {max(loads)}: each stage runs at most "
                     f"{seqs} requests at once, the rest wait in vLLM's queue (their TTFP includes "
                     f"the wait); pass --max-num-seqs >= {max(loads)} to have every request of the loop scheduled")
        print(f"note: {load_note}", file=sys.stderr)
    if graph_note := (gpus and capture_note(mem.max_num_seqs, base_max_num_seqs(args.stage_config))):
        print(f"note: {graph_note}", file=sys.stderr)
    cfgs = {v: variant_stage_config(
        Path(args.stage_config), out, v, mem=mem, async_chunk=not args.no_stream,
        talker_prefix_caching=talker_cache(args.stage_config, v, thinker_cache_only=args.thinker_cache_only))
        for v in variants}
    warmups: dict[str, list[tuple[float, float]]] = {}  # variant -> unix (start, end) of each warm-up (jit report)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(lab.REPO), os.environ.get("PYTHONPATH")]))}
    if mem.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(mem.malloc_arena_max)
    if mem.cpu_executor == "uni":  # else vLLM's CPU platform turns "uni" into "mp" (a worker process per stage)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    samples: dict[str, dict[str, list[dict]]] = {w: {v: [] for v in variants} for w in workloads}
    warm: dict[str, list[dict]] = {v: [] for v in variants}
    starts: dict[str, list[float]] = {v: [] for v in variants}
    memory: dict[str, Any] = {"samples": []}
    alternation: dict[str, Any] = {"requested": args.alternation, **({"variant_devices": devices} if devices else {})}
    alone = 1 in conc  # the one-at-a-time path (vLLM's per-request stage breakdown)
    rounds = range(args.repeats)
    round_specs = {(w, r): specs(w, r, opts) if alone else [] for w in workloads for r in rounds}
    load_specs = {(w, r, c): specs(w, r, opts, concurrency=c) for w in workloads for r in rounds for c in loads}
    #: load_samples[workload][str(c)][variant]: one batch per round (run_load)
    load_samples = {w: {str(c): {v: [] for v in variants} for c in loads} for w in workloads}
    bar = tqdm(total=sum(map(len, [*round_specs.values(), *load_specs.values()])) * len(variants),
               desc="requests x variants", unit="req")
    # before each workload's timed requests: its first warm-up request again, alone (not a chat turn)
    rewarm_specs = {s["workload"]: dict(s, chat=None) for s in reversed(warmup_specs(workloads, opts))}

    def start(v: str) -> Variant:
        bar.set_postfix_str(f"starting {v}")
        var_env = {**env, "CUDA_VISIBLE_DEVICES": devices[v]} if v in devices else env
        return Variant(v, model, cfgs[v], out / f"log_{v}.txt", env=var_env, stream=not args.no_stream)

    def ready_and_warm(var: Variant) -> None:
        starts[var.name].append(var.wait_ready()["start_s"])
        t_warm = time.time()
        bar.set_postfix_str(f"warming {var.name}")
        warm[var.name].extend(var.run(warmup_specs(workloads, opts)))
        for c in loads:  # batch shapes of every c compiled / autotuned before timing (see warmup_specs)
            bar.set_postfix_str(f"warming {var.name} c={c}")
            ans = var.run_concurrent(warmup_specs(workloads, opts, c), c)
            warm[var.name].extend({**row, "concurrency": c} for row in ans["results"])
        sample_mem(var, "after warm-up")
        warmups.setdefault(var.name, []).append((t_warm, time.time()))

    def sample_mem(var: Variant, when: str) -> None:
        m, gpu = var.mem()
        total = {k: sum(r.get(k, 0) for r in m) for k in ("rss", "pss", "uss", "cpu_s")}
        memory["samples"].append({"variant": var.name, "when": when, "t": time.time(), "total": total, "gpu": gpu,
                                  "processes": m})

    def rewarm(var: Variant, w: str) -> None:
        """An untimed request of ``w`` before its timed ones: puts its shared prefix back (another
        workload may have evicted it) and takes the first request after a pipeline was frozen or
        idle (on an H100 that one took 1,056 ms TTFT, p50 31 ms: docs/benchmarks.md)."""
        if w in ("text", "image", "audio", "floor", "miss"):
            with awake(var):
                warm[var.name].extend(var.run([rewarm_specs[w]]))

    def run_round(group: list[Variant], r: int, w: str) -> None:
        """Round ``r`` of ``w`` on ``group``: each re-warmed, each request sent to every one in turn (order
        rotated by round + request index), then one batch per c each (rotated by round + index of c)."""
        for var in group:
            rewarm(var, w)
        for i, spec in enumerate(round_specs[(w, r)]):
            for var in lab.rotate(group, r + i):
                bar.set_postfix_str(f"round {r} {w} {var.name}")
                with awake(var):
                    rows = [{**row, "variant": var.name} for row in var.run([spec])]
                    for row in rows:
                        samples[row["workload"]][var.name].append(row)
                    bar.update(len(rows))
        for k, c in enumerate(loads):
            for var in lab.rotate(group, r + k):
                with awake(var):
                    bar.set_postfix_str(f"round {r} {w} c={c} {var.name}")
                    ans = var.run_concurrent(load_specs[(w, r, c)], c)
                    rows = [{**row, "variant": var.name} for row in ans.pop("results")]
                    load_samples[w][str(c)][var.name].append({**ans, "round": r, "results": rows})
                    bar.update(len(rows))

    def write_result(final: bool):
        """Summaries, bars, ``result.json`` and plots of what is measured so far (``complete``:
        whether the run reached its end)."""
        summ = {w: S.summarize_workload(samples[w]) for w in workloads}
        S.add_attainable(summ)
        if set(YOCO_VARIANTS) <= set(variants):
            checks = {w: S.yoco_checks(w, summ[w]) for w in workloads if w in ("text", "image", "audio", "chat")}
        else:
            checks = {w: S.bar_checks(w, summ[w]) for w in workloads} if "omni_cache" in variants else {}
        metrics = []
        for v in variants:
            for p in sorted((out / f"metrics_{v}").glob("*.json")):
                with contextlib.suppress(OSError, json.JSONDecodeError):
                    metrics.append({"variant": v, "file": p.name, **json.loads(p.read_text())})
        load = S.summarize_load(load_samples, samples if alone else None)
        load_checks = S.load_checks(load) if "omni_cache" in variants else {}
        overhead = S.overhead_checks(load, samples) if {"omni_cache", "off"} <= set(variants) else {}
        mem_per_variant = S.memory_per_variant(memory["samples"], metrics, variants)
        jit_report = jit_log.jit_report(out, variants, warmups, samples, jit_log.triton_cache_dirs()) if gpus else None
        failed = [v for v in variants if any(r.get("error") for w in workloads for r in samples[w][v])
                  or any(r.get("error") for r in warm[v])]
        result = {
            **stamp, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t_start)),
            "duration_s": time.time() - t_start, "model": model,
            "config": {"args": vars(args), "memory_settings": mem.to_dict(), "workload_options": opts.__dict__,
                       "stage_configs": {v: cfgs[v].read_text() for v in variants}},
            "alternation": alternation, "memory": memory, "memory_per_variant": mem_per_variant,
            "pipeline_start_s": starts, "metric_definitions": METRIC_DEFINITIONS, "workloads": summ,
            "bar_checks": checks, "samples": samples, "concurrency": conc, "load": load, "load_bar_checks": load_checks,
            "overhead_checks": overhead, "step_host_times": S.step_host_times(metrics),
            "load_note": load_note, "graph_note": graph_note or None, "load_samples": load_samples,
            "warmup_samples": warm, "omni_cache_metrics": metrics,
            # a variant with failed requests: the cause, from its log (the logs may stay on the GPU host)
            "variant_failures": {v: lab.failure_excerpt(out / f"log_{v}.txt") for v in failed},
            "jit_compiles": jit_report, "aborted": aborted, "complete": final and not aborted}
        lab.write_result(out, result)
        what = f"{Path(model).name}, {alternation['mode']}, N={args.requests} R={args.repeats}"
        png = S.plot(summ, out / "prefill.png", title=f"thinker prefill, {what}")
        load_png = S.plot_load(load, out / "load.png", title=f"under load, {what}") if loads else None
        return result, png, load_png

    def checkpoint() -> None:
        try:
            write_result(final=False)
        except Exception as exc:  # noqa: BLE001 - a partial summary must never stop the run
            print(f"\nnote: partial result.json not written ({type(exc).__name__}: {exc})", file=sys.stderr)

    live: list[Variant] = []
    aborted, t_start = None, time.time()  # aborted: why the run stopped early (WorkerDied), else None
    try:
        mode = args.alternation
        if mode == "auto":  # the pipeline measured for the memory decision: omni-cache's (the largest pool)
            variants = sorted(variants, key=lambda v: v != "omni_cache")
        # else --variants' order: under restart the first pipeline on a fresh GPU host compiles the Triton
        # kernels the later ones find in the disk cache (docs/benchmarks.md): put omni_cache where you mean to
        # --variant-devices: each pipeline on its own cards, so all start at once (a cold full-size pipeline on
        # one H200 took ~15 min in the fourteenth GPU session: started one after another they fill a hold)
        live += [start(v) for v in (variants if devices and mode != "restart" else variants[:1])]
        ready_and_warm(live[0])
        one = memory["samples"][-1]["total"]
        avail = psutil.virtual_memory().available
        margin = int(args.mem_margin_gib * GiB)
        need = one["pss"] * (len(variants) - 1) + margin
        alternation.update({"one_pipeline_pss_bytes": one["pss"], "one_pipeline_rss_bytes": one["rss"],
                            "available_bytes_with_one_up": avail, "needed_bytes_for_others": need})
        if mode == "auto" and devices:
            mode = "concurrent"
            alternation["reason"] = f"--variant-devices: each variant on its own cards ({args.variant_devices})"
        if mode == "auto":
            ok = avail >= need
            alternation["reason"] = (f"host: available {avail / GiB:.1f} GiB with one pipeline up "
                                     f"{'≥' if ok else '<'} {need / GiB:.1f} GiB needed ({len(variants) - 1} more × "
                                     f"{one['pss'] / GiB:.2f} GiB PSS + {args.mem_margin_gib} GiB margin)")
            if gpus:  # a GPU host: the cards decide first (three full-size pipelines on one card do not fit)
                gpu_ok, gpu_why = gpu_fit(memory["samples"][-1].get("gpu"), gpu_inventory(), len(variants) - 1, margin)
                ok, alternation["reason"] = ok and gpu_ok, f"{gpu_why}; {alternation['reason']}"
            mode = "concurrent" if ok else "restart"
        alternation["mode"] = mode
        if mode == "concurrent":
            alternation["how"] = ("all variants up at once; each request sent to every variant in turn, "
                                  "order rotated by (round + request index)")
            live += [start(v) for v in variants[len(live):]]
            for var in live[1:]:
                ready_and_warm(var)
            bar.set_postfix_str(f"idle probe {args.idle_probe_s:.0f} s")
            c0 = {var.name: var.cpu_s() for var in live}
            time.sleep(args.idle_probe_s)
            alternation["idle_cpu_cores"] = {var.name: (var.cpu_s() - c0[var.name]) / max(args.idle_probe_s, 1e-9)
                                             for var in live}
            alternation["freeze_idle"] = bool(args.freeze_idle)
            if args.freeze_idle:
                alternation["how"] += ("; the pipelines not being timed are stopped (SIGSTOP on the worker and its "
                                       "stage processes) and continued just before their next request")
                for var in live:
                    var.freeze()
            cpu0 = {var.name: var.cpu_s() for var in live}
            for r, w in itertools.product(rounds, workloads):
                run_round(live, r, w)
                checkpoint()
            # idle pipelines must not steal CPU from the one being timed: CPU seconds each pipeline
            # used during the timed phase vs the wall time of its own requests
            cpu = alternation["cpu_during_timed_phase"] = {}
            for var in live:
                if var.frozen:
                    var.thaw()
                sample_mem(var, "end")
                busy = (sum(r.get("e2e_ms") or 0 for w in workloads for r in samples[w][var.name]) / 1000
                        + sum(b.get("wall_s") or 0 for w in workloads for by_c in load_samples[w].values()
                              for b in by_c[var.name]))
                cpu[var.name] = {"cpu_s": var.cpu_s() - cpu0[var.name], "own_requests_wall_s": busy}
        else:
            alternation["how"] = ("one pipeline at a time, restarted every round; variant order rotated "
                                  "per round; all workloads of a round run on one pipeline before the next")
            for r in rounds:
                for k, v in enumerate(lab.rotate(variants, r)):
                    if not (r == 0 and k == 0):
                        live.append(start(v))
                        ready_and_warm(live[-1])
                    var = live[-1]
                    for w in workloads:
                        run_round([var], r, w)
                    sample_mem(var, f"end of round {r}")
                    var.close()
                    live.remove(var)
                    checkpoint()
        alternation["variant_order_per_round"] = (
            [",".join(lab.rotate(variants, r)) for r in rounds] if mode == "restart"
            else "per request: variants rotated by (round + request index); under load (c > 1) one batch per "
                 "variant, variants rotated by (round + index of c in --concurrency)")
    except WorkerDied as exc:  # keep what was measured; the JSON and the exit code say it is partial
        aborted = str(exc)
        alternation.setdefault("mode", mode if mode != "auto" else "undecided")
        print(f"\nerror: {aborted}", file=sys.stderr)
    finally:
        for var in live:
            var.close()
        bar.close()

    result, png, load_png = write_result(final=True)
    print()
    if alone:
        print(S.format_table(result["workloads"], result["bar_checks"]))
    if loads:
        print("\n" + S.format_load_table(result["load"], result["load_bar_checks"]))
    if any(w in workloads for w in S.OVERHEAD_WORKLOADS):
        print("\n" + S.format_overhead(result["overhead_checks"]))
        print(S.format_step_host_times(result["step_host_times"]))
    print("\n" + S.format_memory(result["memory_per_variant"]))
    print(f"\nalternation: {alternation['mode']} ({alternation.get('reason', 'requested')})")
    if "one_pipeline_pss_bytes" in alternation:
        print(f"one pipeline after warm-up: PSS {alternation['one_pipeline_pss_bytes'] / GiB:.2f} GiB, "
              f"RSS {alternation['one_pipeline_rss_bytes'] / GiB:.2f} GiB")
    if alternation.get("idle_cpu_cores"):
        print("idle pipeline CPU (cores): " + ", ".join(
              f"{k} {v:.2f}" for k, v in alternation["idle_cpu_cores"].items())
              + ("; frozen while others are timed" if alternation.get("freeze_idle") else ""))
    if result["jit_compiles"] is not None:
        print("\n" + jit_log.format_jit(result["jit_compiles"]))
    print(f"wrote {out / 'result.json'} and {png}" + (f" and {load_png}" if load_png else ""))
    if aborted:
        print(f"INCOMPLETE RUN: {aborted}", file=sys.stderr)
    return 1 if aborted else 0


METRIC_DEFINITIONS = {
    "prefill_ms": "thinker prefill time of the request: vLLM's per-request prefill time (first-token timestamp minus "
        "scheduled timestamp, both from the thinker's engine core), read as the change of "
        "vllm:request_prefill_time_seconds{stage=0}_sum across the request (requests are sent one at a time)",
    "ttft_ms": "driver clock: generate() called -> first thinker output with a text token received (thinker streamed "
        "with output_kind=DELTA)",
    "thinker_last_ms": "driver clock: generate() called -> the thinker's last output with new tokens",
    "thinker_tpot_ms": "thinker time per output token after the first: (thinker_last_ms - ttft_ms) / (output tokens "
        "- 1), driver clock; None below 8 output tokens (benchmarks.prefill.summary.metric)",
    "vllm_ttft_ms": "vLLM-Omni stage-0 vllm_ttft_ms: arrival at the thinker -> first token (orchestrator clock)",
    "ttfp_ms": "driver clock: generate() called -> first code2wav output with audio samples received: the first audio "
        "packet when streaming (AsyncOmni, async_chunk true); the whole waveform with --no-stream (synchronous Omni, "
        "async_chunk false: code2wav emits it at once)",
    "talker_prefill_ms": "talker prefill: change of vllm:request_prefill_time_seconds{stage=1}_sum across the request",
    "talker_hit_tokens": "talker prefix-hit tokens of the request (omni-cache's talker identity hook); None: the "
        "variant's talker runs without prefix caching, or not streaming",
    "talker_decode_ms": "talker decode steps after its first codec frame (the rest of the first codec chunk: the "
        "talker's max_tokens is the first chunk's frame count): vllm:request_decode_time_seconds{stage=1}",
    "code2wav_ms": "code2wav scheduled -> finished: vllm:request_inference_time_seconds{stage=2}",
    "handoff_ms": "ttfp_ms - ttft_ms - talker_prefill_ms - talker_decode_ms - code2wav_ms: hand-off, transfer and "
        "orchestration time (median of per-request values)",
    "e2e_ms": "driver clock: generate() called -> last output of the request",
    "load": "concurrency c > 1: a closed loop with c requests in flight per variant and batch; per request only the "
        "driver-clock ttft_ms / ttfp_ms / e2e_ms, hit ratio, tokens and audio counts (vLLM's histogram sums are per "
        "engine, so prefill_ms and TTFP's parts are None under load); c = 1 is taken from the one-at-a-time samples",
    "throughput_rps": "requests finished without error per second of a batch's wall time (first request sent -> last "
        "output, driver clock); median over rounds. c = 1: requests / sum of their e2e_ms",
    "p95": "95th percentile, linear interpolation between order statistics (numpy's default, lab.describe)",
    "gpu_bytes": "GPU memory used by the variant's process tree (NVML per-process used memory), bytes",
    "omni_cache_pinned_host_bytes": "bytes of omni-cache's hidden-state pools in pinned host memory "
        "(pool_pinned_bytes of its metrics files)",
    "stage_0_gen_ms": "vLLM-Omni: request submitted to the thinker -> thinker finished (prefill + decode steps)",
    "hit_ratio": "h = num_cached_tokens / num_prompt_tokens of the thinker (vLLM prefix hit)",
    "computed_tokens": "thinker prompt tokens computed (vllm:request_prefill_kv_computed_tokens)",
    "speedup_vs_off": "median prefill_ms of cache off / median prefill_ms of the variant",
    "speedup_paired": "median over requests (same round, index) of off prefill_ms / variant prefill_ms",
    "speedup_paired_ci95": "95% percentile-bootstrap interval of speedup_paired (4000 resamples, seed 0)",
    "ideal_speedup": "1 / (1 - h), h the variant's median hit ratio",
    "fraction_of_ideal": "speedup_vs_off / ideal_speedup",
    "attainable_speedup": "median prefill_ms of the workload on cache off / median prefill_ms of workload 'floor' "
        "(the hit's suffix alone, no prefix) on cache off: the speedup of a prefix cache whose hit costs a prefill of "
        "the uncached suffix alone",
    "fraction_of_attainable": "speedup_vs_off / attainable_speedup",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prefill_bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
