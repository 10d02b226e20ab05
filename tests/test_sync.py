"""The sync loop's policy (full vs partial, failure handling, UDP conntrack) with fakes."""

from __future__ import annotations

import gc
import time

from kproxy.dataplane.base import Dataplane, SyncError, SyncResult
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeTracker
from kproxy.server.http import HealthState
from kproxy.sources.base import ObjectEvent, ObjectKey
from kproxy.sync import ProxyLoop, udp_serving_map
from tests.support.objects import endpoint, endpoint_slice, port, service


class FakeDataplane(Dataplane):
    mode = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int]] = []
        self.collector_on: list[bool] = []
        self.fail = False

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
        self.calls.append((full, len(snapshot.services)))
        self.collector_on.append(gc.isenabled())
        if self.fail:
            raise SyncError("kernel said no")
        return SyncResult(full=full, services=len(snapshot.services))

    def drifted(self) -> bool:
        return False

    def owned(self) -> list:
        return []

    def cleanup(self, *, dry_run: bool = False) -> list:
        return []


class ListSource:
    def __init__(self, objects: list[dict]) -> None:
        self.objects = objects
        self.synced = False

    def start(self, sink) -> None:
        sink([event(o) for o in self.objects])
        self.synced = True

    def stop(self) -> None:
        pass


def event(o: dict, deleted: bool = False) -> ObjectEvent:
    meta = o["metadata"]
    return ObjectEvent(
        ObjectKey(o["kind"], meta.get("namespace", "default"), meta["name"]), None if deleted else o
    )


def udp_objects(ips: list[str]) -> list[dict]:
    return [
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")], type="NodePort"),
        endpoint_slice("dns", [endpoint(ip) for ip in ips], [port("dns", 8080, protocol="UDP")]),
    ]


def make_loop(plane: FakeDataplane, cleaned: list) -> ProxyLoop:
    return ProxyLoop(
        ChangeTracker("node1"),
        plane,
        min_sync_period=0.0,
        sync_period=0.2,
        udp_cleaner=lambda ips, ports: cleaned.append((ips, ports)) or 3,
    )


def test_first_sync_full_then_partial_on_changes() -> None:
    plane = FakeDataplane()
    cleaned: list = []
    loop = make_loop(plane, cleaned)
    loop.start(ListSource(udp_objects(["10.244.0.2", "10.244.0.3"])))
    try:
        assert plane.calls[0] == (True, 1)
        loop.on_events([event(udp_objects(["10.244.0.2"])[1])])
        deadline = time.monotonic() + 3
        while len([c for c in plane.calls if not c[0]]) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (False, 1) in plane.calls
        assert not loop.pending
        # UDP endpoints changed: the cleaner ran with the serving endpoints only.
        ips, ports = cleaned[-1]
        assert ips[("10.96.0.53", 53)] == {"10.244.0.2"}
        assert loop.status.conntrack_deleted >= 3
    finally:
        loop.stop()


def test_failed_conntrack_cleanup_is_reported_and_retried_without_a_change() -> None:
    """The sync goes on (no failed sync); the failure is in the status; the next periodic
    sync retries the cleanup though no UDP endpoint changed since."""
    plane = FakeDataplane()
    calls: list[int] = []

    def cleaner(ips: dict, ports: dict) -> int:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("conntrack -L failed with exit code 1: refused")
        return 1

    loop = ProxyLoop(
        ChangeTracker("node1"), plane, min_sync_period=0.0, sync_period=0.2, udp_cleaner=cleaner
    )
    loop.start(ListSource(udp_objects(["10.244.0.2", "10.244.0.3"])))
    try:
        loop.on_events([event(udp_objects(["10.244.0.2"])[1])])
        deadline = time.monotonic() + 3
        while loop.status.conntrack_failures == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = loop.status
        assert st.conntrack_failures == 1 and "refused" in (st.conntrack_error or "")
        assert st.failures == 0 and not loop.pending
        deadline = time.monotonic() + 3
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 3 and loop.status.conntrack_error is None
        time.sleep(0.5)  # later syncs with nothing changed and nothing owed: no cleanup
        assert len(calls) == 3
    finally:
        loop.stop()


def test_failure_keeps_going_and_next_sync_is_full() -> None:
    plane = FakeDataplane()
    loop = make_loop(plane, [])
    loop.start(ListSource(udp_objects(["10.244.0.2"])))
    try:
        plane.fail = True
        loop.on_events([event(udp_objects(["10.244.0.9"])[1])])
        deadline = time.monotonic() + 3
        while loop.status.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.status.failures >= 1 and "kernel said no" in (loop.status.last_error or "")
        assert loop.pending, "the change is still pending after a failed apply"
        plane.fail = False
        deadline = time.monotonic() + 3
        while loop.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not loop.pending
        first_ok_after_failure = [c for c in plane.calls[2:]]
        assert first_ok_after_failure and all(full for full, _ in first_ok_after_failure[:2])
    finally:
        loop.stop()


def test_a_change_queued_during_a_sync_stays_unhealthy_while_later_syncs_fail() -> None:
    """The sync that was running when a change came did not take it: its success must not
    mark the change synced, or /healthz stays 200 while every later sync fails."""
    plane = FakeDataplane()
    loop = make_loop(plane, [])
    health = HealthState(health_timeout=0.4)
    loop.observers.append(health)
    loop.start(ListSource(udp_objects(["10.244.0.2"])))
    real_sync = plane.sync

    def sync_meeting_a_change(snapshot: Snapshot, *, full: bool) -> SyncResult:
        if not plane.calls[1:]:  # the first sync after start: a change arrives meanwhile
            loop.on_events([event(udp_objects(["10.244.0.9"])[1])])
            plane.fail = False
            result = real_sync(snapshot, full=full)
            plane.fail = True  # every later sync fails
            return result
        return real_sync(snapshot, full=full)

    plane.sync = sync_meeting_a_change  # type: ignore[method-assign]
    try:
        loop.on_events([event(udp_objects(["10.244.0.3"])[1])])
        deadline = time.monotonic() + 3
        while loop.status.failures < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.status.failures >= 2 and loop.pending
        time.sleep(0.5)
        assert health.report()[0] is False, "healthy while a queued change waits on"
        plane.sync = real_sync  # type: ignore[method-assign]
        plane.fail = False
        deadline = time.monotonic() + 3
        while loop.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert health.report()[0] is True
    finally:
        loop.stop()


def test_an_operators_full_sync_request_distrusts_the_kernel_first() -> None:
    plane = FakeDataplane()
    events: list[str] = []
    plane.distrust_kernel = lambda: events.append("distrust")  # type: ignore[attr-defined]
    real_sync = plane.sync

    def sync(snapshot: Snapshot, *, full: bool) -> SyncResult:
        events.append("full" if full else "partial")
        return real_sync(snapshot, full=full)

    plane.sync = sync  # type: ignore[method-assign]
    loop = make_loop(plane, [])
    loop.start(ListSource(udp_objects(["10.244.0.2"])))
    try:
        assert events == ["full"], "the first sync needs no distrust: nothing is trusted yet"
        loop.request_full_sync()
        deadline = time.monotonic() + 3
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[1:3] == ["distrust", "full"]
    finally:
        loop.stop()


def test_udp_serving_map_covers_every_destination() -> None:
    t = ChangeTracker("node1")
    objs = udp_objects(["10.244.0.2", "10.244.0.3"])
    objs[0]["spec"]["ports"][0]["nodePort"] = 30053
    objs[0]["spec"]["externalIPs"] = ["10.99.0.53"]
    t.apply([event(o) for o in objs])
    ips, ports = udp_serving_map(t.snapshot())
    assert ips == {
        ("10.96.0.53", 53): {"10.244.0.2", "10.244.0.3"},
        ("10.99.0.53", 53): {"10.244.0.2", "10.244.0.3"},
    }
    assert ports == {30053: {"10.244.0.2", "10.244.0.3"}}


def test_syncs_run_with_the_collector_paused_and_a_full_one_freezes_what_it_leaves() -> None:
    plane = FakeDataplane()
    loop = make_loop(plane, [])
    enabled = gc.isenabled()
    gc.enable()
    frozen = gc.get_freeze_count()
    try:
        loop.on_events([event(o) for o in udp_objects(["10.244.0.2"])])
        assert loop.sync_once()
        assert plane.calls[-1][0] is True
        assert gc.get_freeze_count() > frozen
        loop.on_events([event(o) for o in udp_objects(["10.244.0.3"])])
        plane.fail = True
        assert not loop.sync_once()
        assert plane.collector_on == [False, False]
        assert gc.isenabled()
    finally:
        loop.stop()
        gc.unfreeze()
        if not enabled:
            gc.disable()


def test_between_syncs_holds_the_loop_or_gives_up_after_its_wait() -> None:
    import threading

    loop = make_loop(FakeDataplane(), [])
    entered = threading.Event()

    def a_sync() -> None:
        with loop.exclusive():
            entered.set()

    with loop.between_syncs(wait=0.0) as quiet:
        assert quiet
        other = threading.Thread(target=a_sync)
        other.start()
        assert not entered.wait(0.2), "a sync ran while the reader held the loop"
    other.join(timeout=5)
    assert entered.is_set()
    release, running = threading.Event(), threading.Event()

    def a_long_sync() -> None:
        with loop.exclusive():
            running.set()
            release.wait(10)

    other = threading.Thread(target=a_long_sync)
    other.start()
    assert running.wait(5)
    started = time.monotonic()
    with loop.between_syncs(wait=0.2) as quiet:
        assert not quiet
    assert 0.2 <= time.monotonic() - started < 5
    release.set()
    other.join(timeout=5)
