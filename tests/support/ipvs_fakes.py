"""In-memory stand-ins for IPVS (decoding the real netlink messages), kube-ipvs0, ipset and
iptables, for host unit tests of the ipvs dataplane (the kernel tests run in UML)."""

from __future__ import annotations

import errno
import socket
import struct
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.ipvs import netlink as nl
from kproxy.dataplane.ipvs.dummy import Addresses
from kproxy.dataplane.ipvs.ipset import parse_save
from kproxy.dataplane.ipvs.netlink import KernelDest, KernelService
from kproxy.dataplane.ipvs.nlsock import Request, be16, parse_attrs, u16, u32
from kproxy.dataplane.ipvs.plan import PROTOCOL_NAMES, VSKey
from tests.support.iptables_fakes import FakeXtables

Dest = tuple[str, int]


def decode(req: Request) -> tuple[int, VSKey, dict[int, bytes], dict[int, bytes] | None]:
    """(command, service key, service attrs, dest attrs) of an IPVS request."""
    cmd = req.payload[0]
    top = parse_attrs(req.payload, 4)
    svc = parse_attrs(top[nl.ATTR_SERVICE])
    key = VSKey(
        PROTOCOL_NAMES[u16(svc[nl.SVC_PROTOCOL])],
        socket.inet_ntoa(svc[nl.SVC_ADDR][:4]),
        be16(svc[nl.SVC_PORT]),
    )
    dest = parse_attrs(top[nl.ATTR_DEST]) if nl.ATTR_DEST in top else None
    return cmd, key, svc, dest


@dataclass
class FakeIpvs:
    family: int = 42
    services_: dict[VSKey, KernelService] = field(default_factory=dict)
    dests_: dict[VSKey, dict[Dest, KernelDest]] = field(default_factory=dict)
    sent: list[Request] = field(default_factory=list)
    refuse: dict[str, int] = field(default_factory=dict)  # request.what prefix -> errno
    timeouts_set: tuple[int, int, int] | None = None
    batch_error: OSError | None = None  # apply() raises it, sending nothing (a failed batch)

    def close(self) -> None:
        pass

    def add(self, key: VSKey, scheduler: str = "rr", flags: int = 0, timeout: int = 0) -> None:
        self.services_[key] = KernelService(key, scheduler, flags, timeout)
        self.dests_.setdefault(key, {})

    def add_dest(self, key: VSKey, ip: str, port: int, weight: int = 1, **kw: int) -> None:
        self.dests_[key][(ip, port)] = KernelDest(ip, port, weight, **kw)

    def services(self) -> list[KernelService]:
        return list(self.services_.values())

    def dests(self, key: VSKey) -> list[KernelDest]:
        return list(self.dests_.get(key, {}).values())

    def all_dests(self) -> dict[VSKey, list[KernelDest]]:
        return {k: list(v.values()) for k, v in self.dests_.items()}

    def set_timeouts(self, tcp: int, tcpfin: int, udp: int) -> None:
        self.timeouts_set = (tcp, tcpfin, udp)

    def apply(self, requests: Sequence[Request]) -> list[tuple[Request, int]]:
        if self.batch_error is not None:
            raise self.batch_error
        failed = []
        for req in requests:
            self.sent.append(req)
            code = next((c for p, c in self.refuse.items() if req.what.startswith(p)), 0)
            code = code or self._one(req)
            if code:
                failed.append((req, code))
        return failed

    def delete_services(self, keys: Iterable[VSKey]) -> list[tuple[Request, int]]:
        return self.apply([nl.delete_service(self.family, k) for k in keys])

    def _one(self, req: Request) -> int:
        cmd, key, svc, dest = decode(req)
        if cmd in (nl.CMD_NEW_SERVICE, nl.CMD_SET_SERVICE):
            exists = key in self.services_
            if (cmd == nl.CMD_NEW_SERVICE) == exists:
                return errno.EEXIST if exists else errno.ESRCH
            flags = struct.unpack_from("=II", svc[nl.SVC_FLAGS])[0]
            sched = svc[nl.SVC_SCHED_NAME].rstrip(b"\0").decode()
            self.services_[key] = KernelService(key, sched, flags, u32(svc[nl.SVC_TIMEOUT]))
            self.dests_.setdefault(key, {})
            return 0
        if cmd == nl.CMD_DEL_SERVICE:
            if key not in self.services_:
                return errno.ESRCH
            del self.services_[key]
            self.dests_.pop(key, None)
            return 0
        assert dest is not None
        if key not in self.services_:
            return errno.ESRCH
        d = (socket.inet_ntoa(dest[nl.DEST_ADDR][:4]), be16(dest[nl.DEST_PORT]))
        per = self.dests_[key]
        if cmd == nl.CMD_DEL_DEST:
            return 0 if per.pop(d, None) is not None else errno.ENOENT
        fwd, weight = u32(dest[nl.DEST_FWD_METHOD]), u32(dest[nl.DEST_WEIGHT])
        if cmd == nl.CMD_NEW_DEST:
            if d in per:
                return errno.EEXIST
            per[d] = KernelDest(d[0], d[1], weight, fwd)
            return 0
        if d not in per:
            return errno.ENOENT
        per[d] = replace(per[d], weight=weight, fwd_method=fwd)
        return 0


@dataclass
class FakeDummy:
    exists: bool = False
    bound: set[str] = field(default_factory=set)
    node: set[str] = field(default_factory=lambda: {"10.100.0.1", "127.0.0.1"})

    def close(self) -> None:
        pass

    def lookup(self) -> tuple[int, str] | None:
        return (7, "dummy") if self.exists else None

    def ensure(self) -> int:
        self.exists = True
        return 7

    def delete(self) -> bool:
        was, self.exists = self.exists, False
        self.bound.clear()
        return was

    def addresses(self, index: int | None) -> Addresses:
        return Addresses(frozenset(self.bound if index else ()), frozenset(self.node))

    def bind(self, index: int, ips: Iterable[str]) -> list[tuple[str, int]]:
        if not self.exists:
            return [(ip, errno.ENODEV) for ip in ips]
        self.bound.update(ips)
        return []

    def unbind(self, index: int, ips: Iterable[str]) -> list[tuple[str, int]]:
        self.bound.difference_update(ips)
        return []


@dataclass
class FakeIpset:
    sets: dict[str, set[str]] = field(default_factory=dict)
    restores: list[list[str]] = field(default_factory=list)

    def save(self, names: Iterable[str] | None = None) -> dict[str, set[str]]:
        wanted = set(names) if names is not None else set(self.sets)
        return {k: set(v) for k, v in self.sets.items() if k in wanted}

    def names(self) -> list[str]:
        return list(self.sets)

    def restore(self, lines: Sequence[str]) -> None:
        if not lines:
            return
        self.restores.append(list(lines))
        for line in lines:
            verb, name, *rest = line.split()
            if verb == "create":
                self.sets.setdefault(name, set())
            elif verb == "add":
                self.sets[name].add(rest[0])
            elif verb == "del":
                self.sets[name].discard(rest[0])
            elif verb == "destroy":
                del self.sets[name]

    def destroy(self, name: str) -> None:
        self.sets.pop(name, None)


@dataclass
class FakeIptables:
    """A runner for IptablesBackend: a legacy save text, restores recorded (and applied to
    the text for the chains and jumps they declare and delete, crudely)."""

    save_text: str = ""
    restores: list[str] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], data: str | None) -> subprocess.CompletedProcess[str]:
        tool = argv[0]
        if "--version" in argv:
            return subprocess.CompletedProcess(list(argv), 0, "iptables v1.8.9 (legacy)\n", "")
        if tool.endswith("-save"):
            return subprocess.CompletedProcess(list(argv), 0, self.save_text, "")
        if tool.endswith("-restore"):
            self.restores.append(data or "")
            return subprocess.CompletedProcess(list(argv), 0, "", "")
        if "-S" in argv:
            chain = argv[-1]
            found = f":{chain} " in self.save_text
            return subprocess.CompletedProcess(list(argv), 0 if found else 1, "", "")
        return subprocess.CompletedProcess(list(argv), 1, "", "unsupported in the fake")

    def backend(self) -> IptablesBackend:
        return IptablesBackend("legacy", runner=self)


def parsed_sets(text: str) -> dict[str, set[str]]:
    return parse_save(text)


@dataclass
class IpvsKernel:
    """Every fake an IpvsDataplane writes to, with iptables kept whole (iptables_fakes)."""

    ipvs: FakeIpvs
    dummy: FakeDummy
    ipset: FakeIpset
    iptables: FakeXtables

    def state(self) -> dict[str, object]:
        """Everything the dataplane programmed, comparable with ==."""
        return {
            "services": dict(self.ipvs.services_),
            "dests": {k: dict(v) for k, v in self.ipvs.dests_.items()},
            "bound": set(self.dummy.bound),
            "sets": {k: set(v) for k, v in self.ipset.sets.items()},
            "iptables": self.iptables.save(),
        }
