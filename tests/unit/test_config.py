"""Stage-config validation: one clear error naming file, stage and key, before any engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omni_cache.cli import main
from omni_cache.driver.stage_config import StageConfigError, load_stage_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "stage_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_bundled_stage_configs_validate(path):
    cfg = load_stage_config(path)
    assert cfg.stage_ids


def _write(tmp_path, mutate) -> Path:
    raw = yaml.safe_load((REPO / "stage_configs" / "qwen3_omni_cpu.yaml").read_text())
    mutate(raw)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_unknown_stage_key_names_file_stage_key_and_suggestion(tmp_path):
    p = _write(tmp_path, lambda r: r["stages"][0].update(enable_prefix_cache=True))
    with pytest.raises(StageConfigError) as e:
        load_stage_config(p)
    msg = str(e.value)
    assert str(p) in msg and "stage 0" in msg and "'enable_prefix_cache'" in msg
    assert "did you mean 'enable_prefix_caching'" in msg
    assert (e.value.stage_id, e.value.key) == (0, "enable_prefix_cache")


def test_wrong_type(tmp_path):
    p = _write(tmp_path, lambda r: r["stages"][1].update(max_num_seqs="many"))
    with pytest.raises(StageConfigError, match=r"stage 1: key 'max_num_seqs': expected int"):
        load_stage_config(p)


def test_unknown_top_level_key(tmp_path):
    p = _write(tmp_path, lambda r: r.update(asyncchunk=True))
    with pytest.raises(StageConfigError, match="key 'asyncchunk': unknown key"):
        load_stage_config(p)


def test_bad_omni_cache_backend(tmp_path):
    p = _write(tmp_path, lambda r: r["stages"][0]["env"].update(OMNI_CACHE_PREFIX_CACHE_BACKEND="lmcache"))
    with pytest.raises(StageConfigError, match="env.OMNI_CACHE_PREFIX_CACHE_BACKEND"):
        load_stage_config(p)


def test_duplicate_stage_id(tmp_path):
    p = _write(tmp_path, lambda r: r["stages"][1].update(stage_id=0))
    with pytest.raises(StageConfigError, match="stage 0: key 'stage_id': duplicate"):
        load_stage_config(p)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(StageConfigError, match="nope.yaml: file not found"):
        load_stage_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [\n")
    with pytest.raises(StageConfigError, match="not valid YAML"):
        load_stage_config(bad)


def test_missing_model_dir(tmp_path):
    with pytest.raises(StageConfigError, match="has no config.json"):
        load_stage_config(REPO / "stage_configs" / "qwen3_omni_cpu.yaml", model_dir=tmp_path)


def test_cli_validate_exit_codes(tmp_path, capsys):
    assert main(["validate", str(REPO / "stage_configs" / "qwen3_omni_cpu.yaml")]) == 0
    p = _write(tmp_path, lambda r: r["stages"][0].update(blocksize=32))
    assert main(["validate", str(p)]) == 2
    assert "did you mean 'block_size'" in capsys.readouterr().err


def test_engine_argument_vllm_omni_refuses_is_refused_early(tmp_path):
    # vLLM-Omni owns the hand-off function in the pipeline topology; it would refuse it
    # only while starting the engines
    p = _write(tmp_path, lambda r: r["stages"][0].update(custom_process_next_stage_input_func="my.func"))
    with pytest.raises(StageConfigError, match="stage 0: key 'custom_process_next_stage_input_func': unknown key"):
        load_stage_config(p)


def test_omni_cache_backend_without_the_capped_scheduler_is_refused(tmp_path):
    def no_pipeline(r):  # auto-detected Qwen3-Omni: no cap, no talker identity
        r.pop("pipeline")
        r["stages"][1]["enable_prefix_caching"] = False

    p = _write(tmp_path, no_pipeline)
    with pytest.raises(StageConfigError,
                       match=r"stage 0: key 'pipeline': .*capped scheduler.*qwen3_omni_moe_omni_cache"):
        load_stage_config(p)
    # the built-in cache needs no cap; async scheduling is allowed with the capped pipeline
    load_stage_config(_write(tmp_path, lambda r: (no_pipeline(r),
                                                  r["stages"][0]["env"].update(OMNI_CACHE_PREFIX_CACHE_BACKEND="builtin"))))
    load_stage_config(_write(tmp_path, lambda r: r["stages"][0].update(async_scheduling=True)))


def test_talker_prefix_caching_without_content_identity_is_refused(tmp_path):
    """The bundled CPU config caches the talker's KV (content-keyed); without omni-cache's
    pipeline (vLLM-Omni's own talker scheduler: placeholder hashes) or on code2wav it is
    refused, naming the stage and the key."""
    assert load_stage_config(REPO / "stage_configs" / "qwen3_omni_cpu.yaml").prefix_cache_backend(1) == "talker"

    def builtin_pipeline(r):
        r.pop("pipeline")
        r["stages"][0]["env"]["OMNI_CACHE_PREFIX_CACHE_BACKEND"] = "builtin"

    with pytest.raises(StageConfigError, match=r"stage 1: key 'enable_prefix_caching': .*placeholder prompt ids"):
        load_stage_config(_write(tmp_path, builtin_pipeline))
    with pytest.raises(StageConfigError, match=r"stage 2: key 'enable_prefix_caching'"):
        load_stage_config(_write(tmp_path, lambda r: r["stages"][2].update(enable_prefix_caching=True)))
    # Gemma-3n thinker: not its layout
    with pytest.raises(StageConfigError, match=r"stage 1: key 'enable_prefix_caching'"):
        load_stage_config(_write(tmp_path, lambda r: r.update(pipeline="gemma3n_omni_cache")))


def test_setting_values_and_scope_are_checked_against_the_registry(tmp_path):
    p = _write(tmp_path, lambda r: r["stages"][0]["env"].update(OMNI_CACHE_CPU_IDLE_BACKOFF_MS="two"))
    with pytest.raises(StageConfigError, match="OMNI_CACHE_CPU_IDLE_BACKOFF_MS.*non-negative integer"):
        load_stage_config(p)
    p = _write(tmp_path, lambda r: r["stages"][0]["env"].update(OMNI_CACHE_HOME="/tmp"))
    with pytest.raises(StageConfigError, match="OMNI_CACHE_HOME.*not a per-stage setting"):
        load_stage_config(p)
    p = _write(tmp_path, lambda r: r["stages"][0]["env"].update(OMNI_CACHE_CUDA_PLATFORM="1"))
    load_stage_config(p)  # the CUDA platform switch may be set per stage (it was missing from the old list)


def test_yoco_check_without_model_says_it_was_skipped(capsys):
    assert main(["validate", "gemma3n_yoco_cpu.yaml"]) == 0
    out = capsys.readouterr().out
    assert "note: stage 0: KV-shared (YOCO) check skipped" in out and "--model" in out


THREE_PROBLEMS = """\
pipeline: qwen3_omni_moe_omni_cache
stages:
  - stage_id: 0
    enable_prefix_cache: true
    env:
      OMNI_CACHE_PREFIX_CACHE_BACKEND: lmcache
  - stage_id: 1
    max_num_seqs: many
  - stage_id: 2
    enable_prefix_caching: true
"""


def test_every_problem_is_reported_at_once_with_line_stage_and_key(tmp_path):
    p = tmp_path / "three.yaml"
    p.write_text(THREE_PROBLEMS)
    with pytest.raises(StageConfigError) as e:
        load_stage_config(p)
    got = {(q.line, q.stage_id, q.key) for q in e.value.problems}
    assert got == {(4, 0, "enable_prefix_cache"), (6, 0, "env.OMNI_CACHE_PREFIX_CACHE_BACKEND"),
                   (8, 1, "max_num_seqs"), (10, 2, "enable_prefix_caching")}, e.value.problems
    lines = str(e.value).splitlines()
    assert len(lines) == 4 and all(ln.startswith(f"{p}:") for ln in lines), lines
    assert f"{p}:4: stage 0: key 'enable_prefix_cache': unknown key (did you mean 'enable_prefix_caching'?)" in lines
    assert any(ln.startswith(f"{p}:8: stage 1: key 'max_num_seqs': expected int") for ln in lines), lines
    # the first problem's fields stay on the error (callers that read .stage_id / .key)
    assert (e.value.line, e.value.stage_id, e.value.key) == (4, 0, "enable_prefix_cache")


def test_cli_validate_prints_every_problem_and_exits_non_zero(tmp_path, capsys):
    p = tmp_path / "three.yaml"
    p.write_text(THREE_PROBLEMS)
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [ln.split(": ")[0] for ln in err[:4]] == ["error"] * 4, err
    for where in (":4: stage 0: key 'enable_prefix_cache'", ":6: stage 0: key 'env.OMNI_CACHE_PREFIX_CACHE_BACKEND'",
                  ":8: stage 1: key 'max_num_seqs'", ":10: stage 2: key 'enable_prefix_caching'"):
        assert sum(where in ln for ln in err) == 1, (where, err)
    assert err[-1] == f"{p}: 4 problems"


def test_yaml_syntax_error_names_its_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - stage_id: 0\n    block_size: [32\n")
    with pytest.raises(StageConfigError, match=r"bad.yaml:\d+: not valid YAML") as e:
        load_stage_config(bad)
    assert e.value.line is not None and len(e.value.problems) == 1


def test_stages_without_usable_ids_are_reported_and_the_rest_still_checked(tmp_path):
    p = tmp_path / "ids.yaml"
    p.write_text("stages:\n  - stage_id: zero\n    blocksize: 32\n  - 7\n  - stage_id: 1\n    blocksize: 32\n")
    with pytest.raises(StageConfigError) as e:
        load_stage_config(p)
    got = [(q.line, q.stage_id, q.key) for q in e.value.problems]
    assert got == [(2, None, "stage_id"), (4, None, "stages"), (6, 1, "blocksize")], e.value.problems


def _shared_card_config(tmp_path) -> Path:
    """The one-GPU config with the talker's ``kv_cache_memory_bytes`` taken out."""
    raw = yaml.safe_load((REPO / "stage_configs" / "qwen3_omni_gpu1.yaml").read_text())
    raw["stages"][1].pop("kv_cache_memory_bytes")
    p = tmp_path / "shared.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_stages_sharing_a_card_without_kv_bytes_fail_validate_when_started_together(tmp_path, monkeypatch):
    """What stopped the full-size H200 run (2026-11-27: the talker measured the thinker's KV as its
    own and found 0 GiB): with OMNI_CACHE_PARALLEL_STAGE_INIT=1 validate refuses it, naming the
    stage and key; without, a note."""
    p = _shared_card_config(tmp_path)
    monkeypatch.setenv("OMNI_CACHE_PARALLEL_STAGE_INIT", "1")
    with pytest.raises(StageConfigError) as e:
        load_stage_config(p)
    assert [(q.stage_id, q.key) for q in e.value.problems] == [(1, "kv_cache_memory_bytes")], str(e.value)
    monkeypatch.setenv("OMNI_CACHE_PARALLEL_STAGE_INIT", "0")
    cfg = load_stage_config(p)
    assert any(n.startswith("stage 1: shares device '0'") for n in cfg.notes), cfg.notes
