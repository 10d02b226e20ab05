"""After a live switch away from ipvs mode: keep the busy virtual servers until they drain.

IPVS translates its connections itself: conntrack holds only the rewritten reply, not a NAT
binding. Deleting a virtual server that still carries connections makes IPVS expire them
(expire_nodest_conn=1) and their next packet reaches the node's own stack, which resets
it. New flows are not IPVS's any more once the new mode is installed (its DNAT in nat
PREROUTING runs before IPVS in LOCAL_IN), so the old virtual servers only carry what they
already had. IpvsDataplane.retire() keeps the TCP virtual servers with live connections and
their kube-ipvs0 addresses (IPVS needs the VIP to be local); a Draining then deletes each
one once its connections are gone, or after CAP seconds, and kube-ipvs0 when none is left.

"Live" is any connection not closed or half closed (CLOSED_STATES): IPVS keeps those for
up to two minutes (counted in InActConn). ActiveConn cannot decide alone: IPVS counts the
pre-established states, SYN_SENT among them, as active (seen in the UML kernel), and after
a switch SYN_SENT marks flows that are not IPVS's (see CLOSED_STATES). So a virtual server
with any connection costs a read of /proc/net/ip_vs_conn (once at the switch, then once per
poll while something drains); one with none is idle without it. UDP and SCTP virtual
servers go at once, as in graceful termination (names.GRACEFUL_PROTOCOLS): IPVS keeps an
idle UDP entry for its whole timeout, so they would never look drained.

The reaping lives in the daemon process only: a restart (in any mode but ipvs) removes
ipvs leftovers at startup (leftovers.clean_leftovers), killing what is still draining; that
is accepted. It only ever deletes the virtual servers and addresses it kept itself, by exact
protocol, address and port.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.netlink import KernelDest, KernelService
from kproxy.dataplane.ipvs.nlsock import Request
from kproxy.dataplane.ipvs.plan import PROTOCOL_NUMBERS, VSKey
from kproxy.host.commands import in_netns, run_command

log = logging.getLogger("kproxy.ipvs.drain")

CAP = 15 * 60.0  # seconds a kept virtual server may drain before it is deleted anyway
INTERVAL = 2.0
PROC_IP_VS_CONN = "/proc/net/ip_vs_conn"
# States of connections that are closed or closing. Half-closed ones (FIN_WAIT, CLOSE_WAIT,
# LAST_ACK) count as closing: IPVS keeps them up to 2 minutes after a client's last request
# (seen in the UML switch test), and waiting for them would hold the old mode that long; the
# price is a reset for a transfer still running in one direction after the other closed.
# SYN_SENT counts too: in NAT mode IPVS enters it only from the real server's side (its
# SYN-ACK). After the switch that is a new flow the new mode DNATs, whose client reused the
# port of one of IPVS's TIME_WAIT entries: IPVS sees its replies in FORWARD only and holds
# the entry in SYN_SENT for 2 minutes (seen in the UML switch test), though it carries
# nothing of IPVS's.
CLOSED_STATES = frozenset({"TIME_WAIT", "CLOSE", "FIN_WAIT", "CLOSE_WAIT", "LAST_ACK", "SYN_SENT"})

ConnReader = Callable[[], Mapping[VSKey, int]]


class Ipvs(Protocol):
    def services(self) -> list[KernelService]: ...
    def all_dests(self) -> dict[VSKey, list[KernelDest]]: ...
    def delete_services(self, keys: Iterable[VSKey]) -> list[tuple[Request, int]]: ...


class Dummy(Protocol):
    def lookup(self) -> tuple[int, str] | None: ...
    def addresses(self, index: int | None) -> object: ...
    def unbind(self, index: int, ips: Iterable[str]) -> list[tuple[str, int]]: ...
    def delete(self) -> bool: ...


def parse_conn_table(text: str) -> dict[VSKey, int]:
    """/proc/net/ip_vs_conn -> live (not TIME_WAIT/CLOSE) connections per virtual server."""
    out: dict[VSKey, int] = {}
    for line in text.splitlines():
        f = line.split()
        # Pro FromIP FPrt ToIP TPrt DestIP DPrt State Expires ... (IPv4: 8 hex digits)
        if len(f) < 8 or f[0] not in PROTOCOL_NUMBERS or len(f[3]) != 8:
            continue
        if f[7] in CLOSED_STATES:
            continue
        try:
            key = VSKey(f[0], socket.inet_ntoa(int(f[3], 16).to_bytes(4, "big")), int(f[4], 16))
        except ValueError:
            continue
        out[key] = out.get(key, 0) + 1
    return out


def read_conn_table(netns: str | None) -> dict[VSKey, int]:
    if netns is None:
        with open(PROC_IP_VS_CONN) as f:
            return parse_conn_table(f.read())
    proc = run_command(in_netns(["cat", PROC_IP_VS_CONN], netns))
    if proc.returncode != 0:
        raise OSError(f"reading {PROC_IP_VS_CONN}: {proc.stderr.strip()}")
    return parse_conn_table(proc.stdout)


def busy(
    keys: Iterable[VSKey],
    dests: Mapping[VSKey, list[KernelDest]] | None,
    conns: ConnReader,
) -> dict[VSKey, int]:
    """The TCP virtual servers among keys that still carry connections (how many).
    Unknown counts (dests None, or the connection table unreadable) count as busy:
    keeping a virtual server a little longer costs nothing, deleting it resets flows."""
    out: dict[VSKey, int] = {}
    unsure: list[VSKey] = []
    for key in keys:
        if key.protocol not in n.GRACEFUL_PROTOCOLS:
            continue
        if dests is None:
            out[key] = -1
            continue
        if any(d.active > 0 or d.inactive > 0 for d in dests.get(key, [])):
            unsure.append(key)
    if unsure:
        try:
            table = conns()
        except OSError as err:
            log.warning(
                "cannot read %s (%s): keeping %d virtual servers", PROC_IP_VS_CONN, err, len(unsure)
            )
            table = {k: -1 for k in unsure}
        out.update({k: table[k] for k in unsure if table.get(k, 0) != 0})
    return out


@dataclass
class Draining:
    """Virtual servers kept by IpvsDataplane.retire(), and the kube-ipvs0 addresses they
    need. run() reaps them (in a thread of the daemon)."""

    netns: str | None
    servers: dict[VSKey, int] = field(default_factory=dict)  # -> connections when kept
    addresses: set[str] = field(default_factory=set)
    cap: float = CAP
    interval: float = INTERVAL
    clock: Callable[[], float] = time.monotonic
    conns: ConnReader | None = None
    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = self.started or self.clock()
        if self.conns is None:
            netns = self.netns
            self.conns = lambda: read_conn_table(netns)

    @property
    def done(self) -> bool:
        return not self.servers

    def summary(self) -> str:
        if self.done:
            return "nothing draining"
        shown = ", ".join(
            f"{k} ({c if c >= 0 else '?'} connections)"
            for k, c in sorted(self.servers.items(), key=lambda kv: str(kv[0]))[:10]
        )
        more = f" and {len(self.servers) - 10} more" if len(self.servers) > 10 else ""
        return (
            f"draining {len(self.servers)} virtual servers: {shown}{more};"
            f" {len(self.addresses)} addresses and {n.DUMMY_DEVICE} kept until they are idle"
            f" (at most {self.cap:.0f} s)"
        )

    def poll(self, ipvs: Ipvs, dummy: Dummy) -> bool:
        """One look: delete the kept virtual servers that are idle (all of them past the
        cap), the addresses no kept one needs, kube-ipvs0 once none is left. True: done."""
        present = {s.key for s in ipvs.services()}
        for key in [k for k in self.servers if k not in present]:
            log.info("drained virtual server %s is gone already", key)
            del self.servers[key]
        waited = self.clock() - self.started
        if self.servers:
            assert self.conns is not None
            still = busy(self.servers, ipvs.all_dests(), self.conns)
            if waited >= self.cap:
                if still:
                    log.warning(
                        "drain cap of %.0f s reached: deleting %d kept virtual servers with"
                        " connections left (%s)",
                        self.cap,
                        len(still),
                        ", ".join(str(k) for k in sorted(still, key=str)[:10]),
                    )
                going = list(self.servers)
            else:
                going = [k for k in self.servers if k not in still]
            self._delete(ipvs, going, waited)
        self._release_addresses(dummy, final=not self.servers)
        return self.done

    def _delete(self, ipvs: Ipvs, keys: Collection[VSKey], waited: float) -> None:
        if not keys:
            return
        # Request descriptions are exact: "delete virtual server TCP 10.96.0.10:80".
        failed = {r.what: code for r, code in ipvs.delete_services(keys)}
        for key in keys:
            code = failed.get(f"delete virtual server {key}")
            if code is not None and code not in (2, 3):  # ENOENT/ESRCH: gone already
                log.warning(
                    "could not delete drained virtual server %s: %s", key, os.strerror(code)
                )
                continue
            log.info("virtual server %s drained after %.0f s: deleted", key, waited)
            self.servers.pop(key, None)

    def _release_addresses(self, dummy: Dummy, *, final: bool) -> None:
        needed = {k.address for k in self.servers}
        spare = sorted(self.addresses - needed)
        found = dummy.lookup()
        if found is None or found[1] != "dummy":
            self.addresses -= set(spare)
            return
        index = found[0]
        if spare:
            failed = dict(dummy.unbind(index, spare))
            for ip in spare:
                if ip in failed:
                    log.warning(
                        "could not unbind %s from %s: %s",
                        ip,
                        n.DUMMY_DEVICE,
                        os.strerror(failed[ip]),
                    )
                else:
                    self.addresses.discard(ip)
        if final and not self.addresses:
            others = getattr(dummy.addresses(index), "dummy", frozenset())
            if others:
                log.warning(
                    "%s holds addresses kproxy did not keep (%s): left alone",
                    n.DUMMY_DEVICE,
                    ", ".join(sorted(others)[:5]),
                )
                return
            dummy.delete()
            log.info("no virtual server left draining: %s deleted", n.DUMMY_DEVICE)

    def run(self, stop: threading.Event) -> None:
        """Poll every interval until done or stop is set (the daemon stops, or a switch
        back into ipvs mode adopts what is left)."""
        from kproxy.dataplane.ipvs.dummy import DummyDevice
        from kproxy.dataplane.ipvs.netlink import IpvsNetlink, IpvsUnavailable

        try:
            ipvs = IpvsNetlink(self.netns)
            dummy = DummyDevice(self.netns)
        except (IpvsUnavailable, OSError) as err:
            log.error("cannot reap the drained ipvs virtual servers: %s", err)
            return
        try:
            while not stop.wait(self.interval):
                try:
                    if self.poll(ipvs, dummy):
                        return
                except OSError as err:  # NetlinkError is an OSError
                    log.warning("reaping drained ipvs virtual servers: %s", err)
            if not self.done:
                log.info("stopped reaping with %s", self.summary())
        finally:
            ipvs.close()
            dummy.close()
