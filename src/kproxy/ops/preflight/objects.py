"""The Services and EndpointSlices of --source, as the model sees them.

All reads go through kproxy.model (snapshot_from_objects for the ServicePorts the modes
program, model.parse for the selector and the slices' ports), so a finding here is about
exactly what the proxy would do. Collisions matter per mode: two service ports on one
NodePort (or one address and port) give the traffic to one of them, and which one depends
on the mode, so a switch can silently move it (measured in the lab: see winner()).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from kproxy.model.objects import ServicePort
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, block, info, warn

NODE_PORT_RANGE = (30000, 32767)  # the API server's default --service-node-port-range
MAX_LISTED = 20
SLICE_LABEL = "kubernetes.io/service-name"  # per-object findings beyond this are summarised in one


def _cap(findings: list[Finding], id: str, what: str) -> list[Finding]:
    if len(findings) <= MAX_LISTED:
        return findings
    rest = findings[MAX_LISTED:]
    subjects = [f.subject for f in rest]
    return [
        *findings[:MAX_LISTED],
        Finding(
            id,
            rest[0].severity,
            f"{len(rest)} more {what}: {', '.join(subjects[:10])}"
            + (", ..." if len(rest) > 10 else ""),
            rest[0].why,
            facts={"subjects": subjects},
        ),
    ]


def _by_service(ports: Iterable[ServicePort]) -> dict[str, list[ServicePort]]:
    out: dict[str, list[ServicePort]] = defaultdict(list)
    for sp in ports:
        out[sp.name.service].append(sp)
    return out


def check_rejections(ctx: Context) -> list[Finding]:
    snap = ctx.snapshot
    if snap is None:
        return []
    out = []
    for rej in snap.rejections:
        zero = "Invalid value: 0:" in rej.reason
        who = f"{rej.namespace}/{rej.name}" if rej.namespace else rej.name
        out.append(
            warn(
                "objects.port-zero" if zero else "objects.invalid",
                f"{rej.kind} {who}: {rej.field}: {rej.reason}",
                f"the {rej.kind} is skipped in every mode: its traffic gets no rules"
                + (" (port 0 is never a valid service, slice or node port)" if zero else ""),
                [f"kubectl -n {rej.namespace or 'default'} edit {rej.kind.lower()} {rej.name}"],
                subject=who,
                facts={"kind": rej.kind, "field": rej.field},
            )
        )
    return _cap(out, "objects.invalid", "invalid objects")


def check_endpoints(ctx: Context) -> list[Finding]:
    snap, view = ctx.snapshot, ctx.view
    if snap is None or view is None:
        return []
    out: list[Finding] = []
    unselected: list[str] = []
    for svc, ports in sorted(_by_service(snap.services.values()).items()):
        parsed = view.services.get(svc)
        selector = parsed.selector if parsed else ()
        if any(sp.any_endpoints for sp in ports):
            continue
        eps = [e for sp in ports for e in sp.endpoints]
        sel = ",".join(f"{k}={v}" for k, v in selector)
        ns, name = svc.split("/", 1)
        if eps:
            out.append(
                warn(
                    "objects.no-ready-endpoints",
                    f"service {svc} has {len(eps)} endpoints, none ready or serving",
                    "new connections to it are rejected in every mode",
                    [
                        f"kubectl -n {ns} get endpointslices -l {SLICE_LABEL}={name} -o wide",
                        f"kubectl -n {ns} get pods -l {sel}"
                        if sel
                        else f"kubectl -n {ns} describe service {name}",
                    ],
                    subject=svc,
                )
            )
        elif selector:
            out.append(
                warn(
                    "objects.no-endpoints",
                    f"service {svc} selects {sel} but has no endpoints",
                    "no pod matches the selector (or none is ready): connections to it are "
                    "rejected in every mode",
                    [
                        f"kubectl -n {ns} get pods -l {sel} -o wide",
                        f"kubectl -n {ns} get endpointslices -l {SLICE_LABEL}={name}",
                    ],
                    subject=svc,
                    facts={"selector": dict(selector)},
                )
            )
        elif parsed is not None:
            unselected.append(svc)
    out = _cap(out, "objects.no-endpoints", "services without endpoints")
    if unselected:
        out.append(
            info(
                "objects.no-selector-no-endpoints",
                f"{len(unselected)} services have no selector and no EndpointSlices: "
                f"{', '.join(unselected[:10])}{', ...' if len(unselected) > 10 else ''}",
                "their endpoints are managed by hand or by another controller; until it writes "
                "slices, connections are rejected",
                facts={"services": unselected},
            )
        )
    return out


def check_named_ports(ctx: Context) -> list[Finding]:
    snap, view = ctx.snapshot, ctx.view
    if snap is None or view is None:
        return []
    out = []
    for sp in snap.sorted_ports():
        if not isinstance(sp.target_port, str) or sp.endpoints:
            continue
        svc = sp.name.service
        slices = view.slices_of(svc)
        if not any(s.endpoints for s in slices):
            continue  # no endpoints at all: check_endpoints reports that
        names = sorted({p[0] or "(unnamed)" for s in slices for p in s.ports})
        ns, name = svc.split("/", 1)
        out.append(
            warn(
                "objects.named-port-unresolved",
                f"{sp.name} targets the named port {sp.target_port!r}, which resolves to nothing: "
                f"the service's EndpointSlices carry ports {', '.join(names) or 'none'} but none "
                f"for {sp.name.port or 'this port'}",
                "no pod behind the service declares a container port with that name, so this "
                "port has no endpoints while the service's other ports do",
                [
                    f"kubectl -n {ns} get pods -o jsonpath='{{..ports}}'  # container port names",
                    f"kubectl -n {ns} edit service {name}  # fix targetPort",
                ],
                subject=str(sp.name),
            )
        )
    return _cap(out, "objects.named-port-unresolved", "unresolved named ports")


def _edit(port_name: str) -> str:
    ns, rest = port_name.split("/", 1)
    return f"kubectl -n {ns} edit service {rest.split(':')[0].split(' ')[0]}"


def winner(mode: str | None, names: list[str]) -> str | None:
    """Which of several service ports sharing one destination gets its traffic in a mode
    (measured in the lab, tests/test_preflight_kernel.py): iptables and userspace match the
    first rule, in service-port order; nftables' map keeps the last element written. ipvs:
    not known yet."""
    if mode in ("iptables", "userspace"):
        return names[0]
    if mode == "nftables":
        return names[-1]
    return None


def _collision(ctx: Context, id: str, what: str, subject: str, names: list[str]) -> Finding:
    now, then = winner(ctx.current_mode, names), winner(ctx.target, names)
    facts = {"services": names, "served_now": now, "served_after": then}
    fix = [_edit(n) for n in names if n != (then or names[0])]
    if now and then and now != then:
        return block(
            id,
            f"{what} is used by {len(names)} service ports ({', '.join(names)}): "
            f"{ctx.current_mode} mode sends it to {now}, {ctx.target} mode would send it to {then}",
            "the switch silently moves that traffic to another service",
            fix,
            subject=subject,
            facts=facts,
        )
    served = f"; {ctx.target} mode sends it to {then}" if then else ""
    return warn(
        id,
        f"{what} is used by {len(names)} service ports ({', '.join(names)}){served}",
        "only one of them gets the traffic, the others none; which one differs between modes",
        fix,
        subject=subject,
        facts=facts,
    )


def check_node_ports(ctx: Context) -> list[Finding]:
    snap = ctx.snapshot
    if snap is None:
        return []
    out = []
    low, high = NODE_PORT_RANGE
    users: dict[tuple[str, int], list[str]] = defaultdict(list)
    for sp in snap.sorted_ports():
        if sp.node_port:
            users[(sp.protocol.lower, sp.node_port)].append(str(sp.name))
            if not low <= sp.node_port <= high:
                out.append(
                    warn(
                        "objects.nodeport-out-of-range",
                        f"{sp.name} has NodePort {sp.node_port}, outside {low}-{high}",
                        "a NodePort outside the range can capture a port the node itself uses "
                        f"(sshd on 22, the kubelet on 10250): every local address's "
                        f"{sp.protocol.lower}/{sp.node_port} goes to the service",
                        [
                            f"ss -lntup | grep ':{sp.node_port} '  # who else uses it",
                            f"kubectl -n {sp.name.namespace} edit service {sp.name.name}"
                            "  # a nodePort in range, or none to get one",
                        ],
                        subject=str(sp.name),
                        facts={"node_port": sp.node_port},
                    )
                )
        if sp.health_check_node_port:
            users[("tcp", sp.health_check_node_port)].append(f"{sp.name.service} (health check)")
    for (proto, port), names in sorted(users.items()):
        distinct = sorted(set(names))
        if len(distinct) > 1:
            what = f"NodePort {proto}/{port}"
            out.append(
                _collision(ctx, "objects.nodeport-collision", what, f"{proto}/{port}", distinct)
            )
    dests: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    for sp in snap.sorted_ports():
        for ip in (sp.cluster_ip, *sp.external_ips, *sp.load_balancer_ips):
            dests[(ip, sp.protocol.lower, sp.port)].append(str(sp.name))
    for (ip, proto, port), names in sorted(dests.items()):
        distinct = sorted(set(names))
        if len(distinct) > 1:
            what = f"{proto} {ip}:{port}"
            out.append(_collision(ctx, "objects.destination-collision", what, what, distinct))
    return out


def check_references(ctx: Context) -> list[Finding]:
    """EndpointSlices (and ExternalName services) pointing at a Service that gets no rules
    because it has no ClusterIP, or does not exist."""
    view = ctx.view
    if view is None:
        return []
    out = []
    counts: dict[str, int] = defaultdict(int)
    for sl in view.slices:
        counts[f"{sl.namespace}/{sl.service}"] += len(sl.endpoints)
    orphans = []
    for svc, n in sorted(counts.items()):
        if svc in view.services:
            continue
        why = view.ignored.get(svc)
        if why is None:
            if svc not in view.known:
                orphans.append(svc)
            continue
        if "no clusterIP" in why:
            ns, name = svc.split("/", 1)
            out.append(
                warn(
                    "objects.no-cluster-ip-referenced",
                    f"EndpointSlices with {n} endpoints reference service {svc}, which has no "
                    f"ClusterIP ({why})",
                    "nothing is programmed for those endpoints: clients of the service get no "
                    "answer until a ClusterIP is allocated",
                    [f"kubectl -n {ns} get service {name} -o jsonpath='{{.spec.clusterIP}}'"],
                    subject=svc,
                )
            )
    local_names = {}
    for key in view.known:
        ns, name = key.split("/", 1)
        for suffix in ("", ".svc", ".svc.cluster.local"):
            local_names[f"{name}.{ns}{suffix}"] = key
    for key, external_name in sorted(view.external_names.items()):
        target = local_names.get(external_name.rstrip("."))
        if target and "no clusterIP" in view.ignored.get(target, ""):
            out.append(
                warn(
                    "objects.no-cluster-ip-referenced",
                    f"ExternalName service {key} points at {target}, which has no ClusterIP",
                    "clients resolving the name get nothing to connect to",
                    ["kubectl get service -n {} {} -o yaml".format(*target.split("/", 1))],
                    subject=key,
                )
            )
    if orphans:
        out.append(
            info(
                "objects.orphan-slices",
                f"EndpointSlices reference {len(orphans)} services that do not exist: "
                f"{', '.join(orphans[:10])}",
                "their endpoints are unused",
                facts={"services": orphans},
            )
        )
    return out


CHECKS = (
    Check("objects", check_rejections, needs_source=True),
    Check("objects", check_endpoints, needs_source=True),
    Check("objects", check_named_ports, needs_source=True),
    Check("objects", check_node_ports, needs_source=True),
    Check("objects", check_references, needs_source=True),
)
