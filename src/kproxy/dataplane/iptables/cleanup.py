"""Find and remove the iptables state of kproxy and upstream kube-proxy, and nothing else.

What counts as ours is decided by chain name only: the chains upstream kube-proxy creates
in any of its modes (iptables, ipvs, the old userspace portals), the per-service chains
by prefix, and every rule elsewhere that jumps into one of them. kubelet's chains
(KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-MARK-DROP, KUBE-IPTABLES-HINT) and every other
program's chains are never touched, which is deliberately narrower than "flush KUBE-*".
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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
# The chains each mode writes itself (a leftover cleanup in that mode keeps these).
IPTABLES_MODE_CHAINS = frozenset(
    {
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
        "KUBE-PROXY-CANARY",
    }
)


def iptables_mode_chain(chain: str) -> bool:
    return chain in IPTABLES_MODE_CHAINS or names.is_service_chain(chain)


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


def owned_state(
    backend: IptablesBackend, keep: Callable[[str], bool] | None = None
) -> list[OwnedObject]:
    """Our chains and the rules elsewhere that jump into them, in one backend.

    keep(chain) marks chains the running mode still uses: they are not listed, nor are
    jumps into them; rules of kept chains that jump into a listed chain are listed (they
    would stop the chain from being deleted)."""
    where = f"iptables-{backend.flavour}"
    try:
        tables = parse_save(backend.save())
    except IptablesError as err:
        log.warning("cannot read %s rules: %s", where, err)
        return []
    kept = keep or (lambda _: False)

    def goes(chain: str) -> bool:
        return is_owned_chain(chain) and not kept(chain)

    found: list[OwnedObject] = []
    for table in TABLES:
        dump = tables.get(table)
        if dump is None:
            continue
        for rule in dump.rules:
            chain, target = rule_chain(rule), _target(rule)
            if goes(target) and not goes(chain):
                why = (
                    f"jumps to kube-proxy chain {target}"
                    if not is_owned_chain(chain)
                    else f"a rule of {chain} (kept) that jumps to leftover chain {target}"
                )
                found.append(OwnedObject("iptables-rule", f"{where} {table}", rule, why))
        for chain in sorted(dump.chains):
            if not goes(chain):
                continue
            if chain in KUBE_PROXY_CHAINS:
                why = "a kube-proxy top-level chain"
            else:
                why = f"a kube-proxy per-service chain (KUBE-{chain.split('-')[1]}-)"
            found.append(OwnedObject("iptables-chain", f"{where} {table}", chain, why))
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


def cleanup(
    backend: IptablesBackend, *, dry_run: bool = False, keep: Callable[[str], bool] | None = None
) -> list[OwnedObject]:
    owned = owned_state(backend, keep)
    if owned and not dry_run:
        backend.restore(cleanup_input(owned))
    return owned
