"""omni-cache's cache-aware conversation window for realtime (duplex) Qwen3-Omni sessions, on
vLLM-Omni's own plugin code (``prepare_prompt_config``; no engine): a long voice session
through the stock window and through omni-cache's, comparing how often a turn's prompt
extends the previous turn's (what the thinker's prefix cache can reuse)."""

from __future__ import annotations

import numpy as np
import pybase64 as base64
import pytest

from omni_cache.engine.duplex import (
    STOCK_MAX_AUDIO,
    CacheAwareQwen3OmniDuplexPlugin,
    WindowState,
    group_turns,
    plan_window,
)


def _payload(turn: int) -> dict:
    pcm = np.full(160, turn / 100, dtype="<f4")
    return {"audio": base64.b64encode(pcm.tobytes()).decode()}


def _session(plugin, turns: int, extra_body: dict | None = None) -> list[list]:
    """``turns`` voice turns; per turn the prompt's message list as the plugin builds it,
    each entry reduced to what the prompt encodes (the turn an audio payload came from, or
    the text)."""
    state = plugin.create_session_state()
    history: list[dict] = []
    prompts = []
    for k in range(turns):
        history.append({"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": f"item-{k}"}}]})
        cfg = plugin.prepare_prompt_config({"conversation": [dict(m) for m in history],
                                            **({"extra_body": extra_body} if extra_body else {})},
                                           state=state, payload=_payload(k))
        prompts.append([("audio", round(float(np.frombuffer(base64.b64decode(m["audio_payload"]["audio"]),
                                                            dtype="<f4")[0]) * 100))
                        if "audio_payload" in m else (m["role"], str(m.get("content")))
                        for m in cfg["qwen_messages"]])
        history.append({"role": "assistant", "content": f"answer {k}"})
    return prompts


def _extends(prev: list, cur: list) -> bool:
    return cur[:len(prev)] == prev


@pytest.fixture()
def plugins(monkeypatch):
    from vllm_omni.model_executor.models.qwen3_omni.duplex.plugin import Qwen3OmniDuplexPlugin

    monkeypatch.delenv("OMNI_CACHE_REALTIME_WINDOW", raising=False)  # the default: omni-cache's window
    return Qwen3OmniDuplexPlugin(lambda *a, **k: b""), CacheAwareQwen3OmniDuplexPlugin(lambda *a, **k: b"")


@pytest.mark.parametrize("which", ["vllm_omni", "server_setting", "session_extra_body"])
def test_stock_window_changes_the_prefix_every_turn_from_the_fifth(plugins, which, monkeypatch):
    if which == "server_setting":
        monkeypatch.setenv("OMNI_CACHE_REALTIME_WINDOW", "stock")
    plugin = plugins[0] if which == "vllm_omni" else CacheAwareQwen3OmniDuplexPlugin(lambda *a, **k: b"")
    extra = {"omni_cache_window": "stock"} if which == "session_extra_body" else None
    stock = _session(plugin, 12, extra)
    assert all(_extends(stock[k - 1], stock[k]) for k in range(1, 4))
    assert not any(_extends(stock[k - 1], stock[k]) for k in range(4, 12))
    assert all(sum(e[0] == "audio" for e in p) <= STOCK_MAX_AUDIO for p in stock)


def test_cache_aware_window_keeps_the_prefix_most_turns_and_the_opening_turn(plugins):
    ours = _session(plugins[1], 24)
    extends = [_extends(ours[k - 1], ours[k]) for k in range(1, 24)]
    # 4 audio payloads: the pinned turn's, the kept one's, the one being answered; so with
    # keep_on_slide 1 the window slides every second turn (every turn with the stock window)
    assert sum(extends) >= 11, extends
    assert all(p[0] == ("audio", 0) for p in ours)  # the opening turn stays
    assert all(sum(e[0] == "audio" for e in p) <= STOCK_MAX_AUDIO for p in ours)
    assert all(p[-1] == ("audio", k) for k, p in enumerate(ours))  # the utterance answered is last
    # the turn before a slide is kept (keep_on_slide = 1): its answer is still in context
    for k in range(1, 24):
        if not extends[k - 1]:
            assert ("assistant", f"answer {k - 1}") in ours[k], (k, ours[k])


def test_keep_on_slide_zero_slides_every_third_turn(monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_REALTIME_KEEP_ON_SLIDE", "0")
    ours = _session(CacheAwareQwen3OmniDuplexPlugin(lambda *a, **k: b""), 24)
    assert sum(_extends(ours[k - 1], ours[k]) for k in range(1, 24)) >= 15


def test_plan_window_budget_and_state():
    hist = []
    for _ in range(10):
        hist.append({"role": "user", "content": [{"type": "audio_url"}]})
        hist.append({"role": "assistant", "content": "x"})
    hist.append({"role": "user", "content": [{"type": "audio_url"}]})
    turns = group_turns(hist)
    assert len(turns) == 11 and all(t.audio == 1 for t in turns)
    st = WindowState()
    kept = plan_window(turns, st, pinned_turns=1, keep_on_slide=1)
    assert kept[0] is turns[0] and kept[-1] is turns[-1]
    assert sum(t.audio for t in kept) <= STOCK_MAX_AUDIO and st.segment_start == turns[-2].start
    # the same history again: the segment does not move
    assert plan_window(turns, st, pinned_turns=1, keep_on_slide=1) == kept


def test_bundled_duplex_config_is_the_cpu_config_in_duplex_mode(tmp_path):
    """``qwen3_omni_cpu_duplex.yaml`` = ``qwen3_omni_cpu.yaml`` + ``session_mode: duplex`` + the
    thinker's media limits of vLLM-Omni's duplex deploy (the GPU ones likewise: two GPUs, one
    H200, two H100s at full size); it validates, names omni-cache's pipeline (whose duplex plugin is the cache-aware
    window) and the server prints its URL."""
    import yaml

    from omni_cache.driver.server import OmniServer
    from omni_cache.driver.stage_config import bundled_stage_config, load_stage_config
    from omni_cache.engine.plugin import DUPLEX_PLUGIN, register

    for turn_based, name in (("qwen3_omni_cpu.yaml", "qwen3_omni_cpu_duplex.yaml"),
                             ("qwen3_omni_30b_a3b_gpu.yaml", "qwen3_omni_30b_a3b_gpu_duplex.yaml"),
                             ("qwen3_omni_30b_a3b_h200_dummy.yaml", "qwen3_omni_30b_a3b_h200_dummy_duplex.yaml"),
                             ("qwen3_omni_30b_a3b_2xh100_dummy.yaml", "qwen3_omni_30b_a3b_2xh100_dummy_duplex.yaml")):
        base = yaml.safe_load(bundled_stage_config(turn_based).read_text())
        duplex = yaml.safe_load(bundled_stage_config(name).read_text())
        assert duplex.pop("session_mode") == "duplex", name
        assert duplex.pop("duplex_session")["max_sessions"] == base["stages"][0]["max_num_seqs"], name
        assert duplex["stages"][0].pop("limit_mm_per_prompt") == {"audio": 4, "image": 8}, name
        assert duplex == base, name
        load_stage_config(bundled_stage_config(name))
    register()
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES

    assert OMNI_PIPELINES[base["pipeline"]].duplex_plugin == DUPLEX_PLUGIN
    server = OmniServer(tmp_path / "no-model", bundled_stage_config("qwen3_omni_cpu_duplex.yaml"), port=8123)
    assert server.realtime_url == "ws://127.0.0.1:8123/v1/realtime?duplex=1"
    assert OmniServer(tmp_path / "no-model", bundled_stage_config("qwen3_omni_cpu.yaml"), port=1).realtime_url is None


def test_unknown_window_is_a_clear_error_and_a_session_may_pick_its_window():
    from vllm_omni.engine.duplex.plugin import DuplexRuntimeConfigError

    plugin = CacheAwareQwen3OmniDuplexPlugin(lambda *a, **k: b"")
    with pytest.raises(DuplexRuntimeConfigError, match="omni_cache_window='widest': expected one of omni_cache, stock"):
        plugin.validate_client_extra_body({"omni_cache_window": "widest"})
    plugin.validate_client_extra_body({"omni_cache_window": "stock"})
    ours = _session(plugin, 8)
    stock = _session(plugin, 8, {"omni_cache_window": "stock"})
    assert ours[:4] == stock[:4] and ours[4:] != stock[4:]
