"""Find and remove the iptables state of kproxy and upstream kube-proxy, and nothing else.

What counts as ours is decided by chain name only: the chains upstream kube-proxy creates
in any of its modes (iptables, ipvs, the old userspace portals), the per-service chains
by prefix, and every rule elsewhere that jumps into one of them. kubelet's chains
(KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-MARK-DROP, KUBE-IPTABLES-HINT) and every other
program's chains are never touched, which is deliberately narrower than "flush KUBE-*".
"""

from __future__ import annotations

import logging

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.iptables import names
from kproxy.dataplane.iptables.backend import IptablesBackend, IptablesError, parse_save, rule_chain

log = logging.getLogger("kproxy.iptables.cleanup")

# Top-level chains of upstream kube-proxy, per mode (and kproxy's, which are the same).
KUBE_PROXY_CHAINS = frozenset(
    {
        # iptables mode
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
        "KUBE-PROXY-CANARY",
        # ipvs mode
        "KUBE-NODE-PORT",
        "KUBE-LOAD-BALANCER",
        "KUBE-SOURCE-RANGES-FIREWALL",
        "KUBE-IPVS-FILTER",
        "KUBE-IPVS-OUT-FILTER",
        # the removed userspace mode
        "KUBE-PORTALS-CONTAINER",
        "KUBE-PORTALS-HOST",
        "KUBE-NODEPORT-CONTAINER",
        "KUBE-NODEPORT-HOST",
        "KUBE-NODEPORT-NON-LOCAL",
    }
)
# Chains that look like ours but belong to kubelet (kube-proxy's own cleanup keeps them too).
KUBELET_CHAINS = frozenset(
    {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-MARK-DROP", "KUBE-IPTABLES-HINT"}
)
TABLES = ("filter", "nat", "mangle", "raw")


def is_owned_chain(chain: str) -> bool:
    return chain in KUBE_PROXY_CHAINS or names.is_service_chain(chain)


def _target(rule: str) -> str:
    parts = rule.split()
    for flag in ("-j", "-g"):
        if flag in parts:
            i = parts.index(flag)
            if i + 1 < len(parts):
                return parts[i + 1]
    return ""


def owned_state(backend: IptablesBackend) -> list[OwnedObject]:
    """Our chains and the foreign rules that jump into them, in one backend."""
    where = f"iptables-{backend.flavour}"
    try:
        tables = parse_save(backend.save())
    except IptablesError as err:
        log.warning("cannot read %s rules: %s", where, err)
        return []
    found: list[OwnedObject] = []
    for table in TABLES:
        dump = tables.get(table)
        if dump is None:
            continue
        for rule in dump.rules:
            chain = rule_chain(rule)
            target = _target(rule)
            if not is_owned_chain(chain) and is_owned_chain(target):
                found.append(
                    OwnedObject(
                        "iptables-rule",
                        f"{where} {table}",
                        rule,
                        f"jumps to kube-proxy chain {target}",
                    )
                )
        for chain in sorted(dump.chains):
            if chain in KUBE_PROXY_CHAINS:
                found.append(
                    OwnedObject(
                        "iptables-chain", f"{where} {table}", chain, "a kube-proxy top-level chain"
                    )
                )
            elif names.is_service_chain(chain):
                prefix = chain.split("-")[1]
                found.append(
                    OwnedObject(
                        "iptables-chain",
                        f"{where} {table}",
                        chain,
                        f"a kube-proxy per-service chain (KUBE-{prefix}-)",
                    )
                )
    return found


def cleanup_input(owned: list[OwnedObject]) -> str:
    """One restore input that removes the given state: jumps first, then flush, then delete."""
    by_table: dict[str, tuple[list[str], list[str]]] = {}
    for obj in owned:
        table = obj.where.rsplit(" ", 1)[1]
        rules, chains = by_table.setdefault(table, ([], []))
        if obj.kind == "iptables-rule":
            rules.append("-D" + obj.name[2:])
        else:
            chains.append(obj.name)
    out: list[str] = []
    for table, (rules, chains) in by_table.items():
        out.append(f"*{table}")
        out += [f":{c} - [0:0]" for c in chains]
        out += rules
        out += [f"-X {c}" for c in chains]
        out.append("COMMIT")
    return "\n".join(out) + "\n" if out else ""


def cleanup(backend: IptablesBackend, *, dry_run: bool = False) -> list[OwnedObject]:
    owned = owned_state(backend)
    if owned and not dry_run:
        backend.restore(cleanup_input(owned))
    return owned
