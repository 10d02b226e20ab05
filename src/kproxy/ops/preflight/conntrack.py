"""Conntrack headroom: entries vs nf_conntrack_max, the established-TCP timeout, and what the
conntrack section of the configuration will set at the next start.

A full table drops new connections ("nf_conntrack: table full, dropping packet", #71261);
a switch adds connections of its own (self-probes) while both modes are programmed. The
count is per network namespace, nf_conntrack_max is the host's (read-only in other
namespaces), so a fix for max runs in the host namespace.
"""

from __future__ import annotations

from kproxy.config import format_duration
from kproxy.node_tuning import desired_conntrack_max
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, info, warn

WARN_RATIO = 0.70
# Below this an idle established connection (a database pool, a websocket) loses its entry
# within the hour; mid-switch its next packet is seen as new by the new mode.
SHORT_ESTABLISHED = 3600
HASHSIZE = "/sys/module/nf_conntrack/parameters/hashsize"


def check_headroom(ctx: Context) -> list[Finding]:
    count = ctx.access.sysctl_int("net/netfilter/nf_conntrack_count")
    maximum = ctx.access.sysctl_int("net/netfilter/nf_conntrack_max")
    if count is None or maximum is None or maximum <= 0:
        return [
            info(
                "conntrack.unreadable",
                "nf_conntrack_count / nf_conntrack_max cannot be read (conntrack not loaded yet?)",
                "the headroom check did not run",
                ["sysctl net.netfilter.nf_conntrack_count net.netfilter.nf_conntrack_max"],
            )
        ]
    ratio = count / maximum
    facts = {"count": count, "max": maximum, "ratio": round(ratio, 3)}
    if ratio < WARN_RATIO:
        return []
    ct = ctx.target_config.conntrack
    desired = desired_conntrack_max(ct.max_per_core, ct.min, ctx.access.cpu_count())
    bigger = max(desired, maximum * 2)
    return [
        warn(
            "conntrack.headroom",
            f"the conntrack table is {ratio:.0%} full ({count} of {maximum} entries)",
            "when it is full the kernel drops new connections (nf_conntrack: table full, "
            "dropping packet); a switch opens connections of its own while both modes run",
            [
                f"sysctl -w net.netfilter.nf_conntrack_max={bigger}  # in the host namespace",
                f"echo net.netfilter.nf_conntrack_max={bigger} > /etc/sysctl.d/90-conntrack.conf",
                "conntrack -S  # look for drop / insert_failed counters",
            ],
            facts=facts,
        )
    ]


def check_planned_max(ctx: Context) -> list[Finding]:
    ct = ctx.target_config.conntrack
    cpus = ctx.access.cpu_count()
    desired = desired_conntrack_max(ct.max_per_core, ct.min, cpus)
    current = ctx.access.sysctl_int("net/netfilter/nf_conntrack_max")
    facts = {
        "max_per_core": ct.max_per_core,
        "min": ct.min,
        "cpus": cpus,
        "desired": desired,
        "current": current,
    }
    if desired == 0:
        return [
            info(
                "conntrack.max-untouched",
                f"conntrack.maxPerCore is 0: kproxy leaves nf_conntrack_max as it is ({current})",
                facts=facts,
            )
        ]
    if current is not None and current >= desired:
        return []
    hashsize = ctx.access.read(HASHSIZE)
    return [
        info(
            "conntrack.max-planned",
            f"at its next start kproxy raises nf_conntrack_max from {current} to {desired} "
            f"(maxPerCore {ct.max_per_core} x {cpus} CPUs, at least min {ct.min}) and the "
            f"hash table to {desired // 4} (now {hashsize.strip() if hashsize else '?'}); "
            "a live switch does not",
            "until then the current maximum applies",
            [f"sysctl -w net.netfilter.nf_conntrack_max={desired}  # now, in the host namespace"],
            facts=facts,
        )
    ]


def check_tcp_timeout(ctx: Context) -> list[Finding]:
    current = ctx.access.sysctl_int("net/netfilter/nf_conntrack_tcp_timeout_established")
    if current is None:
        return []
    wanted = int(ctx.target_config.conntrack.tcp_established_timeout)
    facts = {"current": current, "configured": wanted}
    if current < SHORT_ESTABLISHED:
        target = wanted or 86400
        return [
            warn(
                "conntrack.tcp-timeout-short",
                f"nf_conntrack_tcp_timeout_established is {current} s "
                f"({format_duration(current)}): idle TCP connections lose their conntrack "
                "entry that quickly",
                "a connection whose entry expired is treated as new: after a switch the new "
                "mode may send it to another endpoint or drop it, and the client sees a reset",
                [f"sysctl -w net.netfilter.nf_conntrack_tcp_timeout_established={target}"],
                facts=facts,
            )
        ]
    if wanted and wanted != current:
        return [
            info(
                "conntrack.tcp-timeout-planned",
                f"nf_conntrack_tcp_timeout_established is {current} s; kproxy sets it to "
                f"{wanted} s (conntrack.tcpEstablishedTimeout) at its next start",
                facts=facts,
            )
        ]
    return []


CHECKS = (
    Check("conntrack", check_headroom),
    Check("conntrack", check_planned_max),
    Check("conntrack", check_tcp_timeout),
)
