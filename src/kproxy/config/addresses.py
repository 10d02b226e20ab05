"""Addresses the way upstream's Go code parses them (net.ParseCIDR, net.SplitHostPort, ...),
which is stricter or looser than Python's ipaddress in places."""

from __future__ import annotations

import ipaddress
import re
from typing import Any


def is_ipv4ish(value: Any) -> bool:
    # Go's ParseIP(x).To4() != nil: IPv4 or IPv4-mapped IPv6; anything else counts as IPv6.
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return False
    return ip.version == 4 or ip.ipv4_mapped is not None


def append_port_if_needed(addr: str, port: int) -> str:
    """proxyutil.AppendPortIfNeeded: a bare IP gets the port, anything else is kept."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr
    return f"[{addr}]:{port}" if ip.version == 6 else f"{addr}:{port}"


def split_host_port(value: str) -> tuple[str, str] | None:
    """Go's net.SplitHostPort for the cases that matter here; None when malformed."""
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 : end + 2] != ":":
            return None
        return value[1:end], value[end + 2 :]
    host, sep, port = value.rpartition(":")
    if not sep or ":" in host:
        return None
    return host, port


_CIDR = re.compile(r"[^/\s]+/[0-9]{1,3}")


def parse_cidr(value: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    # Go's ParseCIDR: "addr/len" only (no bare address, no netmask form); host bits allowed.
    if not _CIDR.fullmatch(value):
        return None
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        return None
