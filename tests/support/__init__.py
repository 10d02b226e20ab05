"""What tests share: object builders, fakes of the kernel and the cluster, lab helpers.

Test modules import from here, never from each other (tests/test_support.py checks it).
"""
