"""Find and remove ipvs-mode state of kproxy and upstream kube-proxy, and nothing else.

Upstream's --cleanup flushes every IPVS virtual server on the node (PR #97336), taking a
keepalived VIP or any other IPVS user down with it. kproxy removes only virtual servers it
can tell are kube-proxy's:
* the address is bound on kube-ipvs0 (kube-proxy binds every ClusterIP, and external/LB IPs
  that are not on another interface),
* (address, protocol, port) is in KUBE-CLUSTER-IP, KUBE-EXTERNAL-IP(-LOCAL) or
  KUBE-LOAD-BALANCER,
* it is a NodePort: the port is in KUBE-NODE-PORT-TCP/UDP (or address,sctp:port in
  KUBE-NODE-PORT-SCTP-HASH) and the address is one of the node's,
* this kproxy programmed it, or it is upstream's scheduler probe (198.51.100.0:20000).
Virtual servers inside ipvs.excludeCIDRs are never touched. Order: virtual servers, then
iptables chains (jumps first), then kube-ipvs0, then the ipsets (the chains reference them).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.iptables.backend import (
    IptablesBackend,
    IptablesError,
    TableDump,
    parse_save,
    rule_chain,
)
from kproxy.dataplane.iptables.cleanup import cleanup_input
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.hold import hold_objects
from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.host.commands import in_netns, run_command

if TYPE_CHECKING:
    from kproxy.dataplane.ipvs.dummy import DummyDevice
    from kproxy.dataplane.ipvs.ipset import IpsetClient
    from kproxy.dataplane.ipvs.netlink import IpvsNetlink
    from kproxy.dataplane.kernel_dump import KernelDump

log = logging.getLogger("kproxy.ipvs.cleanup")


@dataclass(frozen=True)
class Clients:
    """Kernel clients a running dataplane already holds (opening them in another network
    namespace costs a helper process each)."""

    ipvs: IpvsNetlink
    dummy: DummyDevice
    ipset: IpsetClient


Net = ipaddress.IPv4Network | ipaddress.IPv6Network
IPTABLES_MODE_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-")
_HASH_PORT_SETS = (n.CLUSTER_IP, n.EXTERNAL_IP, n.EXTERNAL_IP_LOCAL, n.LOAD_BALANCER)


def parse_cidrs(cidrs: Iterable[str]) -> list[Net]:
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


def excluded(address: str, nets: Sequence[Net]) -> bool:
    ip = ipaddress.ip_address(address)
    return any(ip in net for net in nets)


def ownership(
    key: VSKey,
    *,
    bound: Iterable[str] | frozenset[str],
    sets: Mapping[str, set[str]],
    node_addresses: Iterable[str] | frozenset[str],
    known: Iterable[VSKey] | frozenset[VSKey] = frozenset(),
) -> str | None:
    """Why a virtual server is kube-proxy's (None: it is not, leave it alone)."""
    lp = key.protocol.lower()
    if key in known:
        return "programmed by this kproxy"
    if key == VSKey("TCP", n.PROBE_ADDRESS, n.PROBE_PORT):
        return "kube-proxy's scheduler probe (198.51.100.0:20000)"
    if key.address in bound:
        return f"its address is bound on {n.DUMMY_DEVICE}"
    entry = f"{key.address},{lp}:{key.port}"
    for name in _HASH_PORT_SETS:
        if entry in sets.get(name, ()):
            return f"{entry} is in ipset {name}"
    if key.address in node_addresses:
        if key.protocol == "SCTP":
            if f"{key.address},sctp:{key.port}" in sets.get(n.NODE_PORT_SCTP, ()):
                return f"a NodePort: {key.address},sctp:{key.port} is in {n.NODE_PORT_SCTP}"
        else:
            name = n.NODE_PORT_SETS[key.protocol]
            if str(key.port) in sets.get(name, ()):
                return f"a NodePort on a node address: port {key.port} is in ipset {name}"
    return None


# --- iptables ---------------------------------------------------------------------------------


def rule_target(rule: str) -> str:
    """The -j/-g target of a rule line."""
    parts = rule.split()
    for flag in ("-j", "-g"):
        if flag in parts:
            i = parts.index(flag)
            if i + 1 < len(parts):
                return parts[i + 1]
    return ""


def is_ipvs_chain(table: str, chain: str) -> bool:
    """ipvs mode's chains (a leftover cleanup keeps them while it runs): by table, as
    iptables mode writes some of the names in other tables (filter KUBE-SERVICES)."""
    return (table == "nat" and chain in n.NAT_CHAINS) or (
        table == "filter" and chain in n.FILTER_CHAINS
    )


def iptables_mode_owns_shared(tables: Mapping[str, TableDump]) -> bool:
    """Does iptables mode currently own the chain names both modes use (it restored its
    KUBE-SERVICES last)? Then ipvs mode must leave those chains and their jumps alone."""
    nat = tables.get("nat")
    if nat is None:
        return False
    for rule in nat.rules:
        if rule_chain(rule) != "KUBE-SERVICES":
            continue
        target = rule_target(rule)
        if target.startswith(IPTABLES_MODE_PREFIXES) or target == "KUBE-NODEPORTS":
            return True
    return False


def ipvs_iptables_objects(backend: IptablesBackend) -> list[OwnedObject]:
    """ipvs mode's chains in this backend and the rules elsewhere that jump into them (the
    chains shared with iptables mode only while iptables mode does not own them)."""
    where = f"iptables-{backend.flavour}"
    try:
        tables = parse_save(backend.save())
    except IptablesError as err:
        log.warning("cannot read %s rules: %s", where, err)
        return []
    shared = not iptables_mode_owns_shared(tables)
    found: list[OwnedObject] = []
    for table in ("nat", "filter"):
        dump = tables.get(table)
        if dump is None:
            continue
        ours = {
            c
            for c in dump.chains
            if is_ipvs_chain(table, c) and (shared or c not in n.SHARED_CHAINS)
        }
        for rule in dump.rules:
            target = rule_target(rule)
            if target in ours and rule_chain(rule) not in ours:
                found.append(
                    OwnedObject(
                        "iptables-rule",
                        f"{where} {table}",
                        rule,
                        f"jumps to kube-proxy ipvs chain {target}",
                    )
                )
        for chain in sorted(ours):
            found.append(
                OwnedObject("iptables-chain", f"{where} {table}", chain, "a kube-proxy ipvs chain")
            )
    raw = tables.get("raw")
    found += hold_objects(where, raw.rules if raw is not None else ())
    return found


def remove_iptables(backend: IptablesBackend, objects: list[OwnedObject]) -> None:
    if objects:
        backend.restore(cleanup_input(objects))


# --- IPVS virtual servers ---------------------------------------------------------------------


def ipvs_loaded(netns: str | None = None) -> bool:
    """Is IPVS in the kernel? (Checked without loading it: a lookup of its netlink family
    would make the kernel load ip_vs.)"""
    if netns is None:
        return os.path.exists("/proc/net/ip_vs")
    proc = run_command(in_netns(["test", "-e", "/proc/net/ip_vs"], netns))
    return proc.returncode == 0


def virtual_servers(
    netns: str | None = None,
    *,
    dry_run: bool = False,
    exclude_cidrs: Iterable[str] = (),
    known: Iterable[VSKey] = (),
    clients: Clients | None = None,
) -> list[OwnedObject]:
    """kube-proxy's virtual servers (see the module doc), removed unless dry_run."""
    from kproxy.dataplane.ipvs.dummy import DummyDevice
    from kproxy.dataplane.ipvs.ipset import IpsetClient, IpsetError
    from kproxy.dataplane.ipvs.netlink import IpvsNetlink, IpvsUnavailable

    if clients is not None:
        client, dummy, ipset = clients.ipvs, clients.dummy, clients.ipset
    else:
        if not ipvs_loaded(netns):
            return []
        try:
            client = IpvsNetlink(netns)
        except (IpvsUnavailable, OSError) as err:
            log.warning("cannot read IPVS virtual servers: %s", err)
            return []
        dummy = DummyDevice(netns)
        ipset = IpsetClient(netns)
    try:
        found = dummy.lookup()
        index = found[0] if found is not None and found[1] == "dummy" else None
        addrs = dummy.addresses(index)
        try:
            sets = ipset.save(n.SET_NAMES)
        except (IpsetError, OSError):
            sets = {}
        nets = parse_cidrs(exclude_cidrs)
        known_keys = frozenset(known)
        out: list[tuple[VSKey, str]] = []
        for svc in client.services():
            if excluded(svc.key.address, nets):
                continue
            why = ownership(
                svc.key,
                bound=addrs.dummy,
                sets=sets,
                node_addresses=addrs.node,
                known=known_keys,
            )
            if why is not None:
                out.append((svc.key, why))
        if out and not dry_run:
            for req, code in client.delete_services(k for k, _ in out):
                if code not in (2, 3):  # already gone
                    log.warning("%s failed: %s", req.what, os.strerror(code))
        return [OwnedObject("ipvs-virtual-server", "ipvs", str(k), why) for k, why in out]
    finally:
        if clients is None:
            client.close()
            dummy.close()


def remove_dummy(
    netns: str | None = None, *, dry_run: bool = False, dummy: DummyDevice | None = None
) -> list[OwnedObject]:
    from kproxy.dataplane.ipvs.dummy import DummyDevice

    own = dummy is None
    dummy = dummy or DummyDevice(netns)
    try:
        found = dummy.lookup()
        if found is None:
            return []
        if found[1] != "dummy":
            log.warning(
                "%s exists but is a %s interface, not kube-proxy's dummy: left alone",
                n.DUMMY_DEVICE,
                found[1] or "plain",
            )
            return []
        if not dry_run:
            dummy.delete()
        return [
            OwnedObject(
                "interface", "link", n.DUMMY_DEVICE, "kube-proxy ipvs mode's dummy interface"
            )
        ]
    finally:
        if own:
            dummy.close()


def remove_ipsets(
    netns: str | None = None, *, dry_run: bool = False, ipset: IpsetClient | None = None
) -> list[OwnedObject]:
    from kproxy.dataplane.ipvs.ipset import IpsetClient, IpsetError

    client = ipset or IpsetClient(netns)
    try:
        existing = client.names()
    except (IpsetError, OSError):
        return []
    going = [name for name in existing if name in n.OWNED_SET_NAMES]
    if going and not dry_run:
        try:
            client.restore([f"destroy {name}" for name in going])  # one process for all
        except IpsetError:
            kept = []
            for name in going:  # find the ones that cannot go (still referenced?)
                try:
                    client.destroy(name)
                except IpsetError as err:
                    log.warning("%s", err)
                    kept.append(name)
            going = [name for name in going if name not in kept]
    return [OwnedObject("ipset", "ipset", name, "a kube-proxy ipvs mode ipset") for name in going]


def cleanup(
    backend: IptablesBackend | None,
    netns: str | None = None,
    *,
    dry_run: bool = False,
    exclude_cidrs: Iterable[str] = (),
    known: Iterable[VSKey] = (),
    clients: Clients | None = None,
) -> list[OwnedObject]:
    """All of ipvs mode's state, in an order that works."""
    removed = virtual_servers(
        netns, dry_run=dry_run, exclude_cidrs=exclude_cidrs, known=known, clients=clients
    )
    if backend is not None:
        chains = ipvs_iptables_objects(backend)
        if chains and not dry_run:
            remove_iptables(backend, chains)
        removed += chains
    removed += remove_dummy(netns, dry_run=dry_run, dummy=clients.dummy if clients else None)
    removed += remove_ipsets(netns, dry_run=dry_run, ipset=clients.ipset if clients else None)
    return removed


def leftovers(dump: KernelDump, *, remove: bool) -> list[OwnedObject]:
    """ipvs mode's state besides its chains (which the iptables cleanup of every mode
    takes), removed unless not remove. The virtual servers go first: kube-ipvs0 and the
    ipsets say which of them are ours."""
    dry_run = not remove
    return (
        virtual_servers(dump.netns, dry_run=dry_run)
        + remove_dummy(dump.netns, dry_run=dry_run)
        + remove_ipsets(dump.netns, dry_run=dry_run)
    )
