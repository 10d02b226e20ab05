"""Kernel vs desired state: where the rules read back disagree with a Snapshot.

The snapshot (kproxy.model Snapshot: what the daemon last synced, or one built from the
same --source objects) says, per service port, which virtual addresses should exist and
which endpoints each should DNAT to, using the same categorisation the dataplanes use
(ServicePort.internal_endpoints / external_endpoints). Only IPv4 is compared (the
dataplanes are IPv4-only for now).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kproxy.model.objects import ServicePort, Snapshot
from kproxy.ops.inspect.model import (
    ANY_ADDRESS,
    CLUSTER_IP,
    DNAT,
    EXTERNAL_IP,
    LOAD_BALANCER,
    NODE_PORT,
    Outcome,
    Packet,
    VirtualServer,
    in_network,
)


@dataclass
class Expected:
    proto: str
    address: str
    port: int
    service: str
    kind: str
    endpoints: set[str] = field(default_factory=set)
    verdict: str | None = None  # REJECT / DROP when the kernel should refuse
    persistent: int | None = None
    all_endpoints: set[str] = field(default_factory=set)

    @property
    def addr(self) -> str:
        return f"{self.address}:{self.port}"


def _refusal(sp: ServicePort) -> str:
    return "REJECT" if not sp.any_endpoints else "DROP"


def _expect(sp: ServicePort, address: str, port: int, kind: str, internal: bool) -> Expected:
    has = sp.has_internal_endpoints if internal else sp.has_external_endpoints
    eps = sp.internal_endpoints if internal else sp.external_endpoints
    return Expected(
        sp.protocol.lower,
        address,
        port,
        str(sp.name),
        kind,
        endpoints={e.addr for e in eps} if has else set(),
        verdict=None if has else _refusal(sp),
        persistent=sp.affinity_timeout if has else None,
        all_endpoints={e.addr for e in sp.endpoints},
    )


def expected(snapshot: Snapshot) -> list[Expected]:
    """Every virtual address the snapshot implies, with its endpoints (or refusal)."""
    out: list[Expected] = []
    for sp in snapshot.sorted_ports():
        if ":" in sp.cluster_ip:
            continue
        if sp.cluster_ip:
            out.append(_expect(sp, sp.cluster_ip, sp.port, CLUSTER_IP, True))
        out += [
            _expect(sp, ip, sp.port, EXTERNAL_IP, False) for ip in sp.external_ips if ":" not in ip
        ]
        out += [
            _expect(sp, ip, sp.port, LOAD_BALANCER, False)
            for ip in sp.load_balancer_ips
            if ":" not in ip
        ]
        if sp.node_port:
            out.append(_expect(sp, ANY_ADDRESS, sp.node_port, NODE_PORT, False))
    return out


def _eps(items: Iterable[str]) -> str:
    items = sorted(items)
    return ", ".join(items) if items else "nothing"


def _affinity(p: int | None) -> str:
    return "none" if p is None else f"ClientIP for {p} s"


def compare(kernel: list[VirtualServer], snapshot: Snapshot) -> list[str]:
    """Findings, one sentence each; [] when the kernel programs exactly the snapshot."""
    exp = expected(snapshot)
    by_key = {vs.key: vs for vs in kernel}
    nodeports: dict[tuple[str, int], list[VirtualServer]] = {}
    for vs in kernel:
        if vs.kind == NODE_PORT:
            nodeports.setdefault((vs.proto, vs.port), []).append(vs)
    seen: set[tuple[str, str, int]] = set()
    findings: list[str] = []
    missing: dict[str, list[Expected]] = {}
    per_service: dict[str, int] = {}
    for e in exp:
        per_service[e.service] = per_service.get(e.service, 0) + 1
        if e.address == ANY_ADDRESS:
            ks = nodeports.get((e.proto, e.port), [])
        else:
            k = by_key.get((e.proto, e.address, e.port))
            ks = [k] if k is not None else []
        if not ks:
            missing.setdefault(e.service, []).append(e)
            continue
        for k in ks:
            seen.add(k.key)
            findings += _compare_one(e, k)
    for service, misses in missing.items():
        if len(misses) == per_service[service]:
            findings.append(f"service {service} is in the snapshot but not in the kernel")
            continue
        for e in misses:
            findings.append(
                f"{e.proto} {e.addr} ({service} {e.kind}) is in the snapshot but not in the kernel"
            )
    for vs in kernel:
        if vs.key not in seen:
            who = vs.service or "an unnamed service"
            findings.append(
                f"the kernel programs {vs.proto} {vs.addr} for {who}, which is not in the snapshot"
            )
    return findings


def _compare_one(e: Expected, k: VirtualServer) -> list[str]:
    out: list[str] = []
    addr = k.addr
    if k.service and k.service != e.service:
        out.append(f"{e.proto} {addr} is {e.service} in the snapshot but {k.service} in the kernel")
    if e.verdict is None and k.verdict:
        why = f" ({k.verdict_reason})" if k.verdict_reason else ""
        out.append(
            f"the kernel {k.verdict}s new connections to {addr}{why}, but the snapshot has "
            f"endpoints for {e.service}: {_eps(e.endpoints)}"
        )
        return out
    if e.verdict is not None and not k.verdict:
        if k.endpoints:
            out.append(
                f"the snapshot has no {'local ' if e.verdict == 'DROP' else ''}endpoints for "
                f"{e.service} (expect {e.verdict}), but the kernel DNATs {addr} to "
                f"{_eps(rs.addr for rs in k.endpoints)}"
            )
        return out
    if e.verdict is not None and k.verdict and e.verdict != k.verdict:
        out.append(
            f"the kernel {k.verdict}s {addr} but the snapshot says {e.verdict} for {e.service}"
        )
        return out
    if e.verdict is not None:
        return out
    got = {rs.addr for rs in k.endpoints}
    for ep in sorted(got - e.endpoints):
        if ep in e.all_endpoints:
            out.append(
                f"the kernel DNATs {addr} to {ep}, an endpoint of {e.service} the snapshot does "
                "not use for this traffic (not ready, or not local)"
            )
        else:
            out.append(f"the kernel DNATs {addr} to {ep}, which is not an endpoint of {e.service}")
    for ep in sorted(e.endpoints - got):
        out.append(
            f"{e.service} endpoint {ep} is in the snapshot but the kernel does not DNAT "
            f"{addr} to it"
        )
    if e.persistent != k.persistent:
        out.append(
            f"{e.service} at {addr}: session affinity {_affinity(e.persistent)} in the snapshot, "
            f"{_affinity(k.persistent)} in the kernel"
        )
    return out


# --- one traced connection -------------------------------------------------------------------


def _service_for(
    snapshot: Snapshot, pkt: Packet, local: list[str] | None
) -> tuple[ServicePort, str] | None:
    proto = pkt.proto
    for sp in snapshot.sorted_ports():
        if sp.protocol.lower != proto:
            continue
        if sp.port == pkt.dport:
            if sp.cluster_ip == pkt.dst:
                return sp, CLUSTER_IP
            if pkt.dst in sp.external_ips:
                return sp, EXTERNAL_IP
            if pkt.dst in sp.load_balancer_ips:
                return sp, LOAD_BALANCER
    is_local = (local is not None and pkt.dst in local) or pkt.dst.startswith("127.")
    if is_local:
        for sp in snapshot.sorted_ports():
            if sp.protocol.lower == proto and sp.node_port == pkt.dport:
                return sp, NODE_PORT
    return None


def compare_trace(
    outcomes: list[Outcome],
    pkt: Packet,
    snapshot: Snapshot,
    local_addresses: list[str] | None = None,
) -> list[str]:
    """Where the kernel's answer for this connection differs from what the snapshot implies."""
    hit = _service_for(snapshot, pkt, local_addresses)
    dnats = {o.dnat for o in outcomes if o.verdict == DNAT and o.dnat}
    where = f"{pkt.dst}:{pkt.dport}"
    if hit is None:
        if dnats:
            svc = next((o.service for o in outcomes if o.service), None) or "a service"
            return [
                f"the kernel DNATs {pkt} to {_eps(dnats)} ({svc}), but the snapshot has no "
                f"service at {pkt.proto} {where}"
            ]
        return []
    sp, kind = hit
    name = str(sp.name)
    if kind == CLUSTER_IP:
        has, eps = sp.has_internal_endpoints, sp.internal_endpoints
    else:
        has, eps = sp.has_external_endpoints, sp.external_endpoints
        if sp.external_policy_local and (
            pkt.from_node
            or (local_addresses is not None and pkt.src in local_addresses)
            or any(in_network(pkt.src, c) for c in snapshot.node.pod_cidrs)
        ):
            # Pod and node traffic to an external address short-circuits to all endpoints.
            has, eps = sp.any_endpoints, sp.cluster_endpoints
    expected_eps = {e.addr for e in eps}
    blocked = (
        kind == LOAD_BALANCER
        and sp.load_balancer_source_ranges
        and not any(in_network(pkt.src, c) for c in sp.load_balancer_source_ranges)
    )
    refusals = [o for o in outcomes if o.verdict != DNAT]
    findings: list[str] = []
    if not has or blocked:
        why = (
            f"its loadBalancerSourceRanges exclude {pkt.src}"
            if has
            else f"it has no {'local ' if sp.any_endpoints else ''}endpoints"
        )
        if dnats:
            findings.append(
                f"the snapshot says {name} refuses this connection ({why}), but the kernel DNATs "
                f"it to {_eps(dnats)}"
            )
        return findings
    for o in refusals:
        findings.append(
            f"the snapshot has endpoints for {name} at {where} ({_eps(expected_eps)}), but the "
            f"kernel does not DNAT this connection: {o.summary()}"
        )
    for ep in sorted(dnats - expected_eps):
        known = {e.addr for e in sp.endpoints}
        tail = (
            "an endpoint the snapshot does not use for this traffic"
            if ep in known
            else f"which is not an endpoint of {name}"
        )
        findings.append(f"the kernel DNATs {where} to {ep}, {tail}")
    if sp.affinity_timeout is None:
        for ep in sorted(expected_eps - dnats):
            findings.append(
                f"{name} endpoint {ep} is in the snapshot but the kernel never DNATs this "
                "connection to it"
            )
    return findings
