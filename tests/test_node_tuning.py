"""Startup conntrack sizing follows upstream's rule."""

from __future__ import annotations

import pytest

from kproxy.node_tuning import desired_conntrack_max


@pytest.mark.parametrize(
    ("per_core", "minimum", "cpus", "expected"),
    [
        (32768, 131072, 8, 262144),  # upstream's documented example
        (32768, 131072, 2, 131072),  # below the minimum: the minimum
        (0, 131072, 64, 0),  # 0: leave the kernel's value alone
        (32768, 131072, 128, 1 << 20),  # capped like newest upstream
    ],
)
def test_desired_conntrack_max(per_core: int, minimum: int, cpus: int, expected: int) -> None:
    assert desired_conntrack_max(per_core, minimum, cpus) == expected
