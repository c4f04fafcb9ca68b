"""Offline bundle of omni-cache's CUDA stack for air-gapped GPU hosts (docs/gpu.md).

Three subcommands, each run by a shell wrapper:

``build`` (``scripts/offline_bundle.sh``, on any machine with a package registry)
    Downloads the wheels of ``requirements/gpu.lock.txt`` for a target Python / platform
    (``pip download --only-binary=:all: --no-deps``; a package with no wheel for the target,
    e.g. ``openai-whisper``, is built with ``pip wheel --no-deps``), adds omni-cache's own wheel
    (:func:`build_own_wheel`: with this Python's setuptools when it can build wheels, else in
    pip's isolated build environment with setuptools from the registry),
    optionally drops what the target already has at a compatible version (``--skip-freeze``:
    a ``pip freeze`` of the target; *compatible* = the target's version satisfies every
    ``Requires-Dist`` specifier that a bundled wheel places on that package), packs the rest as
    one uncompressed tar (wheels are already compressed) and splits it into parts of at most
    ``--part-size`` bytes. Writes ``manifest.json`` (every wheel: name, version, file, bytes,
    sha256; every skipped package and why; every part: file, bytes, sha256) beside the parts.

``verify`` (``scripts/install_offline.sh``, on the target)
    Checks that every part named in the manifest is present with its size and sha256, joins
    them and unpacks the wheels; exits non-zero naming each missing or corrupt part.

``check`` (``scripts/install_offline.sh``, on the target, after ``pip install``)
    Imports the stack and prints torch / CUDA / cuDNN / NCCL / vLLM / vLLM-Omni / omni-cache
    versions; exits non-zero naming each library that is missing or whose loaded version is not
    the bundle's (e.g. an older NCCL found first on the library path).

Standard library only (plus ``packaging``, or pip's vendored copy), so it runs on a bare host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

try:  # pragma: no cover - whichever is present
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pragma: no cover
    from pip._vendor.packaging.markers import Marker  # noqa: F401
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements" / "gpu.lock.txt"
TAR_NAME = "omni-cache-gpu-bundle.tar"
#: pure-Python wheels copied to ``<out>/bare/`` besides the parts: pytest, zip-imported on a bare
#: lent host (its own torch, nothing installed) by ``scripts/gpu_bare_check.sh``
BARE_WHEELS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")
#: manylinux tags tried for the target (pip matches each glibc minor exactly)
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 18, 24, 27, 28, 31, 34, 35, 39)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"])


def log(msg: str) -> None:
    print(f"[gpu-bundle {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_lock(path: Path) -> dict[str, str]:
    """``name==version`` lines of a lock file (comments and blank lines skipped) as
    ``{canonical name: version}``.

    Raises:
        ValueError: a line that is not ``name==version`` (the file and line number named).
    """
    pins: dict[str, str] = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if not m:
            raise ValueError(f"{path}:{i}: expected 'name==version', got {line!r}")
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def read_freeze(path: Path) -> dict[str, str]:
    """A ``pip freeze`` / ``pip list --format=freeze`` of the target as ``{name: version}``
    (editable and URL lines skipped)."""
    have: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)==([^\s;]+)\s*", line)
        if m:
            have[canonicalize_name(m.group(1))] = m.group(2)
    return have


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
    version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
    reqs = [m.group(1).strip() for m in re.finditer(r"^Requires-Dist: (.+)$", text, re.M)]
    return canonicalize_name(name), version, reqs


def target_env(python: str) -> dict[str, str]:
    """Marker environment of the target (CPython ``python`` on x86-64 Linux)."""
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def constraints_on(wheels: dict[str, tuple[str, list[str]]], python: str) -> dict[str, list[tuple[str, str]]]:
    """``{dependency: [(requiring package, specifier)]}`` from every bundled wheel's
    ``Requires-Dist`` whose marker holds on the target (extras not taken)."""
    env = target_env(python)
    out: dict[str, list[tuple[str, str]]] = {}
    for pkg, (_, reqs) in wheels.items():
        for line in reqs:
            r = Requirement(line)
            if r.marker is not None and not r.marker.evaluate(env):
                continue
            out.setdefault(canonicalize_name(r.name), []).append((pkg, str(r.specifier)))
    return out


def compatible(have_version: str, specs: list[tuple[str, str]]) -> tuple[bool, str]:
    """Whether the target's version satisfies every specifier; the reason either way."""
    v = Version(have_version)
    for pkg, spec in specs:
        if spec and not Requirement(f"x{spec}").specifier.contains(v, prereleases=True):
            return False, f"target has {have_version}, {pkg} needs {spec}"
    why = ", ".join(f"{p} {s}" for p, s in specs if s) or "no bundled wheel constrains it"
    return True, f"target has {have_version} ({why})"


def download(pins: dict[str, str], cache: Path, python: str) -> None:
    """Every pinned wheel into ``cache`` (already-present files are reused by pip)."""
    cache.mkdir(parents=True, exist_ok=True)
    req = cache / "requirements.txt"
    have = {wheel_meta(p)[0]: wheel_meta(p)[1] for p in cache.glob("*.whl")}
    missing = {n: v for n, v in pins.items() if have.get(n) != v}
    if not missing:
        log(f"all {len(pins)} wheels already in {cache}")
        return
    log(f"downloading {len(missing)} of {len(pins)} wheels for CPython {python} into {cache}")
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check"]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    binary, sdist_only = {}, {}
    for n, v in missing.items():
        r = subprocess.run(pip + ["download", "--no-deps", "--only-binary=:all:", "--python-version", python,
                                  "--implementation", "cp", *plat, "-d", str(cache), f"{n}=={v}"],
                           capture_output=True, text=True)
        (binary if r.returncode == 0 else sdist_only)[n] = v
    for n, v in sdist_only.items():  # pure-Python packages published as sdists only
        log(f"{n}=={v}: no wheel for the target; building one (pip wheel --no-deps)")
        subprocess.run(pip + ["wheel", "--no-deps", "-w", str(cache), f"{n}=={v}"], check=True)
    req.unlink(missing_ok=True)


def own_wheel_backend_ready() -> bool:
    """This Python can build omni-cache's wheel without build isolation: setuptools >= 68
    (``pyproject.toml``'s ``build-system``) with a ``bdist_wheel`` command (its own from
    setuptools 70.1 on, before that the ``wheel`` package's). A fresh ``python3`` or venv often
    has neither (Python 3.11's venv: setuptools 65.5 and no ``wheel``; 3.12's: no setuptools)."""
    import importlib.metadata
    import importlib.util

    try:
        setuptools = Version(importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        return False
    if setuptools < Version("68"):
        return False
    return setuptools >= Version("70.1") or importlib.util.find_spec("wheel") is not None


def build_own_wheel(into: Path) -> Path:
    """omni-cache's wheel into ``into``. Built with this Python's setuptools
    (``--no-build-isolation``: offline, as before) when :func:`own_wheel_backend_ready`;
    otherwise, or if that fails, in pip's isolated build environment, which installs
    ``build-system.requires`` from the registry the downloads use."""
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob("omni_cache-*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "wheel", "--no-deps", "-q",
           "-w", str(into)]
    if own_wheel_backend_ready():
        r = subprocess.run(pip + ["--no-build-isolation", str(REPO)])
        if r.returncode == 0:
            return next(into.glob("omni_cache-*.whl"))
        log("building without build isolation failed; retrying in an isolated build environment")
    else:
        log("this Python has no setuptools>=68 with bdist_wheel (e.g. no `wheel` package): building in an "
            "isolated build environment (setuptools from the registry)")
    subprocess.run(pip + [str(REPO)], check=True)
    return next(into.glob("omni_cache-*.whl"))


def build(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pins = read_lock(Path(args.lock))
    cache = Path(args.wheels_cache)
    download(pins, cache, args.python)
    log("building omni-cache's wheel")
    proj = out / "_project"
    build_own_wheel(proj)
    wheels: dict[str, tuple[str, list[str]]] = {}
    files: dict[str, Path] = {}
    for p in list(cache.glob("*.whl")) + list(proj.glob("*.whl")):
        name, version, reqs = wheel_meta(p)
        if name in pins and pins[name] != version:
            continue  # another version left in the cache
        if name not in pins and name != "omni-cache":
            continue
        wheels[name], files[name] = (version, reqs), p
    lost = sorted(set(pins) - set(wheels))
    if lost:
        log(f"ERROR: no wheel for {', '.join(lost)}")
        return 1
    skipped: dict[str, str] = {}
    if args.skip_freeze:
        have = read_freeze(Path(args.skip_freeze))
        cons = constraints_on(wheels, args.python)
        for name in list(wheels):
            if name == "omni-cache" or name not in have:
                continue
            ok, why = compatible(have[name], cons.get(name, []))
            if ok and (have[name] == wheels[name][0] or name not in set(args.always or [])):
                skipped[name] = why
        for name in skipped:
            wheels.pop(name)
        log(f"skipping {len(skipped)} packages the target already has at a compatible version")
    bare = out / "bare"  # pytest and its pure-Python deps, zip-imported on a bare host (scripts/gpu_bare_check.sh)
    shutil.rmtree(bare, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps",
                        "--only-binary=:all:", "--python-version", args.python, "-d", str(bare),
                        *(f"{n}=={pins[n]}" if n in pins else n for n in BARE_WHEELS)], capture_output=True, text=True)
    if r.returncode:
        log(f"warning: no pytest wheels for bare hosts in {bare}: {r.stderr.strip()[-300:]}")
    entries = []
    tar = out / TAR_NAME
    log(f"packing {len(wheels)} wheels into {tar}")
    with tarfile.open(tar, "w") as t:
        for name in sorted(wheels):
            p = files[name]
            t.add(p, arcname=f"wheels/{p.name}")
            entries.append({"name": name, "version": wheels[name][0], "file": p.name,
                            "bytes": p.stat().st_size, "sha256": sha256(p)})
    parts = split(tar, out, int(args.part_size))
    tar.unlink()
    manifest = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": args.python,
                "platforms": PLATFORMS, "lock": str(Path(args.lock).name), "tar": TAR_NAME,
                "total_bytes": sum(p["bytes"] for p in parts), "parts": parts, "wheels": entries,
                "skipped": skipped}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log(f"{len(parts)} parts, {manifest['total_bytes'] / 2**20:,.0f} MiB, manifest {out / 'manifest.json'}")
    return 0


def split(tar: Path, out: Path, size: int) -> list[dict]:
    """``tar`` as parts ``<tar>.part-NNN`` of at most ``size`` bytes, with sizes and sha256."""
    parts = []
    with open(tar, "rb") as f:
        i = 0
        while True:
            chunk = f.read(size)
            if not chunk:
                break
            p = out / f"{tar.name}.part-{i:03d}"
            p.write_bytes(chunk)
            parts.append({"file": p.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            i += 1
    return parts


def verify(args) -> int:
    """Check parts against the manifest, join, unpack into ``--into``."""
    d = Path(args.dir)
    manifest = json.loads((d / "manifest.json").read_text())
    bad = []
    for part in manifest["parts"]:
        p = d / part["file"]
        if not p.exists():
            bad.append(f"{part['file']}: missing")
        elif p.stat().st_size != part["bytes"]:
            bad.append(f"{part['file']}: {p.stat().st_size} bytes, manifest says {part['bytes']}")
        elif sha256(p) != part["sha256"]:
            bad.append(f"{part['file']}: sha256 differs from the manifest (corrupt copy: send it again)")
    if bad:
        print(f"ERROR: {len(bad)} of {len(manifest['parts'])} parts unusable in {d}:", file=sys.stderr)
        for b in bad:
            print(f"  {b}", file=sys.stderr)
        return 1
    log(f"{len(manifest['parts'])} parts present, sizes and sha256 match the manifest")
    into = Path(args.into)
    into.mkdir(parents=True, exist_ok=True)
    tar = into / manifest["tar"]
    with open(tar, "wb") as w:
        for part in manifest["parts"]:
            with open(d / part["file"], "rb") as r:
                while chunk := r.read(1 << 24):
                    w.write(chunk)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    tar.unlink()
    for e in manifest["wheels"]:
        if sha256(into / "wheels" / e["file"]) != e["sha256"]:
            print(f"ERROR: wheel {e['file']} differs from the manifest after joining", file=sys.stderr)
            return 1
    log(f"{len(manifest['wheels'])} wheels unpacked into {into / 'wheels'}")
    return 0


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"ERROR {type(e).__name__}: {e}"
    return getattr(m, "__version__", "?")


def check(args) -> int:
    """Import the stack, print versions, compare with the manifest's."""
    want = {}
    if args.manifest and Path(args.manifest).exists():
        want = {e["name"]: e["version"] for e in json.loads(Path(args.manifest).read_text())["wheels"]}
    problems = []
    report: dict[str, str | None] = {}
    import torch

    report["torch"] = torch.__version__
    report["cuda (torch build)"] = torch.version.cuda
    cuda_ok = torch.cuda.is_available()
    report["gpu"] = torch.cuda.get_device_name(0) if cuda_ok else None
    if not cuda_ok:
        problems.append("torch.cuda.is_available() is False: no GPU, or the driver is older than CUDA "
                        f"{torch.version.cuda} needs")
    report["cudnn"] = str(torch.backends.cudnn.version()) if cuda_ok else None
    try:
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        report["nccl"] = f"ERROR {e}"
    for mod in ("triton", "flashinfer", "transformers", "vllm", "vllm_omni", "omni_cache"):
        report[mod] = _version(mod)
    for k, v in report.items():
        print(f"  {k:<20} {v}")
        if isinstance(v, str) and v.startswith("ERROR"):
            problems.append(f"{k}: {v}")
    expect = {"torch": ("torch", report["torch"]), "triton": ("triton", report["triton"]),
              "vllm": ("vllm", report["vllm"]), "vllm-omni": ("vllm_omni", report["vllm_omni"]),
              "transformers": ("transformers", report["transformers"])}
    for pkg, (mod, got) in expect.items():
        if pkg in want and got and not str(got).startswith(want[pkg].split("+")[0]):
            problems.append(f"{mod}: loaded {got}, the bundle installed {want[pkg]} (an older copy earlier on "
                            f"sys.path? put the install first on PYTHONPATH)")
    nccl_want = want.get("nvidia-nccl-cu13")
    if nccl_want and cuda_ok and report["nccl"] != ".".join(nccl_want.split(".")[:3]):
        problems.append(f"NCCL: torch loaded {report['nccl']}, the bundle has nvidia-nccl-cu13 {nccl_want} "
                        "(the host's older libnccl first on the library path?)")
    if "nvidia-cudnn-cu13" in want and cuda_ok:
        major, minor = (int(x) for x in want["nvidia-cudnn-cu13"].split(".")[:2])
        got = int(report["cudnn"] or 0)
        if got // 10000 != major or (got // 100) % 100 != minor:
            problems.append(f"cuDNN: torch loaded {report['cudnn']}, the bundle has nvidia-cudnn-cu13 "
                            f"{want['nvidia-cudnn-cu13']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": report, "problems": problems}, indent=1))
    if problems:
        print("ERROR: the installed stack is not usable:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print("import check passed")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_bundle", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, filter, pack and split the bundle")
    b.add_argument("--lock", default=str(LOCK))
    b.add_argument("--python", default="3.12", help="target CPython version (default 3.12)")
    b.add_argument("--out", required=True, help="folder for the parts and manifest.json")
    b.add_argument("--wheels-cache", default=os.path.expanduser("~/.cache/omni-cache/gpu-wheels"))
    b.add_argument("--part-size", default=str(48 << 20), help="bytes per part (default 48 MiB)")
    b.add_argument("--skip-freeze", help="a `pip freeze` of the target: skip what it has at a compatible version")
    b.add_argument("--always", nargs="*", help="packages bundled unless the target has the exact locked version")
    v = sub.add_parser("verify", help="check parts, join, unpack")
    v.add_argument("dir")
    v.add_argument("--into", required=True)
    c = sub.add_parser("check", help="import check of the installed stack")
    c.add_argument("--manifest")
    c.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "build" and not str(args.part_size).isdigit():
        m = re.fullmatch(r"(\d+)([KMG])i?B?", args.part_size, re.I)
        if not m:
            ap.error(f"--part-size {args.part_size!r}: expected bytes or e.g. 48M")
        args.part_size = int(m.group(1)) << {"K": 10, "M": 20, "G": 30}[m.group(2).upper()]
    return {"build": build, "verify": verify, "check": check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
