"""``OMNI_CACHE_CPU_ATTENTION`` (omni_cache/engine/cpu_attention.py): with ``vec`` vLLM's CPU
attention kernel choice never comes out ``amx``; with ``auto`` it is vLLM's own."""

from __future__ import annotations

import pytest

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


@pytest.fixture
def restore(monkeypatch):
    from omni_cache.engine import cpu_attention

    monkeypatch.setattr(cpu_attention, "_APPLIED", [False])
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "amx")  # vLLM's choice on an AMX CPU
    yield cpu_attention


def test_vec_replaces_an_amx_choice(restore, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_CPU_ATTENTION", "vec")
    assert restore.apply() is True and restore.apply() is True  # idempotent
    assert cpu_attn._get_attn_isa("bf16", 32, 64) == "vec"


def test_auto_keeps_vllms_choice(restore, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_CPU_ATTENTION", "auto")
    assert restore.apply() is False
    assert cpu_attn._get_attn_isa("bf16", 32, 64) == "amx"


def test_a_moved_seam_is_an_error(restore, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_CPU_ATTENTION", "vec")
    monkeypatch.delattr(cpu_attn, "_get_attn_isa")
    with pytest.raises(RuntimeError, match="_get_attn_isa is gone"):
        restore.apply()
