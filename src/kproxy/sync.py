"""The one sync loop for every mode: source events -> tracker -> bounded runner -> dataplane.

Policy (upstream's): the first sync after start is full (it
adopts whatever rules are there and converges, without flushing anything); later syncs are
partial unless the previous one failed, the last full sync is older than full_sync_period,
or the dataplane reports drift. A failed apply keeps the last good rules in the kernel and
is retried after sync_period. Nothing is flushed on exit: the dataplane outlives us.

A sync runs with Python's cyclic garbage collector paused, and what a full sync leaves alive
is frozen out of later collections (kproxy.memory says why).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol as Interface

from kproxy.dataplane.base import Dataplane, SyncError, SyncResult
from kproxy.memory import collector_paused, settle_after_full_sync
from kproxy.model.objects import Protocol, ServicePort, ServicePortName, Snapshot
from kproxy.model.snapshot import ChangeCounts, ChangeTracker
from kproxy.runner import BoundedFrequencyRunner
from kproxy.sources.base import ObjectEvent, Source

log = logging.getLogger("kproxy.sync")

FULL_SYNC_PERIOD = 3600.0


@dataclass
class SyncStatus:
    """What the loop knows about itself (for status, health and metrics)."""

    syncs: int = 0
    full_syncs: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    last_sync: float | None = None
    last_full_sync: float | None = None
    last_duration: float | None = None
    last_result: SyncResult | None = None
    last_error: str | None = None
    last_queued: float | None = None
    conntrack_deleted: int = 0
    conntrack_failures: int = 0
    conntrack_error: str | None = None  # the last cleanup's, None once one succeeds
    invalid_objects: int = 0
    history: list[tuple[float, bool, float]] = field(default_factory=list)  # (when, full, secs)


UdpCleaner = Callable[[dict[tuple[str, int], set[str]], dict[int, set[str]]], int]


class SyncObserver(Interface):
    """Who wants to know about syncs: metrics, health, the status file."""

    def queued(self, when: float, pending_services: int, pending_endpoints: int) -> None: ...

    def synced(
        self, snapshot: Snapshot, result: SyncResult, seconds: float, counts: ChangeCounts
    ) -> None: ...

    def failed(self, full: bool) -> None: ...

    def conntrack_cleaned(self, deleted: int, error: str | None = None) -> None: ...


class ProxyLoop:
    def __init__(
        self,
        tracker: ChangeTracker,
        dataplane: Dataplane,
        *,
        min_sync_period: float,
        sync_period: float,
        full_sync_period: float = FULL_SYNC_PERIOD,
        udp_cleaner: UdpCleaner | None = None,
        observers: Sequence[SyncObserver] = (),
    ) -> None:
        self.tracker = tracker
        self.dataplane = dataplane
        self.sync_period = sync_period
        self.full_sync_period = full_sync_period
        self.udp_cleaner = udp_cleaner
        self.observers = list(observers)
        self.status = SyncStatus()
        self._lock = threading.Lock()
        self._force_full = True
        self._distrust = False  # see request_full_sync
        self._applied: Snapshot | None = None
        self._applied_generation = -1
        self._udp_cleanup_owed = False  # a failed cleanup is retried at the next sync
        # When the oldest change no sync has taken yet was queued (None: none waits). A change
        # queued while a sync runs is not in that sync: its success must not clear it.
        self._oldest_unsynced: float | None = None
        self._last_drift_check = time.monotonic()
        self.runner = BoundedFrequencyRunner(
            "sync",
            self.sync_once,
            min_interval=min_sync_period,
            max_interval=sync_period,
            retry_interval=sync_period,
        )

    # --- wiring ------------------------------------------------------------------------------

    def on_events(self, events: Sequence[ObjectEvent]) -> None:
        """The source sink: fold events in and ask for a sync if anything changed."""
        if self.tracker.apply(events):
            now = time.time()
            self.status.last_queued = now
            if self._oldest_unsynced is None:
                self._oldest_unsynced = now
            pending = self.tracker.counts
            for obs in self.observers:
                obs.queued(now, len(pending.pending_services), len(pending.pending_endpoints))
            self.runner.run()

    def start(self, source: Source) -> None:
        """Deliver the source's initial objects, run the first (full) sync, keep syncing."""
        source.start(self.on_events)
        self.sync_once()
        self.runner.start()

    def stop(self) -> None:
        self.runner.stop(timeout=30)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """No sync runs while the caller holds this (a mode switch swaps the dataplane)."""
        with self._lock:
            yield

    @contextmanager
    def between_syncs(self, wait: float) -> Iterator[bool]:
        """exclusive() if no sync holds the loop for longer than `wait` seconds; yields
        whether it is held. For a reader that wants the dataplane and the applied snapshot
        of one moment but can do without (a full sync at 10,000 services takes minutes)."""
        held = self._lock.acquire(timeout=wait)
        try:
            yield held
        finally:
            if held:
                self._lock.release()

    def set_dataplane(self, dataplane: Dataplane) -> None:
        """Hand syncing to another dataplane that is already fully programmed."""
        self.dataplane = dataplane

    def request_full_sync(self) -> None:
        """An operator's request: a full sync that rewrites everything, even where the
        dataplane could prove the kernel unchanged (it is asked because someone doubts it)."""
        self._force_full = True
        self._distrust = True
        self.runner.run()

    @property
    def applied_snapshot(self) -> Snapshot | None:
        return self._applied

    @property
    def pending(self) -> bool:
        return self.tracker.generation != self._applied_generation

    # --- one sync ----------------------------------------------------------------------------

    def sync_once(self) -> bool:
        with self._lock:
            ok, full = self._sync_locked()
        if ok and full:
            # A full sync's input is the daemon's largest garbage; settled outside the lock
            # so that a switch or the next sync does not wait for the collector.
            settle_after_full_sync()
        return ok

    def _sync_locked(self) -> tuple[bool, bool]:
        """One sync; (succeeded, was a full sync)."""
        generation = self.tracker.generation
        taken, self._oldest_unsynced = self._oldest_unsynced, None
        snapshot = self.tracker.snapshot()
        counts = self.tracker.take_counts()
        now = time.time()
        full = (
            self._force_full
            or self.status.last_full_sync is None
            or now - self.status.last_full_sync >= self.full_sync_period
            or self._drifted()
        )
        if self._distrust:
            self._distrust = False
            self.dataplane.distrust_kernel()
        started = time.monotonic()
        try:
            with collector_paused():
                result = self.dataplane.sync(snapshot, full=full)
        except SyncError as err:
            self.tracker.return_counts(counts)
            self._still_unsynced(taken)
            self._record_failure(str(err), full)
            return False, False
        except Exception as err:  # a bug must not kill the loop; keep the last good rules
            log.exception("sync failed unexpectedly")
            self.tracker.return_counts(counts)
            self._still_unsynced(taken)
            self._record_failure(f"{type(err).__name__}: {err}", full)
            return False, False
        took = time.monotonic() - started
        previous = self._applied
        self._applied = snapshot
        self._applied_generation = generation
        self._force_full = False
        st = self.status
        st.syncs += 1
        st.consecutive_failures = 0
        st.last_sync = time.time()
        st.last_duration = took
        st.last_result = result
        st.last_error = None
        st.invalid_objects = len(snapshot.rejections)
        st.history = [*st.history[-499:], (st.last_sync, result.full, took)]
        if result.full:
            st.full_syncs += 1
            st.last_full_sync = st.last_sync
        log.info(
            "%s sync: %d service ports, %d rewritten, %d stale chains removed, %.3f s",
            ("full" if result.full else "partial")
            + (" (kernel unchanged since kproxy's last write)" if result.kernel_unchanged else ""),
            result.services,
            result.rewritten,
            result.stale_removed,
            took,
        )
        self._clean_udp_conntrack(previous, snapshot)
        for obs in self.observers:
            obs.synced(snapshot, result, took, counts)
        waiting = self._oldest_unsynced
        if waiting is not None:
            # Queued during this sync: still waiting, since it was queued (/healthz).
            pending = self.tracker.counts
            for obs in self.observers:
                obs.queued(waiting, len(pending.pending_services), len(pending.pending_endpoints))
        return True, result.full

    def _still_unsynced(self, taken: float | None) -> None:
        """A failed sync's changes wait on, since they were first queued."""
        if taken is not None and (self._oldest_unsynced is None or taken < self._oldest_unsynced):
            self._oldest_unsynced = taken

    def _drifted(self) -> bool:
        # At most once per sync period: the check costs a process (and a table read on big
        # nft-backend tables), which must not land on every partial sync.
        now = time.monotonic()
        if now - self._last_drift_check < self.sync_period:
            return False
        self._last_drift_check = now
        return self.dataplane.drifted()

    def _record_failure(self, message: str, full: bool) -> None:
        for obs in self.observers:
            obs.failed(full)
        st = self.status
        st.failures += 1
        st.consecutive_failures += 1
        st.last_error = message
        self._force_full = True
        log.error(
            "sync failed (keeping the last good rules, retry in %.0f s): %s",
            self.sync_period,
            message,
        )

    def _clean_udp_conntrack(self, previous: Snapshot | None, current: Snapshot) -> None:
        # Upstream cleans only after a sync that removed UDP endpoints and never retries a
        # failed cleanup; the stale flows would then stay until the next removal.
        if self.udp_cleaner is None:
            return
        if not (self._udp_cleanup_owed or udp_endpoints_changed(previous, current)):
            return
        service_ips, node_ports = udp_serving_map(current)
        st = self.status
        try:
            deleted = self.udp_cleaner(service_ips, node_ports)
        except Exception as err:
            log.warning("stale UDP conntrack cleanup failed (retried at the next sync): %s", err)
            self._udp_cleanup_owed = True
            st.conntrack_failures += 1
            st.conntrack_error = str(err)
            for obs in self.observers:
                obs.conntrack_cleaned(0, str(err))
            return
        self._udp_cleanup_owed = False
        st.conntrack_deleted += deleted
        st.conntrack_error = None
        for obs in self.observers:
            obs.conntrack_cleaned(deleted)
        if deleted:
            log.info("deleted %d stale UDP conntrack entries", deleted)


def _udp_ports(snapshot: Snapshot | None) -> dict[ServicePortName, ServicePort]:
    if snapshot is None:
        return {}
    return {n: sp for n, sp in snapshot.services.items() if sp.protocol is Protocol.UDP}


def udp_endpoints_changed(previous: Snapshot | None, current: Snapshot) -> bool:
    """Did any UDP service port lose (or change) endpoints? Only then can entries go stale."""
    if previous is None:
        return True  # after a restart, entries may point at endpoints removed while we were down
    old, new = _udp_ports(previous), _udp_ports(current)
    for name, sp in old.items():
        other = new.get(name)
        if other is None or other.endpoints != sp.endpoints or other.cluster_ip != sp.cluster_ip:
            return True
    return False


def udp_serving_map(
    snapshot: Snapshot,
) -> tuple[dict[tuple[str, int], set[str]], dict[int, set[str]]]:
    """(service ip, port) -> serving endpoint IPs, and node port -> serving endpoint IPs."""
    service_ips: dict[tuple[str, int], set[str]] = {}
    node_ports: dict[int, set[str]] = {}
    for sp in _udp_ports(snapshot).values():
        serving = {e.ip for e in sp.endpoints if e.serving}
        for ip in (sp.cluster_ip, *sp.external_ips, *sp.load_balancer_ips):
            service_ips.setdefault((ip, sp.port), set()).update(serving)
        if sp.node_port:
            node_ports.setdefault(sp.node_port, set()).update(serving)
    return service_ips, node_ports
