"""Benchmarks of kvstore's hot paths, run in-process by `kvstore bench`."""
