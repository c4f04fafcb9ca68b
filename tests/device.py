"""The device the pipeline tests run on: the CPU (CI, the default) or one CUDA GPU (the GPU
lane, ``python -m tests.lanes.gpu_check``; docs/gpu.md).

``OMNI_TEST_DEVICE=cuda`` runs the same tests, with the same engines and workloads, on
GPU variants of their stage configs (:func:`device_stage_config`): every stage on device 0 of
the card, a small share of it each (the configs' ``kv_cache_memory_bytes`` keep the KV pools
the size the tests were written for, so expected hits, evictions and preemptions stay the
same), the CPU-only keys dropped. ``OMNI_TEST_COMPILED=1`` also turns the thinker's
``enforce_eager`` off there: torch.compile and CUDA graphs (for fast prefill: self- and
cross-decoder compiled and captured apart, vLLM #22628 / #38879).

The cache-off oracle (c) is bitwise on the CPU, not on CUDA: there a hit's suffix, computed
over cached KV, can differ from a whole-prompt prefill in the last bits, the random model's
near-tie logits can then flip a token, and the talker's sampled codes diverge (measured on an
H100: docs/gpu.md, "The cache-off oracle on CUDA"). On CUDA :data:`CACHE_OFF_BITWISE` is False
and the tests that compare a run with a hit against cache off hold it to a stated precision
instead: prompt rows within :data:`omni_cache.exactness.oracles.TOLERANCE_ULPS` row-scale ulps
(embedding rows bitwise), ids and TTS embeddings bitwise, tokens not compared, audio and codec
frames bitwise only where the talker got the same bits and did not hit (else of equal length).
Comparisons that held bitwise on the H100 stay bitwise. The lane runs the pipeline groups with
vLLM's batch-invariant kernels on the thinker and the talker (``OMNI_TEST_BATCH_INVARIANT=1``:
with them most cache-off comparisons were bitwise there, all but hits over decode-filled
blocks, Gemma-3n's hit and the stress run) and the equality tests once more on the default
kernels (``equality-default``). The writer's rows (a), vLLM-Omni's built-in cache (b) and
fast prefill against the slow path without the cache are bitwise in every mode.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: ``cpu`` or ``cuda``
TEST_DEVICE = os.environ.get("OMNI_TEST_DEVICE", "cpu").strip().lower()
#: the thinker with torch.compile + CUDA graphs (GPU lane only)
TEST_COMPILED = os.environ.get("OMNI_TEST_COMPILED", "0") == "1"
#: AR stages with synchronous scheduling (the CPU platform's only mode) on the GPU too
TEST_SYNC = os.environ.get("OMNI_TEST_SYNC", "0") == "1"
#: vLLM's batch-invariant kernels on the thinker and the talker (``OMNI_TEST_BATCH_INVARIANT=1``:
#: their stages get ``env: VLLM_BATCH_INVARIANT: "1"``; code2wav keeps the default kernels — its
#: transformers modules fail under vLLM's batch-invariant overrides, "expected mat1 and mat2 to
#: have the same dtype", and its input is the talker's codes, equal when those are)
BATCH_INVARIANT = TEST_DEVICE == "cuda" and os.environ.get("OMNI_TEST_BATCH_INVARIANT", "0").strip() == "1"
#: whether a run with a hit is held to cache off bitwise (oracle (c) without tolerance): on the
#: CPU; on CUDA not, with either kernels (docs/gpu.md, "The cache-off oracle on CUDA")
CACHE_OFF_BITWISE = TEST_DEVICE == "cpu" and os.environ.get("OMNI_TEST_CACHE_OFF", "bitwise") != "precision"
#: (``OMNI_TEST_CACHE_OFF=precision`` runs the CUDA comparisons on the CPU: how their code is
#: exercised where there is no GPU)
#: the one-GPU stage config (the GPU main job's)
GPU1_STAGE_CONFIG = REPO / "stage_configs" / "qwen3_omni_gpu1.yaml"
#: each stage's share of the card in the GPU lane: the KV pool is sized by the configs'
#: ``kv_cache_memory_bytes``; this only bounds vLLM's start-up check (free memory >= share)
GPU_STAGE_SHARE = 0.04
#: environment keys that only mean something on the CPU platform
_CPU_ONLY_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")

if TEST_DEVICE not in ("cpu", "cuda"):
    raise RuntimeError(f"OMNI_TEST_DEVICE={TEST_DEVICE!r}: expected 'cpu' or 'cuda'")


def on_cuda() -> bool:
    """Whether the pipeline tests run on a CUDA GPU (``OMNI_TEST_DEVICE=cuda``)."""
    return TEST_DEVICE == "cuda"


def device_stage_config(cfg: str | os.PathLike, out_path: str | os.PathLike | None = None) -> Path:
    """``cfg`` for the test device: unchanged on the CPU; on CUDA, a GPU variant written to
    ``out_path`` (default: beside ``cfg`` when ``cfg`` is a derived file under a temporary
    folder, else a new temporary file) — every stage ``devices: "0"`` with
    ``gpu_memory_utilization`` :data:`GPU_STAGE_SHARE`, CPU-only ``env`` keys removed, and
    with :data:`TEST_COMPILED` the thinker's ``enforce_eager: false`` (a Qwen3-Omni thinker
    also gets the deploy's ``custom_ops: ["+rotary_embedding"]``).

    Returns the path to start the pipeline with.
    """
    cfg = Path(cfg)
    if not on_cuda():
        return cfg
    import yaml

    raw = yaml.safe_load(cfg.read_text())
    for st in raw["stages"]:
        st["devices"] = "0"
        st["gpu_memory_utilization"] = GPU_STAGE_SHARE
        env = st.get("env") or {}
        if BATCH_INVARIANT and st["stage_id"] in (0, 1):
            env["VLLM_BATCH_INVARIANT"] = "1"
        for k in _CPU_ONLY_ENV:
            env.pop(k, None)
        if env:
            st["env"] = env
        else:
            st.pop("env", None)
        if TEST_SYNC and st["stage_id"] in (0, 1):
            st["async_scheduling"] = False
        if TEST_COMPILED and st["stage_id"] == 0:
            st["enforce_eager"] = False
            if str(raw.get("pipeline", "")).startswith("qwen3_omni"):
                # as vLLM-Omni's deploy (qwen3_omni_moe.yaml, platforms.cuda): the rotary custom op;
                # vLLM's native rotary assigns its cos_sin_cache buffer inside the forward, which
                # torch.compile refuses under CUDA graphs (seen on an H100: every compiled engine
                # failed to start)
                st.setdefault("compilation_config", {})["custom_ops"] = ["+rotary_embedding"]
    if out_path is None:
        tmp = Path(tempfile.gettempdir())
        if tmp in cfg.resolve().parents:
            out_path = cfg.with_name(cfg.stem + "_cuda.yaml")
        else:
            out_path = Path(tempfile.mkdtemp(prefix="omni-cache-cuda-")) / (cfg.stem + "_cuda.yaml")
    Path(out_path).write_text(yaml.safe_dump(raw, sort_keys=False))
    return Path(out_path)


def run_args() -> list[str]:
    """Extra ``omni-cache run`` / ``serve`` arguments for the test device: on CUDA the one-GPU
    stage config (:data:`GPU1_STAGE_CONFIG`); on the CPU none (the bundled CPU config)."""
    return ["--stage-config", str(GPU1_STAGE_CONFIG)] if on_cuda() else []
