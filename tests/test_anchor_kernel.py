"""G14 measured: when the last conntrack-using rule of a namespace goes, established NAT
connections die; the anchor keeps them alive. Proves the kernel fact and the anchor."""

from __future__ import annotations

import pytest

from kproxy.dataplane.anchor import ConntrackAnchor
from kproxy.lab.topology import Lab

pytestmark = pytest.mark.kernel

# The smallest nftables-mode-like dataplane: a ClusterIP DNATed to pod1, masqueraded.
DNAT = """\
add table ip g14
add chain ip g14 pre { type nat hook prerouting priority -100 ; }
add chain ip g14 post { type nat hook postrouting priority 100 ; }
add rule ip g14 pre ip daddr 10.96.0.10 tcp dport 80 dnat to 10.244.0.2:8080
add rule ip g14 post ip daddr 10.244.0.2 masquerade
"""


def stream_survives_ruleset_delete(lab: Lab, *, anchored: bool, use_nft: bool = True) -> bool:
    lab.exec(lab.node_ns, ["nft", "-f", "-"], input=DNAT)
    client = lab.agent(lab.client_ns[0])
    stream = client.open_stream(dst="10.96.0.10", port=80)
    assert client.stream_ping(stream).ok
    anchor = ConntrackAnchor(lab.node_ns, use_nft=use_nft)
    if anchored:
        assert anchor.install() == ("nftables" if use_nft else "iptables-legacy")
    lab.exec(lab.node_ns, ["nft", "delete", "table", "ip", "g14"])
    try:
        return client.stream_ping(stream, timeout=1.0).ok
    finally:
        anchor.remove()
        assert not anchor.present()


def test_established_nat_connections_die_without_a_conntrack_user(lab: Lab) -> None:
    assert not stream_survives_ruleset_delete(lab, anchored=False)


@pytest.mark.parametrize("use_nft", [True, False], ids=["nftables-anchor", "legacy-anchor"])
def test_the_anchor_keeps_them_alive(lab: Lab, use_nft: bool) -> None:
    assert stream_survives_ruleset_delete(lab, anchored=True, use_nft=use_nft)
