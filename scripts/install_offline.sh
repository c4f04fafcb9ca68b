#!/usr/bin/env bash
# Install omni-cache's CUDA stack from an offline bundle (scripts/offline_bundle.sh) on a GPU
# host with no registry (docs/gpu.md, "Offline install"):
#   bash scripts/install_offline.sh BUNDLE_DIR --target /opt/omni-cache/site   # then PYTHONPATH=that dir
#   bash scripts/install_offline.sh BUNDLE_DIR --venv .venv-gpu                # a venv (with the host's
#                                                                             #  system site-packages)
# Checks every part (count, size, sha256) against manifest.json, joins and unpacks them,
# `pip install --no-index --no-deps` the wheels, then imports the stack and prints torch / CUDA /
# cuDNN / NCCL / vLLM / vLLM-Omni / omni-cache versions; exits non-zero naming any missing part
# or missing / mismatched library.
set -euo pipefail
usage() { echo "usage: $0 BUNDLE_DIR (--target DIR | --venv DIR) [--python PY] [--work DIR]" >&2; exit 2; }
[ $# -ge 3 ] || usage
BUNDLE="$1"; shift
TARGET=""; VENV=""; PY="${PYTHON:-python3}"; WORK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --target) TARGET="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    *) usage ;;
  esac
done
[ -n "$TARGET$VENV" ] || usage
HERE="$(cd "$(dirname "$0")" && pwd)"
[ -f "$BUNDLE/manifest.json" ] || { echo "ERROR: $BUNDLE/manifest.json not found: not a bundle folder" >&2; exit 1; }
WORK="${WORK:-$(mktemp -d)}"
t0=$(date +%s)
step() { echo "==> [$(( $(date +%s) - t0 ))s] $*"; }
step "verifying and joining the parts in $BUNDLE"
"$PY" "$HERE/gpu_bundle.py" verify "$BUNDLE" --into "$WORK"
if [ -n "$VENV" ]; then
  step "creating $VENV (system site-packages visible: the host's CUDA libraries)"
  "$PY" -m venv --system-site-packages "$VENV"
  PY="$VENV/bin/python"
  step "pip install --no-index --no-deps into $VENV"
  "$PY" -m pip install -q --no-index --no-deps --no-cache-dir "$WORK"/wheels/*.whl
else
  step "pip install --no-index --no-deps --target $TARGET"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$WORK"/wheels/*.whl
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
rm -rf "$WORK/wheels"
step "import check"
"$PY" "$HERE/gpu_bundle.py" check --manifest "$BUNDLE/manifest.json" ${CHECK_JSON:+--json "$CHECK_JSON"}
step "installed in $(( $(date +%s) - t0 )) s${TARGET:+; use it with: export PYTHONPATH=$TARGET}"
