"""Probe: where does a request's audio stop? (docs/gpu.md, "Audio on the GPU")

Starts one streaming pipeline from a stage config (default: the one-GPU config) on the
embedded model with every hand-off recorded — thinker → talker chunks (``handoff/``) and
talker → code2wav codec chunks (``codec/``) — sends one text request, then prints what each
stage received: the thinker chunks' shapes, whether they are finite and their largest value;
the codec chunks' frames, distinct codes and share of zero codes (vLLM-Omni's
``talker2code2wav_async_chunk`` sends no frame whose codes are all 0); the audio samples and
packets that came back.

    OMNI_CACHE_CUDA_PLATFORM=1 python scripts/probe_gpu_audio.py --out /tmp/probe-audio
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def describe(path: Path) -> str:
    d = torch.load(path, map_location="cpu", weights_only=False)
    parts = []
    for k, v in sorted(d.items()):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                f = v.float()
                parts.append(f"{k}{list(v.shape)} finite={bool(torch.isfinite(f).all())} "
                             f"absmax={f.abs().max().item() if f.numel() else 0:.3g}")
            elif v.numel() > 1:
                parts.append(f"{k}{list(v.shape)} distinct={v.unique().numel()} "
                             f"zeros={(v == 0).float().mean().item():.2f} head={v.flatten()[:8].tolist()}")
            else:
                parts.append(f"{k}={v.tolist()}")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stage-config", type=Path, default=REPO / "stage_configs" / "qwen3_omni_gpu1.yaml")
    ap.add_argument("--text", default="Say something about the sea.")
    args = ap.parse_args()
    from omni_cache.driver.inputs import build_request
    from omni_cache.driver.streaming import StreamingPipeline
    from omni_cache.exactness.fuzz import recording_stage_config
    from omni_cache.models import build_qwen3_omni, default_model_dir

    model = build_qwen3_omni(default_model_dir("tiny"), "tiny")
    from omni_cache.driver.variants import derive_stage_config

    cfg = recording_stage_config(args.out, "omni_cache", streaming=True, base=args.stage_config)
    # the talker's DEBUG log says when vLLM-Omni drops a codec frame (stop token first)
    cfg = derive_stage_config(cfg, cfg, env={1: {"VLLM_LOGGING_LEVEL": "DEBUG"}})
    with StreamingPipeline(model, cfg) as pipe:
        print(f"[probe] started in {pipe.start_s:.0f} s", flush=True)
        for i in range(2):
            res = pipe.run(build_request(args.text))
            n = 0 if res.audio is None else res.audio.shape[0]
            print(f"[probe] request {i}: text {res.text!r}; audio {n} samples in {res.audio_packets} packets; "
                  f"TTFP {res.ttfp_s}; talker prompt {res.talker_num_prompt_tokens}, error {res.error}", flush=True)
    for sub in ("handoff", "codec"):
        files = sorted((args.out / sub).glob("*.pt"))
        print(f"[probe] {sub}: {len(files)} chunks")
        for f in files[:3] + (files[-2:] if len(files) > 5 else []):
            print(f"[probe]   {f.name}: {describe(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
