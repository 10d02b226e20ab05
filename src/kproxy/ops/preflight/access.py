"""Every read a check makes goes through NodeAccess, so tests can point it anywhere.

Two kinds of reads:
* node-wide files (/proc/modules, /proc/config.gz, /lib/modules/<release>, /etc/modules-load.d,
  /sys/module): read under `root` ("/" on a node; a fake tree in unit tests). They are the
  same in every network namespace.
* per-namespace state (sysctls under /proc/sys/net, the conntrack count, iptables-save,
  nft, ip addr): read inside `netns` with `ip netns exec` when one is given. With a fake
  root they are read from files under it (root/proc/sys/...) and commands go to `runner`.

Nothing here writes. Commands run with a timeout and never raise for a missing tool: the
result says exit code 127.
"""

from __future__ import annotations

import gzip
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kproxy.host.commands import in_netns

Runner = Callable[[Sequence[str], str | None], "subprocess.CompletedProcess[str]"]

COMMAND_TIMEOUT = 60.0


def run_readonly(
    argv: Sequence[str], input_data: str | None = None
) -> subprocess.CompletedProcess[str]:
    """The default runner: text output, a timeout, 127 for a missing tool."""
    if shutil.which(argv[0]) is None and shutil.which(argv[0], path="/usr/sbin:/sbin") is None:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]} is not installed")
    try:
        return subprocess.run(
            list(argv),
            input=input_data if input_data is not None else "",
            capture_output=True,
            text=True,
            check=False,
            timeout=COMMAND_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(
            list(argv), 124, "", f"timed out after {COMMAND_TIMEOUT} s"
        )


@dataclass
class NodeAccess:
    root: Path = Path("/")
    netns: str | None = None
    runner: Runner = run_readonly
    release: str | None = None  # uname -r; default: the running kernel's
    cpus: int | None = None
    _cache: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def fake_root(self) -> bool:
        return self.root != Path("/")

    # -- node-wide files -------------------------------------------------------------------

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def read(self, absolute: str) -> str | None:
        """A node-wide file's text, or None when it does not exist or cannot be read."""
        p = self.path(absolute)
        try:
            if p.suffix == ".gz":
                return gzip.decompress(p.read_bytes()).decode(errors="replace")
            return p.read_text(errors="replace")
        except OSError:
            return None

    def exists(self, absolute: str) -> bool:
        return self.path(absolute).exists()

    def listdir(self, absolute: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(absolute)))
        except OSError:
            return []

    def kernel_release(self) -> str:
        if self.release is not None:
            return self.release
        if self.fake_root:
            text = self.read("/proc/sys/kernel/osrelease")
            if text:
                return text.strip()
        return platform.release()

    def cpu_count(self) -> int:
        return self.cpus or os.cpu_count() or 1

    # -- per-namespace state ---------------------------------------------------------------

    def run(
        self, argv: Sequence[str], input_data: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A read-only command inside the node's namespace."""
        return self.runner(in_netns(argv, self.netns), input_data)

    def output(self, argv: Sequence[str]) -> str | None:
        """stdout of a command (cached per access), None when it failed."""
        key = "\0".join(argv)
        if key not in self._cache:
            proc = self.run(argv)
            self._cache[key] = proc.stdout if proc.returncode == 0 else None
        value = self._cache[key]
        return value if isinstance(value, str) else None

    def net_file(self, absolute: str) -> str | None:
        """A file whose content depends on the network namespace (/proc/sys/net, /proc/net)."""
        if self.netns is None or self.fake_root:
            return self.read(absolute)
        key = f"cat:{absolute}"
        if key not in self._cache:
            proc = self.run(["cat", absolute])
            self._cache[key] = proc.stdout if proc.returncode == 0 else None
        value = self._cache[key]
        return value if isinstance(value, str) else None

    def net_exists(self, absolute: str) -> bool:
        if self.netns is None or self.fake_root:
            return self.exists(absolute)
        return self.run(["test", "-e", absolute]).returncode == 0

    def sysctl(self, name: str) -> str | None:
        """A sysctl as the node's namespace sees it: "net.ipv4.ip_forward" or slash form."""
        rel = name.replace(".", "/") if "/" not in name else name
        text = self.net_file(f"/proc/sys/{rel}")
        return text.strip() if text is not None else None

    def sysctl_int(self, name: str) -> int | None:
        value = self.sysctl(name)
        try:
            return int(value.split()[0]) if value else None
        except ValueError:
            return None
