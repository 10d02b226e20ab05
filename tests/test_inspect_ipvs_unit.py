"""The ipvs inspect reader on recorded dumps (host side; tests/uml/test_inspect_ipvs.py runs
it against a real IPVS kernel): ipset matches, masquerade marks, shares, counters."""

from __future__ import annotations

from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.ops.inspect import ipvs as iv
from kproxy.ops.inspect.kernel import RecordedSource
from kproxy.ops.inspect.listing import list_services
from kproxy.ops.inspect.trace import trace

SAVE = """*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODE-PORT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES ! -s 10.244.0.0/16 -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
COMMIT
*filter
:INPUT ACCEPT [0:0]
:KUBE-IPVS-FILTER - [0:0]
COMMIT
"""
IPSET = "create KUBE-CLUSTER-IP hash:ip,port family inet\nadd KUBE-CLUSTER-IP 10.96.0.10,tcp:80\n"


class Source(RecordedSource):
    def ipvs_services(self) -> list[iv.IpvsService]:
        stats = {"conns": 3, "inpkts": 10, "outpkts": 8, "inbytes": 100, "outbytes": 90}
        svc = iv.IpvsService(VSKey("TCP", "10.96.0.10", 80), "rr", 0, 0, stats)
        svc.dests = [
            iv.IpvsDest("10.244.0.2", 8080, 1, "Masq", 1, 2, {"conns": 2}),
            iv.IpvsDest("10.244.0.3", 8080, 1, "Masq", 0, 0, {}),
            iv.IpvsDest("10.244.0.4", 8080, 0, "Masq", 0, 1, {}),
        ]
        return [svc]


def source() -> Source:
    return Source(
        iptables={"legacy": SAVE},
        local_addresses=["10.100.0.1", "10.96.0.10"],
        dumps={"ipset": IPSET, "kube-ipvs0": '[{"addr_info":[{"local":"10.96.0.10"}]}]'},
    )


def test_list_reads_ipvs_counters_and_covers_the_iptables_view() -> None:
    result = list_services(source=source(), stats=True)
    (dp,) = result.dataplanes
    assert dp.dataplane == "ipvs" and dp.live and not result.notes
    (vs,) = dp.servers
    assert (vs.scheduler, vs.kind, vs.packets, vs.bytes) == ("rr", "ClusterIP", 18, 190)
    assert [(e.active, e.inactive, e.weight) for e in vs.endpoints] == [
        (1, 2, 1),
        (0, 0, 1),
        (0, 1, 0),
    ]
    assert vs.to_json()["ipvs_stats"]["conns"] == 3
    assert "IPVS's counters" in result.text()


def test_trace_follows_the_ipset_match_to_the_real_servers_with_weight() -> None:
    outside = trace("10.100.0.2", "10.96.0.10", 80, source=source())
    assert outside.destinations() == {"10.244.0.2:8080", "10.244.0.3:8080"}
    assert [o.masquerade for o in outside.outcomes] == [True, True]
    assert [o.probability for o in outside.outcomes] == [0.5, 0.5]
    pod = trace("10.244.0.9", "10.96.0.10", 80, source=source())
    assert [o.masquerade for o in pod.outcomes] == [False, False]
    other = trace("10.100.0.2", "10.96.0.11", 80, source=source())
    assert other.destinations() == set()
