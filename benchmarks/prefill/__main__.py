"""``python -m benchmarks.prefill`` = ``omni-cache bench prefill``."""

import sys

from benchmarks.prefill.harness import main

if __name__ == "__main__":
    sys.exit(main())
