"""Side-by-side benchmarks against the tools users would otherwise use (`make bench`)."""
