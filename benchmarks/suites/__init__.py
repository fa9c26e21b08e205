"""One module per suite of `python -m benchmarks` (benchmarks/registry.py names them)."""
