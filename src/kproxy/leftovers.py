"""Remove what other proxy modes left on this node, once the current mode is serving.

Upstream cleans only the iptables <-> nftables boundary at startup and leaves ipvs
leftovers (kube-ipvs0, ipsets, chains) for a reboot; kproxy removes every other mode's
state, kproxy's and upstream kube-proxy's, and nothing that belongs to other software.
Order matters (field notes, #109286): chains before the ipsets they reference.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from kproxy.dataplane.anchor import TABLE as ANCHOR_TABLE
from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.iptables.backend import IptablesBackend, IptablesError
from kproxy.dataplane.iptables.cleanup import cleanup as iptables_cleanup
from kproxy.dataplane.iptables.cleanup import iptables_mode_chain
from kproxy.dataplane.ipvs.names import OWNED_SET_NAMES
from kproxy.dataplane.userspace.proxier import clean_userspace_leftovers, userspace_chain
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.host.commands import in_netns

log = logging.getLogger("kproxy.leftovers")


def _run(argv: Sequence[str], netns: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(in_netns(argv, netns), capture_output=True, text=True, check=False)


def clean_leftovers(
    mode: str,
    *,
    iptables_flavour: str | None = None,
    netns: str | None = None,
    dry_run: bool = False,
    state_dir: Path | None = None,
) -> list[OwnedObject]:
    """Every other mode's state, removed (or only listed with dry_run). Never raises for one
    failing piece: what could not be removed is logged and the rest still goes."""
    removed: list[OwnedObject] = []
    for flavour in ("nft", "legacy"):
        keep = None
        if flavour == iptables_flavour:
            keep = {"iptables": iptables_mode_chain, "userspace": userspace_chain}.get(mode or "")
        try:
            backend = IptablesBackend(flavour, netns=netns)
            if flavour == iptables_flavour and mode == "ipvs":
                # ipvs mode shares chain names with iptables mode in other tables (filter
                # KUBE-SERVICES is iptables mode's only): decide per table and chain.
                removed += _not_ipvs_chains(backend, dry_run)
            else:
                removed += iptables_cleanup(backend, dry_run=dry_run, keep=keep)
            removed += _switch_raw_rules(backend, dry_run)
        except IptablesError as err:
            log.warning("could not clean iptables-%s leftovers: %s", flavour, err)
    if mode != "userspace":
        removed += clean_userspace_leftovers(
            state_dir or DEFAULT_STATE_DIR, netns=netns, dry_run=dry_run
        )
    if mode != "nftables":
        removed += _nft_tables(netns, dry_run)
    if mode != "ipvs":
        from kproxy.dataplane.ipvs.cleanup import virtual_servers

        # Before kube-ipvs0 and the ipsets go: they say which virtual servers are ours.
        removed += virtual_servers(netns, dry_run=dry_run)
        removed += _kube_ipvs0(netns, dry_run)
        removed += _ipsets(netns, dry_run)
    for obj in removed:
        log.info("%s leftover %s", "would remove" if dry_run else "removed", obj)
    return removed


def _not_ipvs_chains(backend: IptablesBackend, dry_run: bool) -> list[OwnedObject]:
    """Every kube-proxy chain of this backend except ipvs mode's (by table and name), and the
    rules elsewhere that jump into them."""
    from kproxy.dataplane.iptables.cleanup import cleanup_input, owned_state
    from kproxy.dataplane.ipvs.cleanup import is_ipvs_chain, rule_target

    def ipvs_owned(obj: OwnedObject) -> bool:
        table = obj.where.rsplit(" ", 1)[1]
        name = obj.name if obj.kind == "iptables-chain" else rule_target(obj.name)
        return is_ipvs_chain(table, name)

    found = [o for o in owned_state(backend) if not ipvs_owned(o)]
    if found and not dry_run:
        backend.restore(cleanup_input(found))
    return found


def _switch_raw_rules(backend: IptablesBackend, dry_run: bool) -> list[OwnedObject]:
    """The raw-table rules a crash during a switch left, in any mode (outside a switch
    nothing uses them): ipvs mode's datagram hold (ipvs/hold.py; harmless with
    --queue-bypass) and userspace mode's UDP hand-off (NOTRACK for marked replies). Read
    without side effects and cheaply: `iptables-nft -S CHAIN` creates no table; legacy's
    raw table is saved only if it exists (a save of a missing legacy table creates it)."""
    from kproxy.dataplane.iptables.backend import parse_save
    from kproxy.dataplane.iptables.cleanup import cleanup_input
    from kproxy.dataplane.ipvs.hold import HOLD_CHAINS, hold_objects
    from kproxy.dataplane.userspace.render import HANDOFF_COMMENT

    if backend.flavour == "legacy":
        names = _run(["cat", "/proc/net/ip_tables_names"], backend.netns).stdout.split()
        dump = parse_save(backend.save("raw")).get("raw") if "raw" in names else None
        rules = sorted(dump.rules) if dump is not None else []
    else:
        rules = sorted(backend.builtin_outlines({"raw": HOLD_CHAINS})["raw"].builtin_rules)
    where = f"iptables-{backend.flavour}"
    found = hold_objects(where, rules)
    found += [
        OwnedObject(
            "iptables-rule",
            f"{where} raw",
            rule,
            "kproxy userspace mode's UDP hand-off of a switch (left by a crash)",
        )
        for rule in rules
        if f'"{HANDOFF_COMMENT}"' in rule
    ]
    if found and not dry_run:
        backend.restore(cleanup_input(found))
    return found


def _nft_tables(netns: str | None, dry_run: bool) -> list[OwnedObject]:
    if shutil.which("nft") is None:
        return []
    from kproxy.dataplane.nftables.backend import NftBackend, NftError
    from kproxy.dataplane.nftables.cleanup import cleanup as nft_cleanup

    backend = NftBackend(netns=netns)
    removed = nft_cleanup(backend, dry_run=dry_run)
    # The switch's conntrack anchor: only ever a leftover outside a switch (a crash).
    # (Looked up by netlink: `nft list tables` dumps every object first, 28 s at 10,000
    # services on an iptables-nft node.)
    try:
        anchored = backend.table_exists("ip", ANCHOR_TABLE)
    except NftError as err:
        log.warning("cannot look for the switch anchor table: %s", err)
        anchored = False
    if anchored:
        if not dry_run:
            _run(["nft", "delete", "table", "ip", ANCHOR_TABLE], netns)
        removed.append(
            OwnedObject(
                "nft-table",
                "nftables",
                f"ip {ANCHOR_TABLE}",
                "kproxy's mode-switch conntrack anchor",
            )
        )
    return removed


def _kube_ipvs0(netns: str | None, dry_run: bool) -> list[OwnedObject]:
    shown = _run(["ip", "-j", "-d", "link", "show", "kube-ipvs0"], netns)
    if shown.returncode != 0:
        return []
    try:
        kind = json.loads(shown.stdout)[0].get("linkinfo", {}).get("info_kind")
    except (ValueError, IndexError):
        kind = None
    if kind != "dummy":
        log.warning(
            "kube-ipvs0 exists but is a %s interface, not kube-proxy's dummy: left alone", kind
        )
        return []
    if not dry_run:
        _run(["ip", "link", "delete", "kube-ipvs0"], netns)
    return [
        OwnedObject("interface", "link", "kube-ipvs0", "kube-proxy ipvs mode's dummy interface")
    ]


def _ipsets(netns: str | None, dry_run: bool) -> list[OwnedObject]:
    if shutil.which("ipset") is None:
        return []
    names = _run(["ipset", "list", "-n"], netns).stdout.split()
    out = []
    for name in names:
        if name not in OWNED_SET_NAMES:
            continue
        if not dry_run:
            done = _run(["ipset", "destroy", name], netns)
            if done.returncode != 0:
                log.warning("ipset %s not destroyed: %s", name, done.stderr.strip())
                continue
        out.append(OwnedObject("ipset", "ipset", name, "a kube-proxy ipvs mode ipset"))
    return out
