"""`kproxy doctor`: explain a misbehaving node or service, layer by layer.

The node first (the preflight checks that describe the mode serving now: kernel support,
sysctls, conntrack headroom, leftovers, both iptables backends, the configuration), then
each service (one, or every service of --source) walked object -> endpoints -> kernel
rules -> conntrack; a service is broken at its first layer with a blocking finding.
Read only, apart from TCP connects from the node to endpoints and ClusterIPs (--no-probe
turns them off).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kproxy.config import ProxyConfig
from kproxy.conntrack import Conntrack, ConntrackEntry, ConntrackError
from kproxy.model.objects import ServicePort
from kproxy.ops.doctor.knowledge import lookup
from kproxy.ops.doctor.layers import LAYERS, WALK, ServiceView
from kproxy.ops.doctor.probe import connect_all
from kproxy.ops.inputs import node_name_of
from kproxy.ops.preflight.access import NodeAccess
from kproxy.ops.preflight.context import Context
from kproxy.ops.preflight.findings import (
    Finding,
    Severity,
    counts,
    dumps,
    exit_code,
    findings_json,
    render_text,
)
from kproxy.ops.preflight.run import detect_current, run_preflight

NODE_FAMILIES = ("config", "kernel", "sysctls", "conntrack", "dataplane")
# Per-service findings say these better; a doctor is not about to switch.
NODE_SKIP = frozenset(
    {"mode.same", "mode.layout-change", "dataplane.missing-services", "config.mode-differs"}
)
PROBED_SERVICES = 20  # whole-node runs probe a sample, like the switch's self-probe


@dataclass
class ServiceReport:
    service: str
    ports: list[str]
    findings: list[Finding]
    layers: dict[str, str]  # layer -> ok | broken | warn | not checked

    @property
    def broken_layer(self) -> str | None:
        return next((layer for layer in LAYERS if self.layers.get(layer) == "broken"), None)

    @property
    def healthy(self) -> bool:
        return not any(f.severity is not Severity.INFO for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "ports": self.ports,
            "broken_layer": self.broken_layer,
            "layers": self.layers,
            "findings": findings_json(self.findings),
        }


@dataclass
class DoctorResult:
    node: str
    netns: str | None
    mode: str | None
    flavour: str | None
    dataplanes: list[str]
    node_findings: list[Finding]
    services: list[ServiceReport]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def all_findings(self) -> list[Finding]:
        return self.node_findings + [f for s in self.services for f in s.findings]

    @property
    def exit_code(self) -> int:
        return exit_code(self.all_findings)

    def service(self, name: str) -> ServiceReport:
        return next(s for s in self.services if s.service == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "netns": self.netns,
            "mode": self.mode,
            "iptables_flavour": self.flavour,
            "dataplanes": self.dataplanes,
            "healthy": self.exit_code == 0,
            "exit_code": self.exit_code,
            "counts": counts(self.all_findings),
            "node_findings": findings_json(self.node_findings),
            "services": [s.to_dict() for s in self.services],
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
        }

    def to_json(self) -> str:
        return dumps(self.to_dict())

    def print_text(self, console: Any = None, *, all_services: bool = False) -> None:
        from rich.console import Console

        out = console or Console(highlight=False, soft_wrap=True, emoji=False)
        mode = self.mode or "no proxy mode"
        if self.flavour and self.mode in ("iptables", "userspace"):
            mode += f" (iptables-{self.flavour})"
        where = f", network namespace {self.netns}" if self.netns else ""
        labels = {Severity.BLOCK: "BROKEN", Severity.WARN: "WARN", Severity.INFO: "INFO"}
        render_text(
            self.node_findings,
            header=f"kproxy doctor: node {self.node}{where}, {mode}",
            verdict="node: " + ("broken" if exit_code(self.node_findings) else "ok"),
            console=out,
            labels=labels,
            why_label="cause",
        )
        shown = [s for s in self.services if all_services or not s.healthy]
        for s in shown:
            out.print("")
            layers = "  ".join(f"{layer}: {s.layers[layer]}" for layer in LAYERS)
            render_text(
                s.findings,
                header=f"service {s.service} ({', '.join(s.ports)})  {layers}",
                verdict=f"{s.service}: "
                + (f"broken at the {s.broken_layer} layer" if s.broken_layer else "working"),
                console=out,
                labels=labels,
                why_label="cause",
            )
        broken = [s for s in self.services if s.broken_layer]
        by_layer: dict[str, int] = {}
        for s in broken:
            assert s.broken_layer is not None
            by_layer[s.broken_layer] = by_layer.get(s.broken_layer, 0) + 1
        out.print("")
        summary = ", ".join(f"{n} at the {layer} layer" for layer, n in by_layer.items())
        out.print(
            f"{len(self.services)} services checked, {len(broken)} broken"
            + (f" ({summary})" if summary else "")
            + (
                f"; {len(self.services) - len(shown)} healthy ones not shown"
                if not all_services and len(shown) < len(self.services)
                else ""
            )
        )
        for n in self.notes:
            out.print(f"note: {n}")


def _with_knowledge(f: Finding) -> Finding:
    k = lookup(f.id)
    facts = dict(f.facts)
    if k is not None:
        facts.setdefault("symptom", k.symptom)
        facts.setdefault("seen", list(k.seen))
    from dataclasses import replace

    return replace(f, layer="node", facts=facts)


def _service_ports(ctx: Context, name: str) -> list[ServicePort]:
    snap = ctx.snapshot
    if snap is None:
        return []
    return [sp for sp in snap.sorted_ports() if sp.name.service == name]


def run_doctor(
    service: str | None = None,
    *,
    access: NodeAccess | None = None,
    config_path: Path | None = None,
    source: Path | None = None,
    state_dir: Path | None = None,
    status: dict[str, Any] | None = None,
    node_name: str | None = None,
    probe: bool = True,
    config: ProxyConfig | None = None,
    objects: list[dict[str, Any]] | None = None,
    snapshot_taker: Callable[[str | None], dict[str, Any]] | None = None,
    kernel_source: Any = None,
    conntrack_entries: list[ConntrackEntry] | None = None,
    prober: Callable[[list[tuple[str, int]]], dict[tuple[str, int], str]] | None = None,
    node_families: Sequence[str] = NODE_FAMILIES,
) -> DoctorResult:
    """Diagnose the node, and `service` ("ns/name") or every service of the objects."""
    started = time.monotonic()
    acc = access or NodeAccess()
    ctx = Context(
        target="iptables",
        access=acc,
        config_path=config_path,
        source=source,
        status=status,
        node_name=node_name_of(node_name, status),
        state_dir=state_dir,
        config_override=config,
        objects_override=objects,
        snapshot_taker=snapshot_taker,
    )
    mode, flavour, notes = detect_current(ctx.kernel_snapshot)
    mode = (status or {}).get("mode") or mode
    result = DoctorResult(ctx.node_name, acc.netns, mode, flavour, [], [], [], notes=list(notes))

    # -- the node: the preflight checks of the mode serving now --------------------------------
    if mode is not None:
        pf = run_preflight(
            mode,
            access=acc,
            config_path=config_path,
            source=source,
            state_dir=state_dir,
            status=status,
            current_mode=mode,
            current_flavour=flavour,
            node_name=ctx.node_name,
            config=config,
            objects=objects,
            snapshot_taker=lambda _ns: ctx.kernel_snapshot,
            families=node_families,
        )
        result.node_findings = [_with_knowledge(f) for f in pf.findings if f.id not in NODE_SKIP]
    if status is not None and status.get("last_error"):
        result.node_findings.append(
            Finding(
                "proxy.last-sync-failed",
                Severity.WARN,
                f"the running kproxy's last sync failed: {status['last_error']}",
                "the kernel holds the rules of the last good sync; changes since are not in",
                ("kproxy status",),
                layer="node",
            )
        )

    # -- the kernel, read once ----------------------------------------------------------------
    from kproxy.ops.inspect.kernel import KernelSource
    from kproxy.ops.inspect.readers import select

    selection = select(kernel_source or KernelSource(acc.netns))
    live = [v for v in selection.views if v.live]
    result.dataplanes = [v.dataplane for v in live]
    result.notes += [n for n in selection.notes if "mid-switch" in n]
    planes = ctx.programmed
    servers = [vs for v in live for vs in v.services()] if live else None
    programmed = {(k.proto, k.ip, k.port) for plane in planes.values() for k in plane}
    plane_names = result.dataplanes or sorted(planes)
    if conntrack_entries is None:
        try:
            conntrack_entries = Conntrack(acc.netns, runner=acc.runner).list_entries(None)
        except ConntrackError as err:
            result.notes.append(f"conntrack not read: {err}")

    # -- the services ---------------------------------------------------------------------------
    snap = ctx.snapshot
    if service is not None:
        names = [service]
    elif snap is not None:
        names = sorted({sp.name.service for sp in snap.services.values()})
    else:
        names = sorted({vs.service.split(":")[0] for vs in servers or [] if vs.service})
        result.notes.append("no --source: services taken from the kernel, objects not checked")
    probe_fn = prober or (lambda targets: connect_all(targets, acc.netns))
    sample = set(names)
    if service is None and len(names) > PROBED_SERVICES:
        sample = set(random.Random(len(names)).sample(names, PROBED_SERVICES))
    node_ip = ctx.node_ips[0] if ctx.node_ips else ""
    for name in names:
        sv = ServiceView(
            name=name,
            ports=_service_ports(ctx, name),
            snapshot=snap,
            view=ctx.view,
            servers=servers,
            planes=plane_names,
            programmed=programmed,
            conntrack=conntrack_entries,
            probe=probe_fn if probe and name in sample else None,
            node_ip=node_ip,
            source=str(source or ""),
        )
        result.services.append(_walk(sv))
    if ctx.notes:
        result.notes += [n for n in ctx.notes if n not in result.notes]
    result.seconds = time.monotonic() - started
    return result


def _walk(sv: ServiceView) -> ServiceReport:
    findings: list[Finding] = []
    layers: dict[str, str] = {}
    stop = False
    for layer, fn in WALK:
        if stop or (layer in ("endpoints", "conntrack") and not sv.ports):
            layers[layer] = "not checked"
            continue
        got = fn(sv)
        findings += got
        if any(f.blocks for f in got):
            layers[layer] = "broken"
        elif any(f.severity is Severity.WARN for f in got):
            layers[layer] = "warn"
        else:
            layers[layer] = "ok"
        # Nothing below a missing or unproxied object can be judged.
        if layer == "object" and any(
            f.id in ("object.missing", "object.rejected", "object.not-proxied") for f in got
        ):
            stop = True
    ports = [f"{sp.name.port or '-'}:{sp.port}/{sp.protocol.value}" for sp in sv.ports]
    return ServiceReport(sv.name, ports, findings, layers)
