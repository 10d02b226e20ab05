"""Upstream's defaulting (SetDefaults_KubeProxyConfiguration) on the file's raw mapping.

Go fills a field that holds its zero value, so an explicit zero often means "default"
(the package's docstring lists which fields).
"""

from __future__ import annotations

import copy
from typing import Any

from kproxy.config.addresses import append_port_if_needed, is_ipv4ish
from kproxy.config.durations import parse_duration_ns
from kproxy.config.schema import HEALTHZ_PORT, METRICS_PORT

_SECTIONS = ("clientConnection", "iptables", "ipvs", "nftables", "conntrack", "detectLocal")


def _drop_nulls(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None}


def apply_go_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """Upstream's SetDefaults_KubeProxyConfiguration on the raw mapping (see kproxy.config)."""
    out = _drop_nulls(copy.deepcopy(raw))
    for name in _SECTIONS:
        if isinstance(out.get(name), dict):
            out[name] = _drop_nulls(out[name])

    if out.get("bindAddress") == "":
        out["bindAddress"] = "0.0.0.0"
    bind = out.get("bindAddress", "0.0.0.0")
    healthz_host, metrics_host = ("0.0.0.0", "127.0.0.1") if is_ipv4ish(bind) else ("[::]", "[::1]")
    for key, host, port in (
        ("healthzBindAddress", healthz_host, HEALTHZ_PORT),
        ("metricsBindAddress", metrics_host, METRICS_PORT),
    ):
        value = out.get(key, "")
        if value == "":
            out[key] = f"{host}:{port}"
        elif isinstance(value, str):
            out[key] = append_port_if_needed(value, port)

    zero_durations = (
        (out, "configSyncPeriod", "15m0s"),
        (out.get("iptables"), "syncPeriod", "30s"),
        (out.get("iptables"), "minSyncPeriod", "1s"),
        (out.get("ipvs"), "syncPeriod", "30s"),
        (out.get("nftables"), "syncPeriod", "30s"),
        (out.get("nftables"), "minSyncPeriod", "1s"),
    )
    for section, key, default in zero_durations:
        if isinstance(section, dict) and _is_zero_duration(section.get(key)):
            section[key] = default

    client = out.get("clientConnection")
    if isinstance(client, dict):
        if client.get("contentType") == "":
            client["contentType"] = "application/vnd.kubernetes.protobuf"
        for key, default in (("qps", 5.0), ("burst", 10)):
            value = client.get(key)
            if not isinstance(value, bool) and isinstance(value, int | float) and value == 0:
                client[key] = default
    return out


def _is_zero_duration(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return parse_duration_ns(value) == 0
    except ValueError:
        return False
