"""userspace mode: the redirect rules read back from iptables-save, and the workers behind them.

The kernel half is upstream's old userspace chains (dataplane/userspace/render.py): nat
KUBE-PORTALS-CONTAINER / -HOST and KUBE-NODEPORT-CONTAINER / -HOST DNAT (or REDIRECT) each
ClusterIP, externalIP, LoadBalancer IP and NodePort to a local proxy port; filter rules
refuse what has no endpoints. The other half is the running workers, found in /proc (any
state dir): the listener table they applied, the sockets they really listen on (from
/proc/PID/net and their file descriptors) and, on request, a report of their open
connections per endpoint and their ClientIP affinity entries (control.py REPORT_SIGNAL).
Nothing comes from a snapshot, so a lost rule, a dead worker or an unbound port shows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kproxy.dataplane.userspace.balancer import Balancer
from kproxy.dataplane.userspace.control import WORKER_MODULE, WorkerSet, proc_cmdline
from kproxy.dataplane.userspace.render import (
    NODEPORT_CONTAINER,
    NODEPORT_HOST,
    PORTALS_CONTAINER,
    PORTALS_HOST,
    Listener,
)
from kproxy.host.netns import NETNS_DIR
from kproxy.ops.inspect.iptables_rules import (
    Rule,
    Table,
    kind_of_comment,
    parse_chains,
    parse_save,
    service_of_comment,
)
from kproxy.ops.inspect.iptables_trace import IptablesWalker
from kproxy.ops.inspect.kernel import KernelSource, RecordedSource
from kproxy.ops.inspect.model import (
    ANY_ADDRESS,
    CLUSTER_IP,
    DNAT,
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
    split_hostport,
    strip_host_prefix,
)

NAT_CHAINS = (PORTALS_CONTAINER, PORTALS_HOST, NODEPORT_CONTAINER, NODEPORT_HOST)
FILTER_CHAINS = (PORTALS_CONTAINER, PORTALS_HOST)
REPORT_TIMEOUT = 2.0  # a busy node may take a while to schedule every worker
COUNTER_NOTE = (
    "Pkts/Bytes: nat rule counters of the redirect rules (iptables-save -c); nat sees only "
    "the first packet of a connection, so Pkts counts new connections. The workers keep no "
    "per-endpoint counters (n/a)."
)


# --- the workers -------------------------------------------------------------------------------


@dataclass
class WorkerState:
    """What the running workers of one state dir applied, listen on and report."""

    state_dir: Path | None
    table: dict[str, Any] | None = None  # the listener table the controller published
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)  # live workers by index
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)  # fresh reports by index
    # (protocol, port) -> indices of the workers with a socket bound there (from the kernel)
    listening: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def generation(self) -> int | None:
        return None if self.table is None else int(self.table.get("generation", 0))

    def listeners(self) -> dict[tuple[str, int], Listener]:
        out: dict[tuple[str, int], Listener] = {}
        for item in (self.table or {}).get("listeners", ()):
            try:
                lst = Listener.from_json(item)
            except (KeyError, TypeError, ValueError):
                continue
            out[(lst.protocol, lst.port)] = lst
        return out

    def balancer(self) -> Balancer:
        """A balancer configured as the workers are (which endpoints a client may use, and
        whether its address is kept)."""
        table = self.table or {}
        b = Balancer(seed=0)
        b.configure(
            list(self.listeners().values()),
            local_cidrs=table.get("local_cidrs"),
            masquerade_all=bool(table.get("masquerade_all")),
            node_addresses=table.get("node_addresses", ()),
        )
        return b

    def pids(self, indices: set[int] | None = None) -> list[int]:
        return sorted(
            int(st["pid"]) for i, st in self.statuses.items() if indices is None or i in indices
        )

    def conns(self, key: str) -> dict[str, list[int]]:
        """Open connections of one listener over every reporting worker: endpoint ->
        [active, inactive]."""
        out: dict[str, list[int]] = {}
        for report in self.reports.values():
            for ep, (active, inactive) in dict(report.get("conns", {})).get(key, {}).items():
                slot = out.setdefault(ep, [0, 0])
                slot[0] += int(active)
                slot[1] += int(inactive)
        return out

    def affinity(self, service: str, client: str) -> tuple[str, int, float] | None:
        """The endpoint a client is remembered on for a service, and how long ago it was
        used (the youngest entry when several workers know the client)."""
        best: tuple[str, int, float] | None = None
        for report in self.reports.values():
            entry = dict(report.get("affinity", {})).get(service, {}).get(client)
            if entry is None:
                continue
            ip, port, age = str(entry[0]), int(entry[1]), float(entry[2])
            if best is None or age < best[2]:
                best = (ip, port, age)
        return best

    def summary(self) -> str:
        gen = self.generation
        behind = [
            i
            for i, st in self.statuses.items()
            if gen is not None and int(st.get("generation", -1)) < gen
        ]
        text = (
            f"{len(self.statuses)} userspace worker{'s' if len(self.statuses) != 1 else ''}"
            f" (pids {', '.join(map(str, self.pids())) or 'none'}) of {self.state_dir}"
        )
        if gen is not None:
            text += f", listener table generation {gen}"
        if behind:
            text += f"; workers {sorted(behind)} have not applied it yet"
        return text


def _netns_inode(netns: str | None) -> int | None:
    try:
        if netns is None:
            return os.stat("/proc/self/ns/net").st_ino
        return (NETNS_DIR / netns).stat().st_ino
    except OSError:
        return None


def find_worker_dirs(netns: str | None = None) -> list[Path]:
    """State dirs of the userspace workers running in a network namespace (from /proc)."""
    want = _netns_inode(netns)
    found: list[Path] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = proc_cmdline(int(entry.name))
        if WORKER_MODULE not in argv or "--state-dir" not in argv:
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino != want:
                continue
            state_dir = Path(argv[argv.index("--state-dir") + 1])
        except (OSError, IndexError):
            continue
        if state_dir not in found:
            found.append(state_dir)
    return found


def parse_proc_net(text: str, proto: str) -> dict[int, tuple[int, str]]:
    """/proc/PID/net/tcp or udp -> {socket inode: (local port, state)}; state "LISTEN" for a
    listening TCP socket, "UNCONN" for an unconnected UDP one, the hex code otherwise."""
    out: dict[int, tuple[int, str]] = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        try:
            port = int(parts[1].rsplit(":", 1)[1], 16)
            inode = int(parts[9])
        except (IndexError, ValueError):
            continue
        state = parts[3]
        if proto == "tcp" and state == "0A":
            state = "LISTEN"
        elif proto == "udp" and state == "07" and parts[2].endswith(":0000"):
            state = "UNCONN"
        out[inode] = (port, state)
    return out


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def bound_ports(pids: dict[int, int]) -> dict[tuple[str, int], set[int]]:
    """(protocol, port) -> worker indices with a listening socket there, from the kernel.
    `pids` maps worker index -> pid."""
    out: dict[tuple[str, int], set[int]] = {}
    if not pids:
        return out
    any_pid = next(iter(pids.values()))
    sockets: dict[str, dict[int, tuple[int, str]]] = {}
    for proto in ("tcp", "udp"):
        try:
            sockets[proto] = parse_proc_net(Path(f"/proc/{any_pid}/net/{proto}").read_text(), proto)
        except OSError:
            sockets[proto] = {}
    for index, pid in pids.items():
        for inode in _socket_inodes(pid):
            for proto, table in sockets.items():
                hit = table.get(inode)
                if hit is not None and hit[1] in ("LISTEN", "UNCONN"):
                    out.setdefault((proto, hit[0]), set()).add(index)
    return out


def read_worker_state(
    netns: str | None = None, *, state_dir: Path | None = None, report: bool = True
) -> WorkerState | None:
    """The running workers of a namespace (or of `state_dir`); None when there are none.

    report: ask them for a fresh report (open connections, affinity entries); a worker that
    does not answer within REPORT_TIMEOUT is named in the notes."""
    dirs = [state_dir] if state_dir is not None else find_worker_dirs(netns)
    if not dirs:
        return None
    notes: list[str] = []
    if len(dirs) > 1:
        notes.append(
            "workers of several state dirs run here: "
            + ", ".join(map(str, dirs))
            + f"; reading {dirs[0]}"
        )
    workers = WorkerSet(dirs[0], count=0)
    live = workers.workers()
    state = WorkerState(
        dirs[0],
        table=workers.read_table(),
        statuses={i: w.status for i, w in live.items()},
        notes=notes,
    )
    if report and live:
        state.reports, missing = workers.request_reports(REPORT_TIMEOUT)
        if missing:
            state.notes.append(
                f"workers {missing} gave no connection report: ActiveConn/InActConn and "
                "affinity entries count only the others"
            )
    state.listening = bound_ports({i: w.pid for i, w in live.items()})
    return state


class RecordedUserspaceSource(RecordedSource):
    """A RecordedSource with the workers' side given too (for tests and offline dumps)."""

    def __init__(self, *, workers: WorkerState | None = None, **dumps: Any) -> None:
        super().__init__(**dumps)
        self._workers = workers

    def userspace_state(self) -> WorkerState | None:
        return self._workers


def _load_state(source: KernelSource) -> WorkerState | None:
    given = getattr(source, "userspace_state", None)
    if callable(given):
        state = given()
        return state if isinstance(state, WorkerState) else None
    if source.recorded:
        return None
    return read_worker_state(source.netns)


# --- the view ----------------------------------------------------------------------------------


@dataclass
class _Portal:
    """Every redirect rule of one destination (container and host chains)."""

    proto: str
    address: str
    port: int
    kind: str
    service: str
    rules: list[tuple[Rule, str | None, int]] = field(default_factory=list)  # (rule, host, port)


def redirect_target(rule: Rule) -> tuple[str | None, int] | None:
    """(host, proxy port) a redirect rule sends to; host None for REDIRECT (the address of
    the incoming interface)."""
    if rule.target == "DNAT":
        host, port = split_hostport(rule.target_opt("--to-destination") or "")
        return (host, port) if port is not None else None
    if rule.target == "REDIRECT":
        text = (rule.target_opt("--to-ports") or "").split("-", 1)[0]
        return (None, int(text)) if text.isdigit() else None
    return None


def portals(nat: Table) -> dict[tuple[str, str, int], _Portal]:
    """Every destination the nat redirect rules send to a proxy port, by (proto, addr, port)."""
    found: dict[tuple[str, str, int], _Portal] = {}
    for chain in NAT_CHAINS:
        for r in nat.rules(chain):
            target = redirect_target(r)
            if target is None or not (r.proto and r.dport):
                continue
            dst = r.address("-d")
            if chain in (NODEPORT_CONTAINER, NODEPORT_HOST):
                addrs, kind = [strip_host_prefix(dst) if dst else ANY_ADDRESS], NODE_PORT
            elif dst:
                addrs, kind = [strip_host_prefix(dst)], kind_of_comment(r.comment) or CLUSTER_IP
            else:
                continue
            for addr in addrs:
                key = (r.proto, addr, r.dport)
                portal = found.get(key)
                if portal is None:
                    portal = found[key] = _Portal(
                        r.proto, addr, r.dport, kind, service_of_comment(r.comment) or ""
                    )
                portal.rules.append((r, target[0], target[1]))
    return found


def destinations(flavour: str, source: KernelSource) -> dict[Destination, str]:
    """One backend's userspace-mode service destinations (all but NodePorts) -> their
    service port."""
    text = source.iptables_nat(flavour)
    if text is None:
        return {}
    nat = parse_chains(text, "nat", NAT_CHAINS)
    return {
        Destination(p.address, p.proto, p.port): p.service
        for p in portals(nat).values()
        if p.kind != NODE_PORT
    }


class UserspaceView:
    """userspace mode as one iptables backend and the running workers show it."""

    mode = "userspace"
    # ActiveConn/InActConn come from the workers: conntrack only sees the redirect legs.
    counts_connections = True

    def __init__(
        self,
        flavour: str,
        save_text: str,
        source: KernelSource,
        state: WorkerState | None | bool = False,
    ) -> None:
        self.flavour = flavour
        self.dataplane = f"userspace-{flavour}"
        # The same backend's iptables-mode reader sees these chains as "not iptables mode".
        self.covers = (f"iptables-{flavour}",)
        self.source = source
        self.tables: dict[str, Table] = parse_save(save_text)
        self.notes: list[str] = []
        self.has_counters = any(t.has_counters() for t in self.tables.values())
        self.counter_note = COUNTER_NOTE
        self.live, self.present, self.detail = self._detect()
        self._local = source.local_addresses()
        self._state: WorkerState | None | bool = state  # False: not read yet

    def _table(self, name: str) -> Table:
        return self.tables.get(name) or Table(name)

    def _detect(self) -> tuple[bool, bool, str]:
        nat = self._table("nat")
        if not any(nat.has_chain(c) for c in NAT_CHAINS):
            return False, False, "no userspace chains"
        hooks = [
            f"{builtin} -> {chain}"
            for builtin, chain in (("PREROUTING", PORTALS_CONTAINER), ("OUTPUT", PORTALS_HOST))
            if any(r.target == chain for r in nat.rules(builtin))
        ]
        if not hooks:
            return False, True, "userspace chains exist but nothing jumps to them (not hooked)"
        return True, True, "nat " + " and ".join(hooks)

    @property
    def state(self) -> WorkerState | None:
        if self._state is False:
            self._state = _load_state(self.source)
            if self._state is None:
                self.notes.append(
                    "no userspace worker runs here: nothing accepts on the proxy ports"
                )
            else:
                self.notes.append(self._state.summary())
                self.notes += self._state.notes
        return self._state if isinstance(self._state, WorkerState) else None

    def local_addresses(self) -> list[str] | None:
        return self._local

    # -- services ------------------------------------------------------------------------------

    def services(self) -> list[VirtualServer]:
        state = self.state
        listeners = state.listeners() if state is not None else {}
        by_key: dict[str, int] = {}
        out: dict[tuple[str, str, int], VirtualServer] = {}
        for key, portal in portals(self._table("nat")).items():
            vs = self._server(portal, state, listeners)
            out[key] = vs
            if vs.chain:
                by_key[vs.chain] = by_key.get(vs.chain, 0) + 1
        for vs in out.values():
            if by_key.get(vs.chain, 0) > 1 and vs.endpoints:
                vs.notes.append(
                    f"connection counts are the listener's ({vs.chain}), shared by its "
                    f"{by_key[vs.chain]} addresses"
                )
        self._refusals(out)
        return list(out.values())

    def _server(
        self,
        portal: _Portal,
        state: WorkerState | None,
        listeners: dict[tuple[str, int], Listener],
    ) -> VirtualServer:
        rules = [r for r, _h, _p in portal.rules]
        counted = [r for r in rules if r.packets is not None]
        vs = VirtualServer(
            portal.proto,
            portal.address,
            portal.port,
            service=portal.service,
            kind=portal.kind,
            scheduler="rr",
            packets=sum(r.packets or 0 for r in counted) if counted else None,
            bytes=sum(r.bytes or 0 for r in counted) if counted else None,
        )
        ports = sorted({p for _r, _h, p in portal.rules})
        if len(ports) > 1:
            vs.notes.append(
                f"its rules redirect to different proxy ports ({', '.join(map(str, ports))}): "
                "a sync was interrupted?"
            )
        container_sources = [
            r.address("-s") for r in rules if r.chain == PORTALS_CONTAINER and r.address("-s")
        ]
        if portal.kind == LOAD_BALANCER and container_sources:
            vs.source_ranges = tuple(s or "" for s in container_sources)
        elif container_sources or any(
            r.chain == NODEPORT_CONTAINER and r.address("-s") for r in rules
        ):
            srcs = sorted({r.address("-s") or "" for r in rules if r.address("-s")})
            vs.notes.append(
                f"from outside the node only sources in {', '.join(srcs)} are redirected"
            )
        proxy_port = ports[0]
        lst = listeners.get((portal.proto, proxy_port))
        if state is None:
            vs.notes.append(f"redirected to proxy port {proxy_port}, but no worker runs")
            return vs
        if lst is None:
            vs.notes.append(
                f"redirected to {portal.proto} port {proxy_port}, which is in no listener of "
                "the workers' table: connections there are refused"
            )
            return vs
        vs.chain = lst.key
        vs.persistent = lst.affinity
        vs.local_only = lst.source == "local"
        if not state.listening.get((lst.protocol, lst.port)):
            vs.notes.append(
                f"no worker listens on {lst.protocol} port {lst.port} (kernel sockets): "
                "connections are refused"
            )
        for index, st in sorted(state.statuses.items()):
            err = dict(st.get("errors", {})).get(lst.key)
            if err:
                vs.notes.append(f"worker {index}: {err}")
        # As listed for a client from outside (iptables mode's view too): a Local-policy
        # listener's own targets; the node and its pods use the cluster-wide fallback.
        eps = list(lst.targets)
        if vs.local_only and lst.fallback and set(lst.fallback) != set(lst.targets):
            vs.notes.append(
                "the node and its pods are proxied to every endpoint: "
                + ", ".join(f"{ip}:{p}" for ip, p in lst.fallback)
            )
        conns = state.conns(lst.key)
        local = set(self._local or ())
        for ip, port in eps:
            active, inactive = conns.pop(f"{ip}:{port}", [0, 0])
            vs.endpoints.append(
                RealServer(
                    ip,
                    port,
                    chain=lst.key,
                    forward="Local" if ip in local else "Proxy",
                    share=1.0 / len(eps),
                    active=active,
                    inactive=inactive,
                )
            )
        others = sum(a + i for a, i in conns.values())
        if others:
            vs.notes.append(
                f"{others} open connection{'s' if others != 1 else ''} to endpoints not listed "
                f"here ({', '.join(sorted(conns))}): draining, or the node's and pods' fallback"
            )
        if not eps and not vs.local_only:
            vs.notes.append("the listener has no endpoints: the worker resets every connection")
        return vs

    def _refusals(self, out: dict[tuple[str, str, int], VirtualServer]) -> None:
        """filter rules: REJECT without endpoints, DROP without local endpoints (or outside
        loadBalancerSourceRanges) — for whatever is not redirected."""
        filt = self._table("filter")
        seen: set[tuple[str, str, int, str]] = set()
        for chain in FILTER_CHAINS:
            for r in filt.rules(chain):
                comment = r.comment or ""
                if r.target not in ("REJECT", "DROP") or not (r.proto and r.dport):
                    continue
                dst = r.address("-d")
                addr = strip_host_prefix(dst) if dst else ANY_ADDRESS
                mark = (r.proto, addr, r.dport, comment)
                if mark in seen:  # the container and host chains carry the same refusal
                    continue
                seen.add(mark)
                key = (r.proto, addr, r.dport)
                vs = out.get(key)
                where = f"filter {chain} rule {r.number}: {comment}"
                if vs is not None and not vs.endpoints and comment.endswith("endpoints"):
                    # Local policy without local endpoints: what comes from outside is dropped.
                    vs.verdict, vs.verdict_reason = r.target, where
                    continue
                if vs is not None:
                    who = (
                        "sources outside loadBalancerSourceRanges"
                        if "loadBalancerSourceRanges" in comment
                        else "connections that are not redirected"
                    )
                    vs.notes.append(f"{who} are {r.target}ped ({where})")
                    continue
                if not comment.endswith(("has no endpoints", "has no local endpoints")):
                    continue
                kind = CLUSTER_IP if dst else NODE_PORT
                vs = out[key] = VirtualServer(
                    r.proto,
                    addr,
                    r.dport,
                    service=service_of_comment(comment) or "",
                    kind=kind,
                    scheduler="none",
                    packets=r.packets,
                    bytes=r.bytes,
                )
                vs.verdict = r.target
                vs.verdict_reason = where
                vs.local_only = comment.endswith("has no local endpoints")

    # -- trace ---------------------------------------------------------------------------------

    def trace(self, packet: Packet) -> Walk:
        walk = IptablesWalker(self.tables, self._local, self.source).trace(packet)
        notes = [n for n in walk.notes if not n.startswith("the mangle table has rules")]
        state = self.state
        outcomes: list[Outcome] = []
        for o in walk.outcomes:
            outcomes += self._through_worker(o, packet, state)
        notes += self.notes  # the workers: who they are, and who did not report
        if any(s.table == "userspace" for o in outcomes for s in o.steps):
            notes.append(
                'userspace mode: the kernel DNATs to a worker\'s proxy port; "DNAT to" in the '
                "verdict is the worker's own connection to the endpoint"
            )
        return Walk(outcomes, notes)

    def _through_worker(self, o: Outcome, pkt: Packet, state: WorkerState | None) -> list[Outcome]:
        if o.verdict != DNAT or not o.dnat:
            return [o]
        host, port = split_hostport(o.dnat)
        local = host.startswith("127.") or (self._local is not None and host in self._local)
        if not local or port is None:
            return [o]
        steps = list(o.steps)
        if state is None:
            return [
                self._refused(o, steps, f"nothing listens on {o.dnat}: no userspace worker runs")
            ]
        lst = state.listeners().get((pkt.proto, port))
        if lst is None:
            return [
                self._refused(
                    o, steps, f"{pkt.proto} port {port} is in no listener of the workers' table"
                )
            ]
        holders = state.listening.get((lst.protocol, lst.port), set())
        if not holders:
            return [
                self._refused(
                    o, steps, f"no worker listens on {lst.protocol} port {lst.port}: refused"
                )
            ]
        steps.append(
            Step(
                "userspace",
                f"listener {lst.protocol}/{lst.port}",
                None,
                "",
                f"accepted by a worker (pids {', '.join(map(str, state.pids(holders)))}) for "
                f"{lst.service} ({lst.scope})",
            )
        )
        balancer = state.balancer()
        _which, eps = balancer.candidates_for(lst, pkt.src)
        if not eps:
            return [
                self._refused(
                    o, steps, "the listener has no endpoints for this client: the worker resets it"
                )
            ]
        chosen = list(eps)
        # The listener step says where it was delivered, and to whom.
        notes = [n for n in o.notes if not n.endswith("delivered to the node itself")]
        why = "round robin"
        if lst.affinity is not None:
            sticky = state.affinity(lst.service, pkt.src) if state.reports else None
            if not state.reports:
                notes.append(
                    "the workers' affinity entries are unknown (no report): a client with a "
                    f"connection in the last {lst.affinity} s stays on its endpoint"
                )
            elif sticky is not None and sticky[2] < lst.affinity and sticky[:2] in eps:
                chosen = [sticky[:2]]
                why = (
                    f"ClientIP affinity: {pkt.src} used {sticky[0]}:{sticky[1]} "
                    f"{sticky[2]:.0f} s ago (< {lst.affinity} s)"
                )
            else:
                why = f"round robin (no affinity entry for {pkt.src} younger than {lst.affinity} s)"
        if why.startswith("round robin"):
            n = len(chosen)
            why = why.replace("round robin", f"round robin over {n} backend{'s' * (n != 1)}", 1)
        steps.append(Step("userspace", "balancer", None, "", why))
        out = []
        for ip, ep_port in chosen:
            keep = balancer.keep_source(lst, pkt.src, ip)
            step = Step(
                "userspace",
                "connect",
                None,
                "",
                f"connects to {ip}:{ep_port} "
                + ("with the client's address (transparent)" if keep else "from the node"),
            )
            out.append(
                Outcome(
                    None if o.probability is None else o.probability / len(chosen),
                    o.conditions,
                    [*steps, step],
                    DNAT,
                    dnat=f"{ip}:{ep_port}",
                    service=lst.service,
                    masquerade=not keep,
                    notes=list(notes),
                )
            )
        return out

    @staticmethod
    def _refused(o: Outcome, steps: list[Step], why: str) -> Outcome:
        return Outcome(
            o.probability,
            o.conditions,
            steps,
            REJECT,
            service=o.service,
            reason=f"redirected to {o.dnat}, but {why}",
            notes=list(o.notes),
        )


def load(flavour: str, source: KernelSource) -> UserspaceView | None:
    """The userspace view of one backend, or None when it holds no userspace chains."""
    text = source.iptables_save(flavour)
    if text is None:
        return None
    view = UserspaceView(flavour, text, source)
    return view if view.present else None


__all__ = [
    "COUNTER_NOTE",
    "RecordedUserspaceSource",
    "UserspaceView",
    "WorkerState",
    "bound_ports",
    "destinations",
    "find_worker_dirs",
    "load",
    "parse_proc_net",
    "read_worker_state",
]
