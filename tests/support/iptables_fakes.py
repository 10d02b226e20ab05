"""An in-memory iptables of one flavour, as a runner for IptablesBackend (no root, no kernel).

It keeps every table's chains and rules and applies `iptables-restore --noflush` input the
way the tool does: one table section at a time and atomically at its COMMIT; a declared user
chain is created or flushed; -A/-I/-D/-F/-X on a missing chain, -X of a chain a rule still
jumps to, and a jump to a chain that does not exist at COMMIT fail the restore ("line N
failed", as the tools say). It answers `-save [-t table]`, `-S CHAIN`, `-C` and `-D` from
that state, so two dataplanes' end states can be compared as save texts. Rules are kept as
written (the real tools normalise the order of matches; both sides here are this fake).
"""

from __future__ import annotations

import copy
import shlex
import subprocess
from collections.abc import Sequence

BUILTIN_CHAINS: dict[str, tuple[str, ...]] = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
}
# Targets that are not chains (the ones kproxy's modes write).
TARGETS = frozenset(
    {"ACCEPT", "DROP", "REJECT", "RETURN", "DNAT", "SNAT", "MASQUERADE", "MARK", "CONNMARK"}
    | {"REDIRECT", "NOTRACK", "CT", "TPROXY", "LOG"}
)

Table = dict[str, list[str]]  # chain -> its rules ("-A CHAIN ..." lines), in order


class RestoreFailed(Exception):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line} failed: {reason}")
        self.line = line


class FakeXtables:
    """The tables of one iptables flavour; call it as IptablesBackend's runner."""

    def __init__(self, version: str = "1.8.9", flavour: str = "nf_tables") -> None:
        self.tables: dict[str, Table] = {}
        self.version = version
        self.flavour = flavour
        self.restores: list[str] = []

    def backend(self, flavour: str = "legacy"):  # type: ignore[no-untyped-def]
        from kproxy.dataplane.iptables.backend import IptablesBackend

        return IptablesBackend(flavour, runner=self)

    # --- the tools ------------------------------------------------------------------------

    def __call__(self, argv: Sequence[str], data: str | None) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        tool = argv[0]
        if "--version" in argv:
            return _done(argv, 0, f"{tool} v{self.version} ({self.flavour})\n")
        if tool.endswith("-restore"):
            if "--noflush" not in argv:
                return _done(argv, 2, "", "the fake only restores with --noflush")
            try:
                self.restore(data or "")
            except RestoreFailed as err:
                return _done(argv, 1, "", f"{tool}: line {err.line} failed\n")
            return _done(argv, 0, "")
        if tool.endswith("-save"):
            table = argv[argv.index("-t") + 1] if "-t" in argv else None
            return _done(argv, 0, self.save(table))
        table = argv[argv.index("-t") + 1] if "-t" in argv else "filter"
        for op in ("-S", "-C", "-D"):
            if op in argv:
                chain, *spec = argv[argv.index(op) + 1 :]
                return self._rule_command(argv, op, table, chain, spec)
        return _done(argv, 2, "", "unsupported in the fake")

    def _rule_command(
        self, argv: list[str], op: str, table: str, chain: str, spec: list[str]
    ) -> subprocess.CompletedProcess[str]:
        chains = self.tables.get(table, {})
        if chain not in chains:
            return _done(argv, 1, "", "iptables: No chain/target/match by that name.\n")
        if op == "-S":
            head = f"-P {chain} ACCEPT" if chain in BUILTIN_CHAINS[table] else f"-N {chain}"
            return _done(argv, 0, "\n".join([head, *chains[chain]]) + "\n")
        rule = f"-A {chain} " + shlex.join(spec).replace("'", '"')
        if rule not in chains[chain]:
            return _done(argv, 1, "", "iptables: Bad rule (does a matching rule exist?).\n")
        if op == "-D":
            chains[chain].remove(rule)
        return _done(argv, 0, "")

    # --- state ----------------------------------------------------------------------------

    def restore(self, data: str) -> None:
        """Apply restore input with --noflush semantics (RestoreFailed: nothing of the
        failing table section changed)."""
        self.restores.append(data)
        work: Table | None = None
        name = ""
        for number, raw in enumerate(data.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("*"):
                name = line[1:]
                if name not in BUILTIN_CHAINS:
                    raise RestoreFailed(number, f"unknown table {name}")
                work = copy.deepcopy(self.tables.get(name) or _fresh(name))
            elif work is None:
                raise RestoreFailed(number, "no table given")
            elif line == "COMMIT":
                _check_jumps(work, number)
                self.tables[name] = work
                work = None
            else:
                _apply_line(work, name, line, number)
        if work is not None:
            raise RestoreFailed(len(data.splitlines()), "no COMMIT")

    def save(self, table: str | None = None) -> str:
        out: list[str] = []
        for name in sorted(self.tables) if table is None else [table]:
            chains = self.tables.get(name)
            if chains is None:
                continue
            builtin = BUILTIN_CHAINS[name]
            order = [*builtin, *sorted(c for c in chains if c not in builtin)]
            out.append(f"*{name}")
            out += [f":{c} {'ACCEPT' if c in builtin else '-'} [0:0]" for c in order]
            out += [rule for c in order for rule in chains[c]]
            out.append("COMMIT")
        return "\n".join(out) + "\n" if out else ""


def _done(
    argv: list[str], code: int, stdout: str, stderr: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def _fresh(table: str) -> Table:
    return {c: [] for c in BUILTIN_CHAINS[table]}


def _target(rule: str) -> str | None:
    words = rule.split()
    for flag in ("-j", "-g"):
        if flag in words:
            return words[words.index(flag) + 1]
    return None


def _apply_line(work: Table, table: str, line: str, number: int) -> None:
    if line.startswith(":"):
        chain = line[1:].split()[0]
        if chain not in BUILTIN_CHAINS[table]:
            work[chain] = []  # created, or flushed (--noflush flushes declared chains)
        return
    op, _, rest = line.partition(" ")
    chain, _, spec = rest.partition(" ")
    if chain not in work:
        raise RestoreFailed(number, f"no chain {chain}")
    rules = work[chain]
    if op == "-A":
        rules.append(f"-A {chain} {spec}")
    elif op == "-I":
        head, _, tail = spec.partition(" ")
        at, spec = (int(head) - 1, tail) if head.isdigit() else (0, spec)
        rules.insert(at, f"-A {chain} {spec}")
    elif op == "-D":
        if f"-A {chain} {spec}" not in rules:
            raise RestoreFailed(number, "no such rule")
        rules.remove(f"-A {chain} {spec}")
    elif op == "-F":
        rules.clear()
    elif op == "-X":
        if chain in BUILTIN_CHAINS[table] or rules:
            raise RestoreFailed(number, f"cannot delete {chain}")
        if any(_target(r) == chain for rs in work.values() for r in rs):
            raise RestoreFailed(number, f"{chain} is still referenced")
        del work[chain]
    else:
        raise RestoreFailed(number, f"unsupported {op}")


def _check_jumps(work: Table, number: int) -> None:
    for rules in work.values():
        for rule in rules:
            target = _target(rule)
            if target is not None and target not in TARGETS and target not in work:
                raise RestoreFailed(number, f"jump to missing chain {target}")
