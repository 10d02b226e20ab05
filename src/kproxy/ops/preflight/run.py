"""Run the checks that apply to a target mode and collect one report.

Which checks run: every family's CHECKS whose modes include the target; object and
consistency checks need --source. A check that crashes becomes a warning naming it (a
preflight must never be the thing that fails). Reads happen in `access.netns` (None: the
caller's namespace), so tests point a whole run at a lab node.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kproxy.config import ProxyConfig
from kproxy.dataplane.nftables.layouts import describe, switch_layout
from kproxy.ops.inputs import node_name_of
from kproxy.ops.preflight import (
    backup,
    config_checks,
    conntrack,
    dataplane,
    kernel,
    objects,
    sysctls,
)
from kproxy.ops.preflight.access import NodeAccess
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import (
    Finding,
    counts,
    dumps,
    exit_code,
    findings_json,
    render_text,
    warn,
)
from kproxy.ops.preflight.live import PATH_LIVE, PATH_READ, LiveState

log = logging.getLogger("kproxy.preflight")

# Order of the report: what the switch needs to even start, then the node, then the data.
FAMILIES: dict[str, Sequence[Check]] = {
    "config": config_checks.CHECKS,
    "kernel": kernel.CHECKS,
    "sysctls": sysctls.CHECKS,
    "conntrack": conntrack.CHECKS,
    "objects": objects.CHECKS,
    "dataplane": dataplane.CHECKS,
    "backup": backup.CHECKS,
}


@dataclass
class PreflightResult:
    target: str
    current_mode: str | None
    current_flavour: str | None
    node: str
    netns: str | None
    findings: list[Finding]
    ran: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Per check, and "read.kernel" for the first read of the node's dataplane: where a
    # slow preflight spends its time.
    check_seconds: dict[str, float] = field(default_factory=dict)
    # Where the objects and the mode came from: the running kproxy (live.PATH_LIVE) or
    # read here from the source and the kernel (live.PATH_READ).
    path: str = PATH_READ
    # nftables mode's layouts (layouts.py) on either side; None for other modes.
    target_layout: str | None = None
    current_layout: str | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> PreflightResult:
        """A result as to_dict() wrote it (the running kproxy's answer)."""
        return cls(
            target=doc["target"],
            current_mode=doc.get("current_mode"),
            current_flavour=doc.get("current_flavour"),
            node=doc.get("node", ""),
            netns=doc.get("netns"),
            findings=[Finding.from_dict(f) for f in doc.get("findings", [])],
            ran=list(doc.get("checks_run", [])),
            skipped=dict(doc.get("checks_skipped", {})),
            notes=list(doc.get("notes", [])),
            seconds=float(doc.get("seconds", 0.0)),
            check_seconds=dict(doc.get("check_seconds", {})),
            path=doc.get("path", PATH_READ),
            target_layout=doc.get("target_layout"),
            current_layout=doc.get("current_layout"),
        )

    @property
    def exit_code(self) -> int:
        return exit_code(self.findings)

    @property
    def safe(self) -> bool:
        return self.exit_code == 0

    @property
    def blocking(self) -> list[Finding]:
        return [f for f in self.findings if f.blocks]

    def ids(self) -> list[str]:
        return [f.id for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "target_layout": self.target_layout,
            "path": self.path,
            "current_mode": self.current_mode,
            "current_layout": self.current_layout,
            "current_flavour": self.current_flavour,
            "node": self.node,
            "netns": self.netns,
            "safe": self.safe,
            "exit_code": self.exit_code,
            "counts": counts(self.findings),
            "findings": findings_json(self.findings),
            "checks_run": self.ran,
            "checks_skipped": self.skipped,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "check_seconds": {k: round(v, 3) for k, v in self.check_seconds.items()},
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())

    @property
    def target_described(self) -> str:
        """The target for messages: "nftables (compact layout)"; the mode alone otherwise."""
        return describe(self.target, self.target_layout)

    def header(self) -> str:
        mode = self.current_mode
        cur = describe(mode, self.current_layout) if mode else "no proxy mode"
        if self.current_flavour and self.current_mode in ("iptables", "userspace"):
            cur += f" (iptables-{self.current_flavour})"
        where = f", network namespace {self.netns}" if self.netns else ""
        how = " (asked the running kproxy)" if self.path == PATH_LIVE else ""
        target = self.target_described
        return f"kproxy preflight: {cur} -> {target} on node {self.node}{where}{how}"

    def verdict(self) -> str:
        target = self.target_described
        if self.safe:
            return f"SAFE: nothing blocks a switch to {target}"
        return f"BLOCKED: {len(self.blocking)} problem(s) make a switch to {target} unsafe"

    def print_text(self, console: Any = None) -> None:
        render_text(self.findings, header=self.header(), verdict=self.verdict(), console=console)
        for n in self.notes:
            (console.print if console else print)(f"note: {n}")


def detect_current(snap: dict[str, Any]) -> tuple[str | None, str | None, list[str]]:
    """(mode, iptables flavour, notes) of the dataplane hooked into the kernel now."""
    live: list[tuple[str, str | None]] = []
    for fl in ("nft", "legacy"):
        text = snap.get(f"iptables-{fl}", {}).get("output", "")
        if "-j KUBE-PORTALS-CONTAINER" in text:
            live.append(("userspace", fl))
        elif "-j KUBE-SERVICES" in text and ":KUBE-SERVICES" in text:
            live.append(("iptables", fl))
    if backup.nft_layouts(snap):
        live.append(("nftables", None))
    if "-A -" in snap.get("ipvs", {}).get("output", ""):
        live.append(("ipvs", None))
    notes = []
    if len(live) > 1:
        notes.append(
            "more than one proxy mode is hooked into the kernel: "
            + ", ".join(m + (f" (iptables-{f})" if f else "") for m, f in live)
        )
    if not live:
        return None, None, notes
    return live[0][0], live[0][1], notes


def daemon_uptime(pid: int) -> float | None:
    """Seconds since the process started (from /proc; None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return max(0.0, uptime - int(fields[19]) / ticks)


class ForeignNetns(Exception):
    """The proxy runs in a network namespace this process cannot name (no /run/netns entry)."""


def daemon_netns(pid: int) -> str | None:
    """The named network namespace (`ip netns` name) the process runs in; None when it is
    ours. A switch is often run from another namespace than the proxy's (the admin socket is
    a file), and every check must read the proxy's namespace, not the caller's."""
    try:
        theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
        ours = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None  # gone, or not ours to inspect: read our own
    if theirs == ours:
        return None
    try:
        names = sorted(os.listdir("/run/netns"))
    except OSError:
        names = []
    for name in names:
        try:
            if os.stat(f"/run/netns/{name}").st_ino == theirs:
                return name
        except OSError:
            continue
    raise ForeignNetns(
        f"kproxy (pid {pid}) runs in a network namespace without an `ip netns` name: run "
        "preflight inside it (nsenter --net=/proc/PID/ns/net kproxy preflight ...)"
    )


def _daemon_args(pid: int) -> tuple[list[str], Path] | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None
    return [a.decode(errors="replace") for a in argv if a], cwd


def _flag_values(args: list[str], flag: str) -> list[str]:
    out = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith(flag + "="):
            out.append(arg.split("=", 1)[1])
    return out


def daemon_inputs(pid: int) -> dict[str, Path]:
    """--config and --source of a running `kproxy run`, from its command line (read only)."""
    found = _daemon_args(pid)
    if found is None:
        return {}
    args, cwd = found
    out: dict[str, Path] = {}
    for flag in ("--config", "--source"):
        values = _flag_values(args, flag)
        if values:
            out[flag.lstrip("-")] = cwd / values[-1]
    return out


def daemon_node_ips(pid: int) -> list[str]:
    """The --node-ip values of a running `kproxy run` (empty: it detects them)."""
    found = _daemon_args(pid)
    return _flag_values(found[0], "--node-ip") if found else []


def run_preflight(
    target: str,
    *,
    access: NodeAccess | None = None,
    config_path: Path | None = None,
    source: Path | None = None,
    state_dir: Path | None = None,
    status: dict[str, Any] | None = None,
    current_mode: str | None = None,
    current_flavour: str | None = None,
    node_name: str | None = None,
    backup_path: Path | None = None,
    config: ProxyConfig | None = None,
    objects: list[dict[str, Any]] | None = None,
    snapshot_taker: Callable[[str | None], dict[str, Any]] | None = None,
    families: Sequence[str] | None = None,
    live: LiveState | None = None,
    backup_at_switch: bool = False,
    target_layout: str | None = None,
) -> PreflightResult:
    """All checks for a switch to `target` (validated by the caller: one of the modes).
    live: the running kproxy's own objects and mode (live.py), inside that kproxy.
    backup_at_switch: the switch that follows records the dataplane itself before it
    changes anything (its "before" snapshot), so no backup is read and written here.
    target_layout: nftables mode's layout to switch to (validated by the caller); None:
    the one the switch would use (the running kproxy's --nftables-layout, from its status)."""
    started = time.monotonic()
    acc = access or NodeAccess()
    status = dict(status) if status else None
    if status and isinstance(status.get("pid"), int):
        status.setdefault("uptime", daemon_uptime(status["pid"]))
        status.setdefault("node_ips", daemon_node_ips(status["pid"]))
    started_with = (status or {}).get("started_nftables_layout")
    ctx = Context(
        target=target,
        target_layout=switch_layout(target, target_layout, started_with),
        access=acc,
        config_path=config_path,
        source=source,
        status=status,
        node_name=node_name_of(node_name, status),
        state_dir=state_dir,
        backup_path=backup_path,
        config_override=config,
        objects_override=objects,
        snapshot_taker=snapshot_taker,
        live=live,
    )
    read_started = time.monotonic()
    if live is not None:
        # The proxy knows what serves; other modes' state is the leftover check's to find.
        ctx.current_mode, ctx.current_flavour = live.mode, live.flavour
        ctx.current_layout = live.layout
    else:
        detected, flavour, notes = detect_current(ctx.kernel_snapshot)
        ctx.notes += notes
        ctx.current_mode = current_mode or (status or {}).get("mode") or detected
        ctx.current_flavour = current_flavour or (flavour if ctx.current_mode == detected else None)
        if ctx.current_flavour is None and ctx.current_mode in ("iptables", "userspace"):
            ctx.current_flavour = _flavour_with_state(ctx.kernel_snapshot, ctx.current_mode)
        if ctx.current_mode == "nftables":
            ctx.current_layout = _current_layout(ctx)
    read_seconds = time.monotonic() - read_started
    result = PreflightResult(
        target, ctx.current_mode, ctx.current_flavour, ctx.node_name, acc.netns, findings=[]
    )
    result.path = PATH_LIVE if live is not None else PATH_READ
    result.target_layout, result.current_layout = ctx.target_layout, ctx.current_layout
    result.check_seconds["read.kernel"] = read_seconds
    for family, checks in FAMILIES.items():
        if families is not None and family not in families:
            continue
        for check in checks:
            if target not in check.modes:
                result.skipped[check.name] = f"does not apply to {target} mode"
                continue
            if check.needs_source and not ctx.has_objects:
                result.skipped[check.name] = "needs --source (the Services and EndpointSlices)"
                continue
            if backup_at_switch and check.family == "backup":
                result.findings.append(backup.at_switch(ctx))
                result.ran.append(check.name)
                continue
            check_started = time.monotonic()
            try:
                result.findings += check.fn(ctx)
            except Exception as err:  # a broken check must not hide the others
                log.exception("preflight check %s failed", check.name)
                result.findings.append(
                    warn(
                        "preflight.check-failed",
                        f"the check {check.name} failed: {type(err).__name__}: {err}",
                        "its condition was not checked",
                        subject=check.name,
                    )
                )
            result.check_seconds[check.name] = time.monotonic() - check_started
            result.ran.append(check.name)
    if not ctx.has_objects and source is None:
        ctx.notes.append("no --source given: object and consistency checks skipped")
    result.notes = ctx.notes
    result.seconds = time.monotonic() - started
    return result


def _current_layout(ctx: Context) -> str | None:
    """nftables mode's layout serving now: the running kproxy's (its status), else the one
    whose table the kernel holds (None: neither)."""
    status = ctx.status or {}
    if status.get("mode") == "nftables" and status.get("nftables_layout"):
        return str(status["nftables_layout"])
    found = backup.nft_layouts(ctx.kernel_snapshot)
    if len(found) > 1:
        ctx.notes.append(
            "the tables of more than one nftables layout exist ("
            + ", ".join(found)
            + f"): taken as serving: the {found[0]} layout"
        )
    return found[0] if found else None


def _flavour_with_state(snap: dict[str, Any], mode: str) -> str | None:
    marker = ":KUBE-PORTALS-CONTAINER" if mode == "userspace" else ":KUBE-SERVICES"
    for fl in ("nft", "legacy"):
        if marker in snap.get(f"iptables-{fl}", {}).get("output", ""):
            return fl
    return None
