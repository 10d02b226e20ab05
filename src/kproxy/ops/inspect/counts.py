"""ActiveConn / InActConn from the conntrack table, as ipvsadm counts them per real server.

A flow belongs to a virtual server when its original destination is the virtual address
and port (any local address for a "*" NodePort) and to a real server when its reply comes
from that endpoint (reply source address and port). ESTABLISHED flows are active; every
other state (SYN_SENT, TIME_WAIT, CLOSE, …, and stateless UDP) is inactive, as in IPVS.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from kproxy.conntrack import ConntrackEntry
from kproxy.ops.inspect.model import ANY_ADDRESS, VirtualServer


def _local(addr: str, local: set[str] | None) -> bool:
    try:
        if ipaddress.ip_address(addr).is_loopback:
            return True
    except ValueError:
        return False
    return local is None or addr in local


def apply_conntrack(
    servers: Iterable[VirtualServer],
    entries: Iterable[ConntrackEntry],
    local_addresses: Iterable[str] | None = None,
) -> None:
    """Set active / inactive on every real server (and unlisted_conns on the server)."""
    local = set(local_addresses) if local_addresses is not None else None
    by_port: dict[tuple[str, int], list[ConntrackEntry]] = {}
    for e in entries:
        if e.orig_dport is not None:
            by_port.setdefault((e.proto, e.orig_dport), []).append(e)
    for vs in servers:
        for rs in vs.endpoints:
            rs.active = rs.inactive = 0
        vs.unlisted_conns = 0
        for e in by_port.get((vs.proto, vs.port), ()):
            if vs.address == ANY_ADDRESS:
                if not _local(e.orig_dst, local):
                    continue
            elif e.orig_dst != vs.address:
                continue
            for rs in vs.endpoints:
                if e.reply_src == rs.address and e.reply_sport == rs.port:
                    if e.state == "ESTABLISHED":
                        rs.active += 1
                    else:
                        rs.inactive += 1
                    break
            else:
                if e.reply_src != e.orig_dst:  # not DNATed at all: not ours to count
                    vs.unlisted_conns += 1
