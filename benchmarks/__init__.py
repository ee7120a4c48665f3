"""Benchmark helpers for bench.py (the floor arithmetic, the peer engines) and the results log."""
