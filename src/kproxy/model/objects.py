"""The immutable per-node view of Services and endpoints that every proxy mode consumes.

These types are the contract between the object parser (model.parse / model.snapshot) and
the dataplanes, inspectors and doctor. They are frozen so that a snapshot can be shared
between threads and compared cheaply: a service port whose value did not change between two
snapshots needs no new rules (that is how partial syncs find their work).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum


class Protocol(StrEnum):
    TCP = "TCP"
    UDP = "UDP"
    SCTP = "SCTP"

    @property
    def lower(self) -> str:
        return _LOWER[self]


_LOWER = {p: p.value.lower() for p in Protocol}


@dataclass(frozen=True, slots=True, order=True)
class ServicePortName:
    """Upstream's ServicePortName: "ns/name" plus ":port" when the port is named."""

    namespace: str
    name: str
    port: str = ""
    protocol: Protocol = Protocol.TCP

    def __str__(self) -> str:
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.port}" if self.port else base

    @property
    def service(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    """One backend address of a service port, with the conditions upstream uses."""

    ip: str
    port: int
    node_name: str = ""
    zone: str = ""
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    is_local: bool = False
    zone_hints: frozenset[str] = field(default_factory=frozenset)
    node_hints: frozenset[str] = field(default_factory=frozenset)
    # ip:port the way Go's net.JoinHostPort writes it (brackets for IPv6); derived, stored
    # because every renderer needs it for every endpoint.
    addr: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        ip = self.ip
        object.__setattr__(
            self, "addr", f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}"
        )


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One port of one Service as seen from this node, with its endpoints categorised.

    `endpoints` holds every usable endpoint (de-duplicated, sorted by "ip:port" like upstream);
    `cluster_endpoints` and `local_endpoints` are what traffic with Cluster resp. Local policy
    may use, after upstream's ready -> serving-terminating fallback and topology filtering.
    """

    name: ServicePortName
    cluster_ip: str
    port: int
    protocol: Protocol
    target_port: int | str = 0
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()
    load_balancer_source_ranges: tuple[str, ...] = ()
    health_check_node_port: int = 0
    # None: no session affinity; otherwise ClientIP affinity with this timeout (seconds).
    affinity_timeout: int | None = None
    external_policy_local: bool = False
    internal_policy_local: bool = False
    annotations: tuple[tuple[str, str], ...] = ()
    endpoints: tuple[Endpoint, ...] = ()
    cluster_endpoints: tuple[Endpoint, ...] = ()
    local_endpoints: tuple[Endpoint, ...] = ()
    # Every endpoint some rule may DNAT to (cluster + local, merged and sorted).
    reachable_endpoints: tuple[Endpoint, ...] = ()
    # Upstream's hasAnyEndpoints: some ready or serving-terminating endpoint exists anywhere.
    any_endpoints: bool = False

    @property
    def is_external(self) -> bool:
        """True when the port has any externally reachable destination."""
        return bool(self.node_port or self.external_ips or self.load_balancer_ips)

    @property
    def uses_cluster_endpoints(self) -> bool:
        # Pod-to-external-destination traffic always uses Cluster policy (upstream rule).
        return self.is_external or not self.internal_policy_local

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_policy_local or (self.is_external and self.external_policy_local)

    @property
    def has_internal_endpoints(self) -> bool:
        """Traffic to the ClusterIP has somewhere to go (else REJECT or, for Local, DROP)."""
        if self.internal_policy_local:
            return bool(self.local_endpoints)
        return self.any_endpoints

    @property
    def has_external_endpoints(self) -> bool:
        if self.external_policy_local:
            return bool(self.local_endpoints)
        return self.any_endpoints

    @property
    def internal_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local_endpoints if self.internal_policy_local else self.cluster_endpoints

    @property
    def external_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local_endpoints if self.external_policy_local else self.cluster_endpoints

    def annotation(self, key: str, default: str = "") -> str:
        for k, v in self.annotations:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class Rejection:
    """An object (or part of one) that was skipped as invalid."""

    kind: str
    namespace: str
    name: str
    field: str
    reason: str

    def __str__(self) -> str:
        who = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind} {who}: {self.field}: {self.reason}"

    def to_dict(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
            "field": self.field,
            "error": self.reason,
        }


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the proxy needs to know about its own Node object."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()
    addresses: tuple[str, ...] = ()
    pod_cidrs: tuple[str, ...] = ()

    @property
    def zone(self) -> str:
        for k, v in self.labels:
            if k == "topology.kubernetes.io/zone":
                return v
        return ""


class ChangeLog:
    """Which service ports each snapshot of one tracker re-derived, for the last snapshots
    that changed any (at most `keep` of them, naming at most `keep_names` ports together):
    lets a consumer that planned an earlier snapshot of the same tracker visit only the
    ports that may differ instead of every port. Older steps are forgotten (a consumer
    that far behind compares every port)."""

    def __init__(self, keep: int = 256, keep_names: int = 65_536) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._keep_names = keep_names
        self._names = 0  # ports named by the kept entries
        # (seq, names changed from seq - 1 to seq; None: possibly every port)
        self._entries: deque[tuple[int, frozenset[ServicePortName] | None]] = deque(maxlen=keep)

    @property
    def seq(self) -> int:
        return self._seq

    def record(self, changed: frozenset[ServicePortName] | None) -> int:
        """Note the next snapshot (changed names, None for all); returns its seq."""
        with self._lock:
            self._seq += 1
            entries = self._entries
            if len(entries) == entries.maxlen:
                self._names -= len(entries[0][1] or ())
            entries.append((self._seq, changed))
            self._names += len(changed or ())
            while self._names > self._keep_names and len(entries) > 1:
                self._names -= len(entries.popleft()[1] or ())
            return self._seq

    def between(self, old: int, new: int) -> frozenset[ServicePortName] | None:
        """Ports that may differ between snapshot seq `old` and `new` (None: unknown)."""
        if old == new:
            return frozenset()
        if old > new:
            return None
        with self._lock:
            entries = list(self._entries)
        if not entries or entries[0][0] > old + 1:
            return None  # some of the steps are no longer kept
        out: set[ServicePortName] = set()
        for seq, changed in entries:
            if old < seq <= new:
                if changed is None:
                    return None
                out |= changed
        return frozenset(out)


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a snapshot comes from: its tracker's change log and its place in it."""

    log: ChangeLog
    seq: int

    def changed_since(self, earlier: Lineage | None) -> frozenset[ServicePortName] | None:
        """Service ports that may differ from the earlier snapshot's (None: unknown, compare
        them all). Says nothing about the node, which a consumer compares itself."""
        if earlier is None or earlier.log is not self.log:
            return None
        return self.log.between(earlier.seq, self.seq)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one sync programs: service ports keyed and ordered by name."""

    node: NodeInfo
    services: dict[ServicePortName, ServicePort]
    rejections: tuple[Rejection, ...] = ()
    # Newest endpoints.kubernetes.io/last-change-trigger-time seen per service ("ns/name").
    trigger_times: dict[str, float] = field(default_factory=dict)
    # Set by the ChangeTracker that built it; None for snapshots built otherwise.
    lineage: Lineage | None = None

    def __hash__(self) -> int:  # dict fields make the default unhashable; identity is enough
        return id(self)

    def sorted_ports(self) -> list[ServicePort]:
        return [self.services[k] for k in sorted(self.services)]
