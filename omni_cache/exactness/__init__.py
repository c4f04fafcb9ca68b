"""Exactness, stated and searched for: seeded conversations (:mod:`.conversations`), the
oracles that judge what each stage received (:mod:`.oracles`), and the differential fuzzer that
runs conversations through cache off / vLLM-Omni's built-in cache / omni-cache and shrinks a
failure to a small reproducible case (:mod:`.fuzz`). docs/architecture.md ("Integrity") says
what is bitwise against what; ``tests/lanes/fuzz_exactness.py`` runs any number of cases."""
