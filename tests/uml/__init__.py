"""Kernel tests that run inside a User-Mode Linux guest (see tests/test_uml.py)."""
