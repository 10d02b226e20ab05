"""Running the host's command-line tools, optionally inside a named network namespace.

Every mode, inspector and check runs `iptables-restore`, `nft`, `ipset`, `conntrack`, `ip`
... through these helpers, so one failure shape (a CompletedProcess, exit 127 for a missing
binary) and one way of entering a namespace (``ip netns exec``) hold everywhere.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Sequence
from typing import Final

Version = tuple[int, int, int]
# A runner executes argv (already prefixed for the namespace) with optional stdin text.
Runner = Callable[[Sequence[str], str | None], "subprocess.CompletedProcess[str]"]

_VERSION_RE: Final = re.compile(r"v(\d+(?:\.\d+)+)")


def run_command(
    argv: Sequence[str], input_data: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Default runner: capture text output, never raise on a non-zero exit."""
    try:
        return subprocess.run(
            list(argv),
            input=input_data if input_data is not None else "",
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError as exc:
        # Report a missing binary like a shell would, so callers see one failure shape.
        return subprocess.CompletedProcess(list(argv), 127, "", f"{exc}\n")


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
