"""ipvs mode's rtnetlink side (in UML: the host kernel has no dummy driver): kube-ipvs0
created in another network namespace (never in the caller's), addresses bound and unbound
in batches, one dump split between kube-ipvs0 and the other interfaces."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator

import pytest

from kproxy.dataplane.ipvs.dummy import DummyDevice

pytestmark = pytest.mark.kernel


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpt-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def ip(netns: str, *args: str) -> str:
    return subprocess.run(
        ["ip", "-n", netns, *args], capture_output=True, text=True, check=True
    ).stdout


def test_kube_ipvs0_lives_in_the_given_namespace_with_batched_addresses(netns: str) -> None:
    before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    dummy = DummyDevice(netns)
    try:
        assert dummy.lookup() is None
        index = dummy.ensure()
        assert dummy.lookup() == (index, "dummy")
        assert dummy.ensure() == index  # idempotent
        link = ip(netns, "-o", "link", "show", "kube-ipvs0")
        assert "UP" not in link.split("<", 1)[1].split(">", 1)[0].split(","), link
        vips = [f"10.96.{i // 250}.{i % 250 + 1}" for i in range(600)]
        assert dummy.bind(index, vips) == []
        assert dummy.bind(index, vips[:5]) == []  # replace: binding twice is fine
        shown = ip(netns, "-4", "-o", "addr", "show", "dev", "kube-ipvs0")
        assert shown.count(" inet ") == 600 and "10.96.0.1/32" in shown
        ip(netns, "addr", "add", "192.0.2.5/24", "dev", "lo")
        addrs = dummy.addresses(index)
        assert addrs.dummy == frozenset(vips)
        assert "192.0.2.5" in addrs.node and not addrs.node & addrs.dummy
        assert dummy.unbind(index, vips[100:]) == []
        assert dummy.unbind(index, vips[100:]) == []  # already gone: not an error
        assert dummy.addresses(index).dummy == frozenset(vips[:100])
        failed = dummy.bind(index + 1000, ["10.96.9.9"])  # no such interface
        assert [ip_ for ip_, _ in failed] == ["10.96.9.9"]
        assert dummy.delete() and dummy.lookup() is None
    finally:
        dummy.close()
    # The caller's namespace did not change.
    assert subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout == before
