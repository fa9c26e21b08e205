"""The figures of docs/benchmarks.md, behind one door: `python -m benchmarks SUITE [ARGS]`
(benchmarks/registry.py lists the suites; benchmarks/harness/ holds what they share)."""
