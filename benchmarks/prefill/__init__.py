"""The prefill benchmark (``omni-cache bench prefill`` = ``python -m benchmarks.prefill``):
``harness`` (variants, alternation, result files), ``worker`` (one variant's pipeline in its
own process), ``workloads`` (per-modality request specs), ``summary`` (statistics, bars, plot)."""
