"""Foundation: the real vLLM-Omni Qwen3-Omni pipeline on the CPU platform, real media."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omni_cache.driver.inputs import InputError, build_request, sample_path
from tests.util import REPO

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir):
    """The real thinker → talker → code2wav pipeline on the CPU platform (omni-cache on)."""
    from omni_cache.driver.pipeline import OmniPipeline

    with OmniPipeline(tiny_model_dir, REPO / "stage_configs" / "qwen3_omni_cpu.yaml") as pipe:
        yield pipe

LONG_TEXT = (
    "Look carefully at the photograph and listen to the recording. " * 6
)


def test_text_image_audio_request(pipeline, tiny_model_dir):
    req = build_request("What do you see and hear?", image=sample_path("astronaut.jpg"),
                        audio=sample_path("speech.wav"))
    (res,) = pipeline.generate([req])
    assert res.error is None
    assert len(res.token_ids) > 0 and res.text
    # the image and the audio expanded into many placeholder tokens via the HF processors
    assert res.num_prompt_tokens > 150
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert res.audio is not None and res.audio.ndim == 1 and res.audio.shape[0] > 0
    assert np.isfinite(res.audio).all() and float(np.abs(res.audio).max()) > 0
    # code2wav: 12.5 Hz codec frames x prod(upsample rates) x prod(upsampling ratios) = 24 kHz
    c2w = cfg["code2wav_config"]
    assert res.sample_rate == 24_000 == int(12.5 * np.prod(c2w["upsample_rates"]) * np.prod(c2w["upsampling_ratios"]))


def test_shared_prefix_reports_thinker_hit(pipeline):
    first = build_request(LONG_TEXT + "First question?", image=sample_path("astronaut.jpg"))
    second = build_request(LONG_TEXT + "Second, different question?", image=sample_path("astronaut.jpg"))
    (r1,) = pipeline.generate([first])
    (r2,) = pipeline.generate([second])
    assert r2.num_cached_tokens > 0
    # hits are whole KV blocks (block_size 32 in the CPU stage config)
    assert r2.num_cached_tokens % 32 == 0
    assert r2.num_cached_tokens < r2.num_prompt_tokens


@pytest.mark.parametrize("kind", ["image", "audio"])
@pytest.mark.parametrize("problem", ["missing", "corrupt"])
def test_bad_media_file_clear_error_and_pipeline_keeps_serving(pipeline, tmp_path, kind, problem):
    bad = tmp_path / ("bad.jpg" if kind == "image" else "bad.wav")
    if problem == "corrupt":
        bad.write_bytes(b"\x00definitely not media\xff" * 10)
    with pytest.raises(InputError) as err:
        build_request("hi", **{kind: bad})
    assert str(bad) in str(err.value) and kind in str(err.value)
    (res,) = pipeline.generate([build_request("Still there?", audio=sample_path("speech.wav"))])
    assert res.error is None and res.token_ids and res.audio is not None
