"""Find and remove the nftables state of kproxy and upstream kube-proxy, and nothing else.

Ours are exactly: `table ip kube-proxy` and `table ip6 kube-proxy` (upstream's nftables mode
and kproxy's), and tables kproxy itself names `kproxy-...` in the ip, ip6 or inet family --
except the conntrack anchor (`ip kproxy-anchor`, dataplane/anchor.py), which belongs to the
mode-switch machinery and must outlive the cleanup of the mode being switched away from.
Every other table (firewalld, docker, a host's `inet filter`) is never touched; upstream's
own cleanup (`delete table ip kube-proxy` / `ip6 kube-proxy`, not-found ignored) is the same
apart from kproxy's prefix.

Each layout's dataplane owns its own tables (layouts.OWN_TABLES): a switch between the
layouts removes the old layout's table only, and while one layout runs, the other's table
(and any other kproxy- table) is a leftover.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from kproxy.dataplane.anchor import TABLE as ANCHOR_TABLE
from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.nftables import names as n
from kproxy.dataplane.nftables.backend import NftError, TableRef

if TYPE_CHECKING:
    from kproxy.dataplane.kernel_dump import KernelDump

log = logging.getLogger("kproxy.nftables.cleanup")

KUBE_PROXY_TABLES = (TableRef("ip", n.TABLE), TableRef("ip6", n.TABLE))
KPROXY_TABLE_PREFIX = "kproxy-"
KPROXY_FAMILIES = ("ip", "ip6", "inet")


class TableBackend(Protocol):
    def tables(self) -> list[TableRef]: ...
    def delete_table(self, family: str, name: str) -> bool: ...


def is_owned_table(table: TableRef) -> bool:
    if table in KUBE_PROXY_TABLES:
        return True
    if table.name == ANCHOR_TABLE:
        return False
    return table.family in KPROXY_FAMILIES and table.name.startswith(KPROXY_TABLE_PREFIX)


def _of_layout(layout: str) -> set[TableRef]:
    from kproxy.dataplane.nftables.layouts import OWN_TABLES

    return {TableRef(family, name) for family, name in OWN_TABLES[layout]}


def owned_tables(
    backend: TableBackend, *, layout: str | None = None, running: str | None = None
) -> list[OwnedObject]:
    """The owned tables there are: all, or (layout) one layout's own, or all but the
    running layout's own."""
    own = _of_layout(layout) if layout is not None else None
    keep = _of_layout(running) if running is not None else set()
    try:
        tables = backend.tables()
    except NftError as err:
        log.warning("cannot list nftables tables: %s", err)
        return []
    found = []
    for table in sorted(tables, key=str):
        if (own is not None and table not in own) or table in keep:
            continue
        if table in KUBE_PROXY_TABLES:
            reason = "the kube-proxy nftables table (kproxy's or upstream's nftables mode)"
        elif table.family == "ip" and table.name == n.COMPACT_TABLE:
            reason = "the table of kproxy's nftables mode in the compact layout"
        elif is_owned_table(table):
            reason = f"a kproxy table ({KPROXY_TABLE_PREFIX}*)"
        else:
            continue
        found.append(OwnedObject("nft-table", "nftables", str(table), reason))
    return found


def cleanup(
    backend: TableBackend,
    *,
    dry_run: bool = False,
    layout: str | None = None,
    running: str | None = None,
) -> list[OwnedObject]:
    """Delete the owned tables owned_tables() selects (one `delete table` each; one
    already gone is no error)."""
    owned = owned_tables(backend, layout=layout, running=running)
    if dry_run:
        return owned
    for obj in owned:
        family, name = obj.name.split(" ", 1)
        backend.delete_table(family, name)
    return owned


def leftovers(dump: KernelDump, *, remove: bool, running: str | None = None) -> list[OwnedObject]:
    """The tables of nftables mode in a dump (while it runs in a layout: all but that
    layout's own), deleted unless not remove."""
    tables = dump.nft_tables()
    return [] if tables is None else cleanup(tables, dry_run=not remove, running=running)


def other_layouts(dump: KernelDump, running: str, *, remove: bool) -> list[OwnedObject]:
    """While nftables mode runs in one layout: the tables of the others (and any other
    kproxy- table), deleted when remove."""
    return leftovers(dump, remove=remove, running=running)
