"""Benchmarks. Each module measures its peer in the same run and writes results/bench/<name>.json."""
