"""The benchmarks' shared harness (imports nothing from the benchmark scripts)."""
