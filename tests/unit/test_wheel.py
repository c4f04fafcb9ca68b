"""The stage configs ship in the wheel: build it, install it into an empty directory, and run
``omni-cache validate`` on a bundled config by name from outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_installed_wheel_finds_and_validates_its_stage_configs(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, cwd=elsewhere)
    wheel = next(wheels.glob("omni_cache-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, cwd=elsewhere)
    # the wheel's copy first; the rest of PYTHONPATH (a --target install of the stack, as on the
    # GPU lane) kept, the checkout left out
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != REPO]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *rest])}
    where = subprocess.run([sys.executable, "-c", "import omni_cache; print(omni_cache.__file__)"],
                           check=True, capture_output=True, text=True, cwd=elsewhere, env=env).stdout
    assert where.startswith(str(target)), where  # the wheel's copy, not the checkout
    # `omni-cache validate <name>` for each config, in one interpreter (the CLI's main() per
    # name, its stdout kept per name): each new interpreter spends ~8 s importing vLLM-Omni
    names = ("qwen3_omni_cpu.yaml", "gemma3n_yoco_cpu.yaml", "qwen3_omni_30b_a3b_gpu.yaml")
    script = ("import contextlib, io, json, sys\n"
              "from omni_cache.cli import main\n"
              "res = {}\n"
              "for name in sys.argv[1:]:\n"
              "    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf):\n"
              "        rc = main(['validate', name])\n"
              "    res[name] = [rc, buf.getvalue()]\n"
              "print('RESULTS ' + json.dumps(res))\n")
    out = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, cwd=elsewhere,
                         env=env)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    results = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS "))[len("RESULTS "):])
    assert sorted(results) == sorted(names), results
    for name, (rc, stdout) in results.items():
        assert rc == 0, (name, stdout[-2000:], out.stderr[-2000:])
        assert str(target) in stdout and name in stdout, (name, stdout)
