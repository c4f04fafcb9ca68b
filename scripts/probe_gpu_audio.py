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
    ap.add_argument("--variant", default="as-is",
                    choices=["as-is", "as-is-full", "talker-sync", "no-local-seed", "upstream"],
                    help="as-is: the config; talker-sync: the talker with async_scheduling off; no-local-seed: "
                         "the talker without tts_local_seed; upstream: vLLM-Omni's own Qwen3-Omni pipeline, "
                         "every cache off, nothing recorded (run it without OMNI_CACHE_CUDA_PLATFORM)")
    ap.add_argument("--dry-run", action="store_true", help="print the stage config and stop")
    args = ap.parse_args()
    from omni_cache.driver.inputs import build_request
    from omni_cache.driver.streaming import StreamingPipeline
    from omni_cache.exactness.fuzz import recording_stage_config
    from omni_cache.models import build_qwen3_omni, default_model_dir

    model = build_qwen3_omni(default_model_dir("tiny"), "tiny")
    from omni_cache.driver.variants import derive_stage_config

    # small shares of the card and small KV pools: probes can run side by side
    small = {i: {"gpu_memory_utilization": 0.04, "kv_cache_memory_bytes": 1 << 28} for i in (0, 1, 2)}
    if args.variant == "upstream":
        import yaml

        raw = yaml.safe_load(args.stage_config.read_text())
        raw.pop("pipeline", None)  # auto-detected: vLLM-Omni's qwen3_omni_moe
        for st in raw["stages"]:
            st.pop("env", None)
            st["enable_prefix_caching"] = False
            (st.get("default_sampling_params") or {}).pop("extra_args", None)
            st.update(small[st["stage_id"]])
        args.out.mkdir(parents=True, exist_ok=True)
        cfg = args.out / "stage_config_upstream.yaml"
        cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    else:
        cfg = recording_stage_config(args.out, "omni_cache", streaming=True, base=args.stage_config)
        if args.variant == "talker-sync":
            small[1]["async_scheduling"] = False
        if args.variant != "as-is-full":  # as-is-full: the config's own memory shares, KV sized by profiling
            cfg = derive_stage_config(cfg, cfg, stages=small)
        if args.variant == "no-local-seed":
            import yaml

            raw = yaml.safe_load(cfg.read_text())
            raw["stages"][1]["default_sampling_params"].pop("extra_args", None)
            cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    if args.dry_run:
        print(cfg.read_text())
        return 0
    with StreamingPipeline(model, cfg) as pipe:
        print(f"[probe {args.variant}] started in {pipe.start_s:.0f} s", flush=True)
        for i in range(2):
            res = pipe.run(build_request(args.text))
            n = 0 if res.audio is None else res.audio.shape[0]
            print(f"[probe {args.variant}] request {i}: text {res.text[:40]!r}; audio {n} samples in "
                  f"{res.audio_packets} packets; "
                  f"TTFP {res.ttfp_s}; talker prompt {res.talker_num_prompt_tokens}, error {res.error}", flush=True)
    for sub in ("handoff", "codec"):
        files = sorted((args.out / sub).glob("*.pt"))
        print(f"[probe {args.variant}] {sub}: {len(files)} chunks")
        for f in files[:2] + (files[-1:] if len(files) > 3 else []):
            print(f"[probe {args.variant}]   {f.name}: {describe(f)}")
    calls = args.out / "codec" / "calls.jsonl"
    if calls.exists():
        lines = calls.read_text().splitlines()
        print(f"[probe {args.variant}] talker hand-off calls: {len(lines)}")
        for ln in lines[:4] + lines[-2:]:
            print(f"[probe {args.variant}]   {ln}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
