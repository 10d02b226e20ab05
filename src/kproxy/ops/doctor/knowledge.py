"""Symptom -> cause -> commands: what operators found in the field, keyed by finding id.

Each entry says what a user of the service sees (the symptom), the cause behind it, the
commands that show it on the node, and where the failure was seen (issue numbers are
kubernetes/kubernetes unless another project is named). Doctor
attaches the entry to its finding, so the report reads like the troubleshooting tables.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Knowledge:
    symptom: str
    cause: str
    commands: tuple[str, ...] = ()
    seen: tuple[str, ...] = ()


KNOWLEDGE: dict[str, Knowledge] = {
    "object.missing": Knowledge(
        "the service name does not resolve, or its ClusterIP answers nothing",
        "no such Service in the objects the proxy reads",
        ("kubectl get service -A | grep NAME",),
    ),
    "object.rejected": Knowledge(
        "the service never works on any node",
        "the Service is invalid and every proxy skips it",
        ("kubectl get service -n NS NAME -o yaml",),
    ),
    "object.not-proxied": Knowledge(
        "no virtual IP: clients reach pods (or another name) directly",
        "headless and ExternalName services, and services for another proxy "
        "(service.kubernetes.io/service-proxy-name), get no kube-proxy rules by design",
    ),
    "endpoints.none": Knowledge(
        "connection refused at once (the no-endpoints REJECT rule answers)",
        "no pod matches the selector, or none is ready",
        ("kubectl get endpointslices -n NS -l kubernetes.io/service-name=NAME -o wide",),
    ),
    "endpoints.not-ready": Knowledge(
        "connection refused at once, although pods exist",
        "every endpoint is not ready (readiness probes failing, pods terminating)",
        ("kubectl get pods -n NS -o wide", "kubectl describe pod -n NS POD"),
    ),
    "endpoints.named-port": Knowledge(
        "one port of the service is refused, its other ports work",
        "the named targetPort matches no container port name of the pods",
        ("kubectl get pods -n NS -o jsonpath='{..ports}'",),
    ),
    "endpoints.no-local": Knowledge(
        "with a Local traffic policy, this node drops (times out) the traffic",
        "no endpoint runs on this node; for externalTrafficPolicy Local that is by design "
        "(the load balancer's health check should steer away from the node)",
    ),
    "endpoints.unreachable": Knowledge(
        "connections hang (SYN_SENT in conntrack) or are refused by the pod",
        "the pod is down, does not listen on the target port, or the pod network does not "
        "route from this node",
        ("ip route get POD_IP", "conntrack -L -d POD_IP"),
    ),
    "kernel.no-dataplane": Knowledge(
        "every ClusterIP on this node times out; other nodes work",
        "no proxy rules are in the kernel: the proxy is not running, or a firewall reload "
        "flushed them",
        ("kproxy status", "iptables-save | grep -c KUBE-", "nft list table ip kube-proxy"),
    ),
    "kernel.missing": Knowledge(
        "this service fails on this node only",
        "the kernel lacks the rule for this destination (a failed sync, a manual edit, "
        "another writer fighting over the chains: calico#10538)",
        ("kproxy status  # last sync error", "kproxy list --source SRC"),
        ("calico#10538",),
    ),
    "kernel.stale-reject": Knowledge(
        "connection refused although the pods are up and ready",
        "a REJECT rule for 'no endpoints' is still in the kernel, often left by another "
        "proxy mode after a switch",
        ("iptables-save -t filter | grep 'has no endpoints'", "kproxy cleanup --dry-run"),
        ("#102314",),
    ),
    "kernel.drift": Knowledge(
        "some connections go to old pods, or never to new ones",
        "the kernel's endpoints for the service differ from the objects",
        ("kproxy list --source SRC", "kproxy trace --from NODE_IP --to VIP:PORT"),
    ),
    "kernel.probe-failed": Knowledge(
        "the service fails from the node although its endpoints answer directly",
        "the rules in the kernel do not get the connection to an endpoint",
        ("kproxy trace --from NODE_IP --to VIP:PORT",),
    ),
    "conntrack.unreplied": Knowledge(
        "new connections hang; a retry from the same client port hangs for about two minutes",
        "UNREPLIED conntrack entries: connections started while no rule translated them "
        "(a rule gap) keep their old translation",
        ("conntrack -L -d VIP --status UNREPLIED",),
    ),
    "conntrack.stale-udp": Knowledge(
        "UDP (DNS, statsd) keeps going to a pod that is gone",
        "an established UDP conntrack entry still translates to the removed endpoint",
        ("conntrack -L -p udp --orig-dst VIP",),
        ("#19029", "#45976", "#125467", "#141371"),
    ),
    "conntrack.headroom": Knowledge(
        "random new connections fail under load: 'nf_conntrack: table full, dropping packet'",
        "the conntrack table is (nearly) full",
        ("conntrack -S", "dmesg | grep -i conntrack"),
        ("#71261",),
    ),
    "sysctl.ip-forward-off": Knowledge(
        "everything from outside the node (and pod to service to pod) times out",
        "forwarding is off in the node's namespace",
        ("sysctl net.ipv4.ip_forward",),
    ),
    "dataplane.leftovers": Knowledge(
        "refused or black-holed services after a mode switch; ClusterIPs answered locally",
        "another mode's state is still in the packet path (stale REJECTs, kube-ipvs0)",
        ("kproxy cleanup --dry-run",),
        ("#102314", "k3s#5643", "rke2#3017", "calico#7599"),
    ),
    "iptables.both-backends": Knowledge(
        "rules you delete come back, or a service is refused although iptables -L shows it fine",
        "rules live in both iptables-nft and iptables-legacy; the kernel runs both",
        ("iptables-legacy-save | grep KUBE-", "iptables-nft-save | grep KUBE-"),
        ("rancher#29719",),
    ),
    "config.strict-arp-off": Knowledge(
        "LoadBalancer IPs flap between nodes (MetalLB L2)",
        "every node answers ARP for the LB IPs bound to kube-ipvs0",
        ("arping -I eth0 LB_IP",),
        ("metallb#153",),
    ),
}


def lookup(finding_id: str) -> Knowledge | None:
    return KNOWLEDGE.get(finding_id)
