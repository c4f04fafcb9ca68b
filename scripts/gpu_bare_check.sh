#!/usr/bin/env bash
# The first call of a GPU session, on a bare lent host (its own Python, torch and Triton; nothing
# installed, no vLLM): omni-cache's engine-free GPU tests (tests/unit/test_core_*.py -k cuda:
# pools, fused step writes, pinned views) and benchmarks.sync_probe --profile, in ~30 s.
# pytest comes from the pure-Python wheels that scripts/offline_bundle.sh puts in bundle/bare/
# (carry "bundle/bare" in the `run` call), zip-imported from PYTHONPATH (docs/gpu.md, "The next
# GPU session", item 0).
#
#   bash scripts/gpu_bare_check.sh LABEL        # results under $OUT: bare-core.xml, probe/result-LABEL.json
set -u
: "${OUT:?set OUT, the folder the run tool brings back}"
LABEL="${1:-tree}"
# results name the caller's commit (benchmarks/lab.py git()): the host's copy of the git metadata is
# stale (twenty-fifth session: a1b8a3d's tree labelled b8363cb)
export BENCH_COMMIT="${BENCH_COMMIT:-$LABEL}"
WHEELS=$(ls bundle/bare/*.whl 2>/dev/null | tr '\n' ':')
[ -n "$WHEELS" ] || echo "no bundle/bare/*.whl: pytest must be installed on this host" >&2
export PYTHONPATH="$PWD:$WHEELS"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider -k cuda tests/unit/test_core_*.py --junitxml "$OUT/bare-core.xml" 2>&1 | tail -15
python3 -m benchmarks.sync_probe --profile --label "$LABEL" --out "$OUT/probe" 2>&1 | grep -v " INFO " | tail -40
