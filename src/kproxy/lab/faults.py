"""Faults injected into a running kproxy: its tools, its netlink batches, its state dir.

ToolFaults writes a folder of wrappers, one per tool, to put first on the PATH of a
ProxyProcess (its path_prefix). At every call a wrapper reads its control file:

  (no file)  run the real tool
  fail       exit with CODE, MESSAGE on stderr
  hang       sleep SECONDS in a child process (past the tool timeout), then fail
  kill       SIGKILL itself before the real tool runs
  kill-after run the real tool, then SIGKILL itself (the change is made, the caller sees
             a killed tool)

optionally only when the arguments contain MATCH and/or the input contains INPUT_MATCH
(the anchor's `nft -f -` and a sync's differ only there). Each hit is logged, so a test
knows the fault was reached. Netlink batches have no tool to wrap: the same object drives
kproxy.host.netlink_fault through the file env() names.

StateDirFault makes the state dir read-only or full: kproxy then runs with its state dir
on a small tmpfs in a mount namespace of its own (ProxyProcess(state_tmpfs=...)), so
nothing is mounted in the host's.
"""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kproxy.host import netlink_fault

if TYPE_CHECKING:
    from kproxy.lab.proxy import ProxyProcess

TOOLS = (
    "iptables-nft-restore",
    "iptables-nft-save",
    "iptables-nft",
    "iptables-legacy-restore",
    "iptables-legacy-save",
    "iptables-legacy",
    "nft",
    "ipset",
    "conntrack",
    "ipvsadm",
)
ACTIONS = ("fail", "hang", "kill", "kill-after")
SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"

WRAPPER = """\
#!/bin/sh
# kproxy.lab.faults wrapper of {tool}
ctl={ctl}
if [ -s "$ctl" ]; then
  ACTION= CODE=1 MESSAGE= MATCH= INPUT_MATCH= SECONDS_=3600
  . "$ctl"
  hit=1
  if [ -n "$MATCH" ]; then
    case " $* " in *"$MATCH"*) ;; *) hit=0 ;; esac
  fi
  if [ "$hit" = 1 ] && [ -n "$INPUT_MATCH" ]; then
    saved=$(mktemp)
    cat > "$saved"
    grep -qF -- "$INPUT_MATCH" "$saved" || hit=0
    exec 0< "$saved"
    rm -f "$saved"
  fi
  if [ "$hit" = 1 ]; then
    echo "{tool} $ACTION $*" >> {log}
    case "$ACTION" in
      fail) echo "$MESSAGE" >&2; exit "$CODE" ;;
      hang) sleep "$SECONDS_"; exit 1 ;;
      kill) kill -9 $$ ;;
      kill-after) {real} "$@"; kill -9 $$ ;;
    esac
  fi
fi
exec {real} "$@"
"""


class ToolFaults:
    def __init__(self, folder: Path, tools: Sequence[str] = TOOLS) -> None:
        self.folder = folder
        self.bin = folder / "bin"
        self.control = folder / "control"
        self.log = folder / "hits.log"
        self.netlink_control = folder / "netlink"
        self.bin.mkdir(parents=True, exist_ok=True)
        self.control.mkdir(exist_ok=True)
        self.log.touch()
        self.tools: list[str] = []
        for tool in tools:
            real = shutil.which(tool, path=os.environ.get("PATH", "") + ":" + SBIN)
            if real is None:
                continue
            wrapper = self.bin / tool
            wrapper.write_text(
                WRAPPER.format(
                    tool=tool,
                    ctl=shlex.quote(str(self.control / tool)),
                    log=shlex.quote(str(self.log)),
                    real=shlex.quote(real),
                )
            )
            wrapper.chmod(0o755)
            self.tools.append(tool)

    def env(self) -> dict[str, str]:
        """The environment a ProxyProcess needs for netlink faults."""
        return {netlink_fault.ENV: str(self.netlink_control)}

    def set(
        self,
        tool: str,
        action: str,
        *,
        code: int = 1,
        message: str = "",
        match: str = "",
        input_match: str = "",
        seconds: float = 3600.0,
    ) -> None:
        """From the next call on, `tool` does `action` (see the module doc)."""
        if tool not in self.tools:
            raise ValueError(f"no wrapper for {tool!r} (have {', '.join(self.tools)})")
        if action not in ACTIONS:
            raise ValueError(f"unknown fault {action!r}: one of {', '.join(ACTIONS)}")
        values = {
            "ACTION": action,
            "CODE": str(code),
            "MESSAGE": message or f"{tool}: {action} (injected fault)",
            "MATCH": match,
            "INPUT_MATCH": input_match,
            "SECONDS_": f"{seconds:g}",
        }
        text = "".join(f"{k}={shlex.quote(v)}\n" for k, v in values.items())
        tmp = self.control / f".{tool}.tmp"
        tmp.write_text(text)
        tmp.replace(self.control / tool)  # a wrapper never reads half a file

    def netlink(self, kind: str, action: str, seconds: float | None = None) -> None:
        """kproxy's netlink batches of `kind` (nftables, ipvs, any) `action` (fail, hang)."""
        if action not in ("fail", "hang"):
            raise ValueError(f"netlink faults are fail or hang, not {action!r}")
        extra = f" {seconds:g}" if seconds is not None else ""
        tmp = self.folder / ".netlink.tmp"
        tmp.write_text(f"{kind} {action}{extra}\n")
        tmp.replace(self.netlink_control)

    def clear(self, tool: str | None = None) -> None:
        """No fault from the next call on (of `tool`, or of every tool and netlink)."""
        for name in [tool] if tool else self.tools:
            (self.control / name).unlink(missing_ok=True)
        if tool is None:
            self.netlink_control.unlink(missing_ok=True)

    def hits(self, tool: str | None = None) -> int:
        """How many calls met a fault (of `tool`, or of any)."""
        lines = self.log.read_text().splitlines()
        return sum(1 for line in lines if tool is None or line.split(" ", 1)[0] == tool)


class StateDirFault:
    """The state dir of a ProxyProcess started with state_tmpfs, made read-only or full
    inside the process's own mount namespace."""

    def __init__(self, proxy: ProxyProcess) -> None:
        if proxy.state_tmpfs is None or proxy.proc is None:
            raise ValueError("StateDirFault needs a running ProxyProcess with state_tmpfs")
        self.proxy = proxy
        self.pid = proxy.proc.pid

    def _mount(self, options: str) -> None:
        argv = ["mount", "-o", options, str(self.proxy.state_dir)]
        subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", *argv],
            check=True,
            capture_output=True,
            timeout=10,
        )

    def read_only(self) -> None:
        self._mount("remount,ro")

    def writable(self) -> None:
        self._mount("remount,rw")

    @property
    def _filler(self) -> Path:
        return self.proxy.state_view / ".fault-filler"

    def fill(self) -> None:
        """Write until the tmpfs has no room left."""
        block = b"\0" * (1 << 16)
        with self._filler.open("wb", buffering=0) as f:
            try:
                while True:
                    f.write(block)
                    f.flush()
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)
