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


CHILD = """
import gc, multiprocessing
from omni_cache.engine.plugin import freeze_gc_for_process_teardown

def child(q):
    before = gc.get_freeze_count()
    q.put((freeze_gc_for_process_teardown(), before, gc.get_freeze_count()))

if __name__ == "__main__":
    before = gc.get_freeze_count()
    assert freeze_gc_for_process_teardown() is False and gc.get_freeze_count() == before  # main process
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=60))
    p.join(60)
"""


def test_a_stage_process_freezes_its_heap_before_the_runner_teardown(tmp_path):
    """vLLM's runner teardown collects the whole heap (``_cleanup_profiling_kv_cache``); in a
    stage's own process (a multiprocessing child) the heap is frozen first, in a main process
    (in-process engines) it is not. The child's heap is frozen by the call (its permanent
    generation grows by thousands of objects); what was frozen before it is not asserted: on the
    GPU host (Python 3.12.3, the offline bundle) the child started with 375 frozen objects, here
    (3.11) with none (docs/gpu.md, "Twentieth session")."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True).stdout
    froze, before, after = eval(out.strip().splitlines()[-1])  # noqa: S307 (our own child's tuple)
    assert froze is True and after - before > 1000, out


def test_the_cpu_runners_freeze_before_vllms_teardown():
    """Every CPU runner (omni-cache's and the plain ones of the cache-off / built-in variants)
    and the GPU omni-cache runner call it in ``shutdown`` before vLLM's own."""
    import inspect

    from omni_cache.engine import runner, workers_cpu

    for cls in (workers_cpu._CPURunnerFixups, runner.OmniCacheRunnerMixin):
        src = inspect.getsource(cls.shutdown)
        assert src.index("freeze_gc_for_process_teardown()") < src.index("parent()"), cls
