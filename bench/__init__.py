"""Benchmarks (run as modules from the repository root: ``python -m bench.<name>``); never timed in tests."""
