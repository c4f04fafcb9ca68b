"""Stage processes skip the interpreter's final garbage collections
(:func:`omni_cache.engine.plugin.freeze_gc_at_exit`), which made vLLM-Omni force-kill every
stage on a normal stop (the stop itself: tests/pipeline/test_run.py, test_stop.py)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import gc, os
class Cycle:
    def __del__(self):
        os.write(1, b"collected at exit\\n")
gc.disable()
c = Cycle(); c.me = c; del c  # garbage only a collection finds
{hook}
"""
HOOK = """
from omni_cache.engine.plugin import freeze_gc_at_exit
assert freeze_gc_at_exit() and not freeze_gc_at_exit()  # registers once
"""


def _run(hook: str) -> str:
    return subprocess.run([sys.executable, "-c", PROGRAM.format(hook=hook)], capture_output=True, text=True,
                          timeout=60, check=True).stdout


def test_without_the_hook_the_interpreter_collects_at_exit():
    assert _run("") == "collected at exit\n"  # what the hook saves, seen happening


def test_freeze_gc_at_exit_skips_the_final_collections():
    assert _run(HOOK) == ""


def test_the_vllm_plugin_installs_it():
    """vLLM loads ``register_models`` in every process it starts (engine cores, workers)."""
    out = _run("from omni_cache.engine.plugin import register_models\nregister_models()")
    assert "collected at exit" not in out
