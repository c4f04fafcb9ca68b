#!/usr/bin/env bash
# Build the offline bundle of omni-cache's CUDA stack (docs/gpu.md, "Offline install"), on any
# machine with a package registry, for an air-gapped GPU host:
#   bash scripts/offline_bundle.sh --out bundle/ [--python 3.12] [--part-size 48M] \
#        [--skip-freeze target-freeze.txt] [--wheels-cache DIR]
# Wheels of requirements/gpu.lock.txt for CPython --python on x86-64 manylinux (+ omni-cache's
# own wheel), minus what the target's `pip freeze` already has at a compatible version, packed
# and split into parts with manifest.json (sizes, sha256). Copy the folder to the target, then
# run scripts/install_offline.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3)}"
exec "$PY" scripts/gpu_bundle.py build "$@"
