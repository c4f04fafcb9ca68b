"""Shared engines for the pipeline tests: one real vLLM-Omni engine per configuration for the
whole session, started when a test first needs it and stopped right after the last test that
needs it (two cores and 24 GiB hold two or three pipelines at once, not ten).

- Each engine is a session fixture named after its configuration (``sync_omni``,
  ``stream_off``, ``stream_omni``, ``stream_builtin``, ``stress_omni``, ``gemma4``, ``gemma3n``), built by
  :mod:`tests.pipeline.engines`; the workloads a module runs on it are session fixtures too,
  so another module comparing against them does not run them again.
- :func:`pytest_collection_modifyitems` orders the pipeline modules so the tests of one engine
  are adjacent (:data:`MODULE_ORDER`), then records, per engine, its last test;
  :func:`pytest_runtest_teardown` stops an engine after that test.
- The in-process engines run every stage on vLLM's ``uni`` executor (the worker inside the
  stage's engine-core process: one process per stage, not two); the production process layout
  (vLLM's default ``mp``) stays covered by ``omni-cache run`` / ``serve`` and the stop tests,
  which start it as users do (docs/cpu.md, "Test suite").
"""

from __future__ import annotations

import time

import pytest

from tests.pipeline.engines import ENGINES, EngineRegistry

#: pipeline modules in run order: modules sharing an engine are adjacent
MODULE_ORDER = ("test_cache_equality", "test_streaming_equality", "test_exactness_fuzz", "test_stress",
                "test_routing",
                "test_yoco_pipeline", "test_serve", "test_realtime", "test_run", "test_stop")

_registry: EngineRegistry | None = None
_last_user: dict[str, str] = {}  # engine name -> nodeid of the last test that uses it


def _module_rank(item) -> int:
    name = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)


def pytest_collection_modifyitems(session, config, items):
    """Pipeline tests grouped by module in :data:`MODULE_ORDER` (file order inside a module);
    each shared engine's last user recorded."""
    pipeline = [i for i in items
                if "tests/pipeline/" in i.nodeid.replace("\\", "/") or i.nodeid.startswith("pipeline/")]
    if not pipeline:
        return
    in_pipeline = set(pipeline)
    ordered = sorted(pipeline, key=_module_rank)  # stable: file order within a module
    items[:] = [i for i in items if i not in in_pipeline] + ordered
    _last_user.clear()
    for item in ordered:
        for name in ENGINES:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


@pytest.fixture(scope="session")
def engines(tmp_path_factory, tiny_model_dir):
    global _registry
    _registry = EngineRegistry(tmp_path_factory, tiny_model_dir)
    yield _registry
    _registry.close_all()
    _registry = None


def pytest_runtest_teardown(item, nextitem):
    if _registry is None:
        return
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and _registry.started(name):
            t0 = time.perf_counter()
            _registry.close(name)
            print(f"\n[engines] {name} stopped after its last test ({time.perf_counter() - t0:.1f} s)")


def _engine_fixture(name: str):
    @pytest.fixture(scope="session", name=name)
    def fixture(engines):
        return engines.get(name)

    return fixture


sync_omni = _engine_fixture("sync_omni")
stream_off = _engine_fixture("stream_off")
stream_omni = _engine_fixture("stream_omni")
stream_builtin = _engine_fixture("stream_builtin")
stress_omni = _engine_fixture("stress_omni")
gemma4 = _engine_fixture("gemma4")
gemma3n = _engine_fixture("gemma3n")
