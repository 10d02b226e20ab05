"""iptables-save (-c) text -> rules with their matches, targets and counters.

Pure. Rules are parsed generically (generic options, `-m MODULE` options, target options),
so rules other software added are understood as far as their matches go; the evaluator in
iptables_trace.py says which matches it cannot decide.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

_COUNTERS = re.compile(r"^\[(\d+):(\d+)\]\s+")
_COUNTERS_ALONE = re.compile(r"\[(\d+):(\d+)\]")
# Generic (non-module) options, long and short names -> canonical short name.
GENERIC = {
    "-s": "-s",
    "--source": "-s",
    "--src": "-s",
    "-d": "-d",
    "--destination": "-d",
    "--dst": "-d",
    "-p": "-p",
    "--protocol": "-p",
    "-i": "-i",
    "--in-interface": "-i",
    "-o": "-o",
    "--out-interface": "-o",
}
FLAG_GENERIC = {"-f": "-f", "--fragment": "-f"}
# Options that always take exactly one argument, whatever it looks like.
ONE_ARG = {"--comment", "--name", "--to-destination", "--to-source", "--set-xmark", "--mark"}
PORT_PROTOCOLS = {"tcp", "udp", "sctp", "udplite"}
BUILTIN_CHAINS = {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # "-s", "--dport", "--ctstate", …
    values: tuple[str, ...]
    negated: bool = False

    @property
    def value(self) -> str:
        return self.values[0] if self.values else ""


@dataclass(slots=True)
class MatchModule:
    name: str  # "tcp", "comment", "statistic", …
    options: list[Option] = field(default_factory=list)

    def get(self, name: str) -> Option | None:
        for opt in self.options:
            if opt.name == name:
                return opt
        return None


@dataclass(slots=True)
class Rule:
    table: str
    chain: str
    number: int  # 1-based within the chain
    text: str  # the "-A CHAIN …" line without counters
    packets: int | None = None
    bytes: int | None = None
    generic: list[Option] = field(default_factory=list)
    matches: list[MatchModule] = field(default_factory=list)
    target: str | None = None
    goto: bool = False
    target_options: list[Option] = field(default_factory=list)
    parse_error: str | None = None

    def match(self, name: str) -> MatchModule | None:
        for m in self.matches:
            if m.name == name:
                return m
        return None

    def generic_opt(self, name: str) -> Option | None:
        for opt in self.generic:
            if opt.name == name:
                return opt
        return None

    def target_opt(self, name: str) -> str | None:
        for opt in self.target_options:
            if opt.name == name:
                return opt.value
        return None

    @property
    def comment(self) -> str | None:
        m = self.match("comment")
        opt = m.get("--comment") if m else None
        return opt.value if opt else None

    @property
    def only_comments(self) -> bool:
        """No condition besides comments: the rule matches every packet."""
        return not self.generic and all(m.name == "comment" for m in self.matches)

    @property
    def dport(self) -> int | None:
        for m in self.matches:
            opt = m.get("--dport") or m.get("--destination-port")
            if opt and opt.value.isdigit():
                return int(opt.value)
        return None

    @property
    def proto(self) -> str | None:
        opt = self.generic_opt("-p")
        return opt.value if opt and not opt.negated else None

    def address(self, which: str) -> str | None:
        opt = self.generic_opt(which)
        return opt.value if opt and not opt.negated else None


@dataclass
class Table:
    """One table of a save. Rules are parsed per chain on first use, so a trace that walks a
    few chains of a 100,000-rule table parses only those."""

    name: str
    policies: dict[str, str] = field(default_factory=dict)  # chain -> policy ("-" for user)
    # chain -> its "-A" lines with their counters, unparsed
    raw: dict[str, list[tuple[int | None, int | None, str]]] = field(default_factory=dict)
    _parsed: dict[str, list[Rule]] = field(default_factory=dict, repr=False)

    def rules(self, chain: str) -> list[Rule]:
        rules = self._parsed.get(chain)
        if rules is None:
            rules = []
            for number, (packets, nbytes, line) in enumerate(self.raw.get(chain, ()), 1):
                rule = parse_rule(line, table=self.name, number=number)
                rule.packets, rule.bytes = packets, nbytes
                rules.append(rule)
            self._parsed[chain] = rules
        return rules

    @property
    def chain_names(self) -> list[str]:
        return list(dict.fromkeys([*self.policies, *self.raw]))

    def has_chain(self, chain: str) -> bool:
        return chain in self.policies or chain in self.raw

    def has_rules(self) -> bool:
        return any(self.raw.values())

    def has_counters(self) -> bool:
        return any(p is not None for lines in self.raw.values() for p, _, _ in lines)

    def policy(self, chain: str) -> str:
        return self.policies.get(chain, "ACCEPT")


def parse_chains(text: str, table: str, chains: Iterable[str]) -> Table:
    """Some chains of one table of a save, as parse_save(text)[table] has them, found by
    substring search instead of reading every line (a 10,000-service save has 400,000)."""
    out = Table(table)
    start = text.find(f"*{table}\n")
    if start < 0:
        return out
    end = text.find("\nCOMMIT", start)
    end = len(text) if end < 0 else end
    for chain in chains:
        for prefix, line in _lines_of(text, f":{chain}", start, end):
            if not prefix:
                rest = line[len(chain) + 1 :].split(None, 1)
                out.policies[chain] = rest[0] if rest else "-"
                out.raw.setdefault(chain, [])
        for prefix, line in _lines_of(text, f"-A {chain}", start, end):
            counters = _COUNTERS_ALONE.fullmatch(prefix) if prefix else None
            if prefix and counters is None:
                continue  # the text of another line's argument
            packets, nbytes = (
                (int(counters.group(1)), int(counters.group(2))) if counters else (None, None)
            )
            out.raw.setdefault(chain, []).append((packets, nbytes, line))
    return out


def _lines_of(text: str, head: str, start: int, end: int) -> Iterator[tuple[str, str]]:
    """(what precedes `head` on its line, stripped; the line from `head` on, stripped) of
    every line in text[start:end] where `head` is followed by a blank or the line's end
    (searched in place: the table is most of a save, tens of MB)."""
    pos = text.find(head, start, end)
    while pos >= 0:
        after = pos + len(head)
        eol = text.find("\n", after, end)
        eol = end if eol < 0 else eol
        if after == eol or text[after] in " \t\r":
            yield text[text.rfind("\n", start, pos) + 1 : pos].strip(), text[pos:eol].rstrip()
        pos = text.find(head, eol, end)


def parse_save(text: str) -> dict[str, Table]:
    """iptables-save [-c] output -> tables (counters kept when present)."""
    tables: dict[str, Table] = {}
    current: Table | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = tables.setdefault(line[1:], Table(line[1:]))
            continue
        if current is None:
            continue
        if line == "COMMIT":
            current = None
            continue
        if line.startswith(":"):
            name, _, rest = line[1:].partition(" ")
            current.policies[name] = rest.split(" ", 1)[0] if rest else "-"
            current.raw.setdefault(name, [])
            continue
        packets = nbytes = None
        if line.startswith("["):
            m = _COUNTERS.match(line)
            if m:
                packets, nbytes = int(m.group(1)), int(m.group(2))
                line = line[m.end() :]
        if not line.startswith("-A "):
            continue
        chain = line.split(None, 2)[1]
        current.raw.setdefault(chain, []).append((packets, nbytes, line))
    return tables


_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"|(\S+)')
_ESCAPE = re.compile(r"\\(.)")


def split_words(line: str) -> list[str]:
    """iptables-save's quoting: whole arguments in double quotes, with \\" and \\\\ escaped
    (shlex.split gives the same words at a twentieth of the speed)."""
    if '"' not in line and "\\" not in line:
        return line.split()
    if "\\" not in line and line.count('"') == 2:
        # One quoted argument (kube-proxy's comments): split around it.
        head, quoted, tail = line.split('"')
        if (not head or head.endswith(" ")) and (not tail or tail.startswith(" ")):
            return [*head.split(), quoted, *tail.split()]
    words: list[str] = []
    end = 0
    for m in _QUOTED.finditer(line):
        if line[end : m.start()].strip():
            raise ValueError(f"cannot split {line!r}")
        end = m.end()
        quoted, word = m.group(1), m.group(2)
        if quoted is not None:
            words.append(_ESCAPE.sub(r"\1", quoted))
        elif '"' in word:
            return shlex.split(line)  # quotes inside a word: let shlex decide
        else:
            words.append(word)
    return words


def parse_rule(line: str, *, table: str = "", number: int = 0) -> Rule:
    """One '-A CHAIN …' line (as iptables-save prints it) -> Rule."""
    try:
        tokens = split_words(line)
    except ValueError as err:
        parts = line.split()
        return Rule(table, parts[1] if len(parts) > 1 else "", number, line, parse_error=str(err))
    chain = tokens[1] if len(tokens) > 1 else ""
    rule = Rule(table, chain, number, line)
    i = 2
    negate = False
    module: MatchModule | None = None
    in_target = False
    n = len(tokens)
    while i < n:
        tok = tokens[i]
        if tok == "!":
            negate = True
            i += 1
            continue
        if tok in ("-m", "--match") and i + 1 < n:
            module = MatchModule(tokens[i + 1])
            rule.matches.append(module)
            in_target = False
            i += 2
            continue
        if tok in ("-j", "--jump", "-g", "--goto") and i + 1 < n:
            rule.target = tokens[i + 1]
            rule.goto = tok in ("-g", "--goto")
            in_target = True
            i += 2
            continue
        if tok in GENERIC and i + 1 < n:
            rule.generic.append(Option(GENERIC[tok], (tokens[i + 1],), negate))
            if GENERIC[tok] == "-p" and module is None and tokens[i + 1] in PORT_PROTOCOLS:
                # `-p tcp --dport 80` without `-m tcp` loads the tcp match implicitly.
                module = MatchModule(tokens[i + 1])
                rule.matches.append(module)
            negate = False
            i += 2
            continue
        if tok in FLAG_GENERIC:
            rule.generic.append(Option(FLAG_GENERIC[tok], (), negate))
            negate = False
            i += 1
            continue
        if tok.startswith("-"):
            j = i + 1
            values: list[str] = []
            if tok in ONE_ARG and j < n:
                values.append(tokens[j])
                j += 1
            else:
                while j < n and not tokens[j].startswith("-") and tokens[j] != "!":
                    values.append(tokens[j])
                    j += 1
            opt = Option(tok, tuple(values), negate)
            negate = False
            if in_target:
                rule.target_options.append(opt)
            else:
                if module is None:
                    module = MatchModule("?")
                    rule.matches.append(module)
                module.options.append(opt)
            i = j
            continue
        # A stray word: keep it visible rather than guess.
        rule.parse_error = f"unexpected {tok!r}"
        i += 1
    return rule


# --- kube-proxy's comments ---------------------------------------------------------------------

_SUFFIXES = (
    " cluster IP",
    " external IP",
    " loadbalancer IP",
    " has no endpoints",
    " has no local endpoints",
    " health check node port",
)
_NOT_ACCEPTED = re.compile(r"^(?P<name>\S+) traffic not accepted by (?P<chain>KUBE-FW-\S+)$")


def service_of_comment(comment: str | None) -> str | None:
    """The service port a kube-proxy comment names ('ns/svc:port cluster IP' -> 'ns/svc:port')."""
    if not comment:
        return None
    for suffix in _SUFFIXES:
        if comment.endswith(suffix):
            name = comment[: -len(suffix)]
            return name if "/" in name and " " not in name else None
    m = _NOT_ACCEPTED.match(comment)
    if m:
        return m.group("name")
    if "/" in comment and " " not in comment:
        return comment  # KUBE-NODEPORTS and KUBE-SEP rules carry the bare name
    if " -> " in comment:
        name = comment.split(" -> ", 1)[0]
        return name if "/" in name and " " not in name else None
    return None


def kind_of_comment(comment: str | None) -> str | None:
    if not comment:
        return None
    if comment.endswith(" cluster IP"):
        return "ClusterIP"
    if comment.endswith(" external IP"):
        return "ExternalIP"
    if comment.endswith(" loadbalancer IP"):
        return "LoadBalancer"
    return None
