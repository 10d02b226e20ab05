"""The four layers of one service, walked in packet order: object -> endpoints -> kernel
rules -> conntrack. Each returns findings tagged with its layer; a service is broken at the
first layer with a block.

Everything is read through the model (Snapshot, the parsed objects), the inspectors
(ops.inspect readers and drift.compare: the rules read back from the kernel) and the
conntrack table; the only packets sent are the TCP connects of probe.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kproxy.conntrack import ConntrackEntry
from kproxy.model.objects import ServicePort, Snapshot
from kproxy.ops.doctor.knowledge import lookup
from kproxy.ops.inspect import drift
from kproxy.ops.inspect.model import VirtualServer
from kproxy.ops.preflight.context import ObjectView
from kproxy.ops.preflight.findings import Finding, Severity

LAYERS = ("object", "endpoints", "kernel", "conntrack")
MAX_PROBED_ENDPOINTS = 8


def finding(
    layer: str,
    id: str,
    severity: Severity,
    found: str,
    *,
    service: str = "",
    why: str = "",
    fix: list[str] | None = None,
    subs: dict[str, str] | None = None,
    **facts: Any,
) -> Finding:
    """A doctor finding, with the field knowledge of its id: symptom, cause, commands."""
    k = lookup(id)
    cmds = list(fix or [])
    if k is not None:
        for c in k.commands:
            for key, value in (subs or {}).items():
                c = c.replace(key, value)
            if c not in cmds:
                cmds.append(c)
        facts = {"symptom": k.symptom, "seen": list(k.seen), **facts}
        why = why or k.cause
    return Finding(id, severity, found, why, tuple(cmds), subject=service, facts=facts, layer=layer)


@dataclass
class ServiceView:
    """What the walk knows about one Service (namespace/name)."""

    name: str
    ports: list[ServicePort]
    snapshot: Snapshot | None
    view: ObjectView | None
    servers: list[VirtualServer] | None  # None: no readable live dataplane
    planes: list[str]
    programmed: set[tuple[str, str, int]]  # (proto, ip, port): ops.inspect.destinations
    conntrack: list[ConntrackEntry] | None
    probe: Callable[[list[tuple[str, int]]], dict[tuple[str, int], str]] | None
    node_ip: str = ""
    source: str = ""
    endpoint_answers: dict[tuple[str, int], str] = field(default_factory=dict)

    @property
    def ns(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def short(self) -> str:
        return self.name.split("/", 1)[1]

    def subs(self, sp: ServicePort | None = None) -> dict[str, str]:
        out = {
            "NS": self.ns,
            "NAME": self.short,
            "NODE_IP": self.node_ip or "NODE_IP",
            "SRC": self.source or "OBJECTS",
        }
        if sp is not None:
            out["VIP:PORT"] = f"{sp.cluster_ip}:{sp.port}"
            out["VIP"] = sp.cluster_ip
        return out


# --- object ---------------------------------------------------------------------------------


def object_layer(s: ServiceView) -> list[Finding]:
    if s.view is None:
        return []  # no objects given: the walk starts at the kernel
    if s.name in s.view.services:
        return []
    if s.name in s.view.ignored:
        why = s.view.ignored[s.name]
        return [
            finding(
                "object",
                "object.not-proxied",
                Severity.INFO,
                f"service {s.name} is not proxied: {why}",
                service=s.name,
                reason=why,
            )
        ]
    rejected = [
        r
        for r in (s.snapshot.rejections if s.snapshot else ())
        if r.kind == "Service" and f"{r.namespace}/{r.name}" == s.name
    ]
    if rejected:
        r = rejected[0]
        return [
            finding(
                "object",
                "object.rejected",
                Severity.BLOCK,
                f"service {s.name} is invalid and skipped: {r.field}: {r.reason}",
                service=s.name,
                fix=[f"kubectl -n {s.ns} edit service {s.short}  # {r.field}"],
                subs=s.subs(),
            )
        ]
    return [
        finding(
            "object",
            "object.missing",
            Severity.BLOCK,
            f"there is no Service {s.name} in the objects",
            service=s.name,
            subs={"NAME": s.short},
        )
    ]


# --- endpoints ------------------------------------------------------------------------------


def endpoints_layer(s: ServiceView) -> list[Finding]:
    out: list[Finding] = []
    parsed = s.view.services.get(s.name) if s.view else None
    selector = ",".join(f"{k}={v}" for k, v in parsed.selector) if parsed else ""
    slices = s.view.slices_of(s.name) if s.view else []
    for sp in s.ports:
        name = str(sp.name)
        subs = s.subs(sp)
        if not sp.endpoints:
            if isinstance(sp.target_port, str) and any(sl.endpoints for sl in slices):
                out.append(
                    finding(
                        "endpoints",
                        "endpoints.named-port",
                        Severity.BLOCK,
                        f"{name}: the named targetPort {sp.target_port!r} resolves to no "
                        "endpoint (the slices have endpoints for other ports only)",
                        service=s.name,
                        subs=subs,
                    )
                )
                continue
            what = (
                f"selects {selector} but no EndpointSlice lists an endpoint"
                if selector
                else "has no selector and no EndpointSlices (endpoints are managed by hand)"
            )
            fix = [f"kubectl -n {s.ns} get pods -l {selector} -o wide"] if selector else []
            out.append(
                finding(
                    "endpoints",
                    "endpoints.none",
                    Severity.BLOCK,
                    f"{name} {what}",
                    service=s.name,
                    fix=fix,
                    subs=subs,
                )
            )
            continue
        if not sp.any_endpoints:
            states = ", ".join(
                f"{e.addr} ({'terminating' if e.terminating else 'not ready'})"
                for e in sp.endpoints[:5]
            )
            out.append(
                finding(
                    "endpoints",
                    "endpoints.not-ready",
                    Severity.BLOCK,
                    f"{name}: none of its {len(sp.endpoints)} endpoints is ready: {states}",
                    service=s.name,
                    subs=subs,
                )
            )
            continue
        if sp.internal_policy_local and not sp.local_endpoints:
            out.append(
                finding(
                    "endpoints",
                    "endpoints.no-local",
                    Severity.BLOCK,
                    f"{name}: internalTrafficPolicy Local and no endpoint on this node: "
                    "traffic to the ClusterIP from this node is dropped",
                    service=s.name,
                )
            )
        elif sp.is_external and sp.external_policy_local and not sp.local_endpoints:
            out.append(
                finding(
                    "endpoints",
                    "endpoints.no-local",
                    Severity.WARN,
                    f"{name}: externalTrafficPolicy Local and no endpoint on this node: "
                    "external traffic arriving here is dropped",
                    service=s.name,
                )
            )
    out += _probe_endpoints(s)
    return out


def _probe_endpoints(s: ServiceView) -> list[Finding]:
    if s.probe is None:
        return []
    targets = [
        (e.ip, e.port)
        for sp in s.ports
        if sp.protocol.lower == "tcp"
        for e in sp.reachable_endpoints[:MAX_PROBED_ENDPOINTS]
    ]
    if not targets:
        return []
    answers = s.probe(targets)
    s.endpoint_answers = answers
    bad = {t: a for t, a in answers.items() if a != "ok"}
    if not bad:
        return []
    listed = ", ".join(f"{ip}:{port} ({why})" for (ip, port), why in sorted(bad.items()))
    every = len(bad) == len(answers)
    ip, _ = next(iter(sorted(bad)))
    return [
        finding(
            "endpoints",
            "endpoints.unreachable",
            Severity.BLOCK if every else Severity.WARN,
            (
                f"none of the {len(answers)} endpoints answers"
                if every
                else f"{len(bad)} of {len(answers)} endpoints do not answer"
            )
            + f" a TCP connect from the node: {listed}",
            service=s.name,
            subs={"POD_IP": ip},
            answers={f"{i}:{p}": a for (i, p), a in answers.items()},
        )
    ]


# --- kernel ---------------------------------------------------------------------------------


def kernel_layer(s: ServiceView) -> list[Finding]:
    if not s.planes:
        return [
            finding(
                "kernel",
                "kernel.no-dataplane",
                Severity.BLOCK,
                "no proxy mode has rules in the kernel of this node",
                service=s.name,
            )
        ]
    if s.snapshot is None:
        return _kernel_only(s)
    out: list[Finding] = []
    names = {str(sp.name) for sp in s.ports}
    addresses = {
        (sp.protocol.lower, ip, sp.port)
        for sp in s.ports
        for ip in (sp.cluster_ip, *sp.external_ips, *sp.load_balancer_ips)
    }
    if s.servers is not None and s.snapshot is not None:
        mine = [vs for vs in s.servers if vs.service in names or vs.key in addresses]
        only = Snapshot(
            node=s.snapshot.node, services={sp.name: sp for sp in s.ports}, rejections=()
        )
        for line in drift.compare(mine, only):
            out.append(_drift_finding(s, line))
    elif s.snapshot is not None:
        # No reader for this mode (ipvs/userspace): presence only, from the kernel dump.
        for sp in s.ports:
            if not sp.has_internal_endpoints:
                continue
            key = (sp.protocol.lower, sp.cluster_ip, sp.port)
            if key not in s.programmed:
                out.append(
                    finding(
                        "kernel",
                        "kernel.missing",
                        Severity.BLOCK,
                        f"{sp.protocol.lower} {sp.cluster_ip}:{sp.port} ({sp.name}) is not in "
                        f"the kernel's {', '.join(s.planes)} state",
                        service=s.name,
                        subs=s.subs(sp),
                    )
                )
    out += _probe_service(s)
    return out


def _kernel_only(s: ServiceView) -> list[Finding]:
    """Without objects: what the kernel itself says about the service."""
    mine = [
        vs for vs in s.servers or [] if vs.service == s.name or vs.service.startswith(s.name + ":")
    ]
    if s.servers is not None and not mine:
        return [
            finding(
                "kernel",
                "kernel.missing",
                Severity.BLOCK,
                f"no rule in the kernel's {', '.join(s.planes)} state names service {s.name}",
                service=s.name,
                subs=s.subs(),
            )
        ]
    return [
        finding(
            "kernel",
            "endpoints.none",
            Severity.BLOCK,
            f"the kernel {vs.verdict}s new connections to {vs.proto} {vs.addr} ({vs.service}): "
            f"{vs.verdict_reason or 'the proxy saw no endpoints'}",
            service=s.name,
            subs=s.subs(),
        )
        for vs in mine
        if vs.verdict
    ]


def _drift_finding(s: ServiceView, line: str) -> Finding:
    if "not in the kernel" in line:
        return finding(
            "kernel",
            "kernel.missing",
            Severity.BLOCK,
            line,
            service=s.name,
            subs=s.subs(s.ports[0]),
        )
    if "REJECT" in line and "has endpoints" in line:
        return finding(
            "kernel",
            "kernel.stale-reject",
            Severity.BLOCK,
            line,
            service=s.name,
            subs=s.subs(s.ports[0]),
        )
    return finding(
        "kernel", "kernel.drift", Severity.WARN, line, service=s.name, subs=s.subs(s.ports[0])
    )


def _probe_service(s: ServiceView) -> list[Finding]:
    """Connect to each TCP ClusterIP from the node: broken when its endpoints answer
    directly and the service does not."""
    if s.probe is None:
        return []
    out = []
    for sp in s.ports:
        if sp.protocol.lower != "tcp" or not sp.has_internal_endpoints or not sp.cluster_ip:
            continue
        eps = [(e.ip, e.port) for e in sp.internal_endpoints[:MAX_PROBED_ENDPOINTS]]
        if not eps or any(s.endpoint_answers.get(t) != "ok" for t in eps):
            continue  # the endpoints layer explains it
        answer = s.probe([(sp.cluster_ip, sp.port)]).get((sp.cluster_ip, sp.port))
        if answer == "ok":
            continue
        out.append(
            finding(
                "kernel",
                "kernel.probe-failed",
                Severity.BLOCK,
                f"a connection from the node to {sp.cluster_ip}:{sp.port} ({sp.name}) gets "
                f"{answer}, while its endpoints answer directly",
                service=s.name,
                subs=s.subs(sp),
                answer=answer,
            )
        )
    return out


# --- conntrack ------------------------------------------------------------------------------


def conntrack_layer(s: ServiceView) -> list[Finding]:
    if s.conntrack is None:
        return []
    out: list[Finding] = []
    for sp in s.ports:
        proto = sp.protocol.lower
        vip = sp.cluster_ip
        flows = [
            e
            for e in s.conntrack
            if e.proto == proto and e.orig_dst == vip and e.orig_dport == sp.port
        ]
        if not flows:
            continue
        current = {e.ip for e in sp.endpoints}
        unreplied = [e for e in flows if e.unreplied]
        if unreplied:
            sample = unreplied[0]
            out.append(
                finding(
                    "conntrack",
                    "conntrack.unreplied",
                    Severity.WARN,
                    f"{len(unreplied)} of {len(flows)} {proto} flows to {vip}:{sp.port} "
                    f"({sp.name}) never got a reply, e.g. from {sample.orig_src}:"
                    f"{sample.orig_sport} translated to {sample.reply_src}:{sample.reply_sport}",
                    service=s.name,
                    subs=s.subs(sp),
                    fix=[
                        f"conntrack -D -p {proto} --orig-dst {vip} --orig-port-dst {sp.port} "
                        f"--reply-src {sample.reply_src}"
                    ],
                    unreplied=len(unreplied),
                )
            )
        stale = sorted(
            {e.reply_src for e in flows if e.reply_src not in current and e.reply_src != vip}
        )
        if stale and proto == "udp":
            out.append(
                finding(
                    "conntrack",
                    "conntrack.stale-udp",
                    Severity.BLOCK,
                    f"UDP flows to {vip}:{sp.port} ({sp.name}) still go to {', '.join(stale)}, "
                    "which are no endpoints of the service any more",
                    service=s.name,
                    subs=s.subs(sp),
                    fix=[
                        f"conntrack -D -p udp --orig-dst {vip} --orig-port-dst {sp.port} "
                        f"--reply-src {ip}"
                        for ip in stale
                    ],
                    stale=stale,
                )
            )
        elif stale:
            out.append(
                finding(
                    "conntrack",
                    "conntrack.old-endpoints",
                    Severity.INFO,
                    f"{proto} connections to {vip}:{sp.port} ({sp.name}) still run to "
                    f"{', '.join(stale)}, which are no endpoints of it now (former endpoints, "
                    "or another mode's translation, e.g. userspace's redirect to the node); "
                    "they end with the connections",
                    service=s.name,
                    stale=stale,
                )
            )
    return out


WALK: tuple[tuple[str, Callable[[ServiceView], list[Finding]]], ...] = (
    ("object", object_layer),
    ("endpoints", endpoints_layer),
    ("kernel", kernel_layer),
    ("conntrack", conntrack_layer),
)
