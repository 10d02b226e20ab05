"""kproxy benchmarks: render, sync and memory at scale (`make bench`, see bench/run.py)."""
