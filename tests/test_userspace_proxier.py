"""UserspaceDataplane's sync sequence with a fake iptables and fake workers (no root)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kproxy.dataplane.base import SyncError
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.userspace import control, proxier
from kproxy.dataplane.userspace.control import ControlError, WorkerSet
from kproxy.dataplane.userspace.proxier import UserspaceDataplane, saved_ports
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.objects import endpoint, endpoint_slice, node, port, service

FACTS = NodeFacts(node_ips=("10.100.0.1",), local_addresses=("10.100.0.1",))


class FakeWorker:
    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status


class FakeWorkers:
    """Records what the dataplane publishes; `errors` simulates a port another program holds."""

    def __init__(self, events: list[tuple[str, Any]], tmp: Path) -> None:
        self.events = events
        self.count = 2
        self.dir = tmp / "userspace"
        self.dir.mkdir()
        self.table_path = self.dir / "table.json"
        self.generation = 0
        self.bad_port: int | None = None
        self.fd_limited: int | None = None  # the port a worker had no descriptor for
        self.timeouts: list[float] = []

    def acquire(self) -> None:
        pass

    def ensure(self) -> tuple[list[int], list[int]]:
        return [0, 1], []

    def read_table(self) -> None:
        return None

    def write_table(self, table: dict[str, Any]) -> int:
        self.generation += 1
        self.events.append(("table", sorted(lst["key"] for lst in table["listeners"])))
        self.last = table
        return self.generation

    def wait_applied(self, generation: int, timeout: float) -> dict[int, FakeWorker]:
        self.events.append(("applied", generation))
        self.timeouts.append(timeout)
        errors = {
            lst["key"]: "taken" for lst in self.last["listeners"] if lst["port"] == self.bad_port
        }
        kinds = dict.fromkeys(errors, "in-use")
        for lst in self.last["listeners"]:
            if lst["port"] == self.fd_limited:
                errors[lst["key"]] = f"cannot listen on tcp port {lst['port']}: no file descriptor"
                kinds[lst["key"]] = "fd-limit"
        return {
            0: FakeWorker({"errors": errors, "error_kinds": kinds}),
            1: FakeWorker({"errors": {}}),
        }

    def workers(self) -> dict[int, Any]:
        return {}


def runner_for(events: list[tuple[str, Any]], fail_restore: list[bool]):
    def run(argv: Sequence[str], data: str | None) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        if any(a.endswith("-restore") for a in argv):
            events.append(("restore", data))
            if fail_restore and fail_restore.pop(0):
                return subprocess.CompletedProcess(argv, 1, "", "line 3 failed")
            return subprocess.CompletedProcess(argv, 0, "", "")
        if "-C" in argv:
            return subprocess.CompletedProcess(argv, 1, "", "")  # every jump is missing
        if argv[:1] == ["iptables-nft"] and "--version" in argv:
            return subprocess.CompletedProcess(argv, 0, "iptables v1.8.9 (nf_tables)", "")
        return subprocess.CompletedProcess(argv, 0, "", "")

    return run


def make(tmp_path: Path, fail_restore: list[bool] | None = None):
    events: list[tuple[str, Any]] = []
    backend = IptablesBackend("nft", runner=runner_for(events, fail_restore or []))
    dp = UserspaceDataplane(backend, FACTS, RuleOptions(), state_dir=tmp_path, workers=2)
    dp.workers = FakeWorkers(events, tmp_path)  # type: ignore[assignment]
    dp._ensure_policy_route = lambda: None  # type: ignore[method-assign]
    return dp, events


def snap(*names: str):
    objs: list[dict[str, Any]] = [node()]
    for i, name in enumerate(names):
        objs += [
            service(name, f"10.96.0.{10 + i}", [port("http", 80, 8080)]),
            endpoint_slice(name, [endpoint("10.244.0.2")], [port("http", 8080)]),
        ]
    return snapshot_from_objects(objs, "node1")


def kinds(events: list[tuple[str, Any]]) -> list[Any]:
    return [e if e[0] != "restore" else ("restore",) for e in events]


def test_listeners_are_up_before_their_rules_and_retired_only_after(tmp_path: Path) -> None:
    dp, events = make(tmp_path)
    dp.sync(snap("web"), full=True)
    web, api = "default/web:http/tcp/cluster", "default/api:http/tcp/cluster"
    assert kinds(events) == [("table", [web]), ("applied", 1), ("restore",)]
    restore = events[2][1]
    assert "-I PREROUTING" in restore and "-A PREROUTING -m addrtype" in restore
    events.clear()
    dp.sync(snap("web", "api"), full=False)
    assert kinds(events) == [("table", [api, web]), ("applied", 2), ("restore",)]
    assert "-I PREROUTING" not in events[2][1]  # jumps are only checked on full syncs
    events.clear()
    dp.sync(snap("api"), full=False)
    # web's listener is kept while its rule still exists, dropped after the restore.
    assert kinds(events) == [("table", [api, web]), ("applied", 3), ("restore",), ("table", [api])]
    events.clear()
    dp.sync(snap("api"), full=False)
    assert events == []  # nothing changed: no table, no restore


def test_the_wait_for_the_workers_grows_with_the_listeners_they_open(tmp_path: Path) -> None:
    # A switch to userspace at 10,000 services failed in UML on a fixed 5 s: a worker
    # acknowledges a table only once it has opened every new listener.
    dp, _ = make(tmp_path)
    names = [f"svc{i}" for i in range(200)]
    dp.sync(snap(*names), full=True)
    dp.sync(snap(*names, "one-more"), full=False)
    base = dp.ack_timeout
    first, second = dp.workers.timeouts  # type: ignore[attr-defined]
    assert first == pytest.approx(base + 200 * proxier.ACK_PER_NEW_LISTENER)
    assert second == pytest.approx(base + proxier.ACK_PER_NEW_LISTENER)


def test_a_port_taken_by_another_program_moves_in_the_same_sync(tmp_path: Path) -> None:
    dp, _ = make(tmp_path)
    first = dp._publish(snap("web"), force=True).ports["default/web:http/tcp/cluster"]
    (tmp_path / "b").mkdir()
    dp2, events2 = make(tmp_path / "b")
    dp2.workers.bad_port = first  # type: ignore[attr-defined]
    dp2.sync(snap("web"), full=True)
    moved = dp2.last_plan.ports["default/web:http/tcp/cluster"]  # type: ignore[union-attr]
    assert moved != first
    assert [e[0] for e in events2] == ["table", "applied", "table", "applied", "restore"]
    assert first in dp2._bad_ports


def test_listeners_a_worker_has_no_descriptor_for_fail_the_sync_and_keep_their_ports(
    tmp_path: Path,
) -> None:
    # Moving them would not help (it is the open-file limit, not the port): the sync fails
    # naming the cause, before any rule points at a port nobody listens on.
    dp, _ = make(tmp_path)
    first = dp._publish(snap("web"), force=True).ports["default/web:http/tcp/cluster"]
    (tmp_path / "b").mkdir()
    dp2, events2 = make(tmp_path / "b")
    dp2.workers.fd_limited = first  # type: ignore[attr-defined]
    with pytest.raises(SyncError, match=r"worker 0 could not open 1 of 1 listeners: .*descriptor"):
        dp2.sync(snap("web"), full=True)
    assert [e[0] for e in events2] == ["table", "applied"]  # no restore, no second try
    assert not dp2._bad_ports


def test_a_failed_restore_keeps_the_input_and_forces_a_full_sync(tmp_path: Path) -> None:
    dp, events = make(tmp_path, fail_restore=[True])
    with pytest.raises(SyncError, match="restore failed") as err:
        dp.sync(snap("web"), full=False)
    assert err.value.kept_input and "KUBE-PORTALS-CONTAINER" in err.value.kept_input
    assert (tmp_path / "userspace" / "failed-restore.txt").read_text() == err.value.kept_input
    events.clear()
    dp.sync(snap("web"), full=False)  # still treated as full: jumps checked again
    assert "-I PREROUTING" in events[-1][1]


def test_ports_survive_a_controller_restart(tmp_path: Path) -> None:
    dp, _ = make(tmp_path)
    dp.sync(snap("web", "api", "dns"), full=True)
    ports = dp.last_plan.ports  # type: ignore[union-attr]
    backend = IptablesBackend("nft", runner=runner_for([], []))
    again = UserspaceDataplane(backend, FACTS, RuleOptions(), state_dir=tmp_path, workers=2)
    assert again._ports == ports
    assert saved_ports(tmp_path) == ports


def test_table_generations_continue_across_controllers_and_the_lock_is_exclusive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(WorkerSet, "notify", lambda self: None)
    one = WorkerSet(tmp_path, count=2)
    one.acquire()
    assert one.write_table({"listeners": []}) == 1
    assert one.write_table({"listeners": []}) == 2
    other = WorkerSet(tmp_path, count=2)
    with pytest.raises(ControlError, match="another kproxy controller"):
        other.acquire(timeout=0.2)
    one.release()
    other.acquire(timeout=0.2)
    assert other.write_table({"listeners": []}) == 3
    table = control.read_json(tmp_path / "userspace" / "table.json")
    assert table["generation"] == 3 and table["workers"] == 2
    other.release()


def test_a_status_file_of_a_foreign_process_is_not_adopted(tmp_path: Path) -> None:
    import os

    ws = WorkerSet(tmp_path, count=1)
    ws.dir.mkdir(parents=True)
    # This test process is alive, but it is not a worker of this folder.
    control.write_json_atomic(
        ws.status_path(0),
        {
            "index": 0,
            "pid": os.getpid(),
            "starttime": control.proc_starttime(os.getpid()),
        },
    )
    assert ws.workers() == {}


def _flow(proto: str, src: str, sport: int, dst: str, dport: int, reply: str, rport: int) -> Any:
    from kproxy.conntrack import ConntrackEntry

    return ConntrackEntry(proto, src, dst, sport, dport, reply, src, rport, sport)


def test_redirected_flow_filters_pick_only_flows_answered_by_a_listener() -> None:
    from kproxy.conntrack import DeleteFilter
    from kproxy.dataplane.userspace.proxier import redirected_flow_filters

    listeners = [
        {"port": 20001, "destinations": ["10.96.0.53:53"]},
        {"port": 20002, "destinations": ["nodePort 30053", "192.0.2.7:53"]},
    ]
    entries = [
        # Two clients of the ClusterIP redirected to proxy port 20001: one filter for both.
        _flow("udp", "10.244.0.5", 4000, "10.96.0.53", 53, "10.100.0.1", 20001),
        _flow("udp", "10.244.0.6", 4001, "10.96.0.53", 53, "10.100.0.1", 20001),
        # A NodePort flow answered by its listener...
        _flow("udp", "10.0.0.9", 5000, "10.100.0.1", 30053, "10.100.0.1", 20002),
        # ...and one to the same address and port that a local program answered itself:
        # a filter by destination would take it too, so the redirected flow gets its own.
        _flow("udp", "10.0.0.8", 5001, "10.100.0.1", 30053, "10.100.0.1", 30053),
        # DNATed to a pod by another mode, and a TCP flow: not touched.
        _flow("udp", "10.244.0.7", 4002, "10.96.0.99", 53, "10.244.1.3", 53),
        _flow("tcp", "10.244.0.8", 4003, "10.96.0.53", 53, "10.100.0.1", 20001),
    ]
    assert redirected_flow_filters(entries, listeners) == [
        DeleteFilter(
            "udp",
            orig_src="10.0.0.9",
            orig_sport=5000,
            orig_dst="10.100.0.1",
            orig_dport=30053,
            reply_src="10.100.0.1",
        ),
        DeleteFilter("udp", orig_dst="10.96.0.53", orig_dport=53, reply_src="10.100.0.1"),
    ]


def test_leftover_cleanup_leaves_the_chains_to_the_iptables_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node serving another mode the iptables cleanup of both backends removes the
    userspace chains first; reading them again here cost two iptables-nft-saves."""
    from kproxy.dataplane.iptables import cleanup as iptables_cleanup
    from kproxy.dataplane.userspace.proxier import clean_userspace_leftovers

    def no_read(*args: object, **kwargs: object) -> list[object]:
        raise AssertionError("iptables read by the userspace leftover cleanup")

    monkeypatch.setattr(iptables_cleanup, "owned_state", no_read)
    found = clean_userspace_leftovers(tmp_path / "state", dry_run=True)
    assert [o for o in found if o.kind.startswith("iptables")] == []


def test_remapped_clients_map_the_port_a_worker_sees_to_the_clients_own() -> None:
    from kproxy.conntrack import ConntrackEntry
    from kproxy.dataplane.userspace.proxier import remapped_clients

    listeners = [{"port": 28082, "destinations": ["10.96.0.53:53"]}]
    remapped = ConntrackEntry(
        "udp", "10.100.0.2", "10.96.0.53", 41053, 53, "10.100.0.1", "10.100.0.2", 28082, 45328
    )
    plain = _flow("udp", "10.100.0.3", 41054, "10.96.0.53", 53, "10.100.0.1", 28082)
    # Another mode's flow, remapped too (masquerade): not a worker's business.
    foreign = ConntrackEntry(
        "udp", "10.100.0.4", "10.96.0.99", 5000, 53, "10.244.0.2", "10.100.0.1", 53, 61000
    )
    assert remapped_clients([remapped, plain, foreign], listeners) == {"10.100.0.2:45328": 41053}
