"""``python -m benchmarks.prefill``: the prefill benchmark (:mod:`benchmarks.prefill.harness`)."""

import sys

from benchmarks.prefill.harness import main

if __name__ == "__main__":
    sys.exit(main())
