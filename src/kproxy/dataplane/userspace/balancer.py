"""Endpoint choice for one worker: round robin, ClientIP affinity, and the source address.

Pure (the clock is passed in), so it is unit tested without sockets. Upstream's
LoadBalancerRR: round robin over the endpoints, ClientIP affinity keeps a client on the
endpoint it last used while the entry is younger than the timeout, and after a failed dial
affinity is bypassed (the next attempts take the next endpoints in turn).
"""

from __future__ import annotations

import ipaddress
import random
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kproxy.dataplane.userspace.render import Listener

Addr = tuple[str, int]
# Connect attempts and their timeouts, as upstream's userspace proxy dialled.
DIAL_TIMEOUTS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)


class Networks:
    """A fixed set of IPv4 networks with a fast membership test on address strings."""

    def __init__(self, cidrs: Iterable[str]) -> None:
        self.nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
        self._masks = [
            (int(n.network_address), int(n.netmask)) for n in self.nets if n.version == 4
        ]

    def __contains__(self, ip: str) -> bool:
        try:
            value = int.from_bytes(socket.inet_aton(ip), "big")
        except OSError:
            return False
        return any(value & mask == net for net, mask in self._masks)


@dataclass
class AffinityEntry:
    endpoint: Addr
    last_used: float


@dataclass
class ListenerState:
    """A listener's configuration and its round-robin positions."""

    listener: Listener
    rr: dict[str, int] = field(default_factory=dict)

    def update(self, listener: Listener) -> None:
        self.listener = listener


class Balancer:
    """Every listener of one worker. `node_addresses` are the node's own IPs."""

    def __init__(self, *, seed: int | None = None) -> None:
        self._random = random.Random(seed)
        self.listeners: dict[str, ListenerState] = {}
        # ClientIP affinity per service port (shared by its cluster and external listener,
        # like the iptables mode's per-endpoint `recent` lists).
        self.affinity: dict[str, dict[str, AffinityEntry]] = {}
        self.local_nets: Networks | None = None
        self.masquerade_all = False
        self.node_addresses: frozenset[str] = frozenset()

    def configure(
        self,
        listeners: Sequence[Listener],
        *,
        local_cidrs: Sequence[str] | None,
        masquerade_all: bool = False,
        node_addresses: Iterable[str] = (),
    ) -> None:
        self.local_nets = None if local_cidrs is None else Networks(local_cidrs)
        self.masquerade_all = masquerade_all
        self.node_addresses = frozenset(node_addresses)
        current: dict[str, ListenerState] = {}
        for lst in listeners:
            state = self.listeners.get(lst.key)
            if state is None:
                state = ListenerState(lst)
            else:
                state.update(lst)
            current[lst.key] = state
        self.listeners = current
        # Affinity entries of endpoints that are gone, or of services without affinity.
        usable: dict[str, set[Addr]] = {}
        for state in current.values():
            lst = state.listener
            if lst.affinity is not None:
                usable.setdefault(lst.service, set()).update(lst.targets, lst.fallback)
        for service in list(self.affinity):
            eps = usable.get(service)
            if eps is None:
                del self.affinity[service]
                continue
            table = self.affinity[service]
            for client in [c for c, e in table.items() if e.endpoint not in eps]:
                del table[client]

    # --- per connection ---------------------------------------------------------------------

    def is_node_local(self, client_ip: str) -> bool:
        return client_ip in self.node_addresses or client_ip.startswith("127.")

    def is_pod(self, client_ip: str) -> bool:
        return self.local_nets is not None and client_ip in self.local_nets

    def candidates_for(self, lst: Listener, client_ip: str) -> tuple[str, tuple[Addr, ...]]:
        """(name of the endpoint list, the list) a client of this listener may use."""
        if lst.source == "local" and (self.is_pod(client_ip) or self.is_node_local(client_ip)):
            return "fallback", lst.fallback
        return "targets", lst.targets

    def keep_source(self, lst: Listener, client_ip: str, endpoint_ip: str) -> bool:
        """Should the backend connection carry the client's address (no masquerade)?

        Mirrors iptables mode: hairpin and node-originated traffic is masqueraded, so is
        ClusterIP traffic from outside the detector's CIDRs and externalTrafficPolicy
        Cluster traffic; pod traffic and Local-policy external traffic keep the source."""
        if client_ip == endpoint_ip or self.is_node_local(client_ip):
            return False
        if lst.source == "masquerade":
            return False
        if lst.source == "local":
            return True
        if self.masquerade_all:
            return False
        return self.local_nets is None or client_ip in self.local_nets

    def plan(self, key: str, client_ip: str, now: float) -> list[Addr]:
        """Endpoints to try in order (at most len(DIAL_TIMEOUTS)); [] when there is none."""
        state = self.listeners.get(key)
        if state is None:
            return []
        lst = state.listener
        which, eps = self.candidates_for(lst, client_ip)
        if not eps:
            return []
        out: list[Addr] = []
        if lst.affinity is not None:
            entry = self.affinity.get(lst.service, {}).get(client_ip)
            if entry is not None and now - entry.last_used < lst.affinity and entry.endpoint in eps:
                entry.last_used = now
                out.append(entry.endpoint)
        n = len(eps)
        start = state.rr.get(which)
        if start is None:
            start = self._random.randrange(n)
        state.rr[which] = (start + 1) % n  # one round-robin step per connection
        order = [eps[(start + i) % n] for i in range(n)]
        out += [ep for ep in order if ep not in out]
        # Fewer endpoints than attempts: go round again (a lost SYN deserves a second try).
        i = 0
        while len(out) < len(DIAL_TIMEOUTS):
            out.append(order[i % n])
            i += 1
        return out[: len(DIAL_TIMEOUTS)]

    def connected(self, key: str, client_ip: str, endpoint: Addr, now: float) -> None:
        """A dial succeeded: remember it for ClientIP affinity."""
        state = self.listeners.get(key)
        if state is None or state.listener.affinity is None:
            return
        table = self.affinity.setdefault(state.listener.service, {})
        entry = table.get(client_ip)
        if entry is None:
            table[client_ip] = AffinityEntry(endpoint, now)
        else:
            entry.endpoint = endpoint
            entry.last_used = now

    def prune(self, now: float) -> int:
        """Drop expired affinity entries; returns how many."""
        timeouts = {s.listener.service: s.listener.affinity for s in self.listeners.values()}
        dropped = 0
        for service, table in self.affinity.items():
            ttl = timeouts.get(service)
            for client in [c for c, e in table.items() if ttl is None or now - e.last_used >= ttl]:
                del table[client]
                dropped += 1
        return dropped
