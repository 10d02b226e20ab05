"""Find and remove the iptables state of kproxy and upstream kube-proxy, and nothing else.

What counts as ours is decided by chain name only: the chains upstream kube-proxy creates
in any of its modes (iptables, ipvs, the old userspace portals), the per-service chains
by prefix, and every rule elsewhere that jumps into one of them. kubelet's chains
(KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-MARK-DROP, KUBE-IPTABLES-HINT) and every other
program's chains are never touched, which is deliberately narrower than "flush KUBE-*".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.iptables import names
from kproxy.dataplane.iptables.backend import (
    BUILTIN_CHAINS_OF,
    IptablesBackend,
    IptablesError,
    rule_chain,
)

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
# The chains iptables mode writes itself (a leftover cleanup in that mode keeps these).
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


def keeps_chain(_table: str, chain: str) -> bool:
    """The chains a leftover cleanup keeps while iptables mode runs (in any table)."""
    return iptables_mode_chain(chain)


# A chain the running mode keeps, by table and name (ipvs mode's depend on the table).
KeepChain = Callable[[str, str], bool]
# Chains that look like ours but belong to kubelet (kube-proxy's own cleanup keeps them too).
KUBELET_CHAINS = frozenset(
    {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-MARK-DROP", "KUBE-IPTABLES-HINT"}
)
TABLES = ("filter", "nat", "mangle", "raw")


def is_owned_chain(chain: str) -> bool:
    return chain in KUBE_PROXY_CHAINS or names.is_service_chain(chain)


_TARGET = re.compile(r" -[jg] (\S+)")


def _target(rule: str) -> str:
    m = _TARGET.search(rule)
    return m.group(1) if m else ""


def owned_state(backend: IptablesBackend, keep: KeepChain | None = None) -> list[OwnedObject]:
    """Our chains and the rules elsewhere that jump into them, in one backend.

    keep(table, chain) marks chains the running mode still uses: they are not listed, nor are
    jumps into them; rules of kept chains that jump into a listed chain are listed (they
    would stop the chain from being deleted).

    The save is scanned line by line without being parsed into tables: at 10,000 services
    it holds 320,000 rules of the running mode, and this runs beside it at every start."""
    where = f"iptables-{backend.flavour}"
    try:
        text = backend.save()
    except IptablesError as err:
        log.warning("cannot read %s rules: %s", where, err)
        return []
    kept = keep or (lambda _t, _c: False)
    verdicts: dict[tuple[str, str], bool] = {}

    def goes(table: str, chain: str) -> bool:
        verdict = verdicts.get((table, chain))
        if verdict is None:
            verdict = is_owned_chain(chain) and not kept(table, chain)
            verdicts[table, chain] = verdict
        return verdict

    rules: list[OwnedObject] = []
    chains: list[OwnedObject] = []
    table = ""
    going: set[str] = set()  # this table's chains that go
    pos, size = 0, len(text)
    while pos < size:
        end = text.find("\n", pos)
        if end < 0:
            end = size
        line = text[pos:end]
        first = line[:1]
        if first == "-":
            if not going:
                # iptables-save prints a table's chains before its rules: with nothing to
                # remove here no rule can jump into a leftover, so skip the rules whole
                # (the running mode's 320,000 lines at 10,000 services).
                skip = text.find("\nCOMMIT", pos)
                pos = size if skip < 0 else skip + 1
                continue
            if line.startswith("-A ") and "KUBE-" in line:
                target = _target(line)
                chain = rule_chain(line)
                if target in going and chain not in going:
                    why = (
                        f"jumps to kube-proxy chain {target}"
                        if not is_owned_chain(chain)
                        else f"a rule of {chain} (kept) that jumps to leftover chain {target}"
                    )
                    rules.append(OwnedObject("iptables-rule", f"{where} {table}", line, why))
        elif first == ":":
            chain = line[1:].partition(" ")[0]
            if table in TABLES and goes(table, chain):
                going.add(chain)
                chains.append(OwnedObject("iptables-chain", f"{where} {table}", chain, _why(chain)))
        elif first == "*":
            table = line[1:].strip()
            going = set()
        pos = end + 1
    # Per table: the jumps first, then the chains in name order (what cleanup_input and
    # the dry-run listing expect).
    order = {t: i for i, t in enumerate(TABLES)}

    def table_of(obj: OwnedObject) -> int:
        return order[obj.where.rsplit(" ", 1)[1]]

    out: list[OwnedObject] = []
    for t in sorted({table_of(o) for o in rules + chains}):
        out += [o for o in rules if table_of(o) == t]
        out += sorted((o for o in chains if table_of(o) == t), key=lambda o: o.name)
    return out


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


def going_chains(
    listed: Mapping[str, Iterable[str]], keep: KeepChain | None = None
) -> dict[str, list[str]]:
    """Per table, the chains a cleanup removes, from the chain names alone (sorted)."""
    kept = keep or (lambda _t, _c: False)
    going: dict[str, list[str]] = {}
    for table in TABLES:
        found = [c for c in listed.get(table, ()) if is_owned_chain(c) and not kept(table, c)]
        if found:
            going[table] = sorted(found)
    return going


def cleanup(
    backend: IptablesBackend,
    *,
    dry_run: bool = False,
    keep: KeepChain | None = None,
    listed: Mapping[str, Iterable[str]] | None = None,
) -> list[OwnedObject]:
    """Our state in one backend (owned_state), removed unless dry_run. listed: the chain
    names per table, when the caller has them (iptables-nft's netlink chain dump): a dry
    run where no chain goes then reads no save, as no rule can jump into a chain that
    goes (the 320,000 rules of the running mode at 10,000 services)."""
    if dry_run and listed is not None and not going_chains(listed, keep):
        return []
    done: list[OwnedObject] = []
    if backend.flavour == "nft" and not dry_run:
        done, complete = remove_over_netlink(backend, keep)
        if complete:
            return done
    owned = owned_state(backend, keep)
    if owned and not dry_run:
        backend.restore(cleanup_input(owned))
    return done + [o for o in owned if o not in done]


NETLINK_BATCH = 2000  # messages per nfnetlink batch (~120 KB, under the socket's limit)


def remove_over_netlink(
    backend: IptablesBackend, keep: KeepChain | None = None
) -> tuple[list[OwnedObject], bool]:
    """iptables-nft only: what owned_state() + one restore remove, without either. At
    10,000 services `iptables-nft-save` takes 8-14 s and `iptables-nft-restore` of the
    flush-and-delete input ~90 s; here the chain names come from one netlink dump, the
    jumps from the built-in chains' own listings, and the chains go in nfnetlink batches
    (flush every chain, then delete them): ~5 s; only a table listing where iptables-nft
    has no table at all (an nftables-mode node). Not one transaction: an interruption
    leaves the rest for the next cleanup. Returns what it removed and whether that is
    all; not all when this way does not work here (a chain still referenced from a chain
    that stays, no netlink): the caller then takes the save-based way for what is left."""
    from kproxy.dataplane.nftables.netlink import (
        NetlinkError,
        NftNetlink,
        delete_chain,
        flush_chain,
    )

    where = f"iptables-{backend.flavour}"
    try:
        client = NftNetlink(backend.netns)
    except OSError as err:
        log.info("no nf_tables netlink for the %s cleanup (%s)", where, err)
        return [], False
    rules: list[OwnedObject] = []
    deleted: list[tuple[str, str]] = []  # (table, chain) whose delete was committed
    complete = False
    try:
        # The chain dump carries every chain of the family, an nftables-mode node's
        # 110,000 included (3.5 s at 10,000 services); the table dump is tiny.
        tables = {name for family, name in client.list_tables() if family == client.family}
        if not tables & set(TABLES):
            return [], True
        going = going_chains(client.chains_by_table(), keep)
        if not going:
            return [], True
        outlines = backend.builtin_outlines({t: BUILTIN_CHAINS_OF[t] for t in going})
        found_rules = [
            OwnedObject(
                "iptables-rule", f"{where} {t}", line, f"jumps to kube-proxy chain {_target(line)}"
            )
            for t, outline in outlines.items()
            for line in sorted(outline.builtin_rules)
            if _target(line) in going[t]
        ]
        if found_rules:
            backend.restore(cleanup_input(found_rules))
        rules = found_rules
        flushes = [flush_chain(t, c) for t, cs in going.items() for c in cs]
        for i in range(0, len(flushes), NETLINK_BATCH):
            client.run(flushes[i : i + NETLINK_BATCH])
        pairs = [(t, c) for t, cs in going.items() for c in cs]
        for i in range(0, len(pairs), NETLINK_BATCH):
            batch = pairs[i : i + NETLINK_BATCH]
            client.run([delete_chain(t, c) for t, c in batch])
            deleted += batch
        complete = True
    except (NetlinkError, OSError, IptablesError) as err:
        log.info("removing %s chains over netlink stopped (%s): reading the save", where, err)
    finally:
        client.close()
    chains = [OwnedObject("iptables-chain", f"{where} {t}", c, _why(c)) for t, c in deleted]
    return [o for t in TABLES for o in rules + chains if o.where == f"{where} {t}"], complete


def _why(chain: str) -> str:
    if chain in KUBE_PROXY_CHAINS:
        return "a kube-proxy top-level chain"
    return f"a kube-proxy per-service chain (KUBE-{chain.split('-')[1]}-)"
