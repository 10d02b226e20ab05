"""iptables mode (either backend): the programmed services, read back from iptables-save -c.

Layout (upstream-kube-proxy.md §1.4): nat KUBE-SERVICES holds one rule per ClusterIP /
external IP / LB IP ("<svc> cluster IP" …) jumping to KUBE-SVC/SVL/EXT/FW; KUBE-NODEPORTS one
per NodePort (reached from KUBE-SERVICES' last rule, match-all or per node IP); SVC/SVL
chains hold the affinity checks (-m recent --rcheck) and the probability ladder
(-m statistic) to KUBE-SEP chains, which DNAT. Services without (local) endpoints have only
a filter rule (REJECT / DROP) in KUBE-SERVICES or KUBE-EXTERNAL-SERVICES.
"""

from __future__ import annotations

from collections.abc import Iterator

from kproxy.ops.inspect.iptables_rules import (
    Rule,
    Table,
    kind_of_comment,
    parse_chains,
    parse_save,
    service_of_comment,
)
from kproxy.ops.inspect.iptables_trace import IptablesWalker
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import (
    ANY_ADDRESS,
    EXTERNAL,
    NODE_PORT,
    Destination,
    Packet,
    RealServer,
    VirtualServer,
    Walk,
    split_hostport,
    strip_host_prefix,
)

SERVICES = "KUBE-SERVICES"
NODEPORTS = "KUBE-NODEPORTS"
EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
# Chains of other modes' iptables side: their presence means that mode, not iptables mode.
OTHER_MODES = {
    "ipvs": ("KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"),
    "userspace": ("KUBE-PORTALS-CONTAINER", "KUBE-PORTALS-HOST"),
}
# Chains kubelet owns; they alone do not make a kube-proxy dataplane.
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-PROXY-CANARY")


def service_rules(nat: Table) -> Iterator[tuple[Rule, str, Destination]]:
    """(rule, kind, destination) of each nat KUBE-SERVICES rule that sends a ClusterIP,
    external IP or LoadBalancer IP to its service's chains."""
    for r in nat.rules(SERVICES):
        kind = kind_of_comment(r.comment)
        dst, proto, port = r.address("-d"), r.proto, r.dport
        if kind is None or not (dst and proto and port):
            continue
        yield r, kind, Destination(strip_host_prefix(dst), proto, port)


def destinations(flavour: str, source: KernelSource) -> dict[Destination, str]:
    """One backend's iptables-mode service destinations -> their service port."""
    text = source.iptables_nat(flavour)
    if text is None:
        return {}
    nat = parse_chains(text, "nat", [SERVICES])
    return {dest: service_of_comment(r.comment) or "" for r, _, dest in service_rules(nat)}


class IptablesView:
    """iptables mode as one backend's iptables-save shows it."""

    mode = "iptables"

    def __init__(self, flavour: str, save_text: str, source: KernelSource) -> None:
        self.flavour = flavour
        self.dataplane = f"iptables-{flavour}"
        self.source = source
        self.tables: dict[str, Table] = parse_save(save_text)
        self.notes: list[str] = []
        self.has_counters = any(t.has_counters() for t in self.tables.values())
        self.live, self.present, self.detail = self._detect()
        self._local = source.local_addresses()

    # -- detection ---------------------------------------------------------------------------

    def _detect(self) -> tuple[bool, bool, str]:
        nat = self.tables.get("nat")
        owned = sorted(
            {
                c
                for t in self.tables.values()
                for c in t.chain_names
                if c.startswith("KUBE-") and c not in KUBELET_CHAINS
            }
        )
        if not owned:
            return False, False, "no kube-proxy chains"
        if nat is None or not nat.has_chain(SERVICES):
            for mode, chains in OTHER_MODES.items():
                if nat is not None and any(nat.has_chain(c) for c in chains):
                    return (
                        False,
                        True,
                        f"these are {mode} mode's iptables chains, not iptables mode",
                    )
            return False, True, f"leftover chains ({', '.join(owned[:4])}…), no nat {SERVICES}"
        if any(nat.has_chain(c) for c in OTHER_MODES["ipvs"]):
            return False, True, "these are ipvs mode's iptables chains, not iptables mode"
        hooks = [
            c for c in ("OUTPUT", "PREROUTING") if any(r.target == SERVICES for r in nat.rules(c))
        ]
        if not hooks:
            return False, True, f"nat {SERVICES} exists but nothing jumps to it (not hooked)"
        return True, True, f"nat {' and '.join(hooks)} jump to {SERVICES}"

    # -- services ----------------------------------------------------------------------------

    def _table(self, name: str) -> Table:
        return self.tables.get(name) or Table(name)

    def nodeport_addresses(self) -> tuple[list[str], list[str]]:
        """Where NodePorts answer: ["*"] (every local address) or node IPs; plus notes."""
        notes: list[str] = []
        tail = [r for r in self._table("nat").rules(SERVICES) if r.target == NODEPORTS]
        if not tail:
            return [ANY_ADDRESS], [
                f"no rule in nat {SERVICES} jumps to {NODEPORTS}: NodePorts are unreachable"
            ]
        addrs: list[str] = []
        for r in tail:
            m = r.match("addrtype")
            dst_type = m.get("--dst-type") if m else None
            if dst_type is not None and "LOCAL" in dst_type.value and not dst_type.negated:
                if ANY_ADDRESS not in addrs:
                    addrs.append(ANY_ADDRESS)
                neg = r.generic_opt("-d")
                if neg is not None and neg.negated:
                    notes.append(f"NodePorts are not served on {neg.value}")
            elif r.address("-d"):
                addrs.append(strip_host_prefix(r.address("-d") or ""))
        return addrs or [ANY_ADDRESS], notes

    def services(self) -> list[VirtualServer]:
        nat, filt = self._table("nat"), self._table("filter")
        found: dict[tuple[str, str, int], VirtualServer] = {}

        def add(vs: VirtualServer) -> VirtualServer:
            have = found.get(vs.key)
            if have is None:
                found[vs.key] = vs
                return vs
            have.notes += vs.notes
            return have

        for r, kind, dest in service_rules(nat):
            vs = VirtualServer(
                dest.proto,
                dest.ip,
                dest.port,
                service=service_of_comment(r.comment) or "",
                kind=kind,
                chain=r.target or "",
                packets=r.packets,
                bytes=r.bytes,
            )
            self._resolve(vs, r.target, set())
            add(vs)

        np_addrs, np_notes = self.nodeport_addresses()
        for r in nat.rules(NODEPORTS):
            proto, port = r.proto, r.dport
            if not (r.target and proto and port):
                continue
            dst = r.address("-d")
            for addr in [strip_host_prefix(dst)] if dst else np_addrs:
                vs = VirtualServer(
                    proto,
                    addr,
                    port,
                    service=service_of_comment(r.comment) or "",
                    kind=NODE_PORT,
                    chain=r.target,
                    packets=r.packets,
                    bytes=r.bytes,
                    notes=list(np_notes),
                )
                self._resolve(vs, r.target, set())
                add(vs)

        # Destinations the filter table refuses (no endpoints / no local endpoints).
        for chain in (SERVICES, EXTERNAL_SERVICES):
            for r in filt.rules(chain):
                if r.target not in ("REJECT", "DROP"):
                    continue
                comment = r.comment or ""
                if not comment.endswith(("has no endpoints", "has no local endpoints")):
                    continue
                proto, port, dst = r.proto, r.dport, r.address("-d")
                if not (proto and port):
                    continue
                if dst:
                    addrs = [strip_host_prefix(dst)]
                    kind = "ClusterIP" if chain == SERVICES else EXTERNAL
                else:
                    addrs, kind = np_addrs, NODE_PORT
                for addr in addrs:
                    key = (proto, addr, port)
                    vs = found.get(key) or add(
                        VirtualServer(
                            proto,
                            addr,
                            port,
                            service=service_of_comment(comment) or "",
                            kind=kind,
                            scheduler="none",
                            packets=r.packets,
                            bytes=r.bytes,
                        )
                    )
                    vs.verdict = r.target
                    vs.verdict_reason = f"filter {chain} rule {r.number}: {comment}"
                    if comment.endswith("has no local endpoints"):
                        vs.local_only = True
        return list(found.values())

    def _resolve(self, vs: VirtualServer, chain: str | None, seen: set[str]) -> None:
        """Follow the service's nat chains to its endpoints."""
        nat = self._table("nat")
        if not chain:
            return
        if chain in seen:
            vs.notes.append(f"chain loop at {chain}")
            return
        seen.add(chain)
        if not nat.has_chain(chain):
            vs.notes.append(f"{chain} does not exist in nat (the jump to it fails)")
            return
        rules = nat.rules(chain)
        if chain.startswith("KUBE-FW-"):
            vs.source_ranges = tuple(
                r.address("-s") or ""
                for r in rules
                if r.target and r.target.startswith("KUBE-EXT-") and r.address("-s")
            )
            nxt = next(
                (r.target for r in rules if r.target and r.target.startswith("KUBE-EXT-")), None
            )
            if nxt is None:
                vs.notes.append(
                    f"{chain} sends no source to an external chain: everything is dropped"
                )
                vs.scheduler = "none"
                return
            self._resolve(vs, nxt, seen)
        elif chain.startswith("KUBE-EXT-"):
            final = next(
                (
                    r.target
                    for r in rules
                    if r.only_comments
                    and r.target
                    and r.target.startswith(("KUBE-SVC-", "KUBE-SVL-"))
                ),
                None,
            )
            local_rules = [r for r in rules if r.match("addrtype") is not None]
            if final is None:
                vs.local_only = bool(local_rules)
                vs.scheduler = "none"
                vs.notes.append(
                    f"{chain} has no endpoint chain for traffic from outside the node "
                    "(Local policy without local endpoints): it is not DNATed"
                )
                return
            if final.startswith("KUBE-SVL-"):
                vs.local_only = True
            self._resolve(vs, final, seen)
        elif chain.startswith(("KUBE-SVC-", "KUBE-SVL-")):
            if chain.startswith("KUBE-SVL-"):
                vs.local_only = True
            self._ladder(vs, chain, rules)
        elif chain.startswith("KUBE-SEP-"):
            vs.endpoints.append(self._real_server(chain))
            vs.endpoints[-1].share = 1.0
        else:
            vs.notes.append(f"unexpected chain {chain}")

    def _ladder(self, vs: VirtualServer, chain: str, rules: list[Rule]) -> None:
        vs.scheduler = "random"
        remaining: float | None = 1.0
        seen: set[str] = set()
        for r in rules:
            if not (r.target and r.target.startswith("KUBE-SEP-")):
                continue
            recent = r.match("recent")
            if recent is not None and recent.get("--rcheck") is not None:
                secs = recent.get("--seconds")
                if secs is not None and secs.value.isdigit():
                    vs.persistent = int(secs.value)
                continue
            stat = r.match("statistic")
            p: float | None = 1.0
            if stat is not None:
                prob = stat.get("--probability")
                mode = stat.get("--mode")
                try:
                    p = (
                        float(prob.value)
                        if prob and (mode is None or mode.value == "random")
                        else None
                    )
                except ValueError:
                    p = None
            elif not r.only_comments:
                p = None
                vs.notes.append(f"{chain} rule {r.number} has conditions besides the ladder")
            if r.target in seen:
                continue
            seen.add(r.target)
            rs = self._real_server(r.target)
            if remaining is not None and p is not None:
                rs.share = remaining * p
                remaining -= rs.share
            else:
                remaining = None
            vs.endpoints.append(rs)
        if not vs.endpoints:
            vs.notes.append(f"{chain} has no endpoint rules")
        elif remaining is not None and remaining > 1e-6:
            vs.notes.append(
                f"{remaining * 100:.1f}% of new connections match no rule of {chain} (not DNATed)"
            )

    def _real_server(self, sep: str) -> RealServer:
        for r in self._table("nat").rules(sep):
            if r.target == "DNAT":
                host, port = split_hostport(r.target_opt("--to-destination") or "")
                return RealServer(host, port or 0, chain=sep, packets=r.packets, bytes=r.bytes)
        return RealServer("?", 0, chain=sep)

    # -- trace -------------------------------------------------------------------------------

    def trace(self, packet: Packet) -> Walk:
        return IptablesWalker(self.tables, self._local, self.source).trace(packet)

    def local_addresses(self) -> list[str] | None:
        return self._local


def load(flavour: str, source: KernelSource) -> IptablesView | None:
    """The view of one backend, or None when its save is unavailable or holds no kube-proxy
    chains at all."""
    text = source.iptables_save(flavour)
    if text is None:
        return None
    view = IptablesView(flavour, text, source)
    return view if view.present else None
