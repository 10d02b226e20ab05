"""Node settings kube-proxy applies once at startup: conntrack sysctls and the OOM score.

Same rules as upstream: maxPerCore > 0 sizes nf_conntrack_max as
maxPerCore x CPUs (at least `min`), raised only, and the hash table to a quarter of it;
timeouts are written only when > 0. Failures are warnings, never fatal: a container
with a read-only /proc/sys still proxies.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kproxy.config import ProxyConfig
from kproxy.sysctl import get_sysctl, set_sysctl

log = logging.getLogger("kproxy.node")

HASHSIZE = Path("/sys/module/nf_conntrack/parameters/hashsize")
MAX_CONNTRACK = 1 << 20  # newest upstream caps the computed maximum here


def desired_conntrack_max(max_per_core: int, minimum: int, cpus: int) -> int:
    """0 means "leave it alone" (maxPerCore 0)."""
    if max_per_core <= 0:
        return 0
    return min(max(max_per_core * cpus, minimum), MAX_CONNTRACK)


def apply_conntrack_config(config: ProxyConfig, cpus: int | None = None) -> None:
    ct = config.conntrack
    wanted = desired_conntrack_max(ct.max_per_core, ct.min, cpus or os.cpu_count() or 1)
    if wanted:
        current = int(get_sysctl("net/netfilter/nf_conntrack_max") or 0)
        if current < wanted:
            set_sysctl("net/netfilter/nf_conntrack_max", wanted)
        _raise_hashsize(wanted // 4)
    for name, seconds in (
        ("net/netfilter/nf_conntrack_tcp_timeout_established", ct.tcp_established_timeout),
        ("net/netfilter/nf_conntrack_tcp_timeout_close_wait", ct.tcp_close_wait_timeout),
        ("net/netfilter/nf_conntrack_udp_timeout", ct.udp_timeout),
        ("net/netfilter/nf_conntrack_udp_timeout_stream", ct.udp_stream_timeout),
    ):
        if seconds > 0:
            set_sysctl(name, int(seconds))
    if ct.tcp_be_liberal:
        set_sysctl("net/netfilter/nf_conntrack_tcp_be_liberal", 1)


def _raise_hashsize(size: int) -> None:
    try:
        current = int(HASHSIZE.read_text().strip())
    except (OSError, ValueError):
        return  # nf_conntrack not loaded yet: the kernel sizes it when it loads
    if current >= size:
        return
    try:
        HASHSIZE.write_text(f"{size}\n")
        log.info("set conntrack hashsize %d (was %d)", size, current)
    except OSError as err:
        log.warning("could not set conntrack hashsize to %d: %s", size, err)


def apply_oom_score(score: int) -> None:
    try:
        Path("/proc/self/oom_score_adj").write_text(f"{score}\n")
    except OSError as err:
        log.warning("could not set oom_score_adj %d: %s", score, err)
