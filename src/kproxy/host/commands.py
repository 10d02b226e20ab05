"""Running the host's command-line tools, optionally inside a named network namespace.

Every mode, inspector and check runs `iptables-restore`, `nft`, `ipset`, `conntrack`, `ip`
... through these helpers, so one failure shape (a CompletedProcess, exit 127 for a missing
binary, TIMED_OUT for a tool that hung) and one way of entering a namespace
(``ip netns exec``) hold everywhere.

No tool runs unbounded: a sync holds the loop's lock while its tools run, so one hung
`iptables-restore` would stop every later sync and every mode switch. A tool still running
after the tool timeout is killed together with its process group (a child it started, such
as the tool behind `ip netns exec` or a shell's, would otherwise keep the output pipes open
and the wait for them would hang in its place).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import IO, Final

Version = tuple[int, int, int]
# A runner executes argv (already prefixed for the namespace) with optional stdin text.
Runner = Callable[[Sequence[str], str | None], "subprocess.CompletedProcess[str]"]

_VERSION_RE: Final = re.compile(r"v(\d+(?:\.\d+)+)")

# The longest single tool call seen at 10,000 services is ~20 s (a full restore or an
# `nft -j list` of a big table on a loaded machine): the default leaves room for more.
DEFAULT_TOOL_TIMEOUT: Final = 120.0
# The exit code of a tool killed for running past the timeout (coreutils timeout's).
TIMED_OUT: Final = 124
_tool_timeout = DEFAULT_TOOL_TIMEOUT


def set_tool_timeout(seconds: float) -> None:
    """The timeout of every tool call of this process from now on (`kproxy run
    --tool-timeout`)."""
    global _tool_timeout
    if not seconds > 0:
        raise ValueError(f"a tool timeout must be positive, not {seconds!r}")
    _tool_timeout = float(seconds)


def tool_timeout() -> float:
    return _tool_timeout


def run_command(
    argv: Sequence[str],
    input_data: str | None = None,
    *,
    timeout: float | None = None,
    stdout: IO[bytes] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Default runner: capture text output, never raise on a non-zero exit.

    timeout: seconds (default: the tool timeout); past it the tool and its process group
    are killed and the result has exit code TIMED_OUT and a stderr saying so.
    stdout: a file that takes the output instead of a pipe (large dumps)."""
    args = list(argv)
    limit = _tool_timeout if timeout is None else timeout
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=stdout if stdout is not None else subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a process group of its own, to kill as a whole
        )
    except FileNotFoundError as exc:
        # Report a missing binary like a shell would, so callers see one failure shape.
        return subprocess.CompletedProcess(args, 127, "", f"{exc}\n")
    try:
        out, err = proc.communicate(input_data if input_data is not None else "", timeout=limit)
    except subprocess.TimeoutExpired:
        out, err = _kill_group(proc)
        why = f"{args[0]} did not finish within {limit:g} s: killed (tool timeout)\n"
        return subprocess.CompletedProcess(args, TIMED_OUT, out or "", (err or "") + why)
    except BaseException:
        _kill_group(proc)
        raise
    if proc.returncode < 0:  # say so: "exit code -9" alone does not
        err = (err or "") + f"{args[0]} was killed by {_signal_name(-proc.returncode)}\n"
    return subprocess.CompletedProcess(args, proc.returncode, out or "", err or "")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kill_group(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill the process and its group; what it wrote before."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        # A descendant left the group and holds the pipes: stop waiting for them.
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        return "", ""


def in_netns(argv: Sequence[str], netns: str | None) -> list[str]:
    """Prefix argv so it runs inside `netns` (None: the caller's own namespace)."""
    if netns is None:
        return list(argv)
    return ["ip", "netns", "exec", netns, *argv]


def parse_version(text: str) -> Version | None:
    """'iptables v1.8.9 (nf_tables)' -> (1, 8, 9); None when no version is present."""
    match = _VERSION_RE.search(text)
    if match is None:
        return None
    parts = [int(p) for p in match.group(1).split(".")][:3]
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]
