"""IpvsDataplane against in-memory fakes (tests/support/ipvs_fakes.py decodes the real
netlink messages): the sync order and its diffs, graceful termination, weights, ownership of stale
virtual servers, excludeCIDRs, detach beside iptables mode, and error reporting."""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kproxy.dataplane.base import SyncError
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.ipvs import hold as ipvs_hold
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.dataplane.ipvs.proxier import IpvsDataplane
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.ipvs_fakes import FakeDummy, FakeIpset, FakeIptables, FakeIpvs, decode
from tests.support.objects import endpoint, endpoint_slice, node, port, service

VIP = "10.96.0.10"
KEY = VSKey("TCP", VIP, 80)
PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def objects(pods: tuple[str, ...] = PODS, proto: str = "TCP", **spec: Any) -> list[Any]:
    return [
        node(),
        service("web", VIP, [port("http", 80, 8080, protocol=proto)], **spec),
        endpoint_slice("web", [endpoint(p) for p in pods], [port("http", 8080, protocol=proto)]),
    ]


def snap(*objs: Any) -> Any:
    return snapshot_from_objects(list(objs) or objects(), "node1")


@pytest.fixture
def parts() -> tuple[FakeIpvs, FakeDummy, FakeIpset, FakeIptables]:
    return FakeIpvs(), FakeDummy(), FakeIpset(), FakeIptables()


def make(parts: tuple[FakeIpvs, FakeDummy, FakeIpset, FakeIptables], **opts: Any) -> IpvsDataplane:
    ipvs, dummy, ipset, ipt = parts
    return IpvsDataplane(
        ipt.backend(),
        NodeFacts(node_ips=("10.100.0.1",), local_addresses=("10.100.0.1",)),
        RuleOptions(cluster_cidrs=("10.244.0.0/16",), **opts),
        ipvs=ipvs,  # type: ignore[arg-type]
        ipset=ipset,  # type: ignore[arg-type]
        dummy=dummy,  # type: ignore[arg-type]
        clock=Clock(),
    )


def whats(ipvs: FakeIpvs) -> list[str]:
    out = [r.what for r in ipvs.sent]
    ipvs.sent.clear()
    return out


def test_first_sync_programs_everything_in_upstreams_order(parts: Any) -> None:
    ipvs, dummy, ipset, ipt = parts
    dp = make(parts)
    svc, eps = objects()[1:]
    svc["spec"]["type"] = "NodePort"
    svc["spec"]["ports"][0]["nodePort"] = 30080
    result = dp.sync(snap(node(), svc, eps), full=True)
    assert result.full
    # The NodePort on the node's address from the kernel (not loopback, not kube-ipvs0).
    assert set(ipvs.services_) == {KEY, VSKey("TCP", "10.100.0.1", 30080)}
    assert {d for d in ipvs.dests_[KEY]} == {(p, 8080) for p in PODS}
    assert all(d.weight == 1 and d.fwd_method == n.FWD_MASQ for d in ipvs.dests_[KEY].values())
    assert dummy.bound == {VIP}
    assert ipset.sets[n.CLUSTER_IP] == {f"{VIP},tcp:80"} and ipset.sets[n.IPVS_IPS] == {VIP}
    assert set(ipset.sets) == set(n.SET_NAMES)
    (restore,) = ipt.restores
    # Missing jumps are prepended in the same restore, before each table's COMMIT.
    assert '-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in (
        restore
    )
    assert '-I OUTPUT 1 -m comment --comment "kubernetes ipvs access filter"' in restore
    assert restore.index("*nat") < restore.index("*filter")


def test_unchanged_partial_sync_touches_nothing(parts: Any) -> None:
    ipvs, dummy, ipset, ipt = parts
    dp = make(parts)
    s = snap()
    dp.sync(s, full=True)
    dp.sync(s, full=False)
    whats(ipvs)
    ipset.restores.clear()
    ipt.restores.clear()
    result = dp.sync(s, full=False)
    assert whats(ipvs) == [] and ipset.restores == [] and ipt.restores == []
    assert result.rewritten == 0 and result.rules_written == {"nat": 0, "filter": 0}


def test_first_partial_sync_after_a_full_one_rewrites_the_iptables_layer(parts: Any) -> None:
    """A switch from iptables mode: its cleanup, right after our full sync, deletes the chains
    both modes name alike (KUBE-SERVICES, KUBE-POSTROUTING, ...) and their jumps."""
    ipvs, dummy, ipset, ipt = parts
    dp = make(parts)
    s = snap()
    dp.sync(s, full=True)
    ipt.restores.clear()
    dp.sync(s, full=False)  # the daemon's sync right after the switch
    (restore,) = ipt.restores
    assert ":KUBE-SERVICES - [0:0]" in restore and "-I PREROUTING 1 " in restore
    ipt.restores.clear()
    dp.sync(s, full=False)
    assert ipt.restores == []


def test_endpoint_change_sends_only_its_real_servers(parts: Any) -> None:
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(), full=True)
    whats(ipvs)
    dp.sync(snap(*objects(pods=(*PODS[:2], "10.244.0.9"))), full=False)
    assert sorted(whats(ipvs)) == [
        f"add real server 10.244.0.9:8080 to {KEY}",
        f"delete real server 10.244.0.4:8080 of {KEY}",
    ]


def test_tcp_real_server_with_connections_drains_then_goes(parts: Any) -> None:
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(), full=True)
    ipvs.dests_[KEY][(PODS[2], 8080)] = ipvs.dests_[KEY][(PODS[2], 8080)].__class__(
        PODS[2], 8080, 1, active=1, inactive=2
    )
    whats(ipvs)
    shrunk = snap(*objects(pods=PODS[:2]))
    dp.sync(shrunk, full=False)
    assert whats(ipvs) == [f"set weight 0 of real server 10.244.0.4:8080 of {KEY}"]
    assert ipvs.dests_[KEY][(PODS[2], 8080)].weight == 0
    assert list(dp.draining) == [(KEY, (PODS[2], 8080))]
    dp.sync(shrunk, full=True)  # still busy: stays at weight 0
    assert (PODS[2], 8080) in ipvs.dests_[KEY] and not whats(ipvs)
    ipvs.add_dest(KEY, PODS[2], 8080, weight=0)  # connections ended
    dp.sync(shrunk, full=False)
    assert whats(ipvs) == [f"delete real server 10.244.0.4:8080 of {KEY}"]
    assert not dp.draining


def test_draining_endpoint_that_returns_gets_weight_one(parts: Any) -> None:
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(), full=True)
    ipvs.add_dest(KEY, PODS[2], 8080, weight=1, active=3)
    dp.sync(snap(*objects(pods=PODS[:2])), full=False)
    whats(ipvs)
    dp.sync(snap(), full=False)
    assert whats(ipvs) == [f"set weight 1 of real server 10.244.0.4:8080 of {KEY}"]
    assert not dp.draining and ipvs.dests_[KEY][(PODS[2], 8080)].weight == 1


def test_failed_batch_leaves_no_drain_the_kernel_never_saw(parts: Any) -> None:
    """A draining endpoint returns and another goes in a batch that fails: the retry must
    still give the returning one weight 1 (it once stayed at weight 0 for good)."""
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(), full=True)
    ipvs.add_dest(KEY, PODS[2], 8080, weight=1, active=3)
    ipvs.add_dest(KEY, PODS[1], 8080, weight=1, active=3)
    dp.sync(snap(*objects(pods=PODS[:2])), full=False)
    assert list(dp.draining) == [(KEY, (PODS[2], 8080))]
    flipped = snap(*objects(pods=(PODS[0], PODS[2])))
    ipvs.batch_error = OSError(errno.EIO, "batch refused")
    with pytest.raises(SyncError):
        dp.sync(flipped, full=False)
    assert list(dp.draining) == [(KEY, (PODS[2], 8080))]
    ipvs.batch_error = None
    dp.sync(flipped, full=True)
    assert ipvs.dests_[KEY][(PODS[2], 8080)].weight == 1
    assert ipvs.dests_[KEY][(PODS[1], 8080)].weight == 0
    assert list(dp.draining) == [(KEY, (PODS[1], 8080))]


def test_udp_real_servers_go_at_once_even_with_connections(parts: Any) -> None:
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(*objects(proto="UDP")), full=True)
    udp = VSKey("UDP", VIP, 80)
    ipvs.add_dest(udp, PODS[2], 8080, active=0, inactive=5)
    whats(ipvs)
    dp.sync(snap(*objects(pods=PODS[:2], proto="UDP")), full=False)
    assert whats(ipvs) == [f"delete real server 10.244.0.4:8080 of {udp}"]
    assert not dp.draining


def test_first_sync_resets_weights_later_syncs_keep_them(parts: Any) -> None:
    ipvs, *_ = parts
    ipvs.add(KEY)
    ipvs.add_dest(KEY, PODS[0], 8080, weight=5)
    dp = make(parts)
    dp.sync(snap(), full=True)
    assert ipvs.dests_[KEY][(PODS[0], 8080)].weight == 1
    ipvs.add_dest(KEY, PODS[0], 8080, weight=7)  # an operator's change
    dp.sync(snap(), full=True)
    assert ipvs.dests_[KEY][(PODS[0], 8080)].weight == 7
    # A direct-routing real server (pyroute2's default) is turned into masquerading.
    ipvs.add_dest(KEY, PODS[1], 8080, weight=1, fwd_method=3)
    dp.sync(snap(), full=True)
    assert ipvs.dests_[KEY][(PODS[1], 8080)].fwd_method == n.FWD_MASQ


def test_scheduler_change_edits_in_place(parts: Any) -> None:
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(), full=True)
    whats(ipvs)
    svc = service("web", VIP, [port("http", 80, 8080)], sessionAffinity="ClientIP")
    svc["metadata"]["annotations"] = {n.SCHEDULER_ANNOTATION: "lc"}
    dp.sync(snap(node(), svc, objects()[2]), full=False)
    sent = ipvs.sent[:]
    assert whats(ipvs) == [f"edit virtual server {KEY}"]
    cmd, key, attrs, _ = decode(sent[0])
    assert key == KEY
    assert ipvs.services_[KEY].attributes == ("lc", n.FLAG_PERSISTENT, 10800)


def test_stale_virtual_servers_go_only_when_ours_and_not_excluded(parts: Any) -> None:
    ipvs, dummy, ipset, _ = parts
    stale = VSKey("TCP", "10.96.9.9", 80)  # bound on kube-ipvs0: upstream's leftover
    in_set = VSKey("UDP", "10.96.9.8", 53)  # in KUBE-CLUSTER-IP
    node_port = VSKey("TCP", "10.100.0.1", 30999)  # a NodePort in KUBE-NODE-PORT-TCP
    foreign = VSKey("TCP", "10.100.0.1", 8443)  # keepalived on the node IP
    excluded = VSKey("TCP", "10.111.0.5", 80)  # bound, but in excludeCIDRs
    for k in (stale, in_set, node_port, foreign, excluded):
        ipvs.add(k)
    dummy.exists = True
    dummy.bound |= {"10.96.9.9", "10.111.0.5"}
    ipset.sets = {n.CLUSTER_IP: {"10.96.9.8,udp:53"}, n.NODE_PORT_TCP: {"30999"}}
    dp = make(parts, ipvs_exclude_cidrs=("10.111.0.0/16",))
    result = dp.sync(snap(), full=True)
    assert set(ipvs.services_) == {KEY, foreign, excluded}
    assert result.stale_removed == 3
    assert dummy.bound == {VIP}  # superfluous addresses are unbound (upstream)


def test_refused_requests_are_logged_with_the_service_and_retried(
    parts: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ipvs, *_ = parts
    ipvs.refuse = {f"add virtual server {KEY}": errno.ENOENT}
    dp = make(parts)
    with caplog.at_level(logging.ERROR):
        result = dp.sync(snap(), full=True)  # the rest of the sync still happens
    assert result.full and KEY not in ipvs.services_
    text = caplog.text
    assert "service default/web:http" in text and "No such file or directory" in text
    assert "ip_vs_rr available?" in text
    ipvs.refuse = {}
    whats(ipvs)
    dp.sync(snap(), full=False)
    assert f"add virtual server {KEY}" in whats(ipvs) and KEY in ipvs.services_


def test_invalid_annotation_is_logged_once(parts: Any, caplog: pytest.LogCaptureFixture) -> None:
    dp = make(parts)
    svc = service("web", VIP, [port("http", 80, 8080)])
    svc["metadata"]["annotations"] = {n.SCHEDULER_ANNOTATION: "random"}
    s = snap(node(), svc)
    with caplog.at_level(logging.WARNING):
        dp.sync(s, full=True)
        dp.sync(s, full=False)
    lines = [r.message for r in caplog.records if n.SCHEDULER_ANNOTATION in r.message]
    assert len(lines) == 1 and "service default/web" in lines[0]


def test_failed_bind_makes_the_next_sync_full(parts: Any) -> None:
    ipvs, dummy, *_ = parts
    dp = make(parts)
    dp.sync(snap(), full=True)
    dummy.exists = False  # someone deleted kube-ipvs0
    svc = service("api", "10.96.0.30", [port("http", 80, 8080)])
    dp.sync(snap(*objects(), svc), full=False)
    assert dp.sync(snap(*objects(), svc), full=False).full
    assert "10.96.0.30" in dummy.bound


IPTABLES_MODE_SAVE = """*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-SVC-ABC - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -j KUBE-SVC-ABC
COMMIT
*filter
:INPUT ACCEPT [0:0]
:KUBE-IPVS-FILTER - [0:0]
:KUBE-FORWARD - [0:0]
-A INPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
COMMIT
"""


def test_detach_beside_iptables_mode_keeps_the_shared_jumps(parts: Any) -> None:
    *_, ipt = parts
    ipt.save_text = IPTABLES_MODE_SAVE
    make(parts).detach()
    (restore,) = ipt.restores
    assert '-D INPUT -m comment --comment "kubernetes ipvs access filter"' in restore
    assert "KUBE-SERVICES" not in restore and "KUBE-FORWARD" not in restore


def test_detach_alone_deletes_every_jump(parts: Any) -> None:
    *_, ipt = parts
    ipt.save_text = IPTABLES_MODE_SAVE.replace(
        '-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -j KUBE-SVC-ABC\n',
        "",
    )
    make(parts).detach()
    (restore,) = ipt.restores
    assert '-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in (
        restore
    )
    assert "-D FORWARD" in restore and "-D INPUT" in restore


def test_cleanup_removes_ours_in_order_and_spares_others(parts: Any) -> None:
    ipvs, dummy, ipset, ipt = parts
    dp = make(parts)
    dp.sync(snap(), full=True)
    foreign = VSKey("TCP", "10.100.0.1", 8443)
    ipvs.add(foreign)
    ipset.sets["other-software"] = {"1.2.3.4"}
    ipt.save_text = IPTABLES_MODE_SAVE.replace(
        '-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -j KUBE-SVC-ABC\n',
        "",
    )
    removed = dp.cleanup()
    kinds = [o.kind for o in removed]
    # virtual servers, then iptables, then the interface, then the ipsets (last).
    assert kinds.index("ipvs-virtual-server") < kinds.index("iptables-chain")
    assert kinds.index("iptables-chain") < kinds.index("interface") < kinds.index("ipset")
    assert set(ipvs.services_) == {foreign}
    assert set(ipset.sets) == {"other-software"}
    assert not dummy.exists


def test_prepare_sets_timeouts_only_when_configured(parts: Any, monkeypatch: Any) -> None:
    ipvs, *_ = parts
    seen: list[dict[str, int]] = []
    monkeypatch.setattr(IpvsDataplane, "_sysctls", lambda self, wanted: seen.append(wanted))
    make(parts).prepare()
    assert ipvs.timeouts_set is None
    assert seen[0]["net/ipv4/vs/conntrack"] == 1 and "net/ipv4/conf/all/arp_ignore" not in seen[0]
    make(parts, ipvs_tcp_timeout=900, ipvs_strict_arp=True).prepare()
    assert ipvs.timeouts_set == (900, 0, 0)
    assert seen[1]["net/ipv4/conf/all/arp_ignore"] == 1
    assert seen[1]["net/ipv4/conf/all/arp_announce"] == 2


def test_cleanup_beside_iptables_mode_removes_only_ipvs_only_chains(parts: Any) -> None:
    """After a switch to iptables mode in the same backend: its KUBE-SERVICES, KUBE-FORWARD
    (names ipvs mode uses too) stay; KUBE-NODE-PORT, KUBE-IPVS-FILTER and their jumps go."""
    *_, ipt = parts
    ipt.save_text = IPTABLES_MODE_SAVE
    dp = make(parts)
    removed = dp.cleanup()
    chains = {(o.where.split()[-1], o.name) for o in removed if o.kind == "iptables-chain"}
    assert chains == {("nat", "KUBE-NODE-PORT"), ("filter", "KUBE-IPVS-FILTER")}
    rules = [o.name for o in removed if o.kind == "iptables-rule"]
    assert rules == [
        '-A INPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER'
    ]
    (restore,) = ipt.restores
    assert "-X KUBE-SERVICES" not in restore and "-X KUBE-FORWARD" not in restore


# --- retire: the datagram flows of UDP virtual servers (ipvs/hold.py) --------------------------

UDP = VSKey("UDP", VIP, 80)


def retiring(
    parts: Any, monkeypatch: pytest.MonkeyPatch, *, holds: bool, expired: bool = True
) -> list[str]:
    """A synced UDP service with a flow, retire()d; the events of its datagram handling."""
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(*objects(proto="UDP")), full=True)
    ipvs.add_dest(UDP, PODS[0], 8080, active=0, inactive=1)
    events: list[str] = []

    @contextlib.contextmanager
    def held(backend: Any, netns: Any, keys: list[VSKey]) -> Iterator[object | None]:
        events.append(f"hold {' '.join(map(str, keys))}" if holds else "no hold")
        yield object() if holds else None
        events.append("release")

    real_delete = ipvs.delete_services

    def delete_services(keys: Any) -> Any:
        keys = list(keys)
        events.append(f"delete {' '.join(map(str, keys))}")
        return real_delete(keys)

    def forget(keys: list[VSKey]) -> int:
        events.append(f"forget {' '.join(map(str, keys))}")
        return 1

    monkeypatch.setattr(ipvs_hold, "held", held)
    monkeypatch.setattr(ipvs_hold, "REPLY_GRACE", 0.0)

    def wait_expired(keys: Any, conns: Any) -> bool:
        events.append("ipvs entries gone" if expired else "ipvs entries left")
        return expired

    monkeypatch.setattr(ipvs_hold, "wait_expired", wait_expired)
    monkeypatch.setattr(ipvs, "delete_services", delete_services)
    monkeypatch.setattr(dp, "_forget_datagram_flows", forget)
    removed, draining = dp.retire()
    assert draining.done and UDP not in ipvs.services_
    return events


def test_retire_holds_datagrams_while_ipvs_lets_go_of_their_flows(
    parts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # IPVS deletes the conntrack entry of a flow's tuple (whoever's it is by then) when it
    # expires its own; datagrams wait in the queue until that is done.
    assert retiring(parts, monkeypatch, holds=True) == [
        f"hold {UDP}",
        f"delete {UDP}",
        "ipvs entries gone",
        "release",
    ]
    # Entries IPVS kept: their conntrack entries go before anything is released.
    assert retiring(parts, monkeypatch, holds=True, expired=False)[-3:] == [
        "ipvs entries left",
        f"forget {UDP}",
        "release",
    ]


def test_retire_without_a_hold_forgets_the_flows_before_the_servers_go(
    parts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert retiring(parts, monkeypatch, holds=False) == [
        "no hold",
        f"forget {UDP}",
        f"delete {UDP}",
        "release",
    ]


def test_retire_holds_nothing_for_udp_servers_without_flows(
    parts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ipvs, *_ = parts
    dp = make(parts)
    dp.sync(snap(*objects(proto="UDP")), full=True)
    calls: list[list[VSKey]] = []

    @contextlib.contextmanager
    def held(backend: Any, netns: Any, keys: list[VSKey]) -> Iterator[None]:
        calls.append(list(keys))
        yield None

    monkeypatch.setattr(ipvs_hold, "held", held)
    monkeypatch.setattr(dp, "_forget_datagram_flows", lambda keys: len(keys))
    dp.retire()
    assert calls == [[]] and UDP not in ipvs.services_


def test_hold_rules_queue_before_conntrack_and_pass_without_a_listener() -> None:
    text = ipvs_hold.hold_input([UDP, VSKey("SCTP", "10.100.0.1", 30053)], "-I")
    lines = text.splitlines()
    assert lines[0] == "*raw" and lines[-1] == "COMMIT"
    assert lines[1] == (
        f'-I PREROUTING -d {VIP}/32 -p udp -m udp --dport 80 -m comment --comment "'
        f'{ipvs_hold.HOLD_COMMENT}" -j NFQUEUE --queue-num {ipvs_hold.HOLD_QUEUE} --queue-bypass'
    )
    assert [ln.split()[1] for ln in lines[1:-1]] == ["PREROUTING"] * 2 + ["OUTPUT"] * 2
    assert "-p sctp -m sctp --dport 30053" in lines[2]
    assert ipvs_hold.hold_input([UDP], "-D").splitlines()[1].startswith("-D PREROUTING ")


def test_hold_rules_a_crash_left_are_ipvs_leftovers() -> None:
    from kproxy.dataplane.ipvs.cleanup import ipvs_iptables_objects

    rule = ipvs_hold.hold_input([UDP], "-A").splitlines()[1]
    ipt = FakeIptables(
        save_text=f"*raw\n:PREROUTING ACCEPT [0:0]\n{rule}\n-A PREROUTING -j CT --notrack\nCOMMIT\n"
    )
    found = ipvs_iptables_objects(ipt.backend())
    assert [(o.kind, o.where, o.name) for o in found] == [
        ("iptables-rule", "iptables-legacy raw", rule)
    ]
