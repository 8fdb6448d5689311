"""Benchmark workloads and clients (see `nanoserve bench --help`)."""
