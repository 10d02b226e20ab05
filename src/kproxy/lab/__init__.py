"""Network-namespace lab for kernel tests, the demo and benchmarks.

Entry points: kproxy.lab.topology.Lab (Python), kproxy.lab.cli.lab_app (`kproxy lab`).
Kept import-free so `python -m kproxy.lab.agent` / `.podserver` start fast in namespaces.
"""
