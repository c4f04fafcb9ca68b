"""scripts/gpu_bundle.py's own-wheel step (issue 45 item 5): ``offline_bundle.sh`` run with a
fresh machine's plain ``python3`` (no ``wheel`` package, an old or no setuptools) must still
build omni-cache's wheel; a Python that can build it keeps the offline ``--no-build-isolation``
path."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def _gpu_bundle():
    spec = importlib.util.spec_from_file_location("gpu_bundle", SCRIPTS / "gpu_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("setuptools", "has_wheel", "ready"), [
    (None, True, False), ("65.5.0", True, False), ("68.1.2", False, False), ("68.1.2", True, True),
    ("70.1.0", False, True), ("84.2.1", False, True),
])
def test_backend_ready_needs_setuptools_68_with_bdist_wheel(monkeypatch, setuptools, has_wheel, ready):
    gb = _gpu_bundle()
    real_version, real_find_spec = importlib.metadata.version, importlib.util.find_spec

    def version(name):
        if name != "setuptools":
            return real_version(name)
        if setuptools is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return setuptools

    def find_spec(name, *a):
        if name == "wheel":
            return object() if has_wheel else None
        return real_find_spec(name, *a)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert gb.own_wheel_backend_ready() is ready


@pytest.mark.parametrize("ready", [True, False])
def test_own_wheel_isolation_only_when_the_backend_is_missing(monkeypatch, tmp_path, ready):
    """A Python that can build the wheel keeps ``--no-build-isolation`` (works offline); one
    that cannot gets pip's isolated build environment. (pip itself is a stand-in here.)"""
    gb = _gpu_bundle()
    calls = []

    def run(cmd, check=False, **kw):
        calls.append(cmd)
        (tmp_path / "omni_cache-0.1.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gb, "own_wheel_backend_ready", lambda: ready)
    monkeypatch.setattr(gb.subprocess, "run", run)
    assert gb.build_own_wheel(tmp_path).name.startswith("omni_cache-")
    assert len(calls) == 1 and calls[0][-1] == str(gb.REPO)
    assert ("--no-build-isolation" in calls[0]) is ready


def _registry_reachable() -> bool:
    # the step's pip runs with --isolated (as the downloads do): the default index
    try:
        with urllib.request.urlopen("https://pypi.org/simple/setuptools/", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.skipif(not _registry_reachable(), reason="no package registry reachable (own-wheel build needs one)")
def test_own_wheel_builds_from_a_clean_venv(tmp_path):
    """The own-wheel step run by a fresh venv's Python (no ``wheel``; setuptools 65.5 on 3.11,
    none on 3.12), as ``offline_bundle.sh`` runs it with a fresh machine's ``python3``: before
    the fix ``pip wheel --no-build-isolation`` failed with "invalid command 'bdist_wheel'"."""
    venv, out = tmp_path / "venv", tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    py = str(venv / "bin" / "python")
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import gpu_bundle as g; "
            "assert not g.own_wheel_backend_ready(), 'the clean venv can build wheels: the test proves nothing'; "
            "print(g.build_own_wheel(Path(sys.argv[2])))")
    r = subprocess.run([py, "-c", code, str(SCRIPTS), str(out)], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    wheel = Path(r.stdout.strip().splitlines()[-1])
    assert wheel.parent == out and wheel.suffix == ".whl" and wheel.is_file()
    name, version, _ = _gpu_bundle().wheel_meta(wheel)
    assert name == "omni-cache" and version
