"""Tools around the benchmarks: the device runner and the GPU test shards, A/B runs of a patch, the
compute-sanitizer case, profiler targets and timing probes. They print or drive other tools and
write no result table (benchmarks/ holds the scripts that do). Run one from the repository root as
``python -m scripts.NAME`` (the checkout's package, no install needed) or ``bash scripts/NAME.sh``."""
