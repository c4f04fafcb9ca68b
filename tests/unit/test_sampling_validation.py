"""A stage's ``default_sampling_params`` checked against vLLM's ``SamplingParams`` by
``omni-cache validate``: before this, ``max_tokens: lots`` passed validate and ``omni-cache run``
died 10 s later with "'<' not supported between instances of 'str' and 'int'" (issue 45)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omni_cache.cli import main
from omni_cache.driver.schema import sampling_problems
from omni_cache.driver.stage_config import StageConfigError, load_stage_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "stage_configs").glob("*.yaml"))


def _write(tmp_path, stage_id: int, **params) -> Path:
    raw = yaml.safe_load((REPO / "stage_configs" / "qwen3_omni_cpu.yaml").read_text())
    stage = next(s for s in raw["stages"] if s["stage_id"] == stage_id)
    stage.setdefault("default_sampling_params", {}).update(params)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _problems(path) -> dict[tuple[int | None, str | None], str]:
    with pytest.raises(StageConfigError) as e:
        load_stage_config(path)
    return {(q.stage_id, q.key): q.reason for q in e.value.problems}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_bundled_stage_configs_sampling_params_are_clean(path):
    raw = yaml.safe_load(path.read_text())
    sections = list(raw["stages"])
    sections += [s for plat in (raw.get("platforms") or {}).values() for s in (plat or {}).get("stages") or []]
    for s in sections:
        assert sampling_problems(s.get("default_sampling_params") or {}) == [], (path.name, s["stage_id"])
    load_stage_config(path)


@pytest.mark.parametrize("key, value, reason", [
    ("max_tokens", "lots", "'lots' is not an integer"),
    ("seed", 1.5, "1.5 is not an integer"),
    ("temperature", "hot", "'hot' is not a number"),
    ("ignore_eos", 1, "1 is not true or false"),
    ("stop_token_ids", [1, "x"], "[1, 'x'] is not a list of integers"),
    ("extra_args", [1], "[1] is not a mapping"),
    ("min_p", "1e-5", "'1e-5' is not a number (YAML reads"),
    ("structured_outputs", {"json": "x"}, "is not a StructuredOutputsParams (vLLM does not convert"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None)
def test_bad_type_is_reported_with_stage_and_key(tmp_path, key, value, reason):
    got = _problems(_write(tmp_path, 0, **{key: value}))
    assert reason in got[(0, f"default_sampling_params.{key}")], got


@pytest.mark.parametrize("key, value, rule", [
    ("max_tokens", 0, "must be at least 1"),
    ("temperature", -0.5, "must be in [0, 2]"),
    ("temperature", 2.5, "must be in [0, 2]"),
    ("temperature", float("inf"), "must be in [0, 2]"),
    ("top_p", 0.0, "must be in (0, 1]"),
    ("top_p", 1.5, "must be in (0, 1]"),
    ("top_k", -2, "must be 0 or -1 (off) or at least 1"),
    ("repetition_penalty", 0.0, "greater than 0"),
    ("presence_penalty", 3.0, "must be in [-2, 2]"),
    ("min_p", 1.5, "must be in [0, 1]"),
    ("n", 0, "must be at least 1"),
    ("logprobs", -2, "or -1"),
    ("stop", ["", "x"], "cannot contain an empty string"),
    ("extra_args", {"big": 2**70}, "between -2**63 and 2**64 - 1"),
])
def test_out_of_range_is_reported_with_stage_key_and_rule(tmp_path, key, value, rule):
    got = _problems(_write(tmp_path, 1, **{key: value}))
    reason = got[(1, f"default_sampling_params.{key}")]
    assert reason.startswith(f"{value!r} is out of range: ") and rule in reason, got


def test_unknown_key_is_reported_with_a_suggestion(tmp_path):
    got = _problems(_write(tmp_path, 0, max_token=32))
    assert got[(0, "default_sampling_params.max_token")] == "unknown sampling parameter (did you mean 'max_tokens'?)"
    # vLLM's private bookkeeping is not settable
    got = _problems(_write(tmp_path, 0, _eos_token_id=3))
    assert (0, "default_sampling_params._eos_token_id") in got


def test_cross_field_rules(tmp_path):
    got = _problems(_write(tmp_path, 0, min_tokens=32, max_tokens=8))
    assert got[(0, "default_sampling_params.min_tokens")] == "32 is more than max_tokens (8)"
    no_max = tmp_path / "no_max.yaml"  # max_tokens unset: vLLM's default (16) applies
    no_max.write_text("stages:\n  - stage_id: 0\n    default_sampling_params: {min_tokens: 32}\n")
    assert _problems(no_max)[(0, "default_sampling_params.min_tokens")] == \
        "32 is more than max_tokens (16, vLLM's default)"
    got = _problems(_write(tmp_path, 0, n=2, temperature=0.0))
    assert "temperature 0 (greedy) vLLM requires n: 1" in got[(0, "default_sampling_params.n")]
    got = _problems(_write(tmp_path, 0, stop=["</s>"], detokenize=False))
    assert got[(0, "default_sampling_params.stop")] == "stop strings need detokenize: true"


def test_accepted_edge_values_pass(tmp_path):
    # what vLLM 0.30 accepts: top_k -1 and 0 (off), seed -1 (none), temperature 0 (greedy),
    # top_p 1, an int where a float is declared, nulls where the field is optional
    load_stage_config(_write(tmp_path, 0, top_k=-1, seed=-1, temperature=0, top_p=1, repetition_penalty=1,
                             max_tokens=None, logprobs=-1, stop="x", extra_args={"k": [1, {"n": 2}]},
                             logit_bias={5: -1.5}))
    load_stage_config(_write(tmp_path, 0, top_k=0, min_tokens=0))


SEVERAL = """\
stages:
  - stage_id: 0
    default_sampling_params:
      max_tokens: lots
      temprature: 0.7
  - stage_id: 1
    default_sampling_params:
      top_p: 0
platforms:
  cuda:
    stages:
      - stage_id: 1
        default_sampling_params:
          top_k: 1.5
"""


def test_every_sampling_problem_is_reported_at_once_with_file_line_stage_and_key(tmp_path, capsys):
    p = tmp_path / "several.yaml"
    p.write_text(SEVERAL)
    with pytest.raises(StageConfigError) as e:
        load_stage_config(p)
    got = [(q.line, q.stage_id, q.key) for q in e.value.problems]
    assert got == [(4, 0, "default_sampling_params.max_tokens"), (5, 0, "default_sampling_params.temprature"),
                   (8, 1, "default_sampling_params.top_p"), (14, 1, "default_sampling_params.top_k")], got
    lines = str(e.value).splitlines()
    assert lines[0] == f"{p}:4: stage 0: key 'default_sampling_params.max_tokens': 'lots' is not an integer"
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert "'lots' is not an integer" in err and err.rstrip().endswith(f"{p}: 4 problems")


def test_platform_overlay_is_checked_merged_onto_the_stage(tmp_path):
    # the overlay's max_tokens makes the stage's own min_tokens too large on that platform only
    p = tmp_path / "merge.yaml"
    p.write_text("stages:\n  - stage_id: 0\n    default_sampling_params: {min_tokens: 8, max_tokens: 64}\n"
                 "platforms:\n  cuda:\n    stages:\n      - stage_id: 0\n"
                 "        default_sampling_params: {max_tokens: 4}\n")
    got = [(q.stage_id, q.key, q.reason) for q in _raise(p).problems]
    assert got == [(0, "default_sampling_params.min_tokens", "8 is more than max_tokens (4)")], got


def _raise(p) -> StageConfigError:
    with pytest.raises(StageConfigError) as e:
        load_stage_config(p)
    return e.value


@pytest.mark.parametrize("params", [
    {"max_tokens": "lots"}, {"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2},
    {"repetition_penalty": 0.0}, {"min_tokens": 32}, {"max_token": 3}, {"n": 2, "temperature": 0.0},
    {"stop": [""]},
], ids=str)
def test_what_validate_refuses_vllm_refuses_too(params):
    """The rules follow vLLM: each planted mistake above makes vLLM's own constructor raise
    (what ``omni-cache run`` would die of), and validate names it first."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    assert sampling_problems(params)
    with pytest.raises((TypeError, ValueError, VLLMValidationError)):
        SamplingParams(**params)
