"""The node namespace's sysctls that decide whether proxied packets flow.

Read inside the node's network namespace (NodeAccess.sysctl): ip_forward, route_localnet
(and whether KUBE-FIREWALL still guards it), IPVS's vs/* and the ARP pair strictARP sets,
bridge-nf-call-iptables where pods sit on a Linux bridge.
"""

from __future__ import annotations

import ipaddress
import json
import re

from kproxy.dataplane.iptables.render import KUBELET_FIREWALL_CHAIN
from kproxy.dataplane.kernel_dump import IPTABLES_FLAVOURS
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, block, info, warn

# The kernel that fixed IPVS's port-reuse SYN drops (#70747): conn_reuse_mode=1 is safe.
CONN_REUSE_FIXED = (5, 9)
LOCALNET_GUARD = "block incoming localnet connections"


def check_ip_forward(ctx: Context) -> list[Finding]:
    value = ctx.access.sysctl_int("net/ipv4/ip_forward")
    if value is None or value != 0:
        return []
    kernel = ctx.target != "userspace"
    return [
        (block if kernel else warn)(
            "sysctl.ip-forward-off",
            "net.ipv4.ip_forward is 0 in the node's network namespace",
            f"{ctx.target} mode DNATs connections from clients and pods and forwards them to "
            "endpoints: with forwarding off every such packet is dropped"
            if kernel
            else "userspace mode proxies through local sockets, but pods on other nodes and "
            "externalTrafficPolicy Local still need forwarding",
            [
                "sysctl -w net.ipv4.ip_forward=1",
                "echo net.ipv4.ip_forward=1 > /etc/sysctl.d/90-kproxy.conf",
            ],
            facts={"value": value},
        )
    ]


def _localnet_guarded(ctx: Context) -> bool:
    """Whether either iptables backend holds the rule that drops martians to 127.0.0.0/8:
    in the saves preflight read anyway, or beside a running kproxy (which reads no save:
    at 10,000 services iptables-nft-save alone takes seconds) in the one chain kubelet and
    kube-proxy put it in."""
    if ctx.live is None:
        snap = ctx.kernel_snapshot
        texts = [snap.get(f"iptables-{fl}", {}).get("output", "") for fl in IPTABLES_FLAVOURS]
    else:
        texts = [
            "\n".join(ctx.node_dump.chain_rules(fl, "filter", KUBELET_FIREWALL_CHAIN))
            for fl in IPTABLES_FLAVOURS
        ]
    return any(LOCALNET_GUARD in text for text in texts)


def check_route_localnet(ctx: Context) -> list[Finding]:
    value = ctx.access.sysctl_int("net/ipv4/conf/all/route_localnet")
    if value is None:
        return []
    cfg = ctx.target_config
    wants = ctx.target == "iptables" and cfg.iptables.localhost_node_ports
    if wants and value == 0:
        return [
            warn(
                "sysctl.route-localnet-off",
                "net.ipv4.conf.all.route_localnet is 0 while iptables.localhostNodePorts is true",
                "NodePorts on 127.0.0.1 do not answer: kproxy sets route_localnet when it "
                "starts, a live switch does not",
                ["sysctl -w net.ipv4.conf.all.route_localnet=1"],
                facts={"value": value},
            )
        ]
    if not wants and value == 1 and not _localnet_guarded(ctx):
        return [
            warn(
                "sysctl.route-localnet-exposed",
                "net.ipv4.conf.all.route_localnet is 1 and no KUBE-FIREWALL rule drops "
                "martian packets to 127.0.0.0/8",
                f"{ctx.target} mode does not serve NodePorts on localhost, but route_localnet "
                "lets neighbours reach services bound to 127.0.0.1 (CVE-2020-8558)",
                ["sysctl -w net.ipv4.conf.all.route_localnet=0"],
                facts={"value": value},
            )
        ]
    return []


def _kernel(ctx: Context) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", ctx.access.kernel_release())
    return (int(m[1]), int(m[2])) if m else None


def check_ipvs_sysctls(ctx: Context) -> list[Finding]:
    names = ("conntrack", "expire_nodest_conn", "expire_quiescent_template", "conn_reuse_mode")
    values = {n: ctx.access.sysctl_int(f"net/ipv4/vs/{n}") for n in names}
    out: list[Finding] = []
    if all(v is None for v in values.values()):
        out.append(
            info(
                "sysctl.ipvs-unreadable",
                "net.ipv4.vs.* does not exist yet in the node's namespace (ip_vs is not loaded)",
                "ipvs mode sets vs.conntrack=1, expire_nodest_conn=1 and "
                "expire_quiescent_template=1 when it starts",
            )
        )
    else:
        wanted = {"conntrack": 1, "expire_nodest_conn": 1, "expire_quiescent_template": 1}
        off = {n: values[n] for n, v in wanted.items() if values[n] is not None and values[n] != v}
        if off:
            out.append(
                info(
                    "sysctl.ipvs-planned",
                    "ipvs mode will set "
                    + ", ".join(f"vs.{n}=1 (now {v})" for n, v in off.items()),
                    "vs.conntrack=1 is what lets iptables masquerade IPVS traffic",
                    [f"sysctl -w net.ipv4.vs.{n}=1" for n in off],
                    facts={"values": values},
                )
            )
        kernel = _kernel(ctx)
        if (
            kernel is not None
            and kernel < CONN_REUSE_FIXED
            and values["conn_reuse_mode"] not in (0, None)
        ):
            out.append(
                warn(
                    "sysctl.ipvs-conn-reuse",
                    f"kernel {ctx.access.kernel_release()} is older than 5.9 and "
                    f"net.ipv4.vs.conn_reuse_mode is {values['conn_reuse_mode']}",
                    "IPVS drops the SYN of a connection reusing a recent client port: 1 s "
                    "delays under load (#70747); upstream sets 0 on these kernels, which in "
                    "turn can send traffic to removed pods (#81775)",
                    ["sysctl -w net.ipv4.vs.conn_reuse_mode=0", "# or upgrade to a kernel >= 5.9"],
                )
            )
    if ctx.target_config.ipvs.strict_arp:
        arp = {
            "arp_ignore": (ctx.access.sysctl_int("net/ipv4/conf/all/arp_ignore"), 1),
            "arp_announce": (ctx.access.sysctl_int("net/ipv4/conf/all/arp_announce"), 2),
        }
        differ = {k: v for k, v in arp.items() if v[0] is not None and v[0] != v[1]}
        if differ:
            out.append(
                info(
                    "sysctl.strict-arp-planned",
                    "strictARP: ipvs mode will set "
                    + ", ".join(
                        f"conf.all.{k}={want} (now {now})" for k, (now, want) in differ.items()
                    ),
                    "so the node stops answering ARP for addresses on kube-ipvs0",
                    [f"sysctl -w net.ipv4.conf.all.{k}={want}" for k, (_, want) in differ.items()],
                )
            )
    return out


def _pod_bridges(ctx: Context) -> list[str]:
    """Linux bridges holding an address in the cluster or node pod CIDR (pods on a bridge),
    or named by detectLocal.bridgeInterface."""
    proc = ctx.access.run(["ip", "-j", "-d", "link", "show", "type", "bridge"])
    try:
        bridges = {link.get("ifname", "") for link in json.loads(proc.stdout or "[]")}
    except ValueError:
        bridges = set()
    cfg = ctx.target_config
    named = (
        cfg.detect_local.bridge_interface
        if cfg.effective_detect_local_mode == "BridgeInterface"
        else ""
    )
    out = set()
    on_bridges = [(i, ipaddress.ip_address(a)) for i, a, _ in ctx.addresses if i in bridges]
    if on_bridges:
        # The node's podCIDR lies inside clusterCIDR; it is read (from the objects, slow at
        # scale) only when no clusterCIDR is configured.
        nets = [n for n in (ctx.cluster_cidrs or ctx.pod_cidrs) if n.version == 4]
        out |= {ifname for ifname, addr in on_bridges if any(addr in n for n in nets)}
    if named and named in bridges:
        out.add(named)
    return sorted(out)


def check_bridge_nf(ctx: Context) -> list[Finding]:
    bridges = _pod_bridges(ctx)
    if not bridges:
        return []
    value = ctx.access.sysctl_int("net/bridge/bridge-nf-call-iptables")
    where = ", ".join(bridges)
    why = (
        "packets between pods on the same bridge skip netfilter: a pod reaching a service "
        "whose endpoint sits on the same bridge gets the reply straight from the endpoint, "
        "un-NATed, and the connection hangs"
    )
    if value is None:
        return [
            warn(
                "sysctl.br-netfilter-missing",
                f"pods sit on bridge {where} and br_netfilter is not loaded "
                "(no net.bridge.bridge-nf-call-iptables)",
                why,
                [
                    "modprobe br_netfilter",
                    "echo br_netfilter > /etc/modules-load.d/br_netfilter.conf",
                    "sysctl -w net.bridge.bridge-nf-call-iptables=1",
                ],
                facts={"bridges": bridges},
            )
        ]
    if value == 0:
        return [
            warn(
                "sysctl.bridge-nf-call-iptables-off",
                f"pods sit on bridge {where} and net.bridge.bridge-nf-call-iptables is 0",
                why,
                ["sysctl -w net.bridge.bridge-nf-call-iptables=1"],
                facts={"bridges": bridges, "value": value},
            )
        ]
    return []


CHECKS = (
    Check("sysctls", check_ip_forward),
    Check("sysctls", check_route_localnet, ("iptables", "nftables", "ipvs")),
    Check("sysctls", check_ipvs_sysctls, ("ipvs",)),
    Check("sysctls", check_bridge_nf, ("iptables", "nftables", "ipvs")),
)
