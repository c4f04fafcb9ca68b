"""Thinker prefill time per modality: cache off vs vLLM-Omni's built-in cache vs omni-cache.

Thin entry point; the harness lives in :mod:`omni_cache.bench.harness` (so the installed
``omni-cache bench prefill`` command runs the same code). Options: ``--help``.

    python -m benchmarks.prefill_bench --requests 20 --repeats 3
"""

from __future__ import annotations

import sys

from omni_cache.bench.harness import main

if __name__ == "__main__":
    sys.exit(main())
