"""One benchmark variant's pipeline in its own process; see :mod:`omni_cache.bench.worker`."""

from __future__ import annotations

import sys

from omni_cache.bench.worker import main

if __name__ == "__main__":
    sys.exit(main())
