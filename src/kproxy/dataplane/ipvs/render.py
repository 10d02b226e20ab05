"""Text forms of ipvs-mode state: `ipvsadm -S -n` lines, `ipset save`/restore lines, and the
whole `kproxy render --proxy-mode ipvs` output.

The ipvsadm form is what `ipvsadm-save -n` prints for the same kernel state (and what
`ipvsadm-restore` reads), so a render can be compared with a node line by line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.plan import IpvsPlan, IpvsPlanner, VSKey, is_ipv4
from kproxy.model.objects import Snapshot

PROTO_FLAG = {"TCP": "-t", "UDP": "-u", "SCTP": "--sctp-service"}


@dataclass(frozen=True, slots=True)
class RenderedDest:
    ip: str
    port: int
    weight: int = 1
    fwd_method: int = n.FWD_MASQ
    upper: int = 0
    lower: int = 0


def address_sort_key(address: str) -> tuple[int, ...]:
    if is_ipv4(address):
        return tuple(int(p) for p in address.split("."))
    return (256, *address.encode())


def vs_sort_key(key: VSKey) -> tuple[object, ...]:
    return (address_sort_key(key.address), key.port, key.protocol)


def sched_flags(scheduler: str, flags: int) -> str:
    """ipvsadm's -b argument: sh-port, mh-port, ... (flag-N for other schedulers)."""
    named = n.SCHED_FLAG_NAMES.get(scheduler, {})
    out = []
    for bit, generic in (
        (n.FLAG_SCHED1, "flag-1"),
        (n.FLAG_SCHED2, "flag-2"),
        (n.FLAG_SCHED3, "flag-3"),
    ):
        if flags & bit:
            out.append(named.get(bit, generic))
    return ",".join(out)


def service_line(key: VSKey, scheduler: str, flags: int, timeout: int) -> str:
    line = f"-A {PROTO_FLAG[key.protocol]} {key.address}:{key.port} -s {scheduler}"
    if flags & n.FLAG_PERSISTENT:
        line += f" -p {timeout}"
    if flags & n.FLAG_ONEPACKET:
        line += " -o"
    extra = sched_flags(scheduler, flags)
    if extra:
        line += f" -b {extra}"
    return line


def dest_line(key: VSKey, dest: RenderedDest) -> str:
    fwd = {0: "-m", 2: "-i", 3: "-g"}.get(dest.fwd_method, "-m")
    line = (
        f"-a {PROTO_FLAG[key.protocol]} {key.address}:{key.port} -r {dest.ip}:{dest.port}"
        f" {fwd} -w {dest.weight}"
    )
    if dest.upper:
        line += f" -x {dest.upper}"
    if dest.lower:
        line += f" -y {dest.lower}"
    return line


def ipvsadm_save(
    services: Mapping[VSKey, tuple[str, int, int]],
    dests: Mapping[VSKey, Iterable[RenderedDest]],
) -> str:
    """`ipvsadm -S -n` text for services {key: (scheduler, flags, timeout)} and their dests."""
    lines: list[str] = []
    for key in sorted(services, key=vs_sort_key):
        scheduler, flags, timeout = services[key]
        lines.append(service_line(key, scheduler, flags, timeout))
        for d in sorted(dests.get(key, ()), key=lambda d: (address_sort_key(d.ip), d.port)):
            lines.append(dest_line(key, d))
    return "\n".join(lines) + "\n" if lines else ""


def plan_ipvsadm(plan: IpvsPlan) -> str:
    services = {k: vs.attributes for k, vs in plan.virtual_servers.items()}
    dests = {
        k: [RenderedDest(ip, port) for ip, port in vs.destinations]
        for k, vs in plan.virtual_servers.items()
    }
    return ipvsadm_save(services, dests)


def entry_sort_key(entry: str) -> tuple[object, ...]:
    if entry.isdigit():
        return (0, int(entry))
    head, _, rest = entry.partition(",")
    return (1, address_sort_key(head), rest)


def ipset_restore(sets: Mapping[str, Iterable[str]]) -> str:
    """`ipset restore` input creating every set (in upstream's order) with its entries."""
    lines: list[str] = []
    for info in n.SETS:
        if info.name not in sets:
            continue
        lines.append(info.create_line())
        lines += [f"add {info.name} {e}" for e in sorted(sets[info.name], key=entry_sort_key)]
    return "\n".join(lines) + "\n" if lines else ""


def render_text(
    snapshot: Snapshot,
    facts: NodeFacts,
    options: RuleOptions,
    node_addresses: Iterable[str] | None = None,
) -> str:
    """What a full sync on a fresh node programs, as four commented sections."""
    plan = IpvsPlanner(facts, options).plan(snapshot, node_addresses)
    out = ["# IPVS virtual servers (ipvsadm -S -n)", plan_ipvsadm(plan).rstrip("\n")]
    out.append(f"# {n.DUMMY_DEVICE} addresses (link down, /32 each)")
    out += [f"# {ip}/32" for ip in sorted(plan.bind_addresses, key=address_sort_key)]
    out += ["# ipsets (ipset restore -exist)", ipset_restore(plan.sets).rstrip("\n")]
    out += ["# iptables (iptables-restore --noflush)", plan.iptables_text().rstrip("\n")]
    for problem in plan.problems:
        out.append(f"# problem: {problem}")
    return "\n".join(line for line in out if line) + "\n"
