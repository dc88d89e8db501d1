"""Benchmarks behind `llm-act bench`: they print tables and write under docs/; not tests."""
