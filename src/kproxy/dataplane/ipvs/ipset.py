"""ipsets through the ipset tool, like upstream (which shells out to `ipset` too).

Reads are one `ipset save` (every set and entry); writes are one `ipset restore -exist`
batch per sync (creates, adds and deletes), instead of upstream's one process per entry.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from kproxy.dataplane.ipvs import names as n
from kproxy.host.commands import Runner, in_netns, run_command

MIN_VERSION = (6, 0)  # upstream's MinIPSetCheckVersion (IPv6 support)
_VERSION_RE = re.compile(r"v(\d+)\.(\d+)")
_LINE_RE = re.compile(r"line (\d+)")


class IpsetError(Exception):
    def __init__(self, message: str, *, input_data: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.input_data = input_data
        self.stderr = stderr


def parse_save(text: str, names: Iterable[str] | None = None) -> dict[str, set[str]]:
    """`ipset save` -> entries per set (only `names`, if given; created sets with no entries
    are present with an empty set)."""
    wanted = set(names) if names is not None else None
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or (wanted is not None and parts[1] not in wanted):
            continue
        if parts[0] == "create":
            out.setdefault(parts[1], set())
        elif parts[0] == "add":
            out.setdefault(parts[1], set()).add(parts[2])
    return out


def parse_types(text: str) -> dict[str, str]:
    """`ipset save` -> the type of every set."""
    return {
        parts[1]: parts[2]
        for parts in (line.split(" ", 3) for line in text.splitlines())
        if len(parts) >= 3 and parts[0] == "create"
    }


def sync_lines(
    desired: Mapping[str, set[str]],
    current: Mapping[str, set[str]] | None,
    *,
    create: bool,
) -> list[str]:
    """Restore input taking our sets from `current` (None: unknown, treat as empty) to
    `desired`: creates (when asked), then deletes, then adds."""
    lines: list[str] = []
    if create:
        lines += [n.SET_INFO[name].create_line() for name in n.SET_NAMES if name in desired]
    adds: list[str] = []
    for name in n.SET_NAMES:
        want = desired.get(name)
        if want is None:
            continue
        have = (current or {}).get(name, set())
        lines += [f"del {name} {e}" for e in sorted(have - want)]
        adds += [f"add {name} {e}" for e in sorted(want - have)]
    return lines + adds


class IpsetClient:
    def __init__(self, netns: str | None = None, *, runner: Runner | None = None) -> None:
        self.netns = netns
        self.runner = runner or run_command

    def _run(self, argv: Sequence[str], data: str | None = None) -> tuple[int, str, str]:
        proc = self.runner(in_netns(argv, self.netns), data)
        return proc.returncode, proc.stdout, proc.stderr

    def version(self) -> tuple[int, int] | None:
        code, out, err = self._run(["ipset", "--version"], "")
        m = _VERSION_RE.search(out + err) if code == 0 else None
        return (int(m.group(1)), int(m.group(2))) if m else None

    def save_text(self) -> str:
        code, out, err = self._run(["ipset", "save"])
        if code != 0:
            raise IpsetError(f"ipset save failed (exit {code}): {err.strip()}", stderr=err)
        return out

    def save(self, names: Iterable[str] | None = None) -> dict[str, set[str]]:
        return parse_save(self.save_text(), names)

    def names(self) -> list[str]:
        code, out, err = self._run(["ipset", "list", "-n"])
        if code != 0:
            raise IpsetError(f"ipset list -n failed (exit {code}): {err.strip()}", stderr=err)
        return out.split()

    def restore(self, lines: Sequence[str]) -> None:
        """`ipset restore -exist` of the lines; IpsetError naming the rejected line."""
        if not lines:
            return
        data = "\n".join(lines) + "\n"
        code, _out, err = self._run(["ipset", "restore", "-exist"], data)
        if code != 0:
            m = _LINE_RE.search(err)
            where = ""
            if m and 1 <= int(m.group(1)) <= len(lines):
                where = f" at line {m.group(1)} ({lines[int(m.group(1)) - 1]!r})"
            raise IpsetError(
                f"ipset restore failed{where}: {err.strip()}", input_data=data, stderr=err
            )

    def destroy(self, name: str) -> None:
        code, _out, err = self._run(["ipset", "destroy", name])
        if code != 0 and "does not exist" not in err:
            raise IpsetError(f"ipset destroy {name} failed: {err.strip()}", stderr=err)
