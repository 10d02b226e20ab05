"""A switch's preflight beside a running kproxy, on a real lab node: the running kproxy
answers it from what it holds (no whole nft table listed, no source file opened), with the
findings of the preflight that reads everything itself."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kproxy.dataplane.nftables.layouts import COMPACT, LAYOUTS, TABLES, UPSTREAM
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab
from kproxy.ops.inputs import ops_inputs
from kproxy.ops.preflight.cli import switch_gate
from kproxy.ops.preflight.live import PATH_LIVE, PATH_READ
from tests.support.preflight_lab import config, objects

pytestmark = pytest.mark.kernel


def logging_tool(folder: Path, tool: str, log: Path) -> None:
    """`tool` in `folder`: logs its arguments, one call a line, then runs the real one."""
    real = shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin:/bin")
    assert real is not None
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / tool
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    script.chmod(0o755)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_switchs_preflight_asks_the_running_kproxy_and_finds_the_same(
    lab: Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """kproxy serving nftables mode in either layout (each read by its own map); in
    upstream's, a switch to the compact layout is a layout change."""
    calls = tmp_path / "nft-calls.log"
    calls.touch()
    logging_tool(tmp_path / "bin", "nft", calls)
    proxy = ProxyProcess(
        lab,
        objects(tmp_path / "objects"),
        config=config(tmp_path, "nftables"),
        args=["--nftables-layout", layout],
        workdir=tmp_path / "kp",
        path_prefix=tmp_path / "bin",
    ).start(timeout=60)
    try:
        before = calls.read_text().splitlines()

        def no_reading(*_a: object, **_k: object) -> None:
            raise AssertionError("the switch's preflight read the source again")

        monkeypatch.setattr("kproxy.sources.files.load_path", no_reading)
        gate = switch_gate("iptables", ops_inputs(state_dir=proxy.state_dir), force=False)
        assert gate is not None
        during = calls.read_text().splitlines()[len(before) :]
        live = gate.result
        assert live.path == PATH_LIVE, live.notes
        # The log works: the serving mode's destinations come from its service map alone.
        assert f"-j list map ip {TABLES[layout]} service-ips" in during, during
        assert not [c for c in during if c.startswith("-j list table")], during
        assert not [c for c in during if c.startswith("list ruleset")], during
        assert "backup.at-switch" in live.ids() and gate.backup_path() is None
        # The same node read the old way (the command line, which reads it all itself).
        full = read_everything(proxy, "iptables")
        read_ids = sorted(f["id"] for f in full["findings"] if not f["id"].startswith("backup."))
        live_ids = sorted(f for f in live.ids() if not f.startswith("backup."))
        assert live_ids == read_ids
        assert "backup.ok" in {f["id"] for f in full["findings"]}
        assert live.current_mode == full["current_mode"] == "nftables"
        assert live.current_layout == full["current_layout"] == layout
        # Where a switch naming no layout goes (and a restart comes back): its flag.
        assert proxy.status()["started_nftables_layout"] == layout
        assert live.safe == full["safe"]
        if layout == UPSTREAM:
            # A switch to the other layout is a layout change, not the mode it runs.
            to_compact = switch_gate(
                "nftables", ops_inputs(state_dir=proxy.state_dir), force=False, layout=COMPACT
            )
            assert to_compact is not None and to_compact.result.path == PATH_LIVE
            ids = to_compact.result.ids()
            assert "mode.layout-change" in ids and "mode.same" not in ids, ids
            assert to_compact.result.current_layout == UPSTREAM
            assert to_compact.described == "nftables (compact layout)"
    finally:
        proxy.stop()


def saves_during(log: Path, before: int) -> list[str]:
    return log.read_text().splitlines()[before:]


def test_an_iptables_nft_kproxy_proves_its_rules_and_reads_again_once_someone_else_commits(
    lab: Lab, tmp_path: Path
) -> None:
    """kproxy in iptables mode on iptables-nft: while nothing but its own syncs changed the
    kernel, the switch's preflight to nftables reads no save at all (its destinations come
    from what it wrote, the localnet guard from KUBE-FIREWALL, the leftover scan stops at the
    chain names) and finds what reading everything finds. After another program's commit
    it reads the nat table, and a service rule someone deleted is reported."""
    saves = tmp_path / "saves.log"
    saves.touch()
    for tool in ("iptables-nft-save", "iptables-legacy-save"):
        logging_tool(tmp_path / "bin", tool, saves)
    proxy = ProxyProcess(
        lab,
        objects(tmp_path / "objects"),
        config=config(tmp_path, "iptables"),
        args=["--iptables-backend", "nft"],
        workdir=tmp_path / "kp",
        path_prefix=tmp_path / "bin",
    ).start(timeout=60)
    try:
        deadline = time.monotonic() + 20
        while proxy.status().get("leftovers_removed") is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the start-up leftover scan, which may read saves, is over
        before = len(saves.read_text().splitlines())
        gate = switch_gate("nftables", ops_inputs(state_dir=proxy.state_dir), force=False)
        assert gate is not None and gate.result.path == PATH_LIVE, gate and gate.result.notes
        assert saves_during(saves, before) == []  # a full save logs an empty line
        full = read_everything(proxy, "nftables")
        read_ids = sorted(f["id"] for f in full["findings"] if not f["id"].startswith("backup."))
        live_ids = sorted(f for f in gate.result.ids() if not f.startswith("backup."))
        assert live_ids == read_ids
        assert "dataplane.missing-services" not in live_ids

        # Someone else deletes web's service rule: the generation moves, nothing is proven.
        spec = next(
            line
            for line in lab.exec(
                lab.node_ns, ["iptables-nft", "-t", "nat", "-S", "KUBE-SERVICES"]
            ).stdout.splitlines()
            if "default/web:http cluster IP" in line
        )
        lab.exec(lab.node_ns, ["iptables-nft", "-t", "nat", "-D", *shlex.split(spec)[1:]])
        before = len(saves.read_text().splitlines())
        gate = switch_gate("nftables", ops_inputs(state_dir=proxy.state_dir), force=False)
        assert gate is not None and gate.result.path == PATH_LIVE
        assert "-t nat" in saves_during(saves, before), saves_during(saves, before)
        missing = next(f for f in gate.result.findings if f.id == "dataplane.missing-services")
        assert missing.facts["missing"] == ["tcp 10.96.0.10:80"], missing.facts
    finally:
        proxy.stop()


def read_everything(proxy: ProxyProcess, to: str) -> dict[str, Any]:
    """`kproxy preflight --no-daemon --json` for the proxy's node: every read made anew."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kproxy.cli",
            "preflight",
            "--to",
            to,
            "--json",
            "--no-daemon",
            "--state-dir",
            str(proxy.state_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    doc = json.loads(out.stdout)
    assert doc["path"] == PATH_READ
    return doc
