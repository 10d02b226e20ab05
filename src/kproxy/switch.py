"""Live proxy-mode switching: make before break, verified, with a rollback before cut-over.

Order (each step timed in the report):
  check      the target mode can run here (never a fallback)
  snapshot   the node's dataplane, kept in the state dir (or the verified backup the
             preflight of `kproxy switch` wrote moments before: the same document)
  anchor     conntrack and NAT hooks held for the whole switch (conntrack runs only while
             a rule uses it)
  program    the new mode completely, beside the old one (both in the packet path now;
             both DNAT to the same endpoints, the first binding wins, so this is harmless)
  verify     every service destination of the snapshot is in the new mode's kernel state
             (read back by the readers `kproxy list` uses), and a sample of services
             answers from the node
  cut-over   the old mode leaves the packet path in one step (Dataplane.detach)
  remove     the old mode's state goes (the switch's duration ends here)
  snapshot-after  the node's dataplane again, kept beside the first: written in the
             background after the report (the next switch waits for it)
Anything failing before the cut-over removes the new mode's state, leaves the old mode
untouched and deletes the half-open conntrack entries the attempt may have caused (G13).
A cut-over that fails leaves the old mode serving too (after a full sync of it); state of
the new mode that cannot be removed goes to the daemon's leftover cleanup.
Established connections survive the cut-over: conntrack keeps their translation.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kproxy.conntrack import delete_unreplied_syn_to
from kproxy.dataplane.anchor import ConntrackAnchor
from kproxy.dataplane.base import (
    Dataplane,
    DataplaneUnavailable,
    Draining,
    OwnedObject,
    SyncError,
)
from kproxy.memory import collector_paused, release_free_heap
from kproxy.model.objects import Protocol, Snapshot
from kproxy.modes import MODES
from kproxy.ops.snapshot_file import write_node_snapshot

if TYPE_CHECKING:
    from kproxy.ops.inspect.model import Destination

log = logging.getLogger("kproxy.switch")

PROBE_SAMPLE = 8
PROBE_TIMEOUT = 1.0
# A preflight backup older than this is not taken as the "before" record of a switch.
BEFORE_MAX_AGE = 120.0


@dataclass
class Step:
    name: str
    seconds: float
    detail: str = ""


# What the remove step deleted, in the report: a sample with every kind in it. The whole
# list (110,000 chains at 10,000 services) goes to a file in the state dir: kept in the
# report it held 16 MB in the daemon and was rewritten to status.json at every sync.
REMOVED_IN_REPORT = 100


@dataclass
class SwitchReport:
    from_mode: str
    to_mode: str
    # nftables mode's layouts on either side (None for other modes; layouts.py)
    from_layout: str | None = None
    to_layout: str | None = None
    ok: bool = False
    error: str | None = None
    steps: list[Step] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # a sample, see removed_total
    removed_total: int = 0
    removed_by_kind: dict[str, int] = field(default_factory=dict)
    removed_file: str | None = None  # every removed object, one a line
    # Why the state of the mode not serving could not all be removed: the old mode's after
    # the cut-over (the switch is done all the same), the new mode's after a failure. The
    # daemon's leftover cleanup takes what is left.
    leftover_error: str | None = None
    snapshots: list[str] = field(default_factory=list)
    duration: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @property
    def names(self) -> tuple[str, str]:
        """The two sides as one word each ("nftables-compact"; a mode otherwise)."""
        from kproxy.dataplane.nftables.layouts import target_name

        return target_name(self.from_mode, self.from_layout), target_name(
            self.to_mode, self.to_layout
        )


class SwitchFailed(Exception):
    """A step failed; the message says which and why."""


def plane_name(dp: Dataplane) -> str:
    """The dataplane's name among the readers' (ops.inspect.readers)."""
    from kproxy.dataplane.registry import dataplane_name

    return dataplane_name(dp)


def probe(ip: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when a TCP connection from here reaches an endpoint, else why not. A refusal
    from the endpoint counts as reached: the packet got through the dataplane."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((ip, port))
        except ConnectionRefusedError:
            return None
        except OSError as err:
            return f"{ip}:{port}: {err.strerror or type(err).__name__}"
    return None


def removed_sample(removed: list[OwnedObject], limit: int = REMOVED_IN_REPORT) -> list[str]:
    """Up to `limit` of the removed objects, the first of every kind included."""
    by_kind: dict[str, list[OwnedObject]] = {}
    for obj in removed:
        by_kind.setdefault(obj.kind, []).append(obj)
    per_kind = max(1, limit // max(1, len(by_kind)))
    sample = [obj for objs in by_kind.values() for obj in objs[:per_kind]]
    return [str(o) for o in sample[: max(limit, len(by_kind))]]


class ModeSwitcher:
    def __init__(
        self,
        *,
        make_dataplane: Callable[[str], Dataplane],  # by layouts.target_name()
        state_dir: Path | None,
        prober: Callable[[str, int], str | None] = probe,
        snapshotter: Callable[[], dict[str, object]] | None = None,
        plane_reader: Callable[[str], dict[Destination, str]] | None = None,
    ) -> None:
        """plane_reader: a dataplane's service destinations by its name (default: read
        from the kernel by ops.inspect's readers, imported when a switch verifies: the
        daemon does not load the inspectors before)."""
        self.make_dataplane = make_dataplane
        self.state_dir = state_dir
        self.prober = prober
        # None: the node's own snapshot, streamed to the file (ops.snapshot_file); tests
        # give a function that returns the document.
        self.snapshotter = snapshotter
        self.plane_reader = plane_reader
        self._reapers: list[threading.Thread] = []
        self._stop_reaping = threading.Event()
        self._recorder: threading.Thread | None = None

    def switch(
        self,
        old: Dataplane,
        snapshot: Snapshot,
        to: str,
        *,
        timeout: float,
        before: Path | None = None,
        layout: str | None = None,
    ) -> tuple[SwitchReport, Dataplane]:
        """Returns the report and the dataplane now in use (the new one only on success).
        before: a snapshot of the node taken just now (preflight's backup), kept instead of
        reading the dataplane again. layout: nftables mode's layout to switch to (between
        the layouts of nftables mode too: each has its own table)."""
        self.wait_records()  # the previous switch's after-record reads the kernel
        report = SwitchReport(
            from_mode=old.mode,
            to_mode=to,
            from_layout=old.nftables_layout,
            to_layout=layout if to == "nftables" else None,
        )
        was, target = report.names
        if to == "ipvs":
            # The new ipvs mode adopts the virtual servers still draining: nobody else may
            # delete them now.
            self.stop_reaping()
        started = time.monotonic()
        deadline = started + timeout
        new: Dataplane | None = None
        anchor = ConntrackAnchor()
        cut = False

        def step(name: str, fn: Callable[[], str]) -> None:
            if time.monotonic() > deadline and not cut:
                raise SwitchFailed(f"timed out after {timeout:.0f} s, before step {name!r}")
            t0 = time.monotonic()
            detail = fn()
            report.steps.append(Step(name, round(time.monotonic() - t0, 4), detail))
            log.info(
                "switch %s -> %s: %s done in %.3f s %s",
                was,
                target,
                name,
                report.steps[-1].seconds,
                detail,
            )

        try:
            step("check", lambda: self._check(report))
            new = self._create(target)
            step("snapshot", lambda: self._snapshot_before(report, before))
            step("anchor", lambda: f"conntrack anchor ({anchor.install()})")
            step("program", lambda: self._program(new, snapshot))
            step("verify", lambda: self._verify(new, snapshot))
        except Exception as err:
            # Anything before the cut-over, expected or not (a mode that cannot take the
            # snapshot raises ValueError, say): the old mode stays, the new one goes.
            expected = isinstance(err, SwitchFailed | SyncError | DataplaneUnavailable)
            report.error = str(err) if expected else f"{type(err).__name__}: {err}"
            self._roll_back(new, snapshot, report)
            anchor.remove()
            report.duration = round(time.monotonic() - started, 4)
            log.error("switch %s -> %s failed, %s is still serving: %s", was, target, was, err)
            return report, old
        try:
            cut = True
            assert new is not None  # programmed and verified above
            try:
                step("cut-over", lambda: self._detach(old))
            except Exception as err:
                self._undo_cut_over(old, new, snapshot, report, err)
                report.duration = round(time.monotonic() - started, 4)
                log.error("switch %s -> %s failed at the cut-over: %s", old.mode, to, report.error)
                return report, old
            try:
                step("remove", lambda: self._remove(old, report))
            except Exception as err:
                # The new mode serves from the cut-over on: a removal that fails leaves
                # leftovers, never a half-switched proxy that believes the old mode serves.
                report.leftover_error = f"{type(err).__name__}: {err}"
                log.error(
                    "switch %s -> %s: %s serves, but %s's state could not all be removed "
                    "(left to the leftover cleanup): %s",
                    was,
                    target,
                    target,
                    was,
                    err,
                )
        finally:
            anchor.remove()
        report.ok = True
        # The switch's duration ends when the old mode's state is gone; the record of the
        # result that follows is not part of it (it is a step of its own in the report).
        report.duration = round(time.monotonic() - started, 4)
        log.info("switched %s -> %s in %.3f s", was, target, report.duration)
        step("snapshot-after", lambda: self._record_after(report))
        return report, new

    def wait_records(self, timeout: float | None = None) -> None:
        """Until the after-switch snapshot being written in the background is done."""
        if self._recorder is not None:
            self._recorder.join(timeout)
            if not self._recorder.is_alive():
                self._recorder = None

    # --- steps -------------------------------------------------------------------------------

    def _check(self, report: SwitchReport) -> str:
        to = report.to_mode
        if to not in MODES:
            raise SwitchFailed(f"unknown mode {to!r}: valid modes are {', '.join(MODES)}")
        was, target = report.names
        if was == target:
            layout = f" ({report.to_layout} layout)" if report.to_layout else ""
            raise SwitchFailed(f"already in {to} mode{layout}")
        return f"{was} -> {target}"

    def _create(self, to: str) -> Dataplane:
        try:
            return self.make_dataplane(to)
        except DataplaneUnavailable as err:
            raise SwitchFailed(f"{to} mode cannot run here: {err}") from err

    def _snapshot_path(self, report: SwitchReport, when: str) -> Path | None:
        if self.state_dir is None:
            return None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        was, target = report.names
        return self.state_dir / f"switch-{stamp}-{was}-{target}-{when}.json"

    def _write_record(self, path: Path) -> None:
        if self.snapshotter is None:
            write_node_snapshot(path)
        else:
            with path.open("w") as f:
                json.dump(self.snapshotter(), f, indent=1)

    def _snapshot_before(self, report: SwitchReport, before: Path | None) -> str:
        if before is not None:
            try:
                age = time.time() - before.stat().st_mtime
            except OSError:
                age = None
            if age is not None and 0 <= age <= BEFORE_MAX_AGE:
                report.snapshots.append(str(before))
                return f"{before} (the preflight's verified backup, {age:.0f} s old)"
        try:
            path = self._snapshot_path(report, "before")
            if path is None:
                return "no state dir: not kept"
            try:
                self._write_record(path)
            except OSError:
                path.unlink(missing_ok=True)  # no half record (a full state dir)
                raise
        except OSError as err:
            # The record is what an operator restores from: no switch without it.
            raise SwitchFailed(
                f"could not keep the dataplane's snapshot before the switch in the state dir "
                f"({err}); nothing was changed: free the state dir and try again"
            ) from err
        report.snapshots.append(str(path))
        return str(path)

    def _record_after(self, report: SwitchReport) -> str:
        """The switch is done: its after-record must neither delay the answer nor undo it
        (an error escaping here would leave the caller with the old mode's dataplane while
        the kernel runs the new one)."""
        try:
            path = self._snapshot_path(report, "after")
        except OSError as err:
            log.warning("could not record the dataplane after the switch: %s", err)
            return f"not kept: {err}"
        if path is None:
            return "no state dir: not kept"

        def write() -> None:
            try:
                self._write_record(path)
            except Exception as err:
                log.warning("could not record the dataplane after the switch: %s", err)
            finally:
                # The old mode's state, the new mode's first full sync and this record's
                # dumps are garbage now: hand the heap back (kproxy.memory).
                release_free_heap()

        self._recorder = threading.Thread(target=write, name="switch-record", daemon=True)
        self._recorder.start()
        report.snapshots.append(str(path))
        return f"{path} (written in the background)"

    def _program(self, new: Dataplane, snapshot: Snapshot) -> str:
        with collector_paused():  # as the sync loop's syncs (kproxy.memory)
            result = new.sync(snapshot, full=True)
        return f"{result.services} service ports, {result.pieces} transactions"

    def _verify(self, new: Dataplane, snapshot: Snapshot) -> str:
        from kproxy.ops.inspect.destinations import missing_destinations, plane_destinations

        read = self.plane_reader or plane_destinations
        missing, expected = missing_destinations(snapshot, read(plane_name(new)))
        if missing:
            shown = ", ".join(str(k) for k in missing[:10])
            raise SwitchFailed(
                f"{new.mode} is missing {len(missing)} of {expected} service destinations"
                f" in the kernel: {shown}"
            )
        candidates = sorted(
            (sp.cluster_ip, sp.port)
            for sp in snapshot.services.values()
            if sp.protocol is Protocol.TCP and sp.has_internal_endpoints
        )
        sample = random.Random(len(candidates)).sample(
            candidates, min(PROBE_SAMPLE, len(candidates))
        )
        with ThreadPoolExecutor(max_workers=PROBE_SAMPLE) as pool:
            answers = list(pool.map(lambda target: self.prober(*target), sample))
        failures = [why for why in answers if why is not None]
        if failures:
            raise SwitchFailed(
                f"self-probe failed for {len(failures)} of {len(sample)} services: "
                + "; ".join(failures)
            )
        return f"{expected} destinations in the kernel, {len(sample)} services answered"

    def _detach(self, old: Dataplane) -> str:
        old.detach()
        return f"{old.mode} out of the packet path"

    def _remove(self, old: Dataplane, report: SwitchReport) -> str:
        # ipvs mode translates its connections itself: deleting its busy virtual servers
        # would reset them, so it retires (keeps those until they drain) instead.
        removed, draining = old.retire()
        old.close()
        report.removed = removed_sample(removed)
        report.removed_total = len(removed)
        for obj in removed:
            report.removed_by_kind[obj.kind] = report.removed_by_kind.get(obj.kind, 0) + 1
        report.removed_file = self._keep_removed(report, removed)
        detail = f"{len(removed)} objects of {old.mode} removed"
        if draining is not None and not draining.done:
            self._reap(draining)
            detail += f"; {draining.summary()}"
        return detail

    def _keep_removed(self, report: SwitchReport, removed: list[OwnedObject]) -> str | None:
        path = self._snapshot_path(report, "removed")
        if path is None or not removed:
            return None
        path = path.with_suffix(".txt")
        try:
            path.write_text("".join(f"{o}\n" for o in removed))
        except OSError as err:
            log.warning("could not keep the list of removed objects: %s", err)
            return None
        return str(path)

    def _reap(self, draining: Draining) -> None:
        """Reap a retired mode's draining state in a daemon thread of this process."""
        thread = threading.Thread(
            target=draining.run, args=(self._stop_reaping,), name="drain-reaper", daemon=True
        )
        self._reapers = [t for t in self._reapers if t.is_alive()] + [thread]
        thread.start()

    def stop_reaping(self, timeout: float = 5.0) -> None:
        """Stop reaping (what is left stays until a restart removes it as a leftover)."""
        self._stop_reaping.set()
        for t in self._reapers:
            t.join(timeout)
        self._reapers = []
        self._stop_reaping = threading.Event()

    def _undo_cut_over(
        self,
        old: Dataplane,
        new: Dataplane,
        snapshot: Snapshot,
        report: SwitchReport,
        err: Exception,
    ) -> None:
        """The old mode could not leave the packet path. Its detach is one atomic step, so
        the old mode most likely still serves; a full sync of it makes sure (it puts back
        whatever a detach killed after its commit removed) before the new mode goes. If
        that sync fails too, the new mode stays: it may be the only one serving. Its state
        is then left to the leftover cleanup after the old mode's next good sync."""
        report.error = f"cut-over failed: {type(err).__name__}: {err}"
        try:
            old.sync(snapshot, full=True)
        except Exception as sync_err:
            report.error += f"; {old.mode} could not be synced again either: {sync_err}"
            report.leftover_error = (
                f"{new.mode}'s state stays until {old.mode} syncs again (leftover cleanup)"
            )
            report.steps.append(Step("roll-back", 0.0, f"{new.mode} left in place"))
            return
        self._roll_back(new, snapshot, report)

    def _roll_back(self, new: Dataplane | None, snapshot: Snapshot, report: SwitchReport) -> None:
        if new is not None:
            try:
                new.cleanup()
                new.close()
            except Exception as err:  # keep rolling back; report it
                log.error("could not remove the new mode's state: %s", err)
                report.error = f"{report.error}; removing {new.mode}'s state also failed: {err}"
                # The daemon's leftover cleanup takes it after the old mode's next good sync.
                report.leftover_error = f"{new.mode}'s state not removed: {err}"
        cleared = 0
        vips = {
            ip
            for sp in snapshot.services.values()
            for ip in (sp.cluster_ip, *sp.external_ips, *sp.load_balancer_ips)
        }
        try:
            cleared = delete_unreplied_syn_to(vips)
        except Exception as err:
            log.warning("could not clear half-open conntrack entries: %s", err)
        report.steps.append(
            Step(
                "roll-back", 0.0, f"new mode removed; {cleared} half-open conntrack entries cleared"
            )
        )
