"""The dataplane serving now agrees with the objects, and no other mode's state is around.

Presence is read by the inspect readers from the kernel snapshot the backup took (no
second read), against expected_destinations() of the objects: the very comparison the
switch's verify step makes for the new mode (ops.inspect.destinations), made here for the
old one. Leftovers are what leftovers.clean_leftovers(dry_run=True) would list: the same
function, over the reads preflight already made (leftovers_by_mode()).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.kernel_dump import KernelDump
from kproxy.dataplane.nftables.backend import TableRef
from kproxy.host.commands import Runner
from kproxy.ops.inspect.destinations import expected_destinations
from kproxy.ops.inspect.model import Destination
from kproxy.ops.preflight.backup import NFT_PLANES, planes_of
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, info, warn

if TYPE_CHECKING:
    from kproxy.dataplane.iptables.backend import IptablesBackend

MAX_SHOWN = 10


def _shown(keys: list[Destination], names: dict[Destination, str]) -> str:
    parts = [f"{k} ({names.get(k) or 'unnamed'})" for k in keys[:MAX_SHOWN]]
    more = f", and {len(keys) - MAX_SHOWN} more" if len(keys) > MAX_SHOWN else ""
    return ", ".join(parts) + more


def check_consistency(ctx: Context) -> list[Finding]:
    mode, snap = ctx.current_mode, ctx.snapshot
    if mode is None or snap is None:
        return []
    found = ctx.programmed
    planes = planes_of(mode, ctx.current_flavour, found)
    programmed: dict[Destination, str] = {}
    for p in planes:
        programmed.update(found.get(p, {}))
    expected = expected_destinations(snap)
    names = {
        Destination(ip, sp.protocol.lower, sp.port): str(sp.name)
        for sp in snap.services.values()
        for ip in (sp.cluster_ip, *sp.external_ips, *sp.load_balancer_ips)
    }
    missing = sorted(expected - set(programmed))
    extra = sorted(set(programmed) - expected)
    out = []
    where = ", ".join(planes)
    if missing:
        out.append(
            warn(
                "dataplane.missing-services",
                f"{len(missing)} of {len(expected)} service destinations of the objects are not "
                f"in the kernel's {where} rules: {_shown(missing, names)}",
                f"those services do not work in {mode} mode now, and a rollback to it would not "
                "bring them back; someone removed rules (a firewall reload, a manual flush) or "
                "the last sync failed",
                [
                    "kproxy status  # the last sync error",
                    f"kproxy list --mode {mode} --source {ctx.source}"
                    if ctx.source
                    else f"kproxy list --mode {mode}",
                    "systemctl restart kproxy  # or wait for the next periodic full sync",
                ],
                facts={"missing": [str(k) for k in missing], "dataplane": planes},
            )
        )
    if extra:
        out.append(
            warn(
                "dataplane.extra-services",
                f"the kernel's {where} rules program {len(extra)} destinations the objects do "
                f"not have: {_shown(extra, programmed)}",
                "stale rules (another kube-proxy writing the same tables, or objects deleted "
                "while the proxy was down) send traffic to old endpoints",
                [f"kproxy list --mode {mode}", "ps -ef | grep -e kube-proxy -e kproxy"],
                facts={"extra": [str(k) for k in extra], "dataplane": planes},
            )
        )
    return out


_ORDER = ("iptables-rule", "iptables-chain", "nft-table", "interface", "ipset")


def removal_commands(objs: list[OwnedObject]) -> list[str]:
    """Exact commands that remove these objects, in the order that works (#109286)."""
    cmds: list[str] = []
    ranked = sorted(objs, key=lambda o: _ORDER.index(o.kind) if o.kind in _ORDER else 9)
    for o in ranked:
        if o.kind in ("iptables-rule", "iptables-chain"):
            tool, _, table = o.where.partition(" ")
            if o.kind == "iptables-rule":
                rule = o.name[3:] if o.name.startswith("-A ") else o.name
                cmds.append(f"{tool} -t {table} -D {rule}")
            else:
                cmds.append(f"{tool} -t {table} -F {o.name} && {tool} -t {table} -X {o.name}")
        elif o.kind == "nft-table":
            cmds.append(f"nft delete table {o.name}")
        elif o.kind == "interface":
            cmds.append(f"ip link delete {o.name}")
        elif o.kind == "ipset":
            cmds.append(f"ipset destroy {o.name}")
        elif o.kind == "process":
            cmds.append(f"kill {o.name.removeprefix('pid ')}")
        elif o.kind == "ip-rule":
            cmds.append(f"ip rule del {o.name}")
        elif o.kind == "ip-route":
            cmds.append(f"ip route flush {o.name}")
    return cmds


class _Tables:
    """nftables.cleanup's TableBackend over the tables known to exist (see leftover_objects)."""

    def __init__(self, tables: list[TableRef]) -> None:
        self._tables = tables

    def tables(self) -> list[TableRef]:
        return self._tables

    def delete_table(self, family: str, name: str) -> bool:
        raise AssertionError("preflight never deletes")


class NodeDump(KernelDump):
    """The kernel of the preflight's node, its commands run read-only through the node
    access. Beside a running kproxy this is all there is: each part read only when a
    mode asks (no kernel state section, no whole-table dump), and the chain listing once
    for every check that asks (Context.node_dump)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx.access.netns, state_dir=ctx.state_dir)
        self.ctx = ctx
        self._chain_listings: dict[str, dict[str, list[str]] | None] = {}

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return self.ctx.access.run(argv)

    def tool_runner(
        self, argv: Sequence[str], input_data: str | None
    ) -> subprocess.CompletedProcess[str]:
        return self.ctx.access.runner(argv, input_data)

    def nft_chain_listing(self, family: str) -> dict[str, list[str]] | None:
        if family not in self._chain_listings:
            self._chain_listings[family] = super().nft_chain_listing(family)
        return self._chain_listings[family]


class _PreflightDump(NodeDump):
    """The kernel as preflight already read it: iptables saves and the nftables tables
    from its kernel state (no second read of a 320,000-rule save; listing the nft tables
    itself takes 28 s on an iptables-nft node with 10,000 services), the rest read-only
    through the node access."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.snap = ctx.kernel_snapshot

    def iptables(self, flavour: str) -> IptablesBackend | None:
        from kproxy.dataplane.iptables.backend import IptablesBackend

        text = self.snap.get(f"iptables-{flavour}", {}).get("output", "")
        if ":KUBE-" not in text:
            return None  # no chain of any kube-proxy mode: nothing owned in this backend
        return IptablesBackend(flavour, netns=self.netns, runner=self._saved(text))

    def _saved(self, text: str) -> Runner:
        """A runner that answers a full iptables-save with text already read, and runs
        the rest read-only."""
        readonly = self.ctx.access.runner

        def run(argv: Sequence[str], data: str | None) -> subprocess.CompletedProcess[str]:
            if argv[-1].endswith("-save"):
                return subprocess.CompletedProcess(list(argv), 0, text, "")
            return readonly(argv, data)

        return run

    def iptables_chain_listing(self, flavour: str) -> dict[str, list[str]] | None:
        return None  # the saves are read already: no dump besides them

    def nft_tables(self) -> _Tables:
        tables = []
        for section in NFT_PLANES:  # each layout's section
            output = self.snap.get(section, {}).get("output") or "{}"
            for item in json.loads(output).get("nftables", []):
                t = item.get("table") if isinstance(item, dict) else None
                if t:
                    tables.append(TableRef(t["family"], t["name"]))
        return _Tables(tables)

    def nft_table_exists(self, family: str, name: str) -> bool:
        return self.run(["nft", "-j", "list", "table", family, name]).returncode == 0


def leftovers_by_mode(ctx: Context) -> list[tuple[str | None, OwnedObject]]:
    """What leftovers.clean_leftovers(mode, dry_run=True) lists (the same function), over
    the reads preflight already made; each with the mode whose state it is."""
    from kproxy.leftovers import leftovers_by_mode as found_by_mode

    dump = ctx.node_dump if ctx.live is not None else _PreflightDump(ctx)
    return found_by_mode(dump, ctx.current_mode, ctx.current_flavour, remove=False)


def leftover_objects(ctx: Context) -> list[OwnedObject]:
    return [obj for _mode, obj in leftovers_by_mode(ctx)]


def check_leftovers(ctx: Context) -> list[Finding]:
    found = leftovers_by_mode(ctx)
    if not found:
        return []
    target_own = [o for mode, o in found if mode == ctx.target]
    others = [o for mode, o in found if mode != ctx.target]
    out = []
    if others:
        kinds: dict[str, int] = {}
        for o in others:
            kinds[o.kind] = kinds.get(o.kind, 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        out.append(
            warn(
                "dataplane.leftovers",
                f"state of other proxy modes is on the node ({summary}): "
                + "; ".join(str(o) for o in others[:5])
                + ("; ..." if len(others) > 5 else ""),
                "leftovers stay in the packet path: stale REJECT rules break pods (#102314), "
                "kube-ipvs0 keeps every ClusterIP bound on the node (k3s#5643); a switch "
                "removes only the mode it leaves",
                removal_commands(others)[:30]
                or ["kproxy cleanup --dry-run  # then remove them by hand"],
                facts={"objects": [str(o) for o in others]},
            )
        )
    if target_own:
        out.append(
            info(
                "dataplane.target-state-present",
                f"{ctx.target} mode's state is already on the node ({len(target_own)} objects, "
                f"e.g. {target_own[0]}): the switch adopts and rewrites it",
                facts={"objects": [str(o) for o in target_own]},
            )
        )
    return out


CHECKS = (
    Check("dataplane", check_consistency, needs_source=True),
    Check("dataplane", check_leftovers),
)
