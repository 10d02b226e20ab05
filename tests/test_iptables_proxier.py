"""iptables mode apply logic (full/partial/pieces/failure) against a recording fake backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kproxy.dataplane.base import SyncError
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables import names
from kproxy.dataplane.iptables.backend import IptablesBackend, RestoreError, TableOutline
from kproxy.dataplane.iptables.proxier import IptablesDataplane
from kproxy.model.objects import ServicePortName
from kproxy.model.snapshot import ChangeTracker
from kproxy.ops.inspect.destinations import expected_destinations, programmed
from kproxy.ops.inspect.kernel import RecordedSource
from kproxy.ops.inspect.model import Destination
from kproxy.sources.base import ObjectEvent, ObjectKey
from tests.support.objects import endpoint, endpoint_slice, node, port, service


class FakeBackend:
    """Records restore inputs; remembers chains/jump rules the way the kernel would."""

    def __init__(self, flavour: str = "nft") -> None:
        self.flavour = flavour
        self.restores: list[str] = []
        self.nat_chains: set[str] = set()
        self.rules_present: set[tuple[str, str]] = set()
        self.fail_next: str | None = None
        self.checks = 0  # iptables -C calls
        # The nf_tables generation: None (unreadable, as with the tools' runner) unless a
        # test sets a number; then every committed table section adds one.
        self.gen: int | None = None
        self.on_restore: Callable[[], None] | None = None  # e.g. a commit of someone else

    def generation(self) -> int | None:
        return self.gen

    def restore(self, data: str, *, noflush: bool = True, counters: bool = True) -> None:
        assert noflush, "kproxy never restores without --noflush"
        if self.fail_next is not None:
            bad, self.fail_next = self.fail_next, None
            raise RestoreError(
                tool="iptables-nft-restore",
                command=["iptables-nft-restore"],
                returncode=1,
                stderr=f"iptables-nft-restore: line {bad} failed",
                input_data=data,
            )
        self.restores.append(data)
        if self.gen is not None:
            self.gen += data.count("\nCOMMIT\n")
        if self.on_restore is not None:
            self.on_restore()
        table = ""
        for line in data.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":") and table == "nat":
                self.nat_chains.add(line[1:].split()[0])
            elif line.startswith("-X "):
                self.nat_chains.discard(line[3:])
            elif line.startswith(("-I ", "-A ")) and line.split()[1] in (
                "INPUT",
                "FORWARD",
                "OUTPUT",
                "PREROUTING",
                "POSTROUTING",
            ):
                self.rules_present.add((table, line[3:]))

    def chains(self, table: str) -> set[str]:
        return set(self.nat_chains) if table == "nat" else set()

    def outlines(self, tables: Sequence[str]) -> dict[str, TableOutline]:
        return {
            t: TableOutline(
                chains=self.chains(t),
                builtin_rules={f"-A {r}" for tt, r in self.rules_present if tt == t},
            )
            for t in tables
        }

    def builtin_outlines(self, chains: dict[str, list[str]]) -> dict[str, TableOutline]:
        return {
            t: TableOutline(
                builtin_rules={
                    f"-A {r}" for tt, r in self.rules_present if tt == t and r.split()[0] in cs
                }
            )
            for t, cs in chains.items()
        }

    rule_present = IptablesBackend.rule_present

    def check_rule(self, table: str, spec: list[str]) -> bool:
        import shlex

        self.checks += 1
        return (table, shlex.join(spec).replace("'", '"')) in self.rules_present


def tracker_with(*objects: dict) -> ChangeTracker:
    t = ChangeTracker("node1")
    apply(t, *objects)
    return t


def apply(t: ChangeTracker, *objects: dict) -> None:
    t.apply(
        [
            ObjectEvent(
                ObjectKey(
                    o["kind"], o["metadata"].get("namespace", "default"), o["metadata"]["name"]
                ),
                o,
            )
            for o in objects
        ]
    )


def svc(i: int, eps: int = 2, first: int = 2) -> list[dict]:
    name = f"s{i}"
    return [
        service(name, f"10.96.{i // 250}.{i % 250 + 1}", [port("http", 80, 8080)]),
        endpoint_slice(
            name,
            [endpoint(f"10.244.{i // 250}.{first + j}") for j in range(eps)],
            [port("http", 8080)],
        ),
    ]


@pytest.fixture
def dp(tmp_path: Path) -> tuple[IptablesDataplane, FakeBackend]:
    backend = FakeBackend()
    plane = IptablesDataplane(
        backend,  # type: ignore[arg-type]
        NodeFacts(node_ips=("10.100.0.1",)),
        RuleOptions(cluster_cidrs=("10.244.0.0/16",)),
        state_dir=tmp_path,
    )
    return plane, backend


def test_first_sync_is_full_and_inserts_missing_jumps_once(
    dp: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = dp
    t = tracker_with(*svc(1))
    result = plane.sync(t.snapshot(), full=False)  # nothing applied yet: forced full
    assert result.full
    first = backend.restores[-1]
    assert "*filter" in first and "*nat" in first
    assert (
        '-I PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in first
    )
    assert "-A INPUT -j KUBE-FIREWALL" in first
    assert backend.checks == 0, "no rule in the built-in chains jumps to ours: nothing to -C"
    plane.sync(t.snapshot(), full=True)
    assert "-I " not in backend.restores[-1], "jumps already in place are not added again"
    assert backend.checks == 0, "jumps found in the save need no iptables -C"


def test_a_jump_that_prints_differently_is_confirmed_by_check_not_duplicated(
    dp: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = dp
    t = tracker_with(*svc(1))
    plane.sync(t.snapshot(), full=True)
    real_outlines = backend.outlines
    # An older iptables printed the jumps in another form: the text search misses them all.
    backend.outlines = lambda tables: {  # type: ignore[method-assign]
        k: TableOutline(
            chains=v.chains, builtin_rules={r.replace('"', "'") for r in v.builtin_rules}
        )
        for k, v in real_outlines(tables).items()
    }
    backend.checks = 0
    plane.sync(t.snapshot(), full=True)
    assert backend.checks > 0
    assert "-I " not in backend.restores[-1]


def test_partial_sync_writes_only_the_changed_service(
    dp: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = dp
    t = tracker_with(*svc(1), *svc(2))
    plane.sync(t.snapshot(), full=True)
    old_seps = {c for c in backend.nat_chains if c.startswith(names.SEP_PREFIX)}
    apply(t, svc(2, first=10)[1])  # s2's endpoints move
    result = plane.sync(t.snapshot(), full=False)
    assert not result.full and result.rewritten == 1
    data = backend.restores[-1]
    assert "*filter" not in data, "filter rules did not change, so the table is left alone"
    s1 = names.SVC_PREFIX + names.port_proto_hash(ServicePortName("default", "s1", "http"))
    s2 = names.SVC_PREFIX + names.port_proto_hash(ServicePortName("default", "s2", "http"))
    assert f":{s2} - [0:0]" in data and s1 not in data
    assert "-A KUBE-SERVICES" not in data, "KUBE-SERVICES unchanged: not rewritten"
    stale = sorted(old_seps - {c for c in backend.nat_chains})
    assert len(stale) == 2 and all(f"-X {c}" in data for c in stale)


def test_sync_without_changes_applies_nothing(dp: tuple[IptablesDataplane, FakeBackend]) -> None:
    plane, backend = dp
    t = tracker_with(*svc(1))
    plane.sync(t.snapshot(), full=True)
    n = len(backend.restores)
    plane.sync(t.snapshot(), full=False)
    assert len(backend.restores) == n


def test_new_service_rewrites_kube_services(dp: tuple[IptablesDataplane, FakeBackend]) -> None:
    plane, backend = dp
    t = tracker_with(*svc(1))
    plane.sync(t.snapshot(), full=True)
    apply(t, *svc(2))
    plane.sync(t.snapshot(), full=False)
    data = backend.restores[-1]
    assert ":KUBE-SERVICES - [0:0]" in data and data.count('cluster IP" -m tcp') >= 2


def test_large_full_sync_on_nft_is_loaded_in_ordered_pieces(tmp_path: Path) -> None:
    backend = FakeBackend("nft")
    plane = IptablesDataplane(
        backend,  # type: ignore[arg-type]
        NodeFacts(node_ips=("10.100.0.1",)),
        RuleOptions(cluster_cidrs=("10.244.0.0/16",)),
        piece_services=100,
    )
    objects = [o for i in range(600) for o in svc(i, eps=1)]
    t = tracker_with(*objects)
    result = plane.sync(t.snapshot(), full=True)
    # A fresh node: piece 0 creates the fixed top-level nat chains service chains jump to,
    # then 6 pieces of service chains, then the top-level chains.
    assert result.pieces == 8
    pieces = backend.restores
    assert ":KUBE-MARK-MASQ - [0:0]" in pieces[0] and ":KUBE-SVC-" not in pieces[0]
    assert "-A KUBE-SERVICES" not in pieces[0]
    # Service chains next (nat only, no top-level chain touched), top-level chains last.
    for piece in pieces[1:-1]:
        assert "*filter" not in piece and ":KUBE-SERVICES " not in piece
    assert ":KUBE-SERVICES - [0:0]" in pieces[-1] and "*filter" in pieces[-1]
    assert sum(p.count(":KUBE-SVC-") for p in pieces) == 600
    # On a live node (the chains exist) there is no piece 0.
    backend.restores.clear()
    assert plane.sync(t.snapshot(), full=True).pieces == 7
    # Pieces over a serving table are bigger (each commit re-validates the reachable table):
    # sqrt(4.5 * 600) = 52 services per piece, 12 pieces, against 30 of 20 on a fresh node.
    small = IptablesDataplane(FakeBackend("nft"), NodeFacts(), RuleOptions(), piece_services=20)  # type: ignore[arg-type]
    assert small.sync(t.snapshot(), full=True).pieces == 1 + 30 + 1
    assert small.sync(t.snapshot(), full=True).pieces == 12 + 1
    # A legacy backend rewrites the whole table per restore anyway: one piece there.
    legacy = FakeBackend("legacy")
    plane2 = IptablesDataplane(legacy, NodeFacts(), RuleOptions(), piece_services=100)  # type: ignore[arg-type]
    assert plane2.sync(t.snapshot(), full=True).pieces == 1


def test_failed_restore_keeps_input_and_forces_full_sync(
    dp: tuple[IptablesDataplane, FakeBackend], tmp_path: Path
) -> None:
    plane, backend = dp
    t = tracker_with(*svc(1))
    plane.sync(t.snapshot(), full=True)
    apply(t, svc(1, first=20)[1])
    backend.fail_next = "3"
    with pytest.raises(SyncError, match="line 3"):
        plane.sync(t.snapshot(), full=False)
    kept = (tmp_path / "iptables-failed-restore.txt").read_text()
    assert "KUBE-SEP-" in kept
    assert "line 3" in (tmp_path / "iptables-failed-restore.error").read_text()
    result = plane.sync(t.snapshot(), full=False)
    assert result.full, "after a failure the next sync is full"


def test_detach_removes_every_jump_in_one_restore_nat_first(
    dp: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = dp
    plane.sync(tracker_with(*svc(1)).snapshot(), full=True)
    plane.detach()
    data = backend.restores[-1]
    assert data.index("*nat") < data.index("*filter")
    deleted = [line for line in data.splitlines() if line.startswith("-D ")]
    assert len(deleted) == 12  # upstream's jump list
    assert (
        '-D PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
        in deleted
    )
    assert not any("KUBE-FIREWALL" in line for line in deleted), "kubelet's jumps stay"


def test_partial_sync_deletes_the_chains_of_a_removed_service(
    dp: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = dp
    t = tracker_with(*svc(1), *svc(2))
    plane.sync(t.snapshot(), full=True)
    s2 = names.port_proto_hash(ServicePortName("default", "s2", "http"))
    owned = {c for c in backend.nat_chains if s2 in c}
    t.apply([ObjectEvent(ObjectKey("Service", "default", "s2"), None)])
    result = plane.sync(t.snapshot(), full=False)
    assert not result.full and result.stale_removed == 3  # KUBE-SVC- and two KUBE-SEP-
    data = backend.restores[-1]
    seps = {c for c in backend.nat_chains if c.startswith(names.SEP_PREFIX)}
    assert len(seps) == 2, "only s1's endpoint chains are left"
    assert f"-X {names.SVC_PREFIX}{s2}" in data and not owned & backend.nat_chains
    assert ServicePortName("default", "s2", "http") not in plane.renderer._cache


def test_partial_sync_after_a_pod_cidr_change_rewrites_every_service(tmp_path: Path) -> None:
    backend = FakeBackend()
    plane = IptablesDataplane(
        backend,  # type: ignore[arg-type]
        NodeFacts(node_ips=("10.100.0.1",)),
        RuleOptions(detect_local_mode="NodeCIDR"),
        state_dir=tmp_path,
    )
    t = tracker_with(*svc(1), *svc(2), node("node1", pod_cidr="10.244.1.0/24"))
    plane.sync(t.snapshot(), full=True)
    apply(t, node("node1", pod_cidr="10.244.7.0/24"))
    apply(t, svc(2, first=10)[1])  # and one service changes too
    result = plane.sync(t.snapshot(), full=False)
    assert result.rewritten == 2, "every service's masquerade rule names the pod CIDR"
    data = backend.restores[-1]
    assert "10.244.7.0/24" in data and "10.244.1.0/24" not in data


PORTALS_JUMP = 'PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES'


def test_legacy_resync_reads_the_tables_beside_its_restore_and_finds_no_drift() -> None:
    backend = FakeBackend("legacy")
    plane = IptablesDataplane(backend, NodeFacts(), RuleOptions())  # type: ignore[arg-type]
    t = tracker_with(*svc(1), *svc(2))
    first = plane.sync(t.snapshot(), full=True)
    assert f"-I {PORTALS_JUMP}" in backend.restores[-1], "the first sync adds the jumps"
    assert first.pieces == 1
    backend.restores.clear()
    result = plane.sync(t.snapshot(), full=True)
    assert result.full and result.pieces == 1 and result.stale_removed == 0
    (data,) = backend.restores
    assert "-I PREROUTING" not in data, "the jumps were in place: none written again"
    assert data.count(":KUBE-SVC-") == 2, "every service chain is still rewritten"


def test_legacy_resync_repairs_a_removed_jump_and_a_foreign_stale_chain_after_its_restore() -> None:
    backend = FakeBackend("legacy")
    plane = IptablesDataplane(backend, NodeFacts(), RuleOptions())  # type: ignore[arg-type]
    t = tracker_with(*svc(1))
    plane.sync(t.snapshot(), full=True)
    # Behind kproxy's back: someone deletes the portals jump and leaves a chain of
    # kube-proxy's shape (e.g. an upstream kube-proxy that ran here before).
    backend.rules_present.discard(("nat", PORTALS_JUMP))
    backend.nat_chains.add("KUBE-SEP-AAAAAAAAAAAAAAAA")
    backend.restores.clear()
    result = plane.sync(t.snapshot(), full=True)
    main, repair = backend.restores
    assert "-I PREROUTING" not in main
    assert f"-I {PORTALS_JUMP}" in repair and "-X KUBE-SEP-AAAAAAAAAAAAAAAA" in repair
    assert "KUBE-SVC-" not in repair, "the repair touches only what drifted"
    assert result.stale_removed == 1 and result.pieces == 2
    assert ("nat", PORTALS_JUMP) in backend.rules_present
    assert "KUBE-SEP-AAAAAAAAAAAAAAAA" not in backend.nat_chains
    # The next partial sync trusts the repaired state.
    apply(t, svc(1, first=30)[1])
    assert not plane.sync(t.snapshot(), full=False).full


def test_legacy_resync_that_cannot_read_the_tables_makes_the_next_sync_check_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kproxy.dataplane.iptables.backend import IptablesError

    backend = FakeBackend("legacy")
    plane = IptablesDataplane(backend, NodeFacts(), RuleOptions())  # type: ignore[arg-type]
    t = tracker_with(*svc(1))
    plane.sync(t.snapshot(), full=True)
    real_outlines = backend.outlines

    def broken(tables: Sequence[str]) -> dict[str, TableOutline]:
        raise IptablesError("iptables-legacy-save failed with exit code 1: boom")

    backend.outlines = broken  # type: ignore[method-assign]
    assert plane.sync(t.snapshot(), full=True).full
    assert "could not read the tables" in caplog.text
    backend.outlines = real_outlines  # type: ignore[method-assign]
    backend.rules_present.discard(("nat", PORTALS_JUMP))
    backend.restores.clear()
    result = plane.sync(t.snapshot(), full=False)
    assert result.full, "unverified: the next sync is full"
    (data,) = backend.restores
    assert f"-I {PORTALS_JUMP}" in data, "and reads the tables before its restore"


@pytest.fixture
def counted(dp: tuple[IptablesDataplane, FakeBackend]) -> tuple[IptablesDataplane, FakeBackend]:
    """dp with a readable nf_tables generation, after a first full sync of s1 and s2."""
    plane, backend = dp
    backend.gen = 100
    plane.sync(tracker_with(*svc(1), *svc(2)).snapshot(), full=True)
    return plane, backend


def test_full_sync_over_a_kernel_only_kproxy_changed_writes_only_changes(
    counted: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = counted
    t = tracker_with(*svc(1), *svc(2))
    n = len(backend.restores)
    result = plane.sync(t.snapshot(), full=True)
    assert result.full and result.kernel_unchanged and result.rewritten == 0
    assert len(backend.restores) == n, "nothing changed: nothing written"
    apply(t, svc(2, first=10)[1])
    assert plane.sync(t.snapshot(), full=False).rewritten == 1  # our own commit: still ours
    result = plane.sync(t.snapshot(), full=True)
    assert result.kernel_unchanged and len(backend.restores) == n + 1
    assert not plane.drifted(), "custody answers the canary question without a process"


def test_any_other_commit_makes_the_next_full_sync_read_and_rewrite_everything(
    counted: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = counted
    snap = tracker_with(*svc(1), *svc(2)).snapshot()
    assert backend.gen is not None
    backend.gen += 1  # someone else's commit between our syncs
    result = plane.sync(snap, full=True)
    assert not result.kernel_unchanged and "-A KUBE-SERVICES" in backend.restores[-1]
    assert plane.sync(snap, full=True).kernel_unchanged, "that sync re-established custody"


def test_a_commit_beside_our_restore_ends_custody(
    counted: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = counted
    t = tracker_with(*svc(1), *svc(2))

    def someone_else() -> None:
        assert backend.gen is not None
        backend.gen += 1

    backend.on_restore = someone_else
    apply(t, svc(2, first=10)[1])
    plane.sync(t.snapshot(), full=False)
    backend.on_restore = None
    assert not plane.sync(t.snapshot(), full=True).kernel_unchanged


def test_a_failed_restore_ends_custody(counted: tuple[IptablesDataplane, FakeBackend]) -> None:
    plane, backend = counted
    t = tracker_with(*svc(1), *svc(2))
    apply(t, svc(2, first=10)[1])
    backend.fail_next = "3"
    with pytest.raises(SyncError):
        plane.sync(t.snapshot(), full=False)
    assert not plane.sync(t.snapshot(), full=True).kernel_unchanged


def proven_destinations(plane: IptablesDataplane) -> dict[Destination, str] | None:
    """What the reader finds in the dataplane's proof (None: no proof)."""
    proven = plane.proven_dumps()
    if not proven:
        return None
    return programmed(RecordedSource(dumps=proven), ["iptables-nft"]).get("iptables-nft", {})


def test_custody_proves_the_destinations_of_the_last_write(
    counted: tuple[IptablesDataplane, FakeBackend],
) -> None:
    plane, backend = counted
    t = tracker_with(*svc(1), *svc(2))
    found = proven_destinations(plane)
    assert found is not None and set(found) == expected_destinations(t.snapshot())
    assert set(found.values()) == {"default/s1:http", "default/s2:http"}
    apply(t, *svc(3))
    plane.sync(t.snapshot(), full=False)  # our own commit: the proof follows it
    found = proven_destinations(plane)
    assert found is not None and set(found) == expected_destinations(t.snapshot())
    assert len(found) == 3
    assert backend.gen is not None
    backend.gen += 1  # someone else's commit: nothing is proven until a full sync reads
    assert proven_destinations(plane) is None
    plane.sync(t.snapshot(), full=True)
    assert proven_destinations(plane) is not None


def test_no_generation_no_proof(dp: tuple[IptablesDataplane, FakeBackend]) -> None:
    plane, _backend = dp  # its generation cannot be read (as with legacy, or a tools' runner)
    plane.sync(tracker_with(*svc(1)).snapshot(), full=True)
    assert plane.proven_dumps() == {}
