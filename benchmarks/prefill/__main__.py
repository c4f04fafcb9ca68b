"""``python -m benchmarks.prefill``: the prefill benchmark (:mod:`benchmarks.prefill.harness`)."""

from benchmarks.prefill.harness import main

if __name__ == "__main__":
    raise SystemExit(main())
