"""Benchmarks behind `afd bench`, `afd bench-step` and `afd bench-suite`; imported by nothing but the CLI."""
