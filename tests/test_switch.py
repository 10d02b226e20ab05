"""ModeSwitcher's order and its rollback, with fake dataplanes (no kernel)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kproxy.dataplane.base import SyncResult
from kproxy.model.objects import Snapshot
from kproxy.ops.inspect.destinations import expected_destinations
from kproxy.ops.snapshot import programmed_in
from kproxy.switch import ModeSwitcher
from tests.support.switch_fakes import PROGRAMMED, SNAP, Plane, kernel_with


def switcher_for(
    calls: list[str],
    *,
    state_dir: Path | None = None,
    programmed: dict | None = None,
    prober: Callable[[str, int], str | None] = lambda ip, p: None,
    snapshotter: Callable[[], dict[str, object]] | None = None,
    plane: type[Plane] = Plane,
) -> ModeSwitcher:
    """A switcher over fake planes whose kernel state is `programmed` (PROGRAMMED)."""
    kernel = PROGRAMMED if programmed is None else programmed
    return ModeSwitcher(
        make_dataplane=lambda mode: plane(mode, calls),
        state_dir=state_dir,
        prober=prober,
        snapshotter=snapshotter or (lambda: kernel),
        plane_reader=lambda name: programmed_in(kernel).get(name, {}),
    )


def test_expected_destinations_skip_services_without_endpoints() -> None:
    assert {str(k) for k in expected_destinations(SNAP)} == {
        "tcp 10.96.0.10:80",
        "tcp 10.99.0.10:80",
    }


def test_make_before_break_order(tmp_path: Path) -> None:
    calls: list[str] = []
    switcher = switcher_for(calls, state_dir=tmp_path)
    report, now = switcher.switch(Plane("iptables", calls), SNAP, "nftables", timeout=30)
    assert report.ok, report.error
    assert now.mode == "nftables"
    assert calls == ["nftables.sync", "iptables.detach", "iptables.cleanup"]
    switcher.wait_records(10)  # the after-record is written in the background
    assert len(report.snapshots) == 2 and all(Path(p).exists() for p in report.snapshots)


def test_the_report_keeps_a_sample_of_every_kind_removed_and_the_whole_list_in_a_file(
    tmp_path: Path,
) -> None:
    # At 10,000 services an iptables mode leaves 110,000 chains: the report (kept by the
    # daemon, written to status.json at every sync) holds a sample, the file all of them.
    from kproxy.dataplane.base import OwnedObject
    from kproxy.switch import REMOVED_IN_REPORT

    chains = [OwnedObject("iptables-chain", "nat", f"KUBE-SEP-{i:06d}", "kube") for i in range(500)]
    extra = [OwnedObject("iptables-rule", "nat", "PREROUTING -j KUBE-SERVICES", "jump")]

    class Big(Plane):
        def cleanup(self, *, dry_run: bool = False) -> list:
            self.calls.append(f"{self.mode}.cleanup")
            return chains + extra

    calls: list[str] = []
    switcher = switcher_for(calls, state_dir=tmp_path)
    report, _ = switcher.switch(Big("iptables", calls), SNAP, "nftables", timeout=30)
    assert report.ok and report.removed_total == 501
    assert report.removed_by_kind == {"iptables-chain": 500, "iptables-rule": 1}
    assert len(report.removed) <= REMOVED_IN_REPORT
    assert str(extra[0]) in report.removed and str(chains[0]) in report.removed
    assert report.removed_file is not None
    kept = Path(report.removed_file).read_text().splitlines()
    assert kept == [str(o) for o in chains + extra]
    switcher.wait_records(10)


def test_a_failing_after_record_does_not_undo_a_done_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    switcher = switcher_for(calls, state_dir=tmp_path)
    real = ModeSwitcher._snapshot_path

    def full_disk(self: ModeSwitcher, report: object, when: str) -> Path | None:
        if when == "after":
            raise OSError(28, "No space left on device")
        return real(self, report, when)  # type: ignore[arg-type]

    monkeypatch.setattr(ModeSwitcher, "_snapshot_path", full_disk)
    report, now = switcher.switch(Plane("iptables", calls), SNAP, "nftables", timeout=30)
    assert report.ok and now.mode == "nftables"
    step = next(s for s in report.steps if s.name == "snapshot-after")
    assert "No space left" in step.detail


def test_a_fresh_preflight_backup_is_the_before_record(tmp_path: Path) -> None:
    calls: list[str] = []
    taken: list[int] = []

    def snapshotter() -> dict[str, object]:
        taken.append(1)
        return PROGRAMMED

    switcher = switcher_for(calls, state_dir=tmp_path, snapshotter=snapshotter)
    backup = tmp_path / "preflight-backup.json"
    backup.write_text("{}")
    report, _ = switcher.switch(
        Plane("iptables", calls), SNAP, "nftables", timeout=30, before=backup
    )
    switcher.wait_records(10)
    assert report.ok and report.snapshots[0] == str(backup)
    assert taken == [1], "only the after-record read the dataplane"
    step = next(s for s in report.steps if s.name == "snapshot")
    assert "preflight's verified backup" in step.detail
    # A stale one (or none) is not trusted: the switch reads the dataplane itself.
    old = time.time() - 600
    os.utime(backup, (old, old))
    report, _ = switcher.switch(
        Plane("iptables", calls), SNAP, "nftables", timeout=30, before=backup
    )
    switcher.wait_records(10)
    assert report.ok and report.snapshots[0] != str(backup) and len(taken) == 3


def test_verification_failure_rolls_back_and_keeps_the_old_mode(tmp_path: Path) -> None:
    calls: list[str] = []
    missing_one = kernel_with("10.96.0.10")
    switcher = switcher_for(calls, programmed=missing_one)
    old = Plane("iptables", calls)
    report, now = switcher.switch(old, SNAP, "nftables", timeout=30)
    assert not report.ok and now is old
    assert "missing 1 of 2 service destinations" in (report.error or "")
    assert "tcp 10.99.0.10:80" in (report.error or "")
    assert calls == ["nftables.sync", "nftables.cleanup"], "old mode never detached"
    assert report.steps[-1].name == "roll-back"


def test_probe_failure_rolls_back(tmp_path: Path) -> None:
    calls: list[str] = []
    switcher = switcher_for(calls, prober=lambda ip, p: f"{ip}:{p}: timed out")
    report, _ = switcher.switch(Plane("iptables", calls), SNAP, "nftables", timeout=30)
    assert not report.ok and "self-probe failed for 1 of 1" in (report.error or "")
    assert "iptables.detach" not in calls


def test_unknown_or_same_mode_is_refused() -> None:
    switcher = ModeSwitcher(make_dataplane=lambda m: Plane(m, []), state_dir=None)
    assert "unknown mode" in (
        switcher.switch(Plane("iptables", []), SNAP, "ipvs ", timeout=5)[0].error or ""
    )
    assert "already in" in (
        switcher.switch(Plane("iptables", []), SNAP, "iptables", timeout=5)[0].error or ""
    )


def test_an_unexpected_error_before_cut_over_rolls_back_too(tmp_path: Path) -> None:
    """userspace at 10,000 services: more listeners than its port range (a ValueError)."""
    calls: list[str] = []

    class Unfit(Plane):
        def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
            raise ValueError("10001 listeners do not fit into the proxy port range 20000-29999")

    switcher = switcher_for(calls, plane=Unfit)
    old = Plane("iptables", calls)
    report, now = switcher.switch(old, SNAP, "userspace", timeout=30)
    assert not report.ok and now is old
    assert (
        report.error
        == "ValueError: 10001 listeners do not fit into the proxy port range 20000-29999"
    )
    assert calls == ["userspace.cleanup"], "the new mode removed, the old one never detached"
    assert report.from_mode == "iptables" and report.steps[-1].name == "roll-back"


def test_nft_documents_are_joined_by_text_and_stay_valid_json() -> None:
    # Parsing the 10,000-service table's ~100 MB document to merge it took the daemon's
    # after-switch record to ~1 GB resident.
    from kproxy.ops.snapshot import join_nft_documents, nftables_section

    ip = '{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "ip"}}]}'
    ip6 = '{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "ip6"}}]}'
    assert join_nft_documents([ip]) is ip
    joined = json.loads(join_nft_documents([ip, ip6]))["nftables"]
    assert [next(iter(i)) for i in joined] == ["metainfo", "table", "metainfo", "table"]
    assert json.loads(join_nft_documents([ip, '{"nftables": []}'])) == json.loads(ip)

    def run(argv: list[str]) -> tuple[int, str, str]:
        if argv[-2] == "ip":
            return 0, ip + "\n", ""
        return 1, "", "Error: No such file or directory; did you mean table 'kube-proxy'?"

    section = nftables_section(run)
    assert section["ok"] and json.loads(section["output"]) == json.loads(ip)

    def broken(argv: list[str]) -> tuple[int, str, str]:
        return 0, "table ip kube-proxy {", ""

    section = nftables_section(broken)
    assert not section["ok"] and "not a JSON document" in section["error"]
    assert json.loads(section["output"]) == {"nftables": []}


def test_a_removal_that_fails_after_the_cut_over_leaves_the_switch_done(tmp_path: Path) -> None:
    """The new mode serves from the cut-over on: the old one's leftovers are reported and
    left to the leftover cleanup, never reported as a failed switch (which would make the
    daemon believe the detached old mode still serves)."""

    class Stuck(Plane):
        def cleanup(self, *, dry_run: bool = False) -> list:
            self.calls.append(f"{self.mode}.cleanup")
            raise RuntimeError("nft rejected the transaction")

    calls: list[str] = []
    switcher = switcher_for(calls, state_dir=tmp_path)
    report, now = switcher.switch(Stuck("iptables", calls), SNAP, "nftables", timeout=30)
    assert report.ok and report.error is None and now.mode == "nftables"
    assert calls == ["nftables.sync", "iptables.detach", "iptables.cleanup"]
    assert report.leftover_error == "RuntimeError: nft rejected the transaction"
    assert "remove" not in [s.name for s in report.steps]
