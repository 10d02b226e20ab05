"""A verified backup of the dataplane serving now, taken before anything changes.

The backup is a document in ops.snapshot.take()'s format (iptables-save of both backends,
the kube-proxy nft tables, IPVS, ipsets, kube-ipvs0, conntrack usage; kernelstate.py),
written to a file and read back: it must parse, be
non-empty for the current mode and hold that mode's kube-proxy state (KUBE-SERVICES, the
kube-proxy nft table, IPVS virtual servers), with the same service destinations as the
kernel. The finding carries the commands that restore it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kproxy.dataplane.nftables.layouts import (
    DATAPLANES,
    LAYOUTS,
    TABLES,
    dataplane_name,
    target_name,
)
from kproxy.ops.inspect.destinations import expected_destinations
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, block, info, warn
from kproxy.ops.preflight.kernelstate import KernelState
from kproxy.ops.snapshot import programmed_in

KEEP_BACKUPS = 5
PREFIX = "preflight-backup-"


# nftables mode's dataplanes, one per layout, and each one's snapshot section: both hold
# the mode's state (dataplane/nftables/layouts.py).
NFT_PLANES = tuple(DATAPLANES)


def planes_of(
    mode: str, flavour: str | None, found: dict[str, Any], *, layout: str | None = None
) -> list[str]:
    """The dataplanes (ops.inspect.readers) a mode's state shows up under: nftables mode's
    in `layout` when known (a running kproxy knows its own), else whichever is found."""
    if mode in ("iptables", "userspace"):
        if flavour:
            return [f"{mode}-{flavour}"]
        return [p for p in found if p.startswith(f"{mode}-")] or [f"{mode}-nft"]
    if mode == "nftables":
        if layout:
            return [dataplane_name(layout)]
        return [p for p in NFT_PLANES if p in found] or ["nftables"]
    return [mode]


def _sections(mode: str, flavour: str | None) -> list[str]:
    if mode in ("iptables", "userspace"):
        return [f"iptables-{flavour}"] if flavour else ["iptables-nft", "iptables-legacy"]
    return {"nftables": list(NFT_PLANES), "ipvs": ["ipvs", "ipset"]}.get(mode, [])


def nft_has_kube_proxy(text: str) -> bool:
    """Whether `nft -j list table …` output holds nftables mode's table in either layout
    (ip kube-proxy, ip kproxy-compact)."""
    try:
        items = json.loads(text or "{}").get("nftables", [])
    except (ValueError, AttributeError):
        return False
    for item in items:
        table = item.get("table") if isinstance(item, dict) else None
        if table and table.get("name") in TABLES.values() and table.get("family") == "ip":
            return True
    return False


def nft_layouts(snap: Any) -> list[str]:
    """The nftables layouts whose table the snapshot holds (each in its own section)."""
    return [
        layout
        for layout in LAYOUTS
        if nft_has_kube_proxy(snap.get(dataplane_name(layout), {}).get("output", ""))
    ]


def _kube_state(mode: str, snap: dict[str, Any], sections: list[str]) -> bool:
    text = "".join(snap.get(s, {}).get("output", "") for s in sections)
    if mode == "iptables":
        return ":KUBE-SERVICES" in text
    if mode == "userspace":
        return ":KUBE-PORTALS-CONTAINER" in text
    if mode == "nftables":
        return any(nft_has_kube_proxy(snap.get(s, {}).get("output", "")) for s in sections)
    if mode == "ipvs":
        return "-A -" in snap.get("ipvs", {}).get("output", "")
    return False


def _present(mode: str, snap: Any, sections: list[str]) -> list[str]:
    """The sections that hold the mode's state: a backup restores only what exists (one
    iptables backend of two, one nftables layout's table of two)."""
    found = [s for s in sections if snap.get(s, {}).get("ok")]
    if mode == "nftables":
        return [s for s in found if nft_has_kube_proxy(snap.get(s, {}).get("output", ""))]
    if mode in ("iptables", "userspace"):
        return [s for s in found if _kube_state(mode, snap, [s])]
    return found


def restore_commands(mode: str, sections: list[str], path: str) -> list[str]:
    cmds = []
    for s in sections:
        if s.startswith("iptables-"):
            cmds.append(f"jq -r '.\"{s}\".output' {path} | {s}-restore")
        elif s in NFT_PLANES:
            cmds.append(
                f"jq -r '.\"{s}\".output' {path} > /tmp/{s}.json && nft -j -f /tmp/{s}.json"
            )
        elif s == "ipvs":
            cmds.append(f"jq -r .ipvs.output {path} | ipvsadm -R")
        elif s == "ipset":
            cmds.append(f"jq -r .ipset.output {path} | ipset restore -exist")
    return cmds


def default_path(ctx: Context) -> Path | None:
    if ctx.backup_path is not None:
        return ctx.backup_path
    if ctx.state_dir is None:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S")
    was = target_name(str(ctx.current_mode), ctx.current_layout)
    to = target_name(ctx.target, ctx.target_layout)
    return ctx.state_dir / f"{PREFIX}{stamp}-{was}-to-{to}.json"


def _prune(folder: Path) -> None:
    old = sorted(folder.glob(f"{PREFIX}*.json"))[:-KEEP_BACKUPS]
    for p in old:
        p.unlink(missing_ok=True)


def check_backup(ctx: Context) -> list[Finding]:
    snap = ctx.kernel_snapshot
    found = ctx.programmed
    mode = ctx.current_mode
    if mode is None:
        return [
            info(
                "backup.nothing-to-back-up",
                "no kube-proxy dataplane is serving on this node: there is nothing to back up",
                facts={"dataplanes": sorted(found)},
            )
        ]
    flavour = ctx.current_flavour
    sections = _sections(mode, flavour)
    failed = [s for s in sections if not snap.get(s, {}).get("ok")]
    if (mode in ("iptables", "userspace") and not flavour) or mode == "nftables":
        # one backend (one nftables layout) is enough
        failed = failed if len(failed) == len(sections) else []
    if failed:
        errors = {s: snap.get(s, {}).get("error", "") for s in failed}
        cmds = [snap.get(s, {}).get("command", s) for s in failed]
        return [
            block(
                "backup.failed",
                f"could not read the current {mode} dataplane: "
                + "; ".join(
                    f"{c}: {e or 'failed'}" for c, e in zip(cmds, errors.values(), strict=True)
                ),
                "without a backup a failed switch cannot be restored by hand",
                [f"{c} > /root/{mode}-backup.txt" for c in cmds],
                facts={"errors": errors},
            )
        ]
    planes = planes_of(mode, flavour, found, layout=ctx.current_layout)
    serving = {k: v for p in planes for k, v in found.get(p, {}).items()}
    if not _kube_state(mode, snap, sections):
        return [
            block(
                "backup.no-kube-state",
                f"the node is said to run {mode} mode but its kernel state holds no "
                f"kube-proxy {mode} state ({', '.join(sections)})",
                "the backup would not contain what serves traffic now, so there is nothing to "
                "go back to if the switch fails; something removed the rules (a firewall "
                "reload, another cleanup) or the mode is not what it seems",
                [
                    "kproxy status",
                    f"kproxy list --mode {mode}",
                    "kproxy snapshot -o /root/now.json",
                ],
                facts={"mode": mode, "sections": sections},
            )
        ]
    if not serving:
        expected = expected_destinations(ctx.snapshot) if ctx.snapshot is not None else set()
        if expected or ctx.snapshot is None:
            make = block if expected else warn
            return [
                make(
                    "backup.empty",
                    f"the {mode} dataplane programs no service destinations"
                    + (f", but the objects have {len(expected)}" if expected else ""),
                    "the backup would restore a node that serves nothing",
                    ["kproxy list", "kproxy status"],
                    facts={"expected": len(expected)},
                )
            ]
    path = default_path(ctx)
    document = snap.document() if isinstance(snap, KernelState) else dict(snap)
    text = json.dumps(document, indent=1) + "\n"
    if path is None:
        return [
            info(
                "backup.not-kept",
                f"the {mode} dataplane was read ({len(serving)} service destinations) but "
                "not written anywhere (no state dir)",
                "keep one before switching",
                ["kproxy snapshot -o /root/before-switch.json"],
                facts={"destinations": len(serving)},
            )
        ]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        back = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return [
            block(
                "backup.write-failed",
                f"could not write and read back the backup {path}: {err}",
                "without a backup a failed switch cannot be restored by hand",
                [f"kproxy snapshot -o /root/{mode}-backup.json"],
            )
        ]
    again = programmed_in(back)
    if {p: again.get(p) for p in planes} != {p: found.get(p) for p in planes}:
        return [
            block(
                "backup.unverified",
                f"the backup {path} does not read back the service destinations it holds",
                "a backup that does not restore what serves now is no backup",
                [f"kproxy snapshot -o /root/{mode}-backup.json"],
            )
        ]
    if ctx.backup_path is None:
        _prune(path.parent)
    return [
        info(
            "backup.ok",
            f"backup of the {mode} dataplane ({', '.join(planes)}: {len(serving)} service "
            f"destinations) written to {path} and verified",
            "restore it by hand if everything else fails",
            restore_commands(mode, _present(mode, snap, sections), str(path)),
            facts={"path": str(path), "destinations": len(serving), "bytes": len(text)},
        )
    ]


def at_switch(ctx: Context) -> Finding:
    """The backup of a switch run by the proxy: its "before" record (switch.py) is written
    when the switch starts, before anything changes, so preflight reads nothing for it."""
    mode = ctx.current_mode or "no"
    return info(
        "backup.at-switch",
        f"the {mode} dataplane is recorded by the running kproxy when the switch starts, "
        'before anything changes (its "before" snapshot in the state dir)',
        "restore it by hand if everything else fails (the switch report names the file)",
        ["kproxy snapshot -o /root/before-switch.json  # a copy of your own, now"],
        facts={"mode": ctx.current_mode},
    )


CHECKS = (Check("backup", check_backup),)
