"""The written-down seam (omni_cache.engine.seam) holds for the installed vLLM-Omni: a
version bump that renames, re-signs or adds a manager call fails here, not silently in a
pipeline that no longer uses the cache."""

from __future__ import annotations


def test_seam_matches_installed_vllm_omni():
    from omni_cache.engine.seam import check_seam

    assert check_seam() == []


def test_seam_check_reports_a_moved_method(monkeypatch):
    """The check can fail: a manager whose save_outputs lost its keyword-only arguments."""
    from omni_cache.engine import seam
    from omni_cache.engine.stage_manager import OmniCacheStageManager

    monkeypatch.setattr(OmniCacheStageManager, "save_outputs", lambda self, hidden_states, mm_outputs: 0)
    problems = seam.check_seam()
    assert any("OmniCacheStageManager.save_outputs" in p for p in problems), problems


def test_talker_seam_check_reports_a_predictor_without_generators(monkeypatch):
    """The talker part can fail too: a code predictor whose forward no longer takes them."""
    from vllm_omni.model_executor.models.common.qwen3_code_predictor import CodePredictorWrapper

    from omni_cache.engine import seam

    monkeypatch.setattr(CodePredictorWrapper, "forward",
                        lambda self, layer0_code, layer0_embed, last_talker_hidden: None)
    problems = seam.check_talker_seam()
    assert any("'generators'" in p for p in problems), problems


def test_talker_keys_seam_check_reports_a_moved_speaker_helper(monkeypatch):
    """The helpers that seed the talker block keys are part of the seam: one that moved is
    reported (and, at start-up, talker identity refuses to install)."""
    import vllm_omni.model_executor.stage_input_processors.tts_utils as tts_utils

    from omni_cache.engine import seam

    assert seam.check_talker_keys_seam() == []
    monkeypatch.delattr(tts_utils, "extract_speaker_from_prompt")
    problems = seam.check_seam()
    assert any("extract_speaker_from_prompt" in p for p in problems), problems


def test_seam_check_reports_a_payload_builder_without_its_snapshot(monkeypatch):
    """The snapshot hand-off's seam can fail: a payload builder that no longer takes the step's
    snapshot as keyword parameters (the fresh hand-off rows would have no source)."""
    from vllm_omni.worker import gpu_ar_model_runner

    from omni_cache.engine import seam

    monkeypatch.setattr(gpu_ar_model_runner.GPUARModelRunner, "_build_omni_model_runner_output_from_snapshot",
                        lambda self, *, scheduler_output, prefix_cache_step_id=None: None)
    problems = seam.check_seam()
    assert any("'hidden_states', 'multimodal_outputs'" in p for p in problems), problems
