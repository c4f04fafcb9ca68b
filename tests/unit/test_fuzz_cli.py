"""The exactness fuzzer's GPU options (``tests.lanes.fuzz_exactness``): each engine derived from a
GPU stage config and placed on its own cards (issue 47, item 3: the fuzzer at size)."""

from __future__ import annotations

import pytest
import yaml

from omni_cache.driver.stage_config import bundled_stage_config
from omni_cache.exactness import fuzz
from tests.lanes.fuzz_exactness import exit_code, main, parse_engine_devices, place_on_cards


def test_engine_devices_parse_and_refuse_with_the_flags_name():
    assert parse_engine_devices(None) == {}
    assert parse_engine_devices("off=0;builtin=1;omni=2") == {"off": ["0"], "builtin": ["1"], "omni": ["2"]}
    assert parse_engine_devices("off=0,1; builtin=2,3 ;omni=4,5")["builtin"] == ["2", "3"]
    for bad in ("off=0;builtin=1", "off=0;builtin=0;omni=1", "off=0;builtin=1;omni_cache=2", "off=a;builtin=1;omni=2"):
        with pytest.raises(ValueError, match="--engine-devices"):
            parse_engine_devices(bad)


@pytest.mark.parametrize(("base", "cards", "want"), [
    ("qwen3_omni_30b_a3b_2xh100_dummy.yaml", ["2", "3"], ["2", "3", "3"]),  # thinker on one card, the rest on the other
    ("qwen3_omni_30b_a3b_h200_dummy.yaml", ["1"], ["1", "1", "1"]),
])
def test_each_engine_is_derived_from_the_gpu_config_and_placed_on_its_cards(tmp_path, base, cards, want):
    cfg = fuzz.recording_stage_config(tmp_path / "omni", "omni_cache", streaming=True, in_process=True,
                                      base=bundled_stage_config(base))
    place_on_cards(cfg, cards)
    raw = yaml.safe_load(cfg.read_text())
    assert [st["devices"] for st in raw["stages"]] == want
    # still the GPU config's shape (dummy weights, its KV sizes), recording, with the engine's cache
    src = yaml.safe_load(bundled_stage_config(base).read_text())
    assert [st.get("load_format") for st in raw["stages"]] == [st.get("load_format") for st in src["stages"]]
    assert raw["stages"][0]["env"]["OMNI_CACHE_HANDOFF_DUMP"].endswith("handoff")


def test_a_stage_device_past_the_engines_cards_is_refused(tmp_path):
    cfg = fuzz.recording_stage_config(tmp_path / "off", "off", streaming=False, in_process=True,
                                      base=bundled_stage_config("qwen3_omni_30b_a3b_2xh100_dummy.yaml"))
    with pytest.raises(ValueError, match="do not index into"):
        place_on_cards(cfg, ["0"])  # the talker's device 1 has no card


def test_the_exit_code_follows_the_oracles_asked_for():
    """On CUDA step Z passes ``--fail-on a,b``: a cache-off (c) difference is reported, not failed;
    (a) or (b) fails either way; a bad ``--fail-on`` is refused before any engine starts."""
    assert exit_code({"a": 0, "b": 0, "c": 3}, {"a", "b"}) == 0
    assert exit_code({"a": 0, "b": 0, "c": 3}, {"a", "b", "c"}) == 1
    assert exit_code({"a": 1, "b": 0, "c": 0}, {"a", "b"}) == 1 and exit_code({"a": 0, "b": 2, "c": 0}, {"b"}) == 1
    for bad in ("", "a,d"):
        with pytest.raises(SystemExit) as e:
            main(["--fail-on", bad])
        assert e.value.code == 2
