"""The prefill benchmark (``python -m benchmarks.prefill``, from the checkout):
``harness`` (variants, alternation, result files), ``worker`` (one variant's pipeline in its
own process), ``workloads`` (per-modality request specs), ``summary`` (statistics, bars, plot)."""
