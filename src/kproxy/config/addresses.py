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


def parse_ip(text: str) -> str:
    """An IP address the way Go's net.ParseIP takes it (no zone, no brackets); ValueError
    saying what is wrong."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address") from None
    if "%" in text:
        raise ValueError(f"{text!r}: an IP address here has no zone (%...)")
    return text


def parse_port(text: str, *, zero: bool = False) -> int:
    """A port number, 1-65535 (0 too with zero=True: "disabled"); ValueError otherwise."""
    low = 0 if zero else 1
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= 65535:
        raise ValueError(f"{text!r} is not a port ({low}-65535)")
    return int(text)


def parse_host_port(text: str) -> tuple[str, int]:
    """ "IP:PORT" ("[::1]:10249" for IPv6); ValueError naming the part that is wrong."""
    parts = split_host_port(text)
    if parts is None:
        raise ValueError(f"{text!r} is not IP:PORT (e.g. 127.0.0.1:10249)")
    return parse_ip(parts[0]), parse_port(parts[1])


# Linux's rule for a device name (dev_valid_name), plus no quote or backslash, which the rule
# languages of iptables-restore and nft cannot carry in an interface match.
_IFNAME = re.compile(r"[^\s/:\"'\\]{1,15}")


def is_interface_name(text: str) -> bool:
    """Whether `text` can be a network interface's name (or a name prefix)."""
    printable = text.isascii() and text.isprintable()
    return printable and _IFNAME.fullmatch(text) is not None and text not in (".", "..")
