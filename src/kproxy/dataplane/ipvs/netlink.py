"""IPVS over generic netlink: list, add, edit and delete virtual and real servers.

Written on kproxy's small netlink client (nlsock) rather than pyroute2's IPVS class, for two
reasons: every field is explicit here (pyroute2 defaults real servers to direct routing,
services to wlc, and its "update" verb deletes), and requests go out in batches instead of
one round trip each. Messages are the ones ipvsadm sends (linux/ip_vs.h); IPv4 only.

Reading the whole table: services come from one netlink dump (scheduler, flags and timeout
exactly); their real servers from one read of /proc/net/ip_vs (weights, forwarding method,
active and inactive connections), because netlink can only dump the real servers of one
service per request, which at 10,000 services is 10,000 round trips per full sync.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.nlsock import (
    NetlinkError,
    NetlinkSocket,
    Request,
    be16,
    nla,
    nla_be16,
    nla_str,
    nla_u16,
    nla_u32,
    parse_attrs,
    u16,
    u32,
)
from kproxy.dataplane.ipvs.plan import PROTOCOL_NAMES, PROTOCOL_NUMBERS, VirtualServer, VSKey
from kproxy.host.commands import Runner, in_netns, run_command

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
GENL_HDR = struct.Struct("=BBH")
IPVS_GENL_NAME = "IPVS"
IPVS_GENL_VERSION = 1

CMD_NEW_SERVICE = 1
CMD_SET_SERVICE = 2
CMD_DEL_SERVICE = 3
CMD_GET_SERVICE = 4
CMD_NEW_DEST = 5
CMD_SET_DEST = 6
CMD_DEL_DEST = 7
CMD_GET_DEST = 8
CMD_SET_CONFIG = 12
CMD_GET_CONFIG = 13
CMD_FLUSH = 17

ATTR_SERVICE = 1
ATTR_DEST = 2
ATTR_TIMEOUT_TCP = 4
ATTR_TIMEOUT_TCP_FIN = 5
ATTR_TIMEOUT_UDP = 6

SVC_AF = 1
SVC_PROTOCOL = 2
SVC_ADDR = 3
SVC_PORT = 4
SVC_FWMARK = 5
SVC_SCHED_NAME = 6
SVC_FLAGS = 7
SVC_TIMEOUT = 8
SVC_NETMASK = 9

DEST_ADDR = 1
DEST_PORT = 2
DEST_FWD_METHOD = 3
DEST_WEIGHT = 4
DEST_U_THRESH = 5
DEST_L_THRESH = 6
DEST_ACTIVE_CONNS = 7
DEST_INACT_CONNS = 8
DEST_PERSIST_CONNS = 9

PROC_IP_VS = "/proc/net/ip_vs"
ALL_FLAGS_MASK = 0xFFFFFFFF


class IpvsUnavailable(Exception):
    """The kernel has no IPVS (module ip_vs not loaded and not loadable)."""


@dataclass(frozen=True, slots=True)
class KernelService:
    key: VSKey
    scheduler: str
    flags: int  # without the kernel-internal HASHED bit
    timeout: int
    fwmark: int = 0

    @property
    def attributes(self) -> tuple[str, int, int]:
        return self.scheduler, self.flags, self.timeout


@dataclass(frozen=True, slots=True)
class KernelDest:
    ip: str
    port: int
    weight: int
    fwd_method: int = n.FWD_MASQ
    active: int = 0
    inactive: int = 0

    @property
    def connections(self) -> int:
        return self.active + self.inactive


# --- message building (pure; unit-tested against the layout ipvsadm sends) -------------------


def _genl(cmd: int, attrs: bytes) -> bytes:
    return GENL_HDR.pack(cmd, IPVS_GENL_VERSION, 0) + attrs


def service_key_attrs(key: VSKey) -> bytes:
    return (
        nla_u16(SVC_AF, socket.AF_INET)
        + nla_u16(SVC_PROTOCOL, PROTOCOL_NUMBERS[key.protocol])
        + nla(SVC_ADDR, socket.inet_aton(key.address))
        + nla_be16(SVC_PORT, key.port)
    )


def service_attrs(vs: VirtualServer) -> bytes:
    """Every field of a service, explicitly (the kernel needs all of them for add and edit)."""
    return (
        service_key_attrs(vs.key)
        + nla_str(SVC_SCHED_NAME, vs.scheduler)
        + nla(SVC_FLAGS, struct.pack("=II", vs.flags, ALL_FLAGS_MASK))
        + nla_u32(SVC_TIMEOUT, vs.timeout)
        + nla(SVC_NETMASK, b"\xff\xff\xff\xff")
    )


def dest_attrs(ip: str, port: int, weight: int | None) -> bytes:
    """A real server: masquerading (NAT) forwarding, no connection thresholds."""
    out = nla(DEST_ADDR, socket.inet_aton(ip)) + nla_be16(DEST_PORT, port)
    if weight is not None:
        out += (
            nla_u32(DEST_FWD_METHOD, n.FWD_MASQ)
            + nla_u32(DEST_WEIGHT, weight)
            + nla_u32(DEST_U_THRESH, 0)
            + nla_u32(DEST_L_THRESH, 0)
        )
    return out


def add_service(family: int, vs: VirtualServer) -> Request:
    body = _genl(CMD_NEW_SERVICE, nla(ATTR_SERVICE, service_attrs(vs)))
    return Request(family, 0, body, f"add virtual server {vs.key}")


def edit_service(family: int, vs: VirtualServer) -> Request:
    body = _genl(CMD_SET_SERVICE, nla(ATTR_SERVICE, service_attrs(vs)))
    return Request(family, 0, body, f"edit virtual server {vs.key}")


def delete_service(family: int, key: VSKey) -> Request:
    body = _genl(CMD_DEL_SERVICE, nla(ATTR_SERVICE, service_key_attrs(key)))
    return Request(family, 0, body, f"delete virtual server {key}")


def add_dest(family: int, key: VSKey, ip: str, port: int, weight: int = 1) -> Request:
    body = _genl(
        CMD_NEW_DEST,
        nla(ATTR_SERVICE, service_key_attrs(key)) + nla(ATTR_DEST, dest_attrs(ip, port, weight)),
    )
    return Request(family, 0, body, f"add real server {ip}:{port} to {key}")


def edit_dest(family: int, key: VSKey, ip: str, port: int, weight: int) -> Request:
    body = _genl(
        CMD_SET_DEST,
        nla(ATTR_SERVICE, service_key_attrs(key)) + nla(ATTR_DEST, dest_attrs(ip, port, weight)),
    )
    return Request(family, 0, body, f"set weight {weight} of real server {ip}:{port} of {key}")


def delete_dest(family: int, key: VSKey, ip: str, port: int) -> Request:
    body = _genl(
        CMD_DEL_DEST,
        nla(ATTR_SERVICE, service_key_attrs(key)) + nla(ATTR_DEST, dest_attrs(ip, port, None)),
    )
    return Request(family, 0, body, f"delete real server {ip}:{port} of {key}")


# --- reply parsing ------------------------------------------------------------------------------


def _addr(data: bytes, af: int) -> str:
    if af == socket.AF_INET:
        return socket.inet_ntoa(data[:4])
    return socket.inet_ntop(socket.AF_INET6, data[:16])


def parse_service(body: bytes) -> KernelService | None:
    """A NEW_SERVICE dump reply; None for services kproxy never manages (fwmark, IPv6)."""
    top = parse_attrs(body, GENL_HDR.size)
    if ATTR_SERVICE not in top:
        return None
    a = parse_attrs(top[ATTR_SERVICE])
    af = u16(a[SVC_AF]) if SVC_AF in a else socket.AF_INET
    fwmark = u32(a[SVC_FWMARK]) if SVC_FWMARK in a else 0
    if fwmark or af != socket.AF_INET or SVC_ADDR not in a:
        return None
    proto = PROTOCOL_NAMES.get(u16(a[SVC_PROTOCOL]), str(u16(a[SVC_PROTOCOL])))
    flags = struct.unpack_from("=I", a[SVC_FLAGS])[0] if SVC_FLAGS in a else 0
    return KernelService(
        key=VSKey(proto, _addr(a[SVC_ADDR], af), be16(a[SVC_PORT])),
        scheduler=a.get(SVC_SCHED_NAME, b"").rstrip(b"\0").decode(),
        flags=flags & ~n.FLAG_HASHED,
        timeout=u32(a[SVC_TIMEOUT]) if SVC_TIMEOUT in a else 0,
    )


def parse_dest(body: bytes) -> KernelDest | None:
    top = parse_attrs(body, GENL_HDR.size)
    if ATTR_DEST not in top:
        return None
    a = parse_attrs(top[ATTR_DEST])
    af = u16(a[11]) if 11 in a else socket.AF_INET  # DEST_ADDR_FAMILY (kernel 4.x+)
    if af != socket.AF_INET:
        return None
    return KernelDest(
        ip=_addr(a[DEST_ADDR], af),
        port=be16(a[DEST_PORT]),
        weight=u32(a[DEST_WEIGHT]),
        fwd_method=u32(a[DEST_FWD_METHOD]) & 0x7,
        active=u32(a[DEST_ACTIVE_CONNS]) if DEST_ACTIVE_CONNS in a else 0,
        inactive=u32(a[DEST_INACT_CONNS]) if DEST_INACT_CONNS in a else 0,
    )


_FWD_BY_NAME = {v: k for k, v in n.FWD_NAMES.items()}


def parse_proc_ip_vs(text: str) -> dict[VSKey, list[KernelDest]]:
    """/proc/net/ip_vs -> real servers per IPv4 virtual server (fwmark services skipped)."""
    out: dict[VSKey, list[KernelDest]] = {}
    current: list[KernelDest] | None = None
    for line in text.splitlines():
        if line.startswith("  -> "):
            if current is None:
                continue
            fields = line.split()
            if len(fields) < 6 or ":" not in fields[1] or "[" in fields[1]:
                continue
            addr, _, port = fields[1].partition(":")
            current.append(
                KernelDest(
                    ip=socket.inet_ntoa(int(addr, 16).to_bytes(4, "big")),
                    port=int(port, 16),
                    weight=int(fields[3]),
                    fwd_method=_FWD_BY_NAME.get(fields[2], -1),
                    active=int(fields[4]),
                    inactive=int(fields[5]),
                )
            )
            continue
        fields = line.split()
        current = None
        if len(fields) < 3 or fields[0] not in PROTOCOL_NUMBERS or "[" in fields[1]:
            continue
        addr, _, port = fields[1].partition(":")
        try:
            key = VSKey(
                fields[0], socket.inet_ntoa(int(addr, 16).to_bytes(4, "big")), int(port, 16)
            )
        except ValueError:
            continue
        current = out.setdefault(key, [])
    return out


# --- the client -----------------------------------------------------------------------------


class IpvsNetlink:
    """One generic-netlink socket to IPVS (optionally in a named network namespace)."""

    def __init__(self, netns: str | None = None, *, runner: Runner | None = None) -> None:
        self.netns = netns
        self.runner = runner or run_command
        self.sock = NetlinkSocket(NETLINK_GENERIC, netns)
        self.family = self._resolve_family()

    def close(self) -> None:
        self.sock.close()

    def _resolve_family(self) -> int:
        body = GENL_HDR.pack(CTRL_CMD_GETFAMILY, 1, 0) + nla_str(
            CTRL_ATTR_FAMILY_NAME, IPVS_GENL_NAME
        )
        try:
            replies = self.sock.get(GENL_ID_CTRL, body, "look up the IPVS netlink family")
        except NetlinkError as err:
            raise IpvsUnavailable(
                f"the kernel has no IPVS netlink interface ({err.strerror}): "
                "module ip_vs is not loaded"
            ) from err
        for _t, reply in replies:
            attrs = parse_attrs(reply, GENL_HDR.size)
            if CTRL_ATTR_FAMILY_ID in attrs:
                return u16(attrs[CTRL_ATTR_FAMILY_ID])
        raise IpvsUnavailable("the kernel answered without an IPVS netlink family id")

    # --- reading ------------------------------------------------------------------------

    def services(self) -> list[KernelService]:
        replies = self.sock.dump(self.family, _genl(CMD_GET_SERVICE, b""))
        return [s for _t, body in replies if (s := parse_service(body)) is not None]

    def dests(self, key: VSKey) -> list[KernelDest]:
        """The real servers of one virtual server (one netlink dump)."""
        body = _genl(CMD_GET_DEST, nla(ATTR_SERVICE, service_key_attrs(key)))
        try:
            replies = self.sock.dump(self.family, body)
        except NetlinkError as err:
            if err.errno in (3, 2):  # ESRCH, ENOENT: the service is gone
                return []
            raise
        return [d for _t, b in replies if (d := parse_dest(b)) is not None]

    def all_dests(self) -> dict[VSKey, list[KernelDest]]:
        """Every virtual server's real servers, from one read of /proc/net/ip_vs."""
        if self.netns is None:
            try:
                with open(PROC_IP_VS) as f:
                    text = f.read()
            except FileNotFoundError:
                return {}
        else:
            proc = self.runner(in_netns(["cat", PROC_IP_VS], self.netns), None)
            if proc.returncode != 0:
                raise NetlinkError(5, f"reading {PROC_IP_VS}: {proc.stderr.strip()}")
            text = proc.stdout
        return parse_proc_ip_vs(text)

    def timeouts(self) -> tuple[int, int, int]:
        """(tcp, tcpfin, udp) connection timeouts in seconds (ipvsadm -L --timeout)."""
        replies = self.sock.get(self.family, _genl(CMD_GET_CONFIG, b""), "read IPVS timeouts")
        for _t, body in replies:
            a = parse_attrs(body, GENL_HDR.size)
            return (
                u32(a.get(ATTR_TIMEOUT_TCP, b"\0\0\0\0")),
                u32(a.get(ATTR_TIMEOUT_TCP_FIN, b"\0\0\0\0")),
                u32(a.get(ATTR_TIMEOUT_UDP, b"\0\0\0\0")),
            )
        return 0, 0, 0

    # --- writing ------------------------------------------------------------------------

    def apply(self, requests: Sequence[Request]) -> list[tuple[Request, int]]:
        """Send requests in batches; (request, errno) of each one the kernel refused."""
        return self.sock.batch(requests)

    def set_timeouts(self, tcp: int, tcpfin: int, udp: int) -> None:
        """ipvsadm --set: only non-zero values change (0 keeps the kernel's)."""
        attrs = b""
        for kind, value in (
            (ATTR_TIMEOUT_TCP, tcp),
            (ATTR_TIMEOUT_TCP_FIN, tcpfin),
            (ATTR_TIMEOUT_UDP, udp),
        ):
            if value > 0:
                attrs += nla_u32(kind, value)
        if attrs:
            self.sock.request(
                Request(self.family, 0, _genl(CMD_SET_CONFIG, attrs), "set IPVS timeouts")
            )

    def add_service(self, vs: VirtualServer) -> None:
        self.sock.request(add_service(self.family, vs))

    def delete_service(self, key: VSKey) -> None:
        self.sock.request(delete_service(self.family, key))

    def delete_services(self, keys: Iterable[VSKey]) -> list[tuple[Request, int]]:
        return self.apply([delete_service(self.family, k) for k in keys])


__all__ = [
    "IpvsNetlink",
    "IpvsUnavailable",
    "KernelDest",
    "KernelService",
    "NetlinkError",
    "parse_proc_ip_vs",
]
