"""Remove what other proxy modes left on this node, once the current mode is serving.

Upstream cleans only the iptables <-> nftables boundary at startup and leaves ipvs
leftovers (kube-ipvs0, ipsets, chains) for a reboot; kproxy removes every other mode's
state, kproxy's and upstream kube-proxy's, and nothing that belongs to other software.
What each mode owns is its spec's word (dataplane/registry.py). Order matters (#109286):
the chains of every mode first, in both iptables backends (the running mode keeps its
own), then each other mode's remaining state: ipvs's ipsets after the chains that
reference them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kproxy.dataplane.anchor import TABLE as ANCHOR_TABLE
from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.kernel_dump import IPTABLES_FLAVOURS, KernelDump
from kproxy.dataplane.registry import SPECS

if TYPE_CHECKING:
    from kproxy.dataplane.iptables.backend import IptablesBackend

log = logging.getLogger("kproxy.leftovers")


def clean_leftovers(
    mode: str | None,
    *,
    iptables_flavour: str | None = None,
    netns: str | None = None,
    dry_run: bool = False,
    state_dir: Path | None = None,
    nftables_layout: str | None = None,
) -> list[OwnedObject]:
    """Every other mode's state (and, in nftables mode, the other layouts'), removed (or
    only listed with dry_run). Never raises for one failing piece: what could not be
    removed is logged and the rest still goes."""
    dump = KernelDump(netns, state_dir=state_dir)
    removed = leftovers(
        dump, mode, iptables_flavour, remove=not dry_run, nftables_layout=nftables_layout
    )
    for obj in removed:
        log.info("%s leftover %s", "would remove" if dry_run else "removed", obj)
    return removed


def leftovers(
    dump: KernelDump,
    mode: str | None,
    iptables_flavour: str | None,
    *,
    remove: bool,
    nftables_layout: str | None = None,
) -> list[OwnedObject]:
    """What of the dump is not `mode`'s own (None: no mode runs), removed when remove."""
    found = leftovers_by_mode(
        dump, mode, iptables_flavour, remove=remove, nftables_layout=nftables_layout
    )
    return [obj for _owner, obj in found]


def leftovers_by_mode(
    dump: KernelDump,
    mode: str | None,
    iptables_flavour: str | None,
    *,
    remove: bool,
    nftables_layout: str | None = None,
) -> list[tuple[str | None, OwnedObject]]:
    """leftovers(), each with the mode whose state it is (None: the iptables chains, which
    several modes share, and what a crashed switch left, which no mode adopts). The running
    mode's own state stays; in nftables mode that is its layout's (nftables_layout; None:
    every layout's)."""
    from kproxy.dataplane.iptables.backend import IptablesError
    from kproxy.dataplane.iptables.cleanup import cleanup as iptables_cleanup

    running = SPECS.get(mode or "")
    found: list[tuple[str | None, OwnedObject]] = []
    for flavour in IPTABLES_FLAVOURS:
        backend = dump.iptables(flavour)
        if backend is None:
            continue
        keep = running.keeps_chain if running and flavour == iptables_flavour else None
        # A listing tells a dry run that nothing goes without reading every rule.
        listed = None if remove else dump.iptables_chain_listing(flavour)
        try:
            found += [
                (None, o)
                for o in iptables_cleanup(backend, dry_run=not remove, keep=keep, listed=listed)
            ]
            found += [(None, o) for o in _switch_rules(dump, backend, remove)]
        except IptablesError as err:
            log.warning("could not clean iptables-%s leftovers: %s", flavour, err)
    found += [(None, o) for o in _switch_anchor(dump, remove)]
    for spec in SPECS.values():
        if spec is not running:
            found += [(spec.name, o) for o in (spec.remove if remove else spec.owned)(dump)]
        elif spec.other_layouts is not None and nftables_layout is not None:
            others = spec.other_layouts(dump, nftables_layout, remove=remove)
            found += [(spec.name, o) for o in others]
    return found


def _switch_rules(dump: KernelDump, backend: IptablesBackend, remove: bool) -> list[OwnedObject]:
    """The raw-table rules a crash during a switch left, in any mode (outside a switch
    nothing uses them): each mode's spec says which are its. Read without side effects
    and cheaply: `iptables-nft -S CHAIN` creates no table; legacy's raw table is saved
    only if it exists (a save of a missing legacy table creates it)."""
    from kproxy.dataplane.iptables.backend import BUILTIN_CHAINS_OF, parse_save
    from kproxy.dataplane.iptables.cleanup import cleanup_input

    if backend.flavour == "legacy":
        names = dump.legacy_tables() or []
        raw = parse_save(backend.save("raw")).get("raw") if "raw" in names else None
        rules = sorted(raw.rules) if raw is not None else []
    else:
        outlines = backend.builtin_outlines({"raw": BUILTIN_CHAINS_OF["raw"]})
        rules = sorted(outlines["raw"].builtin_rules)
    where = f"iptables-{backend.flavour}"
    found = [
        obj
        for spec in SPECS.values()
        if spec.switch_rules is not None
        for obj in spec.switch_rules(where, rules)
    ]
    if found and remove:
        backend.restore(cleanup_input(found))
    return found


def _switch_anchor(dump: KernelDump, remove: bool) -> list[OwnedObject]:
    """The switch's conntrack anchor: only ever a leftover outside a switch (a crash)."""
    from kproxy.dataplane.nftables.backend import NftError

    try:
        anchored = dump.nft_table_exists("ip", ANCHOR_TABLE)
    except NftError as err:
        log.warning("cannot look for the switch anchor table: %s", err)
        return []
    if not anchored:
        return []
    if remove:
        dump.run(["nft", "delete", "table", "ip", ANCHOR_TABLE])
    return [
        OwnedObject(
            "nft-table", "nftables", f"ip {ANCHOR_TABLE}", "kproxy's mode-switch conntrack anchor"
        )
    ]
