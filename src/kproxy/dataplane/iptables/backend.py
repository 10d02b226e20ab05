"""The narrow apply layer of iptables mode: iptables-restore / -save / -C / -D, nothing more.

One `IptablesBackend` drives one family (IPv4 for now) through one flavour of the tools,
``nft`` or ``legacy``, always by the binary's full name (``iptables-nft-restore``, ...):
switching with update-alternatives would change the host-wide default (lab G8).

Every command can run in a named network namespace (``ip netns exec NS ...``) so tests and
the lab never have to touch the namespace the process itself runs in.

Upstream behaviour matched here (kubernetes pkg/util/iptables):

* restore flags are ``--noflush --counters`` plus wait flags chosen from the version of the
  flavour's ``iptables`` binary: >= 1.6.2 gets ``-w 5 -W 100000``; an older binary gets
  ``-w`` only if ``iptables-restore --version`` answers at all, else no wait flag;
* plain ``iptables`` commands get ``-w 5 -W 100000`` from 1.6.1, ``-w 5`` from 1.4.22 and
  ``-w`` from 1.4.20;
* ``MASQUERADE --random-fully`` is assumed available from iptables 1.6.2;
* an unreadable version is treated as 1.4.11, upstream's minimum.

Measured on iptables 1.8.9 (both flavours): every ``COMMIT`` is applied on its own, so when
a later table of one input fails, the earlier tables of that input stay applied.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from kproxy.host.commands import Runner, Version, in_netns, parse_version, run_command

log = logging.getLogger(__name__)

FLAVOURS: Final = ("nft", "legacy")
FAMILIES: Final = ("ipv4", "ipv6")

# Version thresholds, as upstream names them.
MIN_VERSION: Final = (1, 4, 11)
WAIT_MIN: Final = (1, 4, 20)
WAIT_SECONDS_MIN: Final = (1, 4, 22)
WAIT_INTERVAL_MIN: Final = (1, 6, 1)
WAIT_RESTORE_MIN: Final = (1, 6, 2)
RANDOM_FULLY_MIN: Final = (1, 6, 2)
WAIT_SECONDS: Final = "5"
WAIT_INTERVAL_USECONDS: Final = "100000"

# Chains kubelet (1.17+) or kube-proxy create in mangle purely so that other tools can tell
# which backend the node uses (kubernetes-sigs/iptables-wrappers looks for these).
HINT_CHAINS: Final = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")
_HINT_RE: Final = re.compile(r"^:(?:KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY)\b", re.MULTILINE)
_RULE_RE: Final = re.compile(r"^-", re.MULTILINE)

# How the tools name the rejected line. Measured on 1.8.9:
#   "Error occurred at line: 4"          (parse errors, both flavours)
#   "iptables-restore: line 4 failed"    (kernel rejected the table, legacy)
#   "...: line 4 failed: No chain/..."   (nft)
#   "line 4: CHAIN_DEL failed (...)"     (nft, e.g. -X of a chain in use)
#   "COMMIT expected at line 4"          (input ended inside a table)
_LINE_RES: Final = (
    re.compile(r"Error occurred at line: (\d+)"),
    re.compile(r"\bline (\d+) failed"),
    re.compile(r"\bline (\d+): "),
    re.compile(r"\bat line:? (\d+)"),
)
# Lines of restore's stderr that never explain a failure.
_NOISE_PREFIXES: Final = ("Ignoring deprecated", "Try `", "Error occurred at line")
_TOOL_PREFIX_RE: Final = re.compile(r"^[\w.-]+(?: v[\d.]+(?: \([^)]*\))?)?:(?:\s+|$)")


class IptablesError(Exception):
    """An iptables tool failed; carries what it said."""

    def __init__(
        self, message: str, *, command: Sequence[str] = (), returncode: int = 0, stderr: str = ""
    ) -> None:
        super().__init__(message)
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr


class RestoreError(IptablesError):
    """iptables-restore rejected its input.

    `input_data` is the complete input, so the caller can keep it for inspection;
    `line_number` (1-based) and `line_text` name the line the tool reported, when it did.
    """

    def __init__(
        self, *, tool: str, command: Sequence[str], returncode: int, stderr: str, input_data: str
    ) -> None:
        self.tool = tool
        self.returncode = returncode
        self.input_data = input_data
        self.line_number = parse_failed_line(stderr)
        self.line_text = _line_of(input_data, self.line_number)
        self.reason = restore_reason(stderr)
        # iptables-nft checks jump targets only at COMMIT and blames that line; point at
        # the rule that jumps to the missing chain as well.
        self.suspect_line_number = _missing_chain_jump(input_data, self.line_number, self.reason)
        self.suspect_line_text = _line_of(input_data, self.suspect_line_number)
        super().__init__(self._sentence(), command=command, returncode=returncode, stderr=stderr)

    def _sentence(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        if self.line_number is None:
            return f"{self.tool} failed with exit code {self.returncode}{why}"
        if self.line_text is None:
            where = f"line {self.line_number} (past the end of the input)"
        else:
            where = f"line {self.line_number} ({self.line_text.strip()!r})"
        suspect = ""
        if self.suspect_line_text is not None:
            suspect = (
                f"; the jump is on line {self.suspect_line_number} "
                f"({self.suspect_line_text.strip()!r})"
            )
        return f"{self.tool} rejected {where}{why}{suspect}"

    def context(self, radius: int = 2) -> str:
        """The rejected line with `radius` lines around it, numbered, marked with '=>'."""
        if self.line_number is None:
            return ""
        lines = self.input_data.splitlines()
        first = max(1, self.line_number - radius)
        last = min(len(lines), self.line_number + radius)
        out = []
        for number in range(first, last + 1):
            mark = "=>" if number == self.line_number else "  "
            out.append(f"{mark} {number:5d}: {lines[number - 1]}")
        return "\n".join(out)


def parse_failed_line(stderr: str) -> int | None:
    """The 1-based input line iptables-restore blames in its stderr, if any."""
    for pattern in _LINE_RES:
        match = pattern.search(stderr)
        if match is not None:
            return int(match.group(1))
    return None


def restore_reason(stderr: str) -> str:
    """The first line of restore's stderr that explains the failure, tool prefix removed."""
    for raw in stderr.splitlines():
        line = raw.strip()
        if not line or line.startswith(_NOISE_PREFIXES):
            continue
        line = _TOOL_PREFIX_RE.sub("", line, count=1).strip()
        if line:
            return line
    return ""


_MISSING_CHAIN_RE: Final = re.compile(r"Chain '([^']+)' does not exist")


def _missing_chain_jump(data: str, number: int | None, reason: str) -> int | None:
    """The first rule of the failed table that jumps to the chain `reason` calls missing."""
    match = _MISSING_CHAIN_RE.search(reason)
    lines = data.splitlines()
    if match is None or number is None or not 1 <= number <= len(lines):
        return None
    if lines[number - 1].strip() != "COMMIT":
        return None
    start = number - 1
    while start > 0 and not lines[start - 1].startswith("*"):
        start -= 1
    target = match.group(1)
    for index in range(start, number - 1):
        tokens = lines[index].split()
        for flag in ("-j", "-g", "--jump", "--goto"):
            if flag in tokens[:-1] and tokens[tokens.index(flag) + 1] == target:
                return index + 1
    return None


def _line_of(data: str, number: int | None) -> str | None:
    if number is None:
        return None
    lines = data.splitlines()
    if 1 <= number <= len(lines):
        return lines[number - 1]
    return None


@dataclass(slots=True)
class TableDump:
    """One ``*table`` section of iptables-save output."""

    name: str
    # chain -> policy ("ACCEPT"/"DROP" for built-in chains, "-" for user chains)
    chains: dict[str, str] = field(default_factory=dict)
    # the "-A CHAIN ..." lines, in order
    rules: list[str] = field(default_factory=list)


def parse_save(text: str) -> dict[str, TableDump]:
    """Split iptables-save output into its tables; comments and COMMIT lines are dropped."""
    tables: dict[str, TableDump] = {}
    current: TableDump | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = tables.setdefault(line[1:], TableDump(line[1:]))
        elif current is None:
            continue
        elif line.startswith(":"):
            name, _, rest = line[1:].partition(" ")
            current.chains[name] = rest.split(" ", 1)[0] if rest else "-"
        elif line.startswith("-A "):
            current.rules.append(line)
        elif line == "COMMIT":
            current = None
    return tables


BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
# Where jumps into our chains can sit, per table (the chains `iptables -S` lists cheaply).
BUILTIN_CHAINS_OF = {
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "raw": ("PREROUTING", "OUTPUT"),
}


@dataclass(slots=True)
class TableOutline:
    """What a sync needs from a table's save: every chain name, and the rules of the
    built-in chains (where our jumps live). User chains' rules are not kept: at 10,000
    services they are 320,000 lines nobody needs."""

    chains: set[str] = field(default_factory=set)
    builtin_rules: set[str] = field(default_factory=set)


# Patterns that start with a distinctive literal: the regex engine then skips ahead with a
# fast search for it (a line-by-line Python loop over a 10,000-service save took 0.43 s).
_TABLE_RE = re.compile(r"\*(\S+)[ \t]*(?=\n|$)")
_CHAIN_RE = re.compile(r"\n:(\S+)")
_BUILTIN_RULE_RES = tuple(
    re.compile(rf"\n(-A {chain}(?: [^\n]*)?)(?=\n|$)") for chain in sorted(BUILTIN_CHAINS)
)


def outline_save(text: str) -> dict[str, TableOutline]:
    """The outline of every table in a save."""
    tables: dict[str, TableOutline] = {}
    for m in _TABLE_RE.finditer(text):
        if m.start() and text[m.start() - 1] != "\n":
            continue  # a '*' inside a rule
        start = m.end()
        end = text.find("\nCOMMIT", start)
        end = len(text) if end < 0 else end
        outline = tables.setdefault(m.group(1), TableOutline())
        outline.chains.update(_CHAIN_RE.findall(text, start, end))
        for pattern in _BUILTIN_RULE_RES:
            outline.builtin_rules.update(r.rstrip() for r in pattern.findall(text, start, end))
    return tables


def rule_chain(rule: str) -> str:
    """The chain of a '-A CHAIN ...' line."""
    parts = rule.split(None, 2)
    return parts[1] if len(parts) > 1 else ""


def rule_spec(rule: str) -> list[str]:
    """'-A CHAIN -m comment --comment "x y" -j Z' -> ['CHAIN', '-m', ..., 'Z'] for -C/-D."""
    tokens = shlex.split(rule)
    if tokens[:1] == ["-A"]:
        tokens = tokens[1:]
    return tokens


def _at_least(version: Version, minimum: Version) -> bool:
    return version >= minimum


def restore_wait_flags(version: Version, restore_answers_version: bool) -> list[str]:
    """Upstream's choice of wait flags for iptables-restore."""
    if _at_least(version, WAIT_RESTORE_MIN):
        return ["-w", WAIT_SECONDS, "-W", WAIT_INTERVAL_USECONDS]
    # Older restores may carry a backported --wait; upstream assumes so when --version works.
    return ["-w"] if restore_answers_version else []


def command_wait_flags(version: Version) -> list[str]:
    """Upstream's choice of wait flags for plain iptables commands."""
    if _at_least(version, WAIT_INTERVAL_MIN):
        return ["-w", WAIT_SECONDS, "-W", WAIT_INTERVAL_USECONDS]
    if _at_least(version, WAIT_SECONDS_MIN):
        return ["-w", WAIT_SECONDS]
    if _at_least(version, WAIT_MIN):
        return ["-w"]
    return []


class IptablesBackend:
    """iptables-restore/-save/-C/-D for one family and flavour, optionally in a namespace."""

    def __init__(
        self,
        flavour: str = "nft",
        *,
        family: str = "ipv4",
        netns: str | None = None,
        runner: Runner | None = None,
    ) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"unknown iptables flavour {flavour!r}; expected one of {FLAVOURS}")
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
        self.flavour = flavour
        self.family = family
        self.netns = netns
        self._runner: Runner = runner or run_command
        self._version: Version | None = None
        self._restore_wait: list[str] | None = None
        stem = "iptables" if family == "ipv4" else "ip6tables"
        self.iptables_bin = f"{stem}-{flavour}"
        self.restore_bin = f"{stem}-{flavour}-restore"
        self.save_bin = f"{stem}-{flavour}-save"

    def __repr__(self) -> str:
        return f"IptablesBackend({self.flavour!r}, family={self.family!r}, netns={self.netns!r})"

    def _run(
        self, argv: Sequence[str], input_data: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self._runner(in_netns(argv, self.netns), input_data)

    def _failed(
        self, what: str, argv: Sequence[str], proc: subprocess.CompletedProcess[str]
    ) -> IptablesError:
        """The error of a tool call that failed: what ran, its exit code and stderr."""
        return IptablesError(
            f"{what} failed with exit code {proc.returncode}: {proc.stderr.strip()}",
            command=in_netns(argv, self.netns),
            returncode=proc.returncode,
            stderr=proc.stderr,
        )

    # -- features ---------------------------------------------------------------------------

    def version(self) -> Version:
        """The iptables version of this flavour (cached); upstream's minimum if unreadable."""
        if self._version is None:
            proc = self._run([self.iptables_bin, "--version"])
            found = parse_version(proc.stdout + proc.stderr) if proc.returncode == 0 else None
            if found is None:
                log.warning(
                    "cannot read the version of %s (exit %d: %s); assuming %s",
                    self.iptables_bin,
                    proc.returncode,
                    proc.stderr.strip(),
                    ".".join(map(str, MIN_VERSION)),
                )
                found = MIN_VERSION
            self._version = found
        return self._version

    def supports_random_fully(self) -> bool:
        """MASQUERADE --random-fully, decided by version as upstream does."""
        return _at_least(self.version(), RANDOM_FULLY_MIN)

    def restore_wait_flags(self) -> list[str]:
        if self._restore_wait is None:
            version = self.version()
            answers = False
            if not _at_least(version, WAIT_RESTORE_MIN):
                # Empty stdin makes old restores without --version exit instead of waiting.
                proc = self._run([self.restore_bin, "--version"], "")
                found = parse_version(proc.stdout + proc.stderr)
                answers = proc.returncode == 0 and found is not None
            self._restore_wait = restore_wait_flags(version, answers)
            if not self._restore_wait:
                log.warning(
                    "%s has no --wait; restores run without the xtables lock", self.restore_bin
                )
        return list(self._restore_wait)

    def command_wait_flags(self) -> list[str]:
        return command_wait_flags(self.version())

    # -- restore ----------------------------------------------------------------------------

    def restore_command(self, *, noflush: bool = True, counters: bool = True) -> list[str]:
        """The restore argv (without the namespace prefix), flags in upstream's order."""
        argv = [self.restore_bin, *self.restore_wait_flags()]
        if noflush:
            argv.append("--noflush")
        if counters:
            argv.append("--counters")
        return argv

    def restore(self, data: str, *, noflush: bool = True, counters: bool = True) -> None:
        """Feed `data` to iptables-restore; raise RestoreError naming the rejected line."""
        argv = self.restore_command(noflush=noflush, counters=counters)
        proc = self._run(argv, data)
        if proc.returncode != 0:
            error = RestoreError(
                tool=self.restore_bin,
                command=in_netns(argv, self.netns),
                returncode=proc.returncode,
                stderr=proc.stderr,
                input_data=data,
            )
            # The caller decides how loudly to report and where to keep the input.
            log.debug("%s\n%s", error, error.context())
            raise error

    # -- save / inspect ---------------------------------------------------------------------

    def save(self, table: str | None = None) -> str:
        """iptables-save output, of one table or of all.

        For legacy, `-t TABLE` would make the kernel create that table in the namespace
        (and a legacy table only goes away with its namespace, G7), so a full save is
        sliced instead; a legacy table that does not exist yields "".
        """
        if table is None or self.flavour == "legacy":
            argv = [self.save_bin]
        else:
            argv = [self.save_bin, "-t", table]
        proc = self._run(argv)
        if proc.returncode != 0:
            raise self._failed(self.save_bin, argv, proc)
        if table is None or self.flavour != "legacy":
            return proc.stdout
        return _slice_table(proc.stdout, table)

    def tables(self) -> dict[str, TableDump]:
        """Every table this flavour holds, parsed."""
        return parse_save(self.save())

    def chains(self, table: str) -> set[str]:
        """Names of all chains (built-in and user) in `table`.

        iptables-nft-save lists the built-in chains of a table even when the nft table does
        not exist; the legacy flavour returns an empty set then.
        """
        dump = parse_save(self.save(table)).get(table)
        return set(dump.chains) if dump else set()

    def outlines(self, tables: Sequence[str]) -> dict[str, TableOutline]:
        """Chains and built-in rules of `tables`, read as cheaply as the flavour allows.
        legacy: one save of everything (the kernel hands over whole table blobs anyway).
        nft: the chain names from one netlink dump, which holds no rules, and the built-in
        chains' rules from `iptables -S CHAIN` (5,000 services: 0.4-0.55 s, where the saves
        of nat and filter take 4.7 s, since iptables-nft-save fetches every chain's rules
        even for the 28 lines of filter); the saves only when that dump is not possible."""
        if self.flavour == "nft":
            listed = self._listed_chains()
            if listed is not None:
                present = {t: listed.get(t, set()) for t in tables}
                out = self.builtin_outlines(
                    {
                        t: [c for c in BUILTIN_CHAINS_OF.get(t, ()) if c in cs]
                        for t, cs in present.items()
                    }
                )
                for table, chains in present.items():
                    out[table].chains = chains
                return out
        legacy = self.flavour == "legacy"
        text = self.save() if legacy else "".join(self.save(t) for t in tables)
        found = outline_save(text)
        return {t: found.get(t, TableOutline()) for t in tables}

    def _listed_chains(self) -> dict[str, set[str]] | None:
        """nft: every chain name per table of this family, or None when they cannot be
        listed over netlink here. Not with a caller's own runner: it stands for the tools
        (tests, dry runs), and a netlink dump would read the real kernel behind it."""
        if self._runner is not run_command:
            return None
        from kproxy.dataplane.nftables.netlink import NetlinkError, NftNetlink

        try:
            client = NftNetlink(self.netns, family="ip" if self.family == "ipv4" else "ip6")
            try:
                listed = client.chains_by_table()
            finally:
                client.close()
        except (NetlinkError, OSError) as err:
            log.debug("cannot list chains over netlink (%s); reading saves", err)
            return None
        return {table: set(chains) for table, chains in listed.items()}

    def builtin_outlines(self, chains: Mapping[str, Iterable[str]]) -> dict[str, TableOutline]:
        """The rules of some built-in chains per table (where the jumps into ours are),
        without the chain lists. nft: `iptables -S CHAIN` for each, which reads that chain
        only (10 ms at 10,000 services, where the save of the two tables takes 14 s);
        legacy: one save (the kernel hands over whole table blobs either way)."""
        if self.flavour == "legacy":
            return self.outlines(list(chains))
        out: dict[str, TableOutline] = {}
        for table, names_ in chains.items():
            outline = out[table] = TableOutline()
            for chain in sorted(set(names_)):
                outline.builtin_rules.update(self.list_chain(table, chain) or ())
        return out

    def list_chain(self, table: str, chain: str) -> list[str] | None:
        """`iptables -t T -S CHAIN`: the chain's '-A' lines, or None when it does not exist."""
        argv = [self.iptables_bin, *self.command_wait_flags(), "-t", table, "-S", chain]
        proc = self._run(argv)
        if proc.returncode == 0:
            return [line.rstrip() for line in proc.stdout.splitlines() if line.startswith("-A ")]
        if proc.returncode == 1 or "does not exist" in proc.stderr or "No chain" in proc.stderr:
            return None
        raise self._failed(f"{self.iptables_bin} -S {chain}", argv, proc)

    def rules(self, table: str, chain: str | None = None) -> list[str]:
        """The '-A' lines of `table`, optionally of one chain, in order."""
        dump = parse_save(self.save(table)).get(table)
        if dump is None:
            return []
        if chain is None:
            return list(dump.rules)
        return [rule for rule in dump.rules if rule_chain(rule) == chain]

    # -- single rules (cleanup tooling) -----------------------------------------------------

    def generation(self) -> int | None:
        """nft: the namespace's nf_tables ruleset generation (one more per committed batch,
        anyone's), or None when it cannot be read; legacy: None (no such counter).
        Not with a caller's own runner: it stands for the tools, not the real kernel."""
        if self.flavour != "nft" or self._runner is not run_command:
            return None
        from kproxy.dataplane.nftables.netlink import NetlinkError, NftNetlink

        try:
            client = NftNetlink(self.netns)
            try:
                return client.generation()
            finally:
                client.close()
        except (NetlinkError, OSError) as err:
            log.debug("cannot read the nf_tables generation: %s", err)
            return None

    def chain_exists(self, table: str, chain: str) -> bool:
        """Does the chain exist? (`iptables -t T -S CHAIN`: cheap, lists one chain.)"""
        return self.list_chain(table, chain) is not None

    def _rule_command(self, op: str, table: str, spec: Sequence[str]) -> list[str]:
        if not spec:
            raise ValueError("a rule spec starts with its chain")
        return [self.iptables_bin, *self.command_wait_flags(), "-t", table, op, *spec]

    def check_rule(self, table: str, spec: Sequence[str]) -> bool:
        """Does the rule exist? `spec` is the chain then the rule, as after '-A' in a save."""
        argv = self._rule_command("-C", table, spec)
        proc = self._run(argv)
        if proc.returncode == 0:
            return True
        # Exit 1 is iptables' "no such rule/chain"; exit 2 naming a chain that "does not
        # exist" is a rule whose jump target is missing, so the rule cannot exist either.
        missing_target = "does not exist" in proc.stderr or "Couldn't load target" in proc.stderr
        if proc.returncode == 1 or (proc.returncode == 2 and missing_target):
            return False
        raise self._failed(f"{self.iptables_bin} -C", argv, proc)

    def rule_present(self, table: str, rule: str, outline: TableOutline | None = None) -> bool:
        """Is `rule` ('CHAIN spec...', as after '-A') in place? Found as text in a built-in
        chain's outline is enough; otherwise iptables -C decides, since it compares rules
        semantically (a jump written by another version may print differently, and a
        false "missing" would add a duplicate). A chain with no rule jumping to the same
        target cannot hold it in any spelling, so then no -C runs (a fresh node's sync ran
        twelve for nothing)."""
        if outline is not None:
            if f"-A {rule}" in outline.builtin_rules:
                return True
            chain, _, rest = rule.partition(" ")
            head, jump = f"-A {chain} ", f"-j {rest.rsplit(' -j ', 1)[-1]}"
            if not any(r.startswith(head) and jump in r for r in outline.builtin_rules):
                return False
        return self.check_rule(table, rule_spec(rule))

    def delete_rule(self, table: str, spec: Sequence[str]) -> bool:
        """Delete the rule if it exists; True when something was deleted."""
        if not self.check_rule(table, spec):
            return False
        argv = self._rule_command("-D", table, spec)
        proc = self._run(argv)
        if proc.returncode != 0:
            raise self._failed(f"{self.iptables_bin} -D", argv, proc)
        return True


def _slice_table(save_output: str, table: str) -> str:
    """The lines of one table's section (from '*table' to its COMMIT) of a full save."""
    out: list[str] = []
    inside = False
    for line in save_output.splitlines(keepends=True):
        if not inside and line.rstrip("\n") == f"*{table}":
            inside = True
        if inside:
            out.append(line)
            if line.rstrip("\n") == "COMMIT":
                break
    return "".join(out)


def chosen_backend(choice: str, netns: str | None = None) -> IptablesBackend:
    """The backend --iptables-backend names: auto (detect like upstream), nft or legacy."""
    if choice not in ("auto", "nft", "legacy"):
        raise ValueError(f"--iptables-backend: invalid value {choice!r}: use auto, nft or legacy")
    return IptablesBackend(detect_backend(netns) if choice == "auto" else choice, netns=netns)


def detect_backend(netns: str | None = None, *, runner: Runner | None = None) -> str:
    """Which iptables backend ("nft" or "legacy") the node already uses.

    The heuristic of kubernetes-sigs/iptables-wrappers (the wrapper kube-proxy's image
    uses to pick a backend), in its order, all failures counting as empty output:

    1. ``iptables-nft-save -t mangle`` or ``ip6tables-nft-save -t mangle`` declares
       KUBE-IPTABLES-HINT or KUBE-KUBELET-CANARY -> "nft" (kubelet >= 1.17 creates one);
    2. a full ``iptables-legacy-save`` or ``ip6tables-legacy-save`` declares one -> "legacy"
       (never ``-t mangle`` with legacy: that would create the table);
    3. otherwise count rule lines (``-A ...``) of the full v4+v6 saves of each flavour:
       more legacy rules than nft rules -> "legacy" (the wrapper's fallback for nodes
       without kubelet hint chains);
    4. otherwise (a tie, an empty node) -> "nft".

    Reading is side-effect free: nft saves never create tables, and a full legacy save
    only lists tables that already exist (verified in fresh namespaces).
    """
    run = runner or run_command

    def output(argv: Sequence[str]) -> str:
        proc = run(in_netns(argv, netns), None)
        return proc.stdout if proc.returncode == 0 else ""

    stems = ("iptables", "ip6tables")
    nft_mangle = [output([f"{stem}-nft-save", "-t", "mangle"]) for stem in stems]
    if any(_HINT_RE.search(text) for text in nft_mangle):
        return "nft"
    legacy_all = [output([f"{stem}-legacy-save"]) for stem in stems]
    if any(_HINT_RE.search(text) for text in legacy_all):
        return "legacy"
    legacy_rules = sum(len(_RULE_RE.findall(text)) for text in legacy_all)
    if legacy_rules == 0:
        return "nft"
    nft_all = [output([f"{stem}-nft-save"]) for stem in stems]
    nft_rules = sum(len(_RULE_RE.findall(text)) for text in nft_all)
    return "legacy" if legacy_rules > nft_rules else "nft"
