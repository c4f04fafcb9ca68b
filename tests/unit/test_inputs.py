"""Request inputs (omni_cache/driver/inputs.py), engine-free: real media through the model's
own processors is covered by the pipeline tests; here, unusable media files."""

from __future__ import annotations

import pytest

from omni_cache.driver.inputs import InputError, build_request, sample_path


@pytest.mark.parametrize("kind", ["image", "audio"])
@pytest.mark.parametrize("problem", ["missing", "corrupt"])
def test_bad_media_file_clear_error(tmp_path, kind, problem):
    """A missing or undecodable media file raises :class:`InputError` naming the file and the
    kind of input, before anything reaches an engine."""
    bad = tmp_path / ("bad.jpg" if kind == "image" else "bad.wav")
    if problem == "corrupt":
        bad.write_bytes(b"\x00definitely not media\xff" * 10)
    with pytest.raises(InputError) as err:
        build_request("hi", **{kind: bad})
    assert str(bad) in str(err.value) and kind in str(err.value)


def test_bundled_media_build_a_request():
    req = build_request("What do you see and hear?", image=sample_path("astronaut.jpg"),
                        audio=sample_path("speech.wav"))
    prompt = req.to_engine_prompt()
    assert set(prompt["multi_modal_data"]) == {"image", "audio"}, sorted(prompt)
