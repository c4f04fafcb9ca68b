"""The package's shape, checked from the source (AST) — no engine is imported:

- engine code (runs inside vLLM-Omni's stage processes) never imports driver code, the CLI,
  the model builders (:mod:`omni_cache.models`: a stage reads token ids from its model's
  config) or the benchmarks;
- the engine-free modules (core, yoco, routing, settings) import neither vLLM nor vLLM-Omni nor the
  adapter packages;
- no import cycle between omni-cache's modules (function-level imports included);
- ``OMNI_CACHE_*`` names appear in library code only through :mod:`omni_cache.settings`, and
  every name mentioned anywhere in the repository is a registered setting;
- the yard's arrows: ``omni_cache`` imports nothing from ``benchmarks``, ``scripts`` or ``tests``
  (none of them ships in the wheel) and never edits ``sys.path``; ``benchmarks`` imports nothing
  from ``tests`` (the test lanes live under
  ``tests/lanes``);
- only the driver starts engines: nothing outside ``omni_cache/driver`` constructs vLLM-Omni's
  ``Omni`` / ``AsyncOmni`` or launches its server itself, and in ``benchmarks/`` only
  ``benchmarks/lab.py`` constructs the driver's pipelines and server (:func:`benchmarks.lab.start`);
- ``pyproject.toml`` lists every package;
- the core stays readable: no function in ``omni_cache/core`` over 60 lines, no module there
  over 400 lines; no module imports another's ``_private`` name.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "omni_cache"


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, module: str) -> set[str]:
    """Every module imported anywhere in the file (top level and inside functions)."""
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _internal_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imp in _imports(path, name):
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and imp != "omni_cache":
                targets.add(imp)
        graph[name] = targets
    return graph


def test_engine_code_never_imports_driver_code():
    bad = {f"{m} imports {t}"
           for m, ts in _internal_graph().items() if m.startswith("omni_cache.engine")
           for t in ts if t.startswith(("omni_cache.driver", "omni_cache.cli", "omni_cache.models"))}
    bad |= {f"{m} imports {imp}" for m, p in _modules().items() if m.startswith("omni_cache.engine")
            for imp in _imports(p, m) if imp.split(".")[0] == "benchmarks"}
    assert not bad, sorted(bad)


@pytest.mark.parametrize("package", ["omni_cache.core", "omni_cache.yoco", "omni_cache.routing",
                                     "omni_cache.settings"])
def test_engine_free_modules_import_no_engine_and_no_adapter(package):
    bad = set()
    for m, p in _modules().items():
        if m == package or m.startswith(package + "."):
            for imp in _imports(p, m):
                if imp.split(".")[0] in ("vllm", "vllm_omni") or imp.startswith(
                        ("omni_cache.engine", "omni_cache.driver", "omni_cache.cli")):
                    bad.add(f"{m} imports {imp}")
    assert not bad, sorted(bad)


def _tree_imports(folder: str) -> dict[str, set[str]]:
    """Every module imported by each ``.py`` file under ``REPO/folder`` (by module name)."""
    return {_module_name(p): _imports(p, _module_name(p)) for p in (REPO / folder).rglob("*.py")}


def test_the_package_imports_nothing_from_the_yard():
    """The wheel ships ``omni_cache`` only: an import of ``benchmarks`` / ``scripts`` / ``tests``
    (or a ``sys.path`` edit to reach a checkout) works from a clone and breaks an install."""
    bad = sorted(f"{m} imports {imp}" for m, p in _modules().items() for imp in _imports(p, m)
                 if imp.split(".")[0] in ("benchmarks", "scripts", "tests"))
    bad += sorted(f"{m} edits sys.path" for m, p in _modules().items()
                  if re.search(r"sys\.path\.(insert|append)|sys\.path\s*=", p.read_text()))
    assert not bad, bad


def test_benchmarks_import_nothing_from_tests():
    """Benchmarks are measurements, not test runners: the runners (GPU lane, mutation run) live
    in ``tests/lanes`` and a benchmark imports no test code."""
    bad = sorted(f"{m} imports {imp}" for m, imps in _tree_imports("benchmarks").items()
                 for imp in imps if imp.split(".")[0] == "tests")
    assert not bad, bad


#: vLLM-Omni's engines; the driver's pipelines and server (which start them the product's way)
ENGINES = {"Omni", "AsyncOmni"}
DRIVER_STARTS = {"OmniPipeline", "StreamingPipeline", "OmniServer"}
#: the module a server process runs (``OmniServer.command``)
SERVER_MODULE = "omni_cache.driver.vllm_serve"


def _python_files() -> dict[str, Path]:
    """Every ``.py`` file of the package, the benchmarks, the scripts and the tests, by name."""
    return {_module_name(p): p for folder in ("omni_cache", "benchmarks", "scripts", "tests")
            for p in (REPO / folder).rglob("*.py")}


def _constructs(path: Path, names: set[str]) -> set[str]:
    """The names among ``names`` that ``path`` calls (``X(...)`` or ``mod.X(...)``) or imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names:
                found.add(name)
        elif isinstance(node, ast.ImportFrom):
            found |= {a.name for a in node.names if a.name in names}
    return found


def test_only_the_driver_starts_engines():
    """One way to start a pipeline or a server: ``omni_cache/driver`` (start environment,
    ``start_kwargs``, engine hooks). No other module constructs ``Omni`` / ``AsyncOmni`` or
    names the server's module (tests may read the driver's command line)."""
    bad = []
    for m, p in _python_files().items():
        if m.startswith("omni_cache.driver"):
            continue
        if hit := _constructs(p, ENGINES):
            bad.append(f"{m} constructs {sorted(hit)}")
        if not m.startswith("tests.") and SERVER_MODULE in p.read_text():
            bad.append(f"{m} launches {SERVER_MODULE}")
    assert not bad, bad


def test_benchmarks_start_engines_only_through_the_lab():
    """``benchmarks.lab.start`` is the only way a benchmark starts anything: no other benchmark
    module constructs the driver's pipelines or server."""
    bad = sorted(f"{m} constructs {sorted(hit)}" for m, p in _python_files().items()
                 if m.startswith("benchmarks.") and m != "benchmarks.lab" and (hit := _constructs(p, DRIVER_STARTS)))
    assert not bad, bad


def test_no_import_cycle():
    graph = _internal_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


_NAME = re.compile(r"OMNI_CACHE_[A-Z][A-Z_]*[A-Z]")


def test_settings_are_named_only_through_the_registry():
    """Library code reads no ``OMNI_CACHE_*`` string literal (docstrings aside): every reader
    goes through :mod:`omni_cache.settings`."""
    bad = []
    for m, p in _modules().items():
        if m == "omni_cache.settings":
            continue
        tree = ast.parse(p.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if _NAME.search(node.value):
                    bad.append(f"{m}:{node.lineno}: {node.value[:60]!r}")
    assert not bad, bad


def git_files(*paths: str) -> list[str]:
    """The tracked files under ``paths`` (``git ls-files``). These tests read what is committed,
    so they need a git checkout of the tree: in an exported copy (no ``.git``) they skip, saying
    so (the GPU lane runs in a checkout)."""
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO, capture_output=True, text=True)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        pytest.skip(f"needs a git checkout of the tree ({REPO} is not one): it checks what is committed")
    return subprocess.run(["git", "ls-files", *paths], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()


def test_every_mentioned_setting_is_registered():
    from omni_cache.settings import SETTINGS

    files = git_files("omni_cache", "stage_configs", "docs", "scripts", "README.md", "benchmarks/*.py",
                      "benchmarks/prefill", "tests")
    unknown = {}
    for f in files:
        path = REPO / f
        if path.suffix not in (".py", ".md", ".yaml", ".sh") or not path.is_file():
            continue
        for name in _NAME.findall(path.read_text()):
            if name not in SETTINGS:
                unknown.setdefault(name, f)
    assert not unknown, unknown


def test_docs_settings_table_is_generated_from_the_registry():
    from omni_cache.settings import markdown_table

    doc = (REPO / "docs" / "stage-config.md").read_text()
    begin, end = "<!-- settings:begin -->", "<!-- settings:end -->"
    assert begin in doc and end in doc, "docs/stage-config.md lacks the generated settings table"
    table = doc.split(begin, 1)[1].split(end, 1)[0].strip()
    assert table == markdown_table(), "regenerate it: python -m omni_cache.settings"


def test_pyproject_lists_every_package():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {_module_name(p.parent / "__init__.py") for p in PKG.rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)
    assert cfg["package-dir"]["omni_cache.stage_configs"] == "stage_configs"


MAX_CORE_FUNCTION_LINES = 60
MAX_CORE_MODULE_LINES = 400


def test_core_functions_and_modules_are_short():
    """A core function that needs more lines is several functions; a module that needs more is
    several concepts (``omni_cache.core``'s docstring lists them)."""
    long = []
    for m, p in _modules().items():
        if not m.startswith("omni_cache.core"):
            continue
        text = p.read_text()
        if len(text.splitlines()) > MAX_CORE_MODULE_LINES:
            long.append(f"{m}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CORE_FUNCTION_LINES:
                    long.append(f"{m}.{node.name}: {lines} lines")
    assert not long, long


#: private imports in modules another change is rewriting (issue 29 leaves them to it)
PRIVATE_IMPORTS_PENDING = {"omni_cache.driver.streaming imports omni_cache.driver.pipeline._audio_of"}


def test_no_private_name_is_imported_across_modules():
    """A module uses another's public surface only: no ``from omni_cache.x import _name``."""
    bad = set()
    for m, p in _modules().items():
        for imp in _imports(p, m):
            module, _, name = imp.rpartition(".")
            if module.startswith("omni_cache") and name.startswith("_") and not name.startswith("__"):
                bad.add(f"{m} imports {imp}")
    assert not bad - PRIVATE_IMPORTS_PENDING, sorted(bad - PRIVATE_IMPORTS_PENDING)


def test_committed_benchmark_results_are_json_and_plots_only():
    """Results keep ``result.json`` (and other JSON) and the plot; raw logs and derived stage
    configs (machine paths) stay local (.gitignore)."""
    files = git_files("benchmarks/results")
    bad = [f for f in files if not f.endswith((".json", ".png"))]
    assert not bad, bad
