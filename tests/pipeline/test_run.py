"""The main job, ``omni-cache run``, end to end on the streaming CPU config: it prints each
request's time to the first text token and to the first audio packet, writes the waveform as
packets arrive (the file holds exactly the samples streamed), and the second request hits."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

pytestmark = pytest.mark.pipeline


def test_run_streams_ttft_ttfp_and_packets(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "omni_cache.cli", "run", "--model", str(tiny_model_dir),
                          "--out", str(tmp_path), "--repeat", "2"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[request ")]
    assert len(lines) == 2 and all("TTFT" in ln and "first audio packet (TTFP)" in ln for ln in lines), lines
    summary = json.loads((tmp_path / "summary.json").read_text())["requests"]
    for r in summary:
        assert r["error"] is None
        assert 0 < r["ttft_s"] < r["ttfp_s"] < r["wall_s"], r  # the first packet before the end
        assert r["audio_packets"] >= 2, r  # the initial codec chunk, then the rest
        wave, sr = sf.read(r["wav"], dtype="float32")
        assert sr == 24_000 and wave.ndim == 1 and wave.shape[0] > 0 and np.isfinite(wave).all()
    assert summary[1]["num_cached_tokens"] > 0  # the repeated prompt hits the first one
