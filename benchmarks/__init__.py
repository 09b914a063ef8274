"""Benchmarks comparing keras_dist with each backend's native way to distribute.

Run them with `python benchmarks/run.py`; see `benchmarks/README.md`.
"""
