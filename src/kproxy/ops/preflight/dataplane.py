"""The dataplane serving now agrees with the objects, and no other mode's state is around.

Presence is read by the inspect readers from the kernel snapshot the backup took (no
second read), against expected_destinations() of the objects: the very comparison the
switch's verify step makes for the new mode (ops.inspect.destinations), made here for the
old one. Leftovers
are what leftovers.clean_leftovers(dry_run=True) would list (leftover_objects()).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.nftables.backend import TableRef
from kproxy.host.commands import Runner
from kproxy.ops.inspect.destinations import expected_destinations
from kproxy.ops.inspect.model import Destination
from kproxy.ops.preflight.backup import planes_of
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, info, warn

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


def _saved(text: str) -> Runner:
    """A runner that answers a full iptables-save with text already read (no second read of
    a 320,000-rule save), and runs nothing else."""

    def run(argv: Sequence[str], _input: str | None) -> subprocess.CompletedProcess[str]:
        if argv[-1].endswith("-save"):
            return subprocess.CompletedProcess(list(argv), 0, text, "")
        return subprocess.CompletedProcess(list(argv), 1, "", "preflight only reads saves")

    return run


def leftover_objects(ctx: Context) -> list[OwnedObject]:
    """What leftovers.clean_leftovers(mode, dry_run=True) lists, from the pieces it is made of
    (the same ownership rules), fed with the reads preflight already made: iptables saves
    from the kernel state, nftables tables probed by name. (clean_leftovers itself lists all
    nft tables, which takes 28 s on an iptables-nft node with 10,000 services.)"""
    from kproxy.dataplane.anchor import TABLE as ANCHOR_TABLE
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.iptables.cleanup import iptables_mode_chain, owned_state
    from kproxy.dataplane.nftables.cleanup import owned_tables
    from kproxy.dataplane.userspace.proxier import clean_userspace_leftovers, userspace_chain
    from kproxy.defaults import DEFAULT_STATE_DIR
    from kproxy.leftovers import _ipsets, _kube_ipvs0  # the same scoping as at startup

    mode, netns, snap = ctx.current_mode or "", ctx.access.netns, ctx.kernel_snapshot
    out: list[OwnedObject] = []
    for flavour in ("nft", "legacy"):
        text = snap.get(f"iptables-{flavour}", {}).get("output", "")
        if ":KUBE-" not in text:
            continue  # no chain of any kube-proxy mode: nothing owned in this backend
        keep = None
        if flavour == ctx.current_flavour:
            keep = {"iptables": iptables_mode_chain, "userspace": userspace_chain}.get(mode)
        backend = IptablesBackend(flavour, netns=netns, runner=_saved(text))
        out += owned_state(backend, keep)
    state_dir = ctx.state_dir or DEFAULT_STATE_DIR
    if mode != "userspace" and _userspace_traces(ctx, state_dir):
        out += clean_userspace_leftovers(state_dir, netns=netns, dry_run=True)
    if mode != "nftables":
        tables = []
        for item in json.loads(snap.get("nftables", {}).get("output") or "{}").get("nftables", []):
            t = item.get("table") if isinstance(item, dict) else None
            if t:
                tables.append(TableRef(t["family"], t["name"]))
        out += owned_tables(_Tables(tables))
        if ctx.access.run(["nft", "-j", "list", "table", "ip", ANCHOR_TABLE]).returncode == 0:
            out.append(
                OwnedObject(
                    "nft-table",
                    "nftables",
                    f"ip {ANCHOR_TABLE}",
                    "kproxy's mode-switch conntrack anchor",
                )
            )
    if mode != "ipvs":
        out += _kube_ipvs0(netns, True) + _ipsets(netns, True)
    return out


def _userspace_traces(ctx: Context, state_dir: Path) -> bool:
    """Whether userspace mode left anything besides its chains (workers' state in the state
    dir, its policy rule): only then is its own leftover listing (slower: it re-detects
    the iptables backend) worth running."""
    from kproxy.dataplane.userspace.control import SUBDIR
    from kproxy.dataplane.userspace.render import RULE_PRIORITY

    if (state_dir / SUBDIR).exists():
        return True
    rules = ctx.access.run(["ip", "rule", "show", "pref", str(RULE_PRIORITY)])
    return bool(rules.stdout.strip())


def check_leftovers(ctx: Context) -> list[Finding]:
    objs = leftover_objects(ctx)
    if not objs:
        return []
    target_own = [o for o in objs if _mode_of(o) == ctx.target]
    others = [o for o in objs if o not in target_own]
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


def _mode_of(o: OwnedObject) -> str:
    if o.kind == "nft-table" and "kube-proxy" in o.name:
        return "nftables"
    if o.kind in ("ipset", "interface"):
        return "ipvs"
    return ""


CHECKS = (
    Check("dataplane", check_consistency, needs_source=True),
    Check("dataplane", check_leftovers),
)
