"""The main job, ``omni-cache run``, end to end on the streaming CPU config: it prints each
request's time to the first text token and to the first audio packet, writes the waveform as
packets arrive and ``summary.json`` after every request, and every request after the first hits
it exactly (thinker and talker: the same prompt, :func:`assert_repeat_hits`). Then it
is stopped the way supervisors do — SIGTERM while a later request is running — and must leave
no process behind (one pipeline start serves both checks)."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import soundfile as sf

from tests.device import GPU1_STAGE_CONFIG, on_cuda, run_args
from tests.pipeline.proctree import Watched, stop_and_check
from tests.pipeline.workloads import prefix_hit
from tests.util import CPU_STAGE_CONFIG

pytestmark = pytest.mark.pipeline
#: full pipeline starts in this module (the suite's time table, tests/conftest.py)
PIPELINE_STARTS = 1  # omni-cache run


def test_run_streams_ttft_ttfp_and_packets_then_stops_cleanly(tiny_model_dir, tmp_path):
    w = Watched(["run", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--repeat", "6", *run_args()], tmp_path)
    done = lambda: [ln for ln in w.lines if ln.startswith("[request ")]  # noqa: E731
    w.wait_for(lambda: len(done()) >= 2, 900, "two finished requests")
    stop_and_check(w, signal.SIGTERM)  # during request 3 (or later)

    lines = done()
    assert 2 <= len(lines) < 6, "the run was not stopped during a request"
    # a clean shutdown says nothing alarming (asyncio's "Task was destroyed but it is pending!"
    # came from vLLM-Omni's output task cancelled and never awaited)
    assert not [ln for ln in w.lines if "Task was destroyed" in ln], "".join(w.lines[-40:])
    assert all("TTFT" in ln and "first audio packet (TTFP)" in ln for ln in lines), lines
    # the embedded model says what it is, before anyone listens to its near-silent WAVs
    from omni_cache.models import EMBEDDED_MODEL_NOTICE, ModelKind

    assert any(ln.rstrip("\n") == EMBEDDED_MODEL_NOTICE for ln in w.lines), "".join(w.lines[:20])
    full = json.loads((tmp_path / "summary.json").read_text())
    assert full["model"] == {"path": str(tiny_model_dir), "kind": ModelKind.EMBEDDED.value}, full["model"]
    summary = full["requests"]
    assert len(summary) == len(lines)
    for r in summary:
        assert r["error"] is None
        assert 0 < r["ttft_s"] < r["ttfp_s"] < r["wall_s"], r  # the first packet before the end
        assert r["audio_packets"] >= 2, r  # the initial codec chunk, then the rest
        wave, sr = sf.read(r["wav"], dtype="float32")
        assert sr == 24_000 and wave.ndim == 1 and wave.shape[0] > 0 and np.isfinite(wave).all()
    assert_repeat_hits(summary, *_block_sizes())


#: talker rows of the final assistant segment (vLLM-Omni's layout): they get no talker block key
ASSISTANT_ROWS = 9


def _block_sizes() -> tuple[int, int]:
    """(thinker, talker) KV block size (tokens) of the stage config ``omni-cache run`` uses here."""
    import yaml

    cfg = GPU1_STAGE_CONFIG if on_cuda() else CPU_STAGE_CONFIG
    stages = {st["stage_id"]: st for st in yaml.safe_load(cfg.read_text())["stages"]}
    sizes = stages[0].get("block_size"), stages[1].get("block_size")
    assert None not in sizes, f"{cfg.name} sets no block_size: the expected hits below need it"
    return sizes


def assert_repeat_hits(summary: list[dict], block: int, talker_block: int) -> None:
    """Every request is the same prompt (same text, photo and recording: equal token ids and
    media), so the first hits nothing and every later one hits it exactly: thinker, the whole
    blocks of the prompt bar vLLM's last token (:func:`~tests.pipeline.workloads.prefix_hit`
    on equal ids: positions stand in for them); talker, every full block of the user rows (all
    but the final assistant segment's :data:`ASSISTANT_ROWS` rows, whose blocks are never
    shared: omni_cache.core.talker_keys)."""
    n, talker_n = summary[0]["num_prompt_tokens"], summary[0]["talker_num_prompt_tokens"]
    assert n > 0 and talker_n > ASSISTANT_ROWS + talker_block, summary[0]
    assert (summary[0]["num_cached_tokens"], summary[0]["talker_num_cached_tokens"]) == (0, 0), summary[0]
    ids = list(range(n))
    expected = (prefix_hit(ids, [ids], block), (talker_n - ASSISTANT_ROWS) // talker_block * talker_block)
    for r in summary[1:]:
        assert (r["num_prompt_tokens"], r["talker_num_prompt_tokens"]) == (n, talker_n), r
        assert (r["num_cached_tokens"], r["talker_num_cached_tokens"]) == expected, (r, expected)
