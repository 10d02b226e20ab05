"""run_command: no tool runs unbounded, and one that hangs is killed with its children."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kproxy.host import netlink_fault
from kproxy.host.commands import TIMED_OUT, run_command


def test_a_hung_tool_is_killed_with_its_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    # The child keeps the output pipe open: killing the shell alone would leave the wait
    # for the pipe hanging.
    script = f"sleep 60 & echo $! > {pid_file}; echo partial; wait"
    started = time.monotonic()
    proc = run_command(["sh", "-c", script], timeout=0.5)
    assert time.monotonic() - started < 5
    assert proc.returncode == TIMED_OUT
    assert "did not finish within 0.5 s" in proc.stderr and proc.stdout == "partial\n"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed; reaped by init
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"


def test_a_killed_tool_says_so() -> None:
    proc = run_command(["sh", "-c", "kill -9 $$"])
    assert proc.returncode == -9 and "killed by SIGKILL" in proc.stderr


def test_input_output_and_a_missing_tool() -> None:
    assert run_command(["cat"], "abc").stdout == "abc"
    assert run_command(["no-such-tool-kproxy"]).returncode == 127


def test_the_netlink_fault_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "netlink"
    monkeypatch.setattr(netlink_fault, "CONTROL", str(control))
    netlink_fault.inject("nftables")  # no file: no fault
    control.write_text("ipvs fail\n")
    netlink_fault.inject("nftables")  # another kind
    with pytest.raises(OSError, match="injected fault"):
        netlink_fault.inject("ipvs")
    control.write_text("any hang 0.1\n")
    with pytest.raises(OSError) as err:
        netlink_fault.inject("nftables")
    assert err.value.errno is not None and os.strerror(err.value.errno)
