"""ipvs mode: virtual servers, real servers and counters read from IPVS over netlink.

The kernel holds no service names in ipvs mode (neither IPVS nor upstream's ipsets carry
comments), so the listing is keyed by address as `ipvsadm -Ln` is; a virtual server's kind
(ClusterIP, ExternalIP, LoadBalancer, NodePort) comes from the ipset it is in. Counters are
IPVS's own (`ipvsadm -Ln --stats`): connections, packets and bytes in both directions per
virtual and per real server; ActiveConn/InActConn are IPVS's per real server.

trace: the iptables layer in front (nat PREROUTING/OUTPUT -> KUBE-SERVICES: masquerade
marks, the KUBE-* ipset matches, evaluated against `ipset save`), then the virtual server
IPVS finds at LOCAL_IN, its scheduler, and one outcome per real server it can pick (weight
> 0), then nat POSTROUTING (masquerade when marked). All of it from the kernel; nothing
from a snapshot.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs import netlink as nl
from kproxy.dataplane.ipvs.nlsock import NetlinkError, nla, parse_attrs
from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.ops.inspect.branch import Branch
from kproxy.ops.inspect.iptables_rules import MatchModule, Table, parse_save
from kproxy.ops.inspect.iptables_trace import IptablesWalker
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import (
    ACCEPT,
    CLUSTER_IP,
    DROP,
    EXTERNAL_IP,
    LOAD_BALANCER,
    NODE_PORT,
    REJECT,
    Destination,
    Outcome,
    Packet,
    RealServer,
    Step,
    VirtualServer,
    Walk,
    in_network,
)

SVC_STATS = 10
SVC_STATS64 = 12
DEST_STATS = 10
DEST_STATS64 = 12
STAT_NAMES = {1: "conns", 2: "inpkts", 3: "outpkts", 4: "inbytes", 5: "outbytes"}
COUNTER_NOTE = (
    "Pkts/Bytes: IPVS's counters (ipvsadm -Ln --stats), both directions summed; --json has "
    "conns, inpkts, outpkts, inbytes, outbytes separately. ActiveConn/InActConn: IPVS's own."
)
KIND_SETS = (
    (n.CLUSTER_IP, CLUSTER_IP),
    (n.EXTERNAL_IP, EXTERNAL_IP),
    (n.EXTERNAL_IP_LOCAL, EXTERNAL_IP),
    (n.LOAD_BALANCER, LOAD_BALANCER),
)


# --- kernel reads ----------------------------------------------------------------------------


@dataclass
class IpvsDest:
    ip: str
    port: int
    weight: int
    forward: str
    active: int
    inactive: int
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class IpvsService:
    key: VSKey
    scheduler: str
    flags: int
    timeout: int
    stats: dict[str, int] = field(default_factory=dict)
    dests: list[IpvsDest] = field(default_factory=list)


def parse_stats(data: bytes) -> dict[str, int]:
    """IPVS_*_ATTR_STATS / STATS64: u32 or u64 per counter (by attribute length)."""
    out: dict[str, int] = {}
    for kind, value in parse_attrs(data).items():
        name = STAT_NAMES.get(kind)
        if name is None:
            continue
        fmt = "=Q" if len(value) >= 8 else "=I"
        out[name] = struct.unpack_from(fmt, value)[0]
    return out


def _stats_of(attrs: dict[int, bytes], plain: int, wide: int) -> dict[str, int]:
    if wide in attrs:
        return parse_stats(attrs[wide])
    return parse_stats(attrs[plain]) if plain in attrs else {}


def read_ipvs(netns: str | None, *, real_servers: bool = True) -> list[IpvsService] | None:
    """Every IPv4 virtual server with its counters, and its real servers unless told not to
    (a dump per virtual server), None when there is no IPVS here."""
    try:
        client = nl.IpvsNetlink(netns)
    except (nl.IpvsUnavailable, OSError):
        return None
    try:
        out: list[IpvsService] = []
        for _t, body in client.sock.dump(client.family, nl._genl(nl.CMD_GET_SERVICE, b"")):
            svc = nl.parse_service(body)
            if svc is None:
                continue
            top = parse_attrs(body, nl.GENL_HDR.size)
            attrs = parse_attrs(top[nl.ATTR_SERVICE])
            item = IpvsService(
                svc.key,
                svc.scheduler,
                svc.flags,
                svc.timeout,
                _stats_of(attrs, SVC_STATS, SVC_STATS64),
            )
            out.append(item)
            if not real_servers:
                continue
            req = nl._genl(nl.CMD_GET_DEST, nla(nl.ATTR_SERVICE, nl.service_key_attrs(svc.key)))
            try:
                replies = client.sock.dump(client.family, req)
            except NetlinkError:
                replies = []  # gone between the two dumps
            for _t2, dbody in replies:
                d = nl.parse_dest(dbody)
                if d is None:
                    continue
                da = parse_attrs(parse_attrs(dbody, nl.GENL_HDR.size)[nl.ATTR_DEST])
                item.dests.append(
                    IpvsDest(
                        d.ip,
                        d.port,
                        d.weight,
                        n.FWD_NAMES.get(d.fwd_method, str(d.fwd_method)),
                        d.active,
                        d.inactive,
                        _stats_of(da, DEST_STATS, DEST_STATS64),
                    )
                )
        return out
    finally:
        client.close()


# `ipvsadm -S -n`'s protocol options (render.PROTO_FLAG) and forwarding methods.
_SAVE_PROTOCOLS = {"-t": "TCP", "-u": "UDP", "--sctp-service": "SCTP"}
_SAVE_FORWARDS = {"-m": "Masq", "-i": "Tunnel", "-g": "Route"}


def _next_words(words: list[str]) -> dict[str, str]:
    """{word: the word after it}: an option's value (a flag maps to what follows it)."""
    return dict(zip(words, [*words[1:], ""], strict=True))


def parse_ipvsadm_save(text: str) -> list[IpvsService]:
    """`ipvsadm -S -n` (IPv4 virtual servers, as read_ipvs gives) -> virtual servers with
    their real servers; no counters (the text has none)."""
    services: dict[VSKey, IpvsService] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) < 3 or words[0] not in ("-A", "-a") or words[1] not in _SAVE_PROTOCOLS:
            continue
        host, _, port = words[2].rpartition(":")
        if not port.isdigit() or ":" in host or host.startswith("["):
            continue
        key = VSKey(_SAVE_PROTOCOLS[words[1]], host, int(port))
        opts = _next_words(words[3:])
        if words[0] == "-A":
            flags = n.FLAG_PERSISTENT if "-p" in opts else 0
            flags |= n.FLAG_ONEPACKET if "-o" in opts else 0
            timeout = int(opts["-p"]) if opts.get("-p", "").isdigit() else 0
            services[key] = IpvsService(key, opts.get("-s", ""), flags, timeout)
        elif key in services and "-r" in opts:
            ip, _, dport = opts["-r"].rpartition(":")
            forward = next((f for o, f in _SAVE_FORWARDS.items() if o in opts), "Masq")
            weight = int(opts["-w"]) if opts.get("-w", "").isdigit() else 1
            dest = IpvsDest(ip, int(dport) if dport.isdigit() else 0, weight, forward, 0, 0)
            services[key].dests.append(dest)
    return list(services.values())


def parse_ipset_save(text: str) -> dict[str, tuple[str, set[str]]]:
    """`ipset save` -> {set name: (type, members)}."""
    sets: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "create":
            sets[parts[1]] = (parts[2], set())
        elif len(parts) >= 3 and parts[0] == "add" and parts[1] in sets:
            sets[parts[1]][1].add(parts[2])
    return sets


def _flags_text(svc: IpvsService) -> list[str]:
    names = n.SCHED_FLAG_NAMES.get(svc.scheduler, {})
    return [name for bit, name in names.items() if svc.flags & bit]


# --- the view --------------------------------------------------------------------------------


class IpvsVirtualServer(VirtualServer):
    ipvs_stats: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return super().to_json() | {"ipvs_stats": dict(getattr(self, "ipvs_stats", {}))}


class IpvsRealServer(RealServer):
    ipvs_stats: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return super().to_json() | {"ipvs_stats": dict(getattr(self, "ipvs_stats", {}))}


def _set_member(
    kind: str, members: set[str], flags: str, pkt: Packet, dst: str, dport: int
) -> bool:
    """Does the packet match `-m set --match-set NAME FLAGS` for a set of this type?"""
    dims = kind.split(":", 1)[1].split(",") if ":" in kind else []
    which = flags.split(",")
    wanted: list[tuple[str, str]] = []
    for dim, f in zip(dims, which, strict=False):
        addr = dst if f == "dst" else pkt.src
        port = dport if f == "dst" else (pkt.sport or 0)
        if dim == "port":
            wanted.append(
                ("port", str(port) if kind.startswith("bitmap") else f"{pkt.proto}:{port}")
            )
        else:
            wanted.append((dim, addr))
    for member in members:
        parts = member.split(",")
        if len(parts) != len(wanted):
            continue
        ok = True
        for (dim, value), part in zip(wanted, parts, strict=True):
            if dim == "net":
                ok = bool(in_network(value, part if "/" in part else f"{part}/32"))
            else:
                ok = value == part
            if not ok:
                break
        if ok:
            return True
    return False


class IpvsWalker(IptablesWalker):
    """The iptables walker, with `-m set` answered from the kernel's ipsets."""

    def __init__(
        self,
        tables: dict[str, Table],
        local: list[str] | None,
        source: KernelSource,
        sets: dict[str, tuple[str, set[str]]] | None,
    ) -> None:
        super().__init__(tables, local, source)
        self.sets = sets

    def _module(
        self, m: MatchModule, br: Branch, pkt: Packet, dst: str, dport: int
    ) -> tuple[bool | None, list[str]]:
        if m.name != "set":
            return super()._module(m, br, pkt, dst, dport)
        opt = m.get("--match-set")
        if opt is None or len(opt.values) < 2 or self.sets is None:
            return None, ["cannot read the ipsets; assuming -m set may match"]
        name, flags = opt.values[0], opt.values[1]
        if name not in self.sets:
            return bool(opt.negated), [f"ipset {name} does not exist"]
        kind, members = self.sets[name]
        hit = _set_member(kind, members, flags, pkt, dst, dport)
        return (not hit if opt.negated else hit), []


class IpvsView:
    mode = "ipvs"
    dataplane = "ipvs"
    counts_connections = True  # ActiveConn/InActConn come from IPVS itself
    has_counters = True
    counter_note = COUNTER_NOTE

    def __init__(
        self,
        services: list[IpvsService],
        source: KernelSource,
        flavour: str | None,
        save_text: str | None,
        sets: dict[str, tuple[str, set[str]]] | None,
    ) -> None:
        self.ipvs = services
        self.source = source
        self.flavour = flavour
        # The same backend's iptables-mode reader sees these chains as "not iptables mode".
        self.covers = (f"iptables-{flavour}",) if flavour else ()
        self.tables: dict[str, Table] = parse_save(save_text or "")
        self.sets = sets
        self.notes: list[str] = []
        self._local = source.local_addresses()
        bound = _dummy_addresses(source)
        self.bound = bound
        reachable = [
            s for s in services if s.key.address in bound or s.key.address in (self._local or ())
        ]
        self.live = bool(reachable)
        self.detail = (
            f"{len(services)} virtual servers, {len(bound)} addresses on {n.DUMMY_DEVICE}"
            if self.live
            else f"{len(services)} virtual servers on no local address"
        )
        if flavour is None:
            self.notes.append("no ipvs-mode iptables chains found: nothing masquerades")
        if sets is None:
            self.notes.append("ipsets unreadable: kinds and set matches unknown")

    def local_addresses(self) -> list[str] | None:
        return self._local

    def _kind(self, key: VSKey) -> str:
        member = f"{key.address},{key.protocol.lower()}:{key.port}"
        for set_name, kind in KIND_SETS:
            if self.sets and member in self.sets.get(set_name, ("", set()))[1]:
                return kind
        np_set = n.NODE_PORT_SETS.get(key.protocol.upper(), "")
        if self.sets and str(key.port) in self.sets.get(np_set, ("", set()))[1]:
            return NODE_PORT
        return CLUSTER_IP if key.address in self.bound else NODE_PORT

    def _server(self, svc: IpvsService) -> IpvsVirtualServer:
        persistent = svc.timeout if svc.flags & n.FLAG_PERSISTENT else None
        stats = svc.stats
        vs = IpvsVirtualServer(
            svc.key.protocol.lower(),
            svc.key.address,
            svc.key.port,
            kind=self._kind(svc.key),
            scheduler=svc.scheduler,
            persistent=persistent,
            packets=stats.get("inpkts", 0) + stats.get("outpkts", 0) if stats else None,
            bytes=stats.get("inbytes", 0) + stats.get("outbytes", 0) if stats else None,
        )
        vs.ipvs_stats = dict(stats)
        flags = _flags_text(svc)
        if flags:
            vs.notes.append("scheduler flags: " + ", ".join(flags))
        total = sum(d.weight for d in svc.dests)
        for d in svc.dests:
            rs = IpvsRealServer(
                d.ip,
                d.port,
                forward=d.forward,
                weight=d.weight,
                share=(d.weight / total) if total else 0.0,
                active=d.active,
                inactive=d.inactive,
                packets=d.stats.get("inpkts", 0) + d.stats.get("outpkts", 0) if d.stats else None,
                bytes=d.stats.get("inbytes", 0) + d.stats.get("outbytes", 0) if d.stats else None,
            )
            rs.ipvs_stats = dict(d.stats)
            vs.endpoints.append(rs)
        if svc.dests and not total:
            vs.notes.append("every real server has weight 0 (draining): new connections fail")
        return vs

    def services(self) -> list[VirtualServer]:
        return [self._server(s) for s in self.ipvs]

    def service_count(self) -> int:
        """Service ports in the kernel: kproxy and upstream give every one with a ClusterIP
        one ClusterIP virtual server (IPVS keeps no names to count by)."""
        return sum(1 for s in self.ipvs if self._kind(s.key) == CLUSTER_IP)

    def _lookup(self, proto: str, dst: str, dport: int) -> IpvsService | None:
        for s in self.ipvs:
            if s.key.protocol.lower() == proto and s.key.address == dst and s.key.port == dport:
                return s
        return None

    # -- trace -----------------------------------------------------------------------------------

    def trace(self, packet: Packet) -> Walk:
        walker = IpvsWalker(self.tables, self._local, self.source, self.sets)
        walker.notes = []
        outcomes: list[Outcome] = []
        nat_chain = "OUTPUT" if packet.from_node else "PREROUTING"
        for br, verdict, step in walker._run("nat", nat_chain, Branch(prob=1.0), packet):
            if verdict in (DROP, REJECT):
                outcomes.append(walker._final(br, verdict, step, packet))
                continue
            if br.dnat is not None:  # iptables DNAT first (iptables mode mid-switch)
                outcomes.append(walker._final(br, ACCEPT, step, packet))
                continue
            svc = self._lookup(packet.proto, packet.dst, packet.dport)
            local = packet.dst in self.bound or packet.dst in (self._local or ())
            if svc is None or not local:
                why = (
                    f"no IPVS virtual server {packet.proto.upper()} {packet.dst}:{packet.dport}"
                    if svc is None
                    else f"{packet.dst} is not a local address: IPVS never sees the packet"
                )
                outcomes.append(
                    Outcome(
                        br.prob, tuple(br.conditions), br.steps, ACCEPT, reason=why, notes=br.notes
                    )
                )
                continue
            fchain = "OUTPUT" if packet.from_node else "INPUT"
            for br2, v2, step2 in walker._run("filter", fchain, br, packet):
                if v2 in (DROP, REJECT):
                    outcomes.append(walker._final(br2, v2, step2, packet))
                    continue
                outcomes += self._through_ipvs(walker, svc, br2, packet)
        notes = [x for x in walker.notes if not x.startswith("the mangle table has rules")]
        return Walk(outcomes, notes + self.notes)

    def _through_ipvs(
        self, walker: IpvsWalker, svc: IpvsService, br: Branch, pkt: Packet
    ) -> list[Outcome]:
        vs = self._server(svc)
        picks = [d for d in svc.dests if d.weight > 0]
        total = sum(d.weight for d in picks)
        sched = svc.scheduler
        flags = ", ".join(_flags_text(svc))
        persist = f", persistent {svc.timeout} s" if svc.flags & n.FLAG_PERSISTENT else ""
        head = Step(
            "ipvs",
            "LOCAL_IN",
            None,
            "",
            f"virtual server {svc.key.protocol} {vs.addr} ({vs.kind}), scheduler {sched}"
            + (f" [{flags}]" if flags else "")
            + persist
            + f": picks one of {len(picks)} real server{'s' * (len(picks) != 1)}",
        )
        if not picks:
            why = "no real servers" if not svc.dests else "every real server has weight 0"
            return [
                Outcome(
                    br.prob,
                    tuple(br.conditions),
                    [*br.steps, head],
                    REJECT,
                    reason=f"IPVS {vs.addr} has {why}: new connections get no answer",
                    notes=br.notes,
                )
            ]
        note = ""
        if sched in ("sh", "dh", "mh"):
            hashed = "destination" if sched == "dh" else "source"
            note = f"{sched} hashes the {hashed}: always the same one of these for {pkt.src}"
        elif sched not in ("rr", "wrr"):
            note = f"{sched} picks by current connection counts; shares are the weights'"
        out: list[Outcome] = []
        for d in picks:
            b = br.fork()
            b.scale(d.weight / total)
            b.dnat = (d.ip, d.port)
            b.steps.append(head)
            b.steps.append(
                Step(
                    "ipvs", vs.addr, None, "", f"{d.forward} to {d.ip}:{d.port} (weight {d.weight})"
                )
            )
            if note:
                b.notes.append(note)
            if svc.flags & n.FLAG_PERSISTENT:
                b.notes.append(
                    f"a client with an IPVS persistence template (last {svc.timeout} s) "
                    "goes to its remembered real server"
                )
            for b2, v2, step2 in walker._run("nat", "POSTROUTING", b, pkt):
                out.append(walker._final(b2, v2 if v2 in (DROP, REJECT) else ACCEPT, step2, pkt))
        return out


def _dummy_addresses(source: KernelSource) -> set[str]:
    text = source.device_addr(n.DUMMY_DEVICE)
    if text is None:
        return set()
    from kproxy.ops.inspect.kernel import parse_ip_addr

    return set(parse_ip_addr(text))


def _ipvs_flavour(source: KernelSource) -> tuple[str | None, str | None]:
    """The iptables backend holding ipvs mode's chains, and its save."""
    for flavour in ("legacy", "nft"):
        text = source.iptables_save(flavour)
        if text and (":KUBE-IPVS-FILTER" in text or "--match-set KUBE-CLUSTER-IP" in text):
            return flavour, text
    return None, None


def _virtual_servers(
    source: KernelSource, *, real_servers: bool = True
) -> list[IpvsService] | None:
    """IPVS's virtual servers: over netlink (with counters) live, `ipvsadm -S -n` recorded."""
    given = getattr(source, "ipvs_services", None)
    if callable(given):
        services: list[IpvsService] | None = given()
        return services
    if source.recorded:
        text = source.ipvsadm_save()
        return parse_ipvsadm_save(text) if text is not None else None
    return read_ipvs(source.netns, real_servers=real_servers)


def destinations(source: KernelSource) -> dict[Destination, str]:
    """Every virtual server, unnamed: IPVS keeps no names, and without the ipsets no kind."""
    return {
        Destination(s.key.address, s.key.protocol.lower(), s.key.port): ""
        for s in _virtual_servers(source, real_servers=False) or ()
    }


def load(source: KernelSource) -> IpvsView | None:
    """The ipvs view of the node, or None when IPVS holds nothing and kube-ipvs0 is absent."""
    services = _virtual_servers(source)
    if services is None:
        return None
    if not services and not _dummy_addresses(source):
        return None
    flavour, text = _ipvs_flavour(source)
    raw = source.ipset_save()
    sets = parse_ipset_save(raw) if raw is not None else None
    return IpvsView(services, source, flavour, text, sets)


__all__ = [
    "IpvsView",
    "destinations",
    "load",
    "parse_ipset_save",
    "parse_ipvsadm_save",
    "parse_stats",
    "read_ipvs",
]
