"""The configuration the target mode will run with (the given file, mode replaced).

Validation is kproxy.config's own (the same messages and "did you mean" hints as `kproxy run`);
the checks here are the mistakes that validate fine and still hurt: a file whose mode
differs from the switch (the next restart switches back), settings that live in per-mode
sections and so change with the mode (masqueradeAll), excludeCIDRs swallowing the pods'
or services' addresses, strictARP off under an ARP-announcing load balancer, NodePort
addresses that match nothing, no clusterCIDR, a userspace port range too small for the
services.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from kproxy.config import ProxyConfig, format_duration
from kproxy.dataplane.base import AVAILABLE_MODES
from kproxy.dataplane.nftables.layouts import DEFAULT_LAYOUT, TABLES, describe, target_name
from kproxy.dataplane.nodepolicy import NodePortAddresses
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, block, info, warn

# Changes per second above which minSyncPeriod 0 means a sync per change, back to back.
HIGH_CHANGE_RATE = 1.0

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def _file(ctx: Context) -> str:
    return str(ctx.config_path) if ctx.config_path else "<config file>"


def yq(ctx: Context, expr: str) -> str:
    """The exact edit, as a yq (mikefarah/yq v4) command on the config file."""
    return f"yq -i '{expr}' {_file(ctx)}"


def check_loads(ctx: Context) -> list[Finding]:
    err = ctx.config_error
    if err is None:
        return []
    out = []
    for problem in err.problems:
        mode = problem.startswith("mode:")
        out.append(
            block(
                "config.mode-invalid" if mode else "config.invalid",
                f"{err.source}: {problem}",
                "kproxy refuses to start with this file (a wrong mode is an error, never a "
                "fallback to another mode: kubernetes #70304)"
                if mode
                else "kproxy refuses to start with this file, and a restart after the switch "
                "would fail",
                [
                    f"$EDITOR {err.source}",
                    f"kproxy render --config {err.source} --source <objects> >/dev/null",
                ],
                subject=problem.split(":", 1)[0],
            )
        )
    return out


def check_target_mode(ctx: Context) -> list[Finding]:
    out = []
    if ctx.target not in AVAILABLE_MODES:
        out.append(
            block(
                "mode.unavailable",
                f"{ctx.target} mode is not available in this build (available: "
                f"{', '.join(AVAILABLE_MODES)})",
                "the switch would fail at its first step",
                [f"kproxy switch --to {m}" for m in AVAILABLE_MODES if m != ctx.current_mode][:1],
            )
        )
    if ctx.current_mode != ctx.target:
        return out
    target = target_name(ctx.target, ctx.target_layout)
    if target_name(ctx.current_mode, ctx.current_layout) == target:
        out.append(
            info(
                "mode.same",
                f"the node already runs {describe(ctx.target, ctx.target_layout)} mode: a "
                "switch would be refused",
                facts={"mode": ctx.target, "layout": ctx.target_layout},
            )
        )
    else:
        out.append(_layout_change(ctx))
    return out


def _layout_change(ctx: Context) -> Finding:
    """nftables mode stays, its layout changes: a switch like any other, between tables."""
    was = ctx.current_layout or DEFAULT_LAYOUT
    to = ctx.target_layout or DEFAULT_LAYOUT
    # Read at start from `kproxy run --nftables-layout` (kproxy's own flag: upstream's
    # configuration has no layout); a live switch leaves it as it is.
    started = (ctx.status or {}).get("started_nftables_layout")
    if started == to:
        restart = f"the running kproxy was started with --nftables-layout {to}: a restart stays"
    elif started:
        restart = (
            f"the running kproxy was started with --nftables-layout {started}: unless the "
            f"flag changes where kproxy is started, a "
            f"restart comes back in the {started} layout and removes the {to} table as a "
            "leftover"
        )
    else:
        restart = (
            f"a restart comes back in the layout the flag names ({DEFAULT_LAYOUT} when absent) "
            "and removes the other layout's table as a leftover"
        )
    return info(
        "mode.layout-change",
        f"the node runs nftables mode in the {was} layout (table ip {TABLES[was]}); the switch "
        f"moves it to the {to} layout (table ip {TABLES[to]}), make-before-break: the {to} "
        f"table is built and verified beside the {was} one, which serves until the cut-over "
        "and is removed after it",
        "the layout is kproxy's own setting, `kproxy run --nftables-layout` (not in the "
        f"configuration file), read when kproxy starts; a live switch does not change it: "
        f"{restart}",
        []
        if started == to
        else [f"kproxy run --nftables-layout {to} ...  # where kproxy is started (its unit)"],
        facts={
            "mode": ctx.target,
            "current_layout": was,
            "target_layout": to,
            "started_layout": started,
        },
    )


def check_mode_in_file(ctx: Context) -> list[Finding]:
    cfg = ctx.config
    if cfg is None or ctx.config_path is None:
        return []
    if cfg.effective_mode == ctx.target:
        return []
    said = f"mode: {cfg.mode}" if cfg.mode else "no mode (blank means iptables)"
    return [
        warn(
            "config.mode-differs",
            f"{ctx.config_path} says {said}, not {ctx.target}",
            "a live switch does not change the file: the next restart goes back to "
            f"{cfg.effective_mode} mode (with a cleanup of {ctx.target}'s state)",
            [yq(ctx, f'.mode = "{ctx.target}"') + "  # kproxy watching it switches by itself"],
            facts={"file_mode": cfg.mode, "target": ctx.target},
        )
    ]


def _masq_section(mode: str) -> str:
    return "nftables" if mode == "nftables" else "iptables"


def _section_values(cfg: ProxyConfig, mode: str) -> tuple[bool, float, float]:
    c = cfg.model_copy(update={"mode": mode})
    return c.masquerade_all, c.sync_period, c.min_sync_period


def check_per_mode_sections(ctx: Context) -> list[Finding]:
    """masqueradeAll and the sync periods come from the mode's own section: a switch can
    change them without anyone editing anything."""
    cur = ctx.current_mode
    if cur is None or cur == ctx.target:
        return []
    cfg = ctx.config or ProxyConfig()
    old = _section_values(cfg, cur)
    new = _section_values(cfg, ctx.target)
    out = []
    if old[0] != new[0]:
        sec_old = "nftables" if cur == "nftables" else "iptables"
        sec_new = "nftables" if ctx.target == "nftables" else "iptables"
        out.append(
            warn(
                "config.masquerade-all-changes",
                f"masqueradeAll is {str(old[0]).lower()} in {cur} mode ({sec_old}.masqueradeAll) "
                f"but {str(new[0]).lower()} in {ctx.target} mode ({sec_new}.masqueradeAll)",
                "the switch changes which traffic is SNATed: "
                + (
                    "clients that relied on masquerading (asymmetric routes) break"
                    if old[0]
                    else "endpoints start seeing the node's address instead of the client's"
                ),
                [yq(ctx, f".{sec_new}.masqueradeAll = {str(old[0]).lower()}")],
                facts={"current": old[0], "target": new[0]},
            )
        )
    changed = [
        f"{name} {format_duration(a)} -> {format_duration(b)}"
        for name, a, b in (("syncPeriod", old[1], new[1]), ("minSyncPeriod", old[2], new[2]))
        if a != b
    ]
    if changed:
        out.append(
            info(
                "config.sync-periods-change",
                f"sync periods change with the mode: {', '.join(changed)}",
                "each mode reads its own section of the file",
                facts={"current": old[1:], "target": new[1:]},
            )
        )
    return out


def _nets(texts: Iterable[str]) -> list[Net]:
    out = []
    for t in texts:
        try:
            out.append(ipaddress.ip_network(t.strip(), strict=False))
        except ValueError:
            continue
    return out


def check_exclude_cidrs(ctx: Context) -> list[Finding]:
    excluded = _nets(ctx.target_config.ipvs.exclude_cidrs)
    if not excluded:
        return []
    named: list[tuple[str, Net]] = [("clusterCIDR", n) for n in ctx.cluster_cidrs]
    named += [("the node's podCIDR", n) for n in ctx.pod_cidrs]
    hits: list[str] = []
    for ex in excluded:
        for what, net in named:
            if ex.version == net.version and ex.overlaps(net):
                hits.append(f"{ex} overlaps {what} {net}")
    snap = ctx.snapshot
    if snap is not None:
        ips: dict[str, str] = {}
        for sp in snap.services.values():
            for ip in (sp.cluster_ip, *sp.external_ips, *sp.load_balancer_ips):
                ips.setdefault(ip, str(sp.name))
        for ex in excluded:
            inside = sorted(ip for ip in ips if ipaddress.ip_address(ip) in ex)
            if inside:
                hits.append(
                    f"{ex} contains {len(inside)} service addresses ({', '.join(inside[:3])}"
                    f"{', ...' if len(inside) > 3 else ''})"
                )
    if not hits:
        return []
    ipvs = ctx.target == "ipvs"
    return [
        (block if ipvs else warn)(
            "config.exclude-cidrs-overlap",
            "ipvs.excludeCIDRs swallows cluster addresses: " + "; ".join(hits),
            "IPVS virtual servers in excludeCIDRs are never cleaned up: services deleted or "
            "moved there keep their old virtual servers and endpoints forever"
            + (
                "" if ipvs else f" (ignored in {ctx.target} mode, but it bites on a switch to ipvs)"
            ),
            [
                yq(ctx, "del(.ipvs.excludeCIDRs)")
                + "  # or list only ranges other software's virtual servers use"
            ],
            facts={"exclude_cidrs": [str(e) for e in excluded], "overlaps": hits},
        )
    ]


def check_masquerade_all(ctx: Context) -> list[Finding]:
    if not ctx.target_config.masquerade_all:
        return []
    return [
        warn(
            "config.masquerade-all",
            f"masqueradeAll is on for {ctx.target} mode: every connection to a service is "
            "SNATed to the node's address",
            "endpoints never see client IPs (access logs, NetworkPolicy by source, "
            "externalTrafficPolicy Local's point) and every connection costs a conntrack "
            "SNAT entry",
            [yq(ctx, f".{_masq_section(ctx.target)}.masqueradeAll = false")],
        )
    ]


def check_min_sync(ctx: Context, rate: float | None = None) -> list[Finding]:
    cfg = ctx.target_config
    if cfg.min_sync_period > 0:
        return []
    rate = ctx_rate(ctx) if rate is None else rate
    section = (
        "ipvs" if ctx.target == "ipvs" else "nftables" if ctx.target == "nftables" else "iptables"
    )
    fix = [yq(ctx, f'.{section}.minSyncPeriod = "1s"')]
    if rate is not None and rate > HIGH_CHANGE_RATE:
        return [
            warn(
                "config.min-sync-zero",
                f"{section}.minSyncPeriod is 0 and objects change {rate:.1f} times per second",
                "every change starts a sync at once: syncs run back to back, burn CPU and "
                "hold the iptables lock (#48107) instead of batching",
                fix,
                facts={"rate": round(rate, 2)},
            )
        ]
    return [
        info(
            "config.min-sync-zero",
            f"{section}.minSyncPeriod is 0: every change syncs at once"
            + (f" (about {rate:.2f} changes/s now)" if rate is not None else ""),
            "fine while changes are rare; at a high change rate syncs run back to back",
            fix,
            facts={"rate": rate},
        )
    ]


def ctx_rate(ctx: Context) -> float | None:
    """Changes per second of the running kproxy (tracker generation over its uptime)."""
    st = ctx.status or {}
    gen, uptime = st.get("generation"), st.get("uptime")
    if isinstance(gen, int) and isinstance(uptime, int | float) and uptime > 0:
        return gen / uptime
    return None


def check_strict_arp(ctx: Context) -> list[Finding]:
    cfg = ctx.target_config.ipvs
    if cfg.strict_arp:
        return []
    snap = ctx.snapshot
    lbs = (
        sorted({ip for sp in snap.services.values() for ip in sp.load_balancer_ips}) if snap else []
    )
    found = "ipvs.strictARP is off" + (
        f" and {len(lbs)} LoadBalancer IPs exist ({', '.join(lbs[:3])})" if lbs else ""
    )
    make = warn if lbs or snap is None else info
    return [
        make(
            "config.strict-arp-off",
            found,
            "ipvs mode binds every service IP to kube-ipvs0, so the node answers ARP for "
            "LoadBalancer IPs: an ARP-announcing load balancer (MetalLB L2) loses its traffic "
            "to whichever node answers first (metallb#153)",
            [yq(ctx, ".ipvs.strictARP = true") + "  # arp_ignore=1, arp_announce=2"],
            facts={"load_balancer_ips": lbs},
        )
    ]


def nodeport_matches(ctx: Context) -> tuple[list[str], list[str]] | None:
    """(the nodePortAddresses entries, the local addresses they match); None = match-all."""
    entries = list(ctx.target_config.effective_node_port_addresses)
    try:
        policy = NodePortAddresses.from_entries(entries)
    except ValueError:
        return None  # a bad entry is the configuration's validation to report
    if policy.match_all or not ctx.addresses:
        return None  # match-all, or the addresses could not be read (noted by the context)
    local = [a for _, a, _ in ctx.addresses]
    # "primary" counts only when the node IP is one of the node's own addresses.
    node_ips = [ip for ip in ctx.node_ips if ip in local]
    matched = policy.addresses(node_ips, local, include_loopback=ctx.target != "nftables")
    return entries, list(matched or ())


def check_node_port_addresses(ctx: Context) -> list[Finding]:
    result = nodeport_matches(ctx)
    if result is None:
        return []
    entries, matched = result
    if matched:
        return []
    snap = ctx.snapshot
    nodeports = (
        sorted({sp.node_port for sp in snap.services.values() if sp.node_port}) if snap else []
    )
    make = block if nodeports else warn
    local = ", ".join(a for _, a, _ in ctx.addresses) or "none read"
    return [
        make(
            "config.nodeport-addresses-match-nothing",
            f"nodePortAddresses {entries} match none of the node's addresses ({local})"
            + (f"; {len(nodeports)} NodePorts exist" if nodeports else ""),
            f"{ctx.target} mode would serve NodePorts (and LoadBalancer traffic through them) "
            "on no address at all",
            [
                yq(ctx, '.nodePortAddresses = ["primary"]') + "  # or CIDRs of its addresses",
                "ip -4 addr show",
            ],
            facts={"node_port_addresses": entries, "node_ports": nodeports[:20]},
        )
    ]


def check_cluster_cidr(ctx: Context) -> list[Finding]:
    cfg = ctx.target_config
    mode = cfg.effective_detect_local_mode
    if mode == "ClusterCIDR" and not cfg.cluster_cidr:
        pods = ", ".join(str(c) for c in ctx.pod_cidrs)
        guess = str(ctx.pod_cidrs[0].supernet(new_prefix=16)) if ctx.pod_cidrs else "10.244.0.0/16"
        return [
            warn(
                "config.cluster-cidr-missing",
                "clusterCIDR is not set (detectLocalMode ClusterCIDR)"
                + (f"; this node's podCIDR is {pods}" if pods else ""),
                "without it kproxy cannot tell pod traffic from outside traffic: traffic from "
                "outside the cluster to ClusterIPs is not masqueraded (replies from other "
                "nodes' endpoints go back around the proxy) and externalTrafficPolicy Local "
                "does not short-circuit pods",
                [yq(ctx, f'.clusterCIDR = "{guess}"') + "  # the cluster's pod CIDR"],
            )
        ]
    if mode == "NodeCIDR" and ctx.snapshot is not None and not ctx.pod_cidrs:
        return [
            warn(
                "config.node-cidr-missing",
                "detectLocalMode is NodeCIDR but the Node object has no podCIDR",
                "local-traffic detection does nothing until the node gets a podCIDR",
                ["kubectl get node -o jsonpath='{.spec.podCIDRs}'"],
            )
        ]
    return []


def check_proxy_port_range(ctx: Context) -> list[Finding]:
    """userspace mode needs one proxy port per listener; more listeners than the range
    holds is a switch that fails after preflight said yes."""
    from kproxy.dataplane.userspace.render import listener_keys, parse_port_range

    snap = ctx.snapshot
    text = ctx.target_config.port_range
    try:
        lo, hi = parse_port_range(text)
    except ValueError:
        return []  # kproxy.config's own validation reports it (check_loads)
    if snap is None:
        return []
    needed = len(listener_keys(snap.services.values()))
    size = hi - lo + 1
    if needed <= size:
        return []
    where = f"portRange {text!r}" if text.strip() else f"the default portRange {lo}-{hi}"
    span = needed + needed // 10  # room for services added later
    start, note = lo, "below the NodePort range 30000-32767"
    if lo + span - 1 >= 30000:
        # Above the NodePort range: taken from the kernel's ephemeral ports, where
        # upstream's own default (an empty portRange) picked them.
        start, note = 32768, "above the NodePort range 30000-32767"
    wider = f"{start}-{min(65535, start + span - 1)}"
    return [
        block(
            "config.port-range-too-small",
            f"userspace mode needs {needed} proxy ports (one per ClusterIP and per external "
            f"scope of each service port) and {where} holds {size}",
            "the new mode could not open its listeners: the switch would roll back, and a "
            "restart in userspace mode would not serve at all",
            [yq(ctx, f'.portRange = "{wider}"') + f"  # {note}"],
            facts={"needed": needed, "range": [lo, hi]},
        )
    ]


def check_open_file_limit(ctx: Context) -> list[Finding]:
    """Every userspace worker holds a socket per listener: an open-file limit the proxy
    cannot lift past that is a switch whose workers never report back (found at 10,000
    services in a UML guest, whose init hands on a hard limit of 4,096)."""
    from kproxy.dataplane.userspace import fdlimit
    from kproxy.dataplane.userspace.render import listener_keys

    snap = ctx.snapshot
    if snap is None:
        return []
    pid = (ctx.status or {}).get("pid")
    proc = f"/proc/{pid}" if isinstance(pid, int) else "/proc/self"
    limit = fdlimit.parse_process_limit(
        ctx.access.read(f"{proc}/limits") or "",
        ctx.access.read(f"{proc}/status") or "",
        ctx.access.read("/proc/sys/fs/nr_open"),
    )
    if limit is None:
        return []
    whose = f"kproxy (pid {pid})" if isinstance(pid, int) else "this shell"
    listeners = len(listener_keys(snap.services.values()))
    reachable = limit.reachable
    room = fdlimit.listener_room(reachable)
    facts = {
        "listeners": listeners,
        "soft": limit.soft,
        "hard": limit.hard,
        "can_raise_hard": limit.can_raise_hard,
        "reachable": reachable,
    }
    want = fdlimit.needed(listeners, fdlimit.DEFAULT_MAX_CONNECTIONS)
    fix = [
        f"systemctl edit kproxy  # [Service] LimitNOFILE={want}",
        f"ulimit -n {want}  # in the shell that starts kproxy run",
    ]
    held = (
        "it may raise it up to fs.nr_open"
        if limit.can_raise_hard
        else "and it cannot raise the hard limit (no CAP_SYS_RESOURCE)"
    )
    if listeners > room:
        return [
            block(
                "config.open-file-limit",
                f"userspace mode needs {listeners} listening sockets in every worker; the "
                f"open-file limit of {whose} reaches {reachable} ({held}): room for {room}",
                "the workers could not open every listener: the switch would roll back, and "
                "a restart in userspace mode would leave services without a listener",
                fix,
                facts=facts,
            )
        ]
    connections = fdlimit.connection_room(reachable, listeners)
    if connections < fdlimit.DEFAULT_MAX_CONNECTIONS:
        return [
            warn(
                "config.open-file-limit",
                f"beside its {listeners} listeners a userspace worker has descriptors for "
                f"{connections} connections at most (open-file limit {reachable}, {held})",
                "past that, each worker stops accepting until connections close",
                fix,
                facts={**facts, "connections": connections},
            )
        ]
    return []


CHECKS = (
    Check("config", check_loads),
    Check("config", check_target_mode),
    Check("config", check_mode_in_file),
    Check("config", check_per_mode_sections),
    Check("config", check_exclude_cidrs),
    Check("config", check_masquerade_all),
    Check("config", check_min_sync),
    Check("config", check_strict_arp, ("ipvs",)),
    Check("config", check_node_port_addresses, ("iptables", "nftables", "ipvs")),
    Check("config", check_cluster_cidr, ("iptables", "nftables", "ipvs")),
    Check("config", check_proxy_port_range, ("userspace",), needs_source=True),
    Check("config", check_open_file_limit, ("userspace",), needs_source=True),
)
