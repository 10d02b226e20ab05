"""kube-ipvs0, the dummy interface that holds the service addresses, over rtnetlink.

The interface is created and never set up (like upstream): its addresses still get
`local` routes, so packets to a VIP are delivered locally, where IPVS takes them. Addresses
go on and off in batched RTM_NEWADDR/RTM_DELADDR messages (10,000 ClusterIPs are 10,000
addresses), and one RTM_GETADDR dump lists every IPv4 address of the node, which gives both
kube-ipvs0's addresses and the node's own (all other interfaces).
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.nlsock import (
    NLM_F_CREATE,
    NLM_F_EXCL,
    NLM_F_REPLACE,
    NetlinkError,
    NetlinkSocket,
    Request,
    nla,
    nla_str,
    parse_attrs,
)

NETLINK_ROUTE = 0
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_DELADDR = 21
RTM_GETADDR = 22
IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
IFLA_IFNAME = 3
IFLA_LINKINFO = 18
IFLA_INFO_KIND = 1
IFA_ADDRESS = 1
IFA_LOCAL = 2


@dataclass(frozen=True, slots=True)
class Addresses:
    """Every IPv4 address of the node, split by whether it is on the dummy interface."""

    dummy: frozenset[str]
    node: frozenset[str]  # on any other interface (loopback included; callers filter)


class DummyDevice:
    def __init__(self, netns: str | None = None, name: str = n.DUMMY_DEVICE) -> None:
        self.name = name
        self.sock = NetlinkSocket(NETLINK_ROUTE, netns)

    def close(self) -> None:
        self.sock.close()

    # --- the link -------------------------------------------------------------------------

    def lookup(self) -> tuple[int, str] | None:
        """(ifindex, link kind) of the interface, or None when it does not exist."""
        body = IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + nla_str(IFLA_IFNAME, self.name)
        try:
            replies = self.sock.get(RTM_GETLINK, body, f"look up {self.name}")
        except NetlinkError as err:
            if err.errno in (errno.ENODEV, errno.ENOENT):
                return None
            raise
        for msg_type, reply in replies:
            if msg_type != RTM_NEWLINK:
                continue
            _family, _type, index, _flags, _change = IFINFOMSG.unpack_from(reply)
            attrs = parse_attrs(reply, IFINFOMSG.size)
            kind = ""
            if IFLA_LINKINFO in attrs:
                info = parse_attrs(attrs[IFLA_LINKINFO])
                kind = info.get(IFLA_INFO_KIND, b"").rstrip(b"\0").decode()
            return index, kind
        return None

    def ensure(self) -> int:
        """The interface's index, creating it (type dummy, left down) when missing."""
        found = self.lookup()
        if found is not None:
            return found[0]
        body = (
            IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
            + nla_str(IFLA_IFNAME, self.name)
            + nla(IFLA_LINKINFO, nla_str(IFLA_INFO_KIND, "dummy"))
        )
        try:
            self.sock.request(
                Request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body, f"create {self.name}")
            )
        except NetlinkError as err:
            if err.errno != errno.EEXIST:
                raise
        found = self.lookup()
        if found is None:
            raise NetlinkError(errno.ENODEV, f"{self.name} vanished right after its creation")
        return found[0]

    def delete(self) -> bool:
        found = self.lookup()
        if found is None:
            return False
        body = IFINFOMSG.pack(socket.AF_UNSPEC, 0, found[0], 0, 0)
        self.sock.request(Request(RTM_DELLINK, 0, body, f"delete {self.name}"))
        return True

    # --- addresses ------------------------------------------------------------------------

    def addresses(self, index: int | None) -> Addresses:
        """One dump of every IPv4 address; `index` is the dummy's (None: it does not exist)."""
        dummy: set[str] = set()
        node: set[str] = set()
        for msg_type, body in self.sock.dump(
            RTM_GETADDR, IFADDRMSG.pack(socket.AF_INET, 0, 0, 0, 0)
        ):
            if msg_type != RTM_NEWADDR:
                continue
            family, _plen, _flags, _scope, ifindex = IFADDRMSG.unpack_from(body)
            if family != socket.AF_INET:
                continue
            attrs = parse_attrs(body, IFADDRMSG.size)
            raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
            if raw is None:
                continue
            (dummy if ifindex == index else node).add(socket.inet_ntoa(raw[:4]))
        return Addresses(frozenset(dummy), frozenset(node))

    def _addr_request(self, kind: int, index: int, ip: str, flags: int, what: str) -> Request:
        raw = socket.inet_aton(ip)
        body = (
            IFADDRMSG.pack(socket.AF_INET, 32, 0, 0, index)
            + nla(IFA_LOCAL, raw)
            + nla(IFA_ADDRESS, raw)
        )
        return Request(kind, flags, body, f"{what} {ip}/32 on {self.name}")

    def bind(self, index: int, ips: Iterable[str]) -> list[tuple[str, int]]:
        """Add /32 addresses; (ip, errno) of those that failed."""
        reqs = [
            self._addr_request(RTM_NEWADDR, index, ip, NLM_F_CREATE | NLM_F_REPLACE, "add")
            for ip in ips
        ]
        return [(r.what.split()[1].split("/")[0], code) for r, code in self.sock.batch(reqs)]

    def unbind(self, index: int, ips: Iterable[str]) -> list[tuple[str, int]]:
        reqs = [self._addr_request(RTM_DELADDR, index, ip, 0, "delete") for ip in ips]
        return [
            (r.what.split()[1].split("/")[0], code)
            for r, code in self.sock.batch(reqs)
            if code != errno.EADDRNOTAVAIL  # already gone
        ]
