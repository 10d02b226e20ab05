"""userspace mode's endpoint choice and source-address policy (pure, no root)."""

from __future__ import annotations

from collections import Counter

from kproxy.dataplane.userspace.balancer import DIAL_TIMEOUTS, Balancer, Networks
from kproxy.dataplane.userspace.render import Listener

A, B, C = ("10.244.0.2", 8080), ("10.244.0.3", 8080), ("10.244.0.4", 8080)
NODE = "10.100.0.1"
POD = "10.244.0.9"
OUTSIDE = "10.100.0.2"


def listener(key: str = "svc/tcp/cluster", targets=(A, B, C), **kw) -> Listener:
    return Listener(
        key=key,
        service=kw.pop("service", "default/svc:http"),
        protocol="tcp",
        scope=kw.pop("scope", "cluster"),
        port=20000,
        targets=tuple(targets),
        **kw,
    )


def balancer(*listeners: Listener, cidrs=("10.244.0.0/16",), **kw) -> Balancer:
    b = Balancer(seed=1)
    b.configure(list(listeners), local_cidrs=cidrs, node_addresses=[NODE], **kw)
    return b


def test_round_robin_spreads_evenly_and_plans_four_attempts() -> None:
    b = balancer(listener())
    firsts = Counter()
    for _ in range(30):
        plan = b.plan("svc/tcp/cluster", OUTSIDE, 0.0)
        assert len(plan) == len(DIAL_TIMEOUTS)
        assert set(plan[:3]) == {A, B, C}  # every endpoint once before any repeat
        firsts[plan[0]] += 1
    assert firsts == Counter({A: 10, B: 10, C: 10})


def test_one_endpoint_is_retried_with_growing_timeouts() -> None:
    b = balancer(listener(targets=(A,)))
    assert b.plan("svc/tcp/cluster", OUTSIDE, 0.0) == [A] * 4
    assert DIAL_TIMEOUTS == (0.25, 0.5, 1.0, 2.0)


def test_no_endpoints_or_unknown_listener_plan_nothing() -> None:
    b = balancer(listener(targets=()))
    assert b.plan("svc/tcp/cluster", OUTSIDE, 0.0) == []
    assert b.plan("other", OUTSIDE, 0.0) == []


def test_client_ip_affinity_sticks_until_the_timeout() -> None:
    b = balancer(listener(affinity=10))
    first = b.plan("svc/tcp/cluster", OUTSIDE, 0.0)
    b.connected("svc/tcp/cluster", OUTSIDE, first[0], 0.0)
    for t in range(1, 10):
        plan = b.plan("svc/tcp/cluster", OUTSIDE, float(t))
        assert plan[0] == first[0]
        assert plan[1] != first[0]  # the retry after a failed dial bypasses affinity
    # Ten seconds after the last use the entry is stale: round robin again.
    seen = {b.plan("svc/tcp/cluster", OUTSIDE, 100.0 + 20 * i)[0] for i in range(6)}
    assert len(seen) > 1
    assert b.prune(1000.0) == 1


def test_affinity_forgets_removed_endpoints_and_is_shared_by_a_services_listeners() -> None:
    cluster = listener(affinity=60)
    external = listener("svc/tcp/external", scope="external", affinity=60, source="masquerade")
    b = balancer(cluster, external)
    b.connected("svc/tcp/cluster", OUTSIDE, B, 0.0)
    assert b.plan("svc/tcp/external", OUTSIDE, 1.0)[0] == B
    b.configure([listener(targets=(A, C), affinity=60)], local_cidrs=None)
    assert b.affinity["default/svc:http"] == {}
    assert b.plan("svc/tcp/cluster", OUTSIDE, 2.0)[0] in (A, C)


def test_keep_source_mirrors_the_iptables_masquerade_rules() -> None:
    cluster = listener()
    masq = listener("m", source="masquerade")
    local = listener("l", source="local")
    b = balancer(cluster, masq, local)
    assert b.keep_source(cluster, POD, A[0])  # pod client: no masquerade
    assert not b.keep_source(cluster, OUTSIDE, A[0])  # off-cluster client to a ClusterIP
    assert not b.keep_source(cluster, A[0], A[0])  # hairpin
    assert not b.keep_source(cluster, NODE, A[0])  # from the node itself
    assert not b.keep_source(cluster, "127.0.0.1", A[0])
    assert not b.keep_source(masq, POD, A[0])  # externalTrafficPolicy Cluster
    assert b.keep_source(local, OUTSIDE, A[0])  # externalTrafficPolicy Local
    assert not b.keep_source(local, A[0], A[0])
    # No detector: upstream does not masquerade ClusterIP traffic at all.
    assert balancer(cluster, cidrs=None).keep_source(cluster, OUTSIDE, A[0])
    assert not balancer(cluster, masquerade_all=True).keep_source(cluster, POD, A[0])


def test_local_policy_sends_pods_and_the_node_to_the_cluster_endpoints() -> None:
    local = listener("l", targets=(A,), fallback=(A, B, C), source="local")
    b = balancer(local)
    assert b.candidates_for(local, OUTSIDE) == ("targets", (A,))
    assert b.candidates_for(local, POD)[1] == (A, B, C)
    assert b.candidates_for(local, NODE)[1] == (A, B, C)
    assert {b.plan("l", OUTSIDE, 0.0)[0] for _ in range(5)} == {A}


def test_networks() -> None:
    nets = Networks(["10.244.0.0/16", "192.168.1.0/24"])
    assert "10.244.3.4" in nets and "192.168.1.7" in nets
    assert "10.245.0.1" not in nets and "not-an-ip" not in nets
