"""The keep/reap decision after a switch away from ipvs mode (ipvs/drain.py), on fakes."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.ipvs.drain import Draining, busy, parse_conn_table
from kproxy.dataplane.ipvs.netlink import KernelDest, KernelService
from kproxy.dataplane.ipvs.nlsock import Request
from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.ops.snapshot import programmed_in
from kproxy.switch import ModeSwitcher
from tests.support.switch_fakes import PROGRAMMED, SNAP, Plane

WEB = VSKey("TCP", "10.96.0.10", 80)
API = VSKey("TCP", "10.96.0.20", 443)
DNS = VSKey("UDP", "10.96.0.10", 53)
OTHER = VSKey("TCP", "192.0.2.1", 80)  # keepalived's, say: never kept by retire()

CONN_TABLE = """\
Pro FromIP   FPrt ToIP     TPrt DestIP   DPrt State       Expires PEName PEData
TCP 0A640003 D2F4 0A60000A 0050 0AF40002 1F90 ESTABLISHED     899
TCP 0A640003 D2F6 0A60000A 0050 0AF40003 1F90 TIME_WAIT       119
TCP 0A640003 D2F8 0A600014 01BB 0AF40003 1F90 TIME_WAIT       110
TCP 0A640003 D2FA 0A600014 01BB 0AF40003 1F90 CLOSE             9
TCP 0A640003 D2FC 0A600014 01BB 0AF40004 1F90 CLOSE_WAIT       50
TCP 0A640003 D2FE 0A600014 01BB 0AF40004 1F90 SYN_SENT        100
TCP 0A640003 D300 0A600014 01BB 0AF40002 1F90 SYN_RECV         50
UDP 0A640003 A000 0A60000A 0035 0AF40002 1F90 UDP             290
"""


def dest(active: int = 0, inactive: int = 0) -> KernelDest:
    return KernelDest("10.244.0.2", 8080, 1, active=active, inactive=inactive)


@dataclass
class FakeIpvs:
    dests: dict[VSKey, list[KernelDest]]
    deleted: list[VSKey] = field(default_factory=list)

    def services(self) -> list[KernelService]:
        return [KernelService(k, "rr", 0, 0) for k in self.dests]

    def all_dests(self) -> dict[VSKey, list[KernelDest]]:
        return self.dests

    def delete_services(self, keys: Iterable[VSKey]) -> list[tuple[Request, int]]:
        for k in list(keys):
            self.deleted.append(k)
            del self.dests[k]
        return []


@dataclass
class FakeAddresses:
    dummy: frozenset[str]


@dataclass
class FakeDummy:
    bound: set[str]
    exists: bool = True

    def lookup(self) -> tuple[int, str] | None:
        return (7, "dummy") if self.exists else None

    def addresses(self, index: int | None) -> FakeAddresses:
        return FakeAddresses(frozenset(self.bound))

    def unbind(self, index: int, ips: Iterable[str]) -> list[tuple[str, int]]:
        self.bound -= set(ips)
        return []

    def delete(self) -> bool:
        self.exists = False
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_conn_table_counts_live_connections_per_virtual_server() -> None:
    # ESTABLISHED and SYN_RECV (a handshake IPVS forwards) count; TIME_WAIT, CLOSE, the
    # half-closed CLOSE_WAIT and SYN_SENT (a reused port's replies only) do not
    assert parse_conn_table(CONN_TABLE) == {WEB: 1, API: 1, DNS: 1}


def test_busy_keeps_tcp_with_live_connections_only() -> None:
    dests = {
        WEB: [dest(active=2), dest(inactive=1)],
        API: [dest(inactive=3)],  # only closed ones in the connection table: idle
        VSKey("TCP", "10.96.0.30", 80): [dest()],
        DNS: [dest(inactive=5)],  # UDP goes at once
    }
    conns = {WEB: 1, API: 0}
    assert busy(dests, dests, lambda: conns) == {WEB: 1}
    conns = {WEB: 1, API: 2}  # two live (e.g. ESTABLISHED) in the connection table
    assert busy(dests, dests, lambda: conns) == {WEB: 1, API: 2}


def test_active_count_alone_does_not_keep_a_virtual_server() -> None:
    # IPVS counts SYN_SENT as active; the connection table (where SYN_SENT is not live) decides
    assert busy([WEB], {WEB: [dest(active=4)]}, lambda: {}) == {}


def test_busy_reads_the_connection_table_only_when_needed() -> None:
    def fail() -> dict[VSKey, int]:
        raise AssertionError("read the connection table")

    assert busy([WEB, DNS], {WEB: [dest()], DNS: [dest(inactive=2)]}, fail) == {}


def test_unknown_counts_keep_the_virtual_server() -> None:
    def unreadable() -> dict[VSKey, int]:
        raise OSError("no such file")

    assert busy([WEB, DNS], None, unreadable) == {WEB: -1}
    assert busy([API], {API: [dest(inactive=1)]}, unreadable) == {API: -1}


def test_reaps_each_virtual_server_when_idle_then_the_link() -> None:
    ipvs = FakeIpvs({WEB: [dest(active=1)], API: [dest(active=1)], OTHER: [dest(active=1)]})
    dummy = FakeDummy({"10.96.0.10", "10.96.0.20"})
    live = {WEB: 1, API: 1, OTHER: 1}  # the connection table
    d = Draining(None, {WEB: 1, API: 1}, {"10.96.0.10", "10.96.0.20"}, conns=lambda: live)
    assert not d.poll(ipvs, dummy)
    assert ipvs.deleted == [] and dummy.exists
    ipvs.dests[API] = [dest()]
    del live[API]
    assert not d.poll(ipvs, dummy)
    assert ipvs.deleted == [API]
    assert dummy.bound == {"10.96.0.10"} and dummy.exists
    ipvs.dests[WEB] = [dest(inactive=1)]  # TIME_WAIT only: the table shows no live one
    del live[WEB]
    assert d.poll(ipvs, dummy)
    assert ipvs.deleted == [API, WEB]
    assert OTHER in ipvs.dests  # never kept, never touched
    assert not dummy.exists and d.done


def test_cap_deletes_what_is_left() -> None:
    clock = Clock()
    ipvs = FakeIpvs({WEB: [dest(active=1)]})
    dummy = FakeDummy({"10.96.0.10"})
    d = Draining(None, {WEB: 1}, {"10.96.0.10"}, cap=60, clock=clock, conns=lambda: {WEB: 1})
    clock.now += 59
    assert not d.poll(ipvs, dummy)
    clock.now += 1
    assert d.poll(ipvs, dummy)
    assert ipvs.deleted == [WEB] and not dummy.exists


def test_leaves_kube_ipvs0_holding_addresses_it_did_not_keep() -> None:
    ipvs = FakeIpvs({WEB: [dest()]})
    dummy = FakeDummy({"10.96.0.10", "10.96.0.99"})
    d = Draining(None, {WEB: 1}, {"10.96.0.10"}, conns=dict)
    assert d.poll(ipvs, dummy)
    assert dummy.bound == {"10.96.0.99"} and dummy.exists


def test_a_virtual_server_deleted_by_someone_else_is_forgotten() -> None:
    ipvs = FakeIpvs({})
    dummy = FakeDummy({"10.96.0.10"})
    d = Draining(None, {WEB: 1}, {"10.96.0.10"}, conns=dict)
    assert d.poll(ipvs, dummy)
    assert ipvs.deleted == [] and not dummy.exists


def test_summary_names_what_drains() -> None:
    d = Draining(None, {WEB: 5}, {"10.96.0.10"}, conns=dict)
    assert "draining 1 virtual servers: TCP 10.96.0.10:80 (5 connections)" in d.summary()
    assert "kube-ipvs0" in d.summary()


def test_run_without_ipvs_gives_up_cleanly() -> None:
    d = Draining(None, {WEB: 1}, set(), interval=0.01, conns=dict)
    stop = threading.Event()
    stop.set()
    # No IPVS on the host: run() gives up with an error instead of raising.
    d.run(stop)
    assert not d.done


# --- the switch side: retire() instead of cleanup(), the reaper thread ---------------------


class FakeDraining:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.stopped = threading.Event()

    @property
    def done(self) -> bool:
        return False

    def summary(self) -> str:
        return "draining 1 virtual servers: TCP 10.96.0.10:80 (5 connections)"

    def run(self, stop: threading.Event) -> None:
        self.started.set()
        stop.wait(30)
        self.stopped.set()


class RetiringPlane(Plane):
    def __init__(self, mode: str, calls: list[str], draining: FakeDraining) -> None:
        super().__init__(mode, calls)
        self.draining = draining

    def retire(self) -> tuple[list[OwnedObject], FakeDraining]:
        self.calls.append(f"{self.mode}.retire")
        return [OwnedObject("ipset", "ipset", "KUBE-CLUSTER-IP", "ipvs")], self.draining


def switcher_for(calls: list[str]) -> ModeSwitcher:
    return ModeSwitcher(
        make_dataplane=lambda mode: Plane(mode, calls),
        state_dir=None,
        prober=lambda ip, p: None,
        snapshotter=lambda: PROGRAMMED,
        plane_reader=lambda plane: programmed_in(PROGRAMMED).get(plane, {}),
    )


def test_switch_retires_a_mode_that_can_drain_and_reaps_in_a_thread() -> None:
    calls: list[str] = []
    draining = FakeDraining()
    switcher = switcher_for(calls)
    old = RetiringPlane("ipvs", calls, draining)
    report, now = switcher.switch(old, SNAP, "nftables", timeout=30)
    assert report.ok, report.error
    assert calls == ["nftables.sync", "ipvs.detach", "ipvs.retire"]  # never ipvs.cleanup
    assert report.removed == ["ipset ipset KUBE-CLUSTER-IP: ipvs"]
    remove = next(s for s in report.steps if s.name == "remove")
    assert "1 objects of ipvs removed; draining 1 virtual servers" in remove.detail
    assert draining.started.wait(5)
    switcher.stop_reaping()
    assert draining.stopped.is_set()


def test_a_switch_into_ipvs_stops_the_reaper_first() -> None:
    calls: list[str] = []
    draining = FakeDraining()
    switcher = switcher_for(calls)
    switcher.switch(RetiringPlane("ipvs", calls, draining), SNAP, "nftables", timeout=30)
    assert draining.started.wait(5)
    switcher.switch(Plane("nftables", calls), SNAP, "ipvs", timeout=30)
    assert draining.stopped.is_set()  # before the new ipvs mode adopted the kept ones
