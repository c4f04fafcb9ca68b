"""Test lanes: runners that drive the test suite as a whole, not tests themselves (pytest
collects nothing here).

- :mod:`tests.lanes.gpu_check`: the GPU lane (``python -m tests.lanes.gpu_check``; docs/gpu.md);
- :mod:`tests.lanes.mutants`: the planted-fault (mutation) run (``python -m tests.lanes.mutants``;
  docs/architecture.md, "Planted faults").

Their reports go to ``benchmarks/results/`` beside the benchmarks' (committed JSON).
"""
