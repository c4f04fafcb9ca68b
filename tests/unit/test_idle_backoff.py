"""The CPU platform's back-off for engine steps that schedule nothing
(omni_cache/engine/idle.py): the sleep schedule, its reset, the off switch, and that every
CPU runner class goes through it before vLLM-Omni's ``execute_model``."""

from __future__ import annotations

import pytest

from omni_cache.engine.idle import IdleBackoff


def _schedule(backoff: IdleBackoff, tokens: list[int], slept: list[float]) -> list[float]:
    out = []
    for n in tokens:
        slept.clear()
        ret = backoff.before_step(n)
        assert ret == sum(slept)
        out.append(ret)
    return out


def test_doubles_from_the_second_empty_step_up_to_the_cap_and_resets_on_work():
    slept: list[float] = []
    b = IdleBackoff(0.008, sleep=slept.append)
    delays = _schedule(b, [5, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0], slept)
    assert delays == [0, 0, 0.001, 0.002, 0.004, 0.008, 0.008, 0.008, 0, 0, 0.001]


def test_a_long_wait_stays_at_the_cap():
    slept: list[float] = []
    b = IdleBackoff(0.005, sleep=slept.append)
    delays = _schedule(b, [0] * 10_000, slept)
    assert max(delays) == 0.005 and delays[-1] == 0.005


def test_cap_zero_never_sleeps():
    slept: list[float] = []
    b = IdleBackoff(0.0, sleep=slept.append)
    assert _schedule(b, [0] * 50, slept) == [0] * 50


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="cap_s"):
        IdleBackoff(-1)
    with pytest.raises(ValueError, match="first_s"):
        IdleBackoff(0.01, first_s=0)


def test_every_cpu_runner_backs_off_before_vllm_omni_executes(monkeypatch):
    """The back-off sits in the CPU runners' MRO before vLLM-Omni's ``execute_model``
    (the omni-cache runner included), and reads ``OMNI_CACHE_CPU_IDLE_BACKOFF_MS``."""
    from omni_cache import settings
    from omni_cache.engine import workers_cpu as w

    fix = w._CPURunnerFixups
    for cls in (w.CPUARModelRunner, w.CPUGenerationModelRunner, w.OmniCacheCPUARModelRunner):
        mro = cls.__mro__
        owner = next(c for c in mro if "execute_model" in vars(c) and c.__module__.startswith("vllm_omni"))
        assert mro.index(fix) < mro.index(owner), cls
    monkeypatch.setenv(settings.CPU_IDLE_BACKOFF_MS.name, "3")
    assert settings.CPU_IDLE_BACKOFF_MS.get_int() == 3
    monkeypatch.setenv(settings.CPU_IDLE_BACKOFF_MS.name, "soon")
    with pytest.raises(settings.SettingError, match="CPU_IDLE_BACKOFF_MS"):
        settings.CPU_IDLE_BACKOFF_MS.get_int()
