"""Benchmarks for fastckpt (run as modules: ``python -m benchmarks.<name>``)."""
