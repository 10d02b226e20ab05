"""Fakes for nftables mode (their own tests are in tests/test_nft_fakes.py).

* FakeTable: an in-memory `table ip kube-proxy` that applies transactions line by line the
  way the kernel does (atomically; missing objects, dangling jumps, element clashes and
  deleting referenced chains are errors) and dumps itself as upstream's knftables.Fake
  does (`add ...` lines).
* sort_dump: upstream's sortNFTablesTransaction (helpers_test.go): lines sorted by object
  type, then name, then text, rules kept in order within their chain. Comparing sorted
  dumps ignores only the order in which services were written.
* trace_packet: upstream's nftablesTracer (same regexps, same chain walk).
* FakeBackend: NftBackend's interface over a FakeTable, for the proxier's unit tests.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, field

from kproxy.dataplane.nftables.backend import NftError, TableRef
from kproxy.dataplane.nftables.steps import op_line, split
from kproxy.dataplane.nftables.transaction import Transaction

WHERE = "ip kube-proxy"


class FakeNftError(Exception):
    def __init__(self, line_number: int, line: str, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}: {line}")
        self.line_number = line_number
        self.line = line
        self.reason = reason


@dataclass
class FakeChain:
    header: str
    rules: list[str] = field(default_factory=list)


@dataclass
class FakeContainer:
    kind: str
    header: str
    elements: dict[str, str] = field(default_factory=dict)  # key -> full "add element" line
    values: dict[str, str] = field(default_factory=dict)  # key -> value


_REF_RE = re.compile(r"\b(?:jump|goto) (\S+?)(?=[ ,}]|$)")
_SET_RE = re.compile(r"@(\S+)")
_ELEMENT_RE = re.compile(r"^(\S+) \{ (.*?)(?: comment (\"[^\"]*\"))?(?: : (.*))? \}$")


@dataclass
class FakeTable:
    """What one `ip kube-proxy` table holds; None table = the table does not exist."""

    exists: bool = False
    header: str = ""
    chains: dict[str, FakeChain] = field(default_factory=dict)
    containers: dict[str, FakeContainer] = field(default_factory=dict)
    transactions: list[str] = field(default_factory=list)

    def copy(self) -> FakeTable:
        return FakeTable(
            self.exists,
            self.header,
            {k: FakeChain(c.header, list(c.rules)) for k, c in self.chains.items()},
            {
                k: FakeContainer(c.kind, c.header, dict(c.elements), dict(c.values))
                for k, c in self.containers.items()
            },
            self.transactions,
        )

    # -- applying --------------------------------------------------------------------

    def apply(self, text: str) -> None:
        """Apply a transaction atomically (on error nothing changes)."""
        work = self.copy()
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            try:
                work._op(line)
            except KeyError as err:
                raise FakeNftError(number, line, f"No such file or directory ({err})") from err
            except ValueError as err:
                raise FakeNftError(number, line, str(err)) from err
        self.transactions.append(text)
        self.exists, self.header = work.exists, work.header
        self.chains, self.containers = work.chains, work.containers

    def _op(self, line: str) -> None:
        verb, kind, rest = line.split(" ", 2)
        if not rest.startswith(WHERE):
            raise ValueError(f"unexpected table in {line!r}")
        rest = rest[len(WHERE) :].strip()
        if kind == "table":
            if verb == "add":
                if not self.exists or "{" in line:
                    self.header = line if "{" in line else self.header or line
                self.exists = True
            elif verb == "delete":
                if not self.exists:
                    raise KeyError("table")
                self.exists, self.header = False, ""
                self.chains, self.containers = {}, {}
            return
        if not self.exists:
            raise KeyError("table")
        if kind == "chain" and verb == "add" and " { " in rest and not _is_definition(rest):
            # add chain T C { rule ; rule ; }: append rules (nft's inline form)
            name, body = rest.split(" ", 1)
            if name not in self.chains:
                self.chains[name] = FakeChain(f"add chain {WHERE} {name}")
            for rule in body[2:-2].split(" ; "):
                if rule.strip():
                    self._op(f"add rule {WHERE} {name} {rule.strip().rstrip(' ;')}")
            return
        if kind in ("set", "map") and verb == "add" and " elements = { " in rest:
            name, body = rest.split(" ", 1)
            header, items = body.split(" elements = { ", 1)
            self._op(f"add {kind} {WHERE} {name} {header} }}")
            for item in items[: -len(" } }")].split(" , "):
                self._op(f"add element {WHERE} {name} {{ {item} }}")
            return
        if kind == "chain":
            name = rest.split(" ", 1)[0]
            if verb == "add":
                chain = self.chains.get(name)
                if chain is None:
                    self.chains[name] = FakeChain(line)
                elif "{" in line:
                    chain.header = line
            elif verb == "flush":
                self.chains[name].rules.clear()
            elif verb == "delete":
                if name not in self.chains:
                    raise KeyError(name)
                if self._chain_users(name):
                    raise ValueError(f"Device or resource busy: {name} is referenced")
                del self.chains[name]
            else:
                raise ValueError(f"unsupported {verb} chain")
        elif kind == "rule":
            if verb != "add":
                raise ValueError("only add rule is supported")
            chain, rule = rest.split(" ", 1)
            self.chains[chain].rules.append(rule)
            for target in _REF_RE.findall(_strip_comment(rule)):
                if target not in self.chains:
                    raise KeyError(target)
            for ref in _SET_RE.findall(rule):
                if ref not in self.containers:
                    raise KeyError(ref)
        elif kind in ("set", "map"):
            name = rest.split(" ", 1)[0]
            if verb == "add":
                if name not in self.containers:
                    self.containers[name] = FakeContainer(kind, line)
            elif verb == "flush":
                c = self.containers[name]
                c.elements.clear()
                c.values.clear()
            elif verb == "delete":
                if name not in self.containers:
                    raise KeyError(name)
                if any(f"@{name}" in r for ch in self.chains.values() for r in ch.rules):
                    raise ValueError(f"Device or resource busy: set {name} is used")
                del self.containers[name]
        elif kind == "element":
            m = _ELEMENT_RE.match(rest)
            if m is None:
                raise ValueError(f"cannot parse element {rest!r}")
            name, key, _comment, value = m.groups()
            c = self.containers[name]
            if verb == "add":
                value = value or ""
                if key in c.values and c.values[key] != value:
                    raise ValueError("File exists")
                for target in _REF_RE.findall(value):
                    if target not in self.chains:
                        raise KeyError(target)
                c.values[key] = value
                c.elements[key] = line
            elif verb == "delete":
                if key not in c.values:
                    raise KeyError(key)
                del c.values[key]
                del c.elements[key]
        else:
            raise ValueError(f"unsupported object {kind}")

    def _chain_users(self, name: str) -> list[str]:
        users = [
            c
            for c, ch in self.chains.items()
            for r in ch.rules
            if name in _REF_RE.findall(_strip_comment(r))
        ]
        users += [
            k for k, c in self.containers.items() for v in c.values.values() if v.endswith(name)
        ]
        return users

    # -- reading ---------------------------------------------------------------------

    def dump(self) -> str:
        if not self.exists:
            return ""
        lines = [self.header]
        for chain in self.chains.values():
            lines.append(chain.header)
        for name, chain in self.chains.items():
            lines += [f"add rule {WHERE} {name} {r}" for r in chain.rules]
        for c in self.containers.values():
            lines.append(c.header)
            lines += list(c.elements.values())
        return "\n".join(lines) + "\n"

    def rules(self, chain: str) -> list[str]:
        return list(self.chains[chain].rules)


def _is_definition(rest: str) -> bool:
    """`NAME { type ... ; }` or `NAME { comment ... ; }`: a chain definition, not rules."""
    body = rest.split(" ", 1)[1]
    return body.startswith("{ type ") or body.startswith("{ comment ")


def _strip_comment(rule: str) -> str:
    return re.sub(r' comment "[^"]*"$', "", rule)


# --- upstream's comparison --------------------------------------------------------------

_ORDER = {"table": 10, "chain": 9, "rule": 8, "set": 7, "map": 6, "element": 5}


def sort_dump(text: str) -> list[str]:
    """upstream's sortNFTablesTransaction: blank lines and # comments dropped; sorted by
    object type, then object name, then whole line, except rules (kept in order)."""
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]

    def key(item: tuple[int, str]) -> tuple[int, str, str, int]:
        index, line = item
        words = line.split(" ")
        kind, name = words[1], words[4] if len(words) > 4 else ""
        tiebreak = "" if kind == "rule" else line
        return (-_ORDER.get(kind, 0), name, tiebreak, index)

    return [line for _, line in sorted(enumerate(lines), key=key)]


def load_dump(table: FakeTable, text: str) -> None:
    """Put a dump into a table (upstream's ParseDump): objects before what uses them."""
    rank = {"table": 0, "set": 1, "map": 1, "chain": 2, "rule": 3, "element": 4}
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    lines.sort(key=lambda line: rank[line.split(" ")[1]])
    table.apply("\n".join(lines) + "\n")


def assert_dump_equal(expected: str, actual: str) -> None:
    exp, act = sort_dump(expected), sort_dump(actual)
    if exp == act:
        return
    missing = [line for line in exp if line not in act]
    extra = [line for line in act if line not in exp]
    detail = "\n".join(["expected, not found:", *missing, "found, not expected:", *extra])
    if not missing and not extra:
        detail = "same lines, different order of rules within a chain"
    raise AssertionError(f"nftables state differs from upstream's:\n{detail}")


# --- upstream's packet tracer -----------------------------------------------------------

_IGNORED = re.compile(r' *comment "[^"]*"$|^ct state new')
_PATTERNS = {
    "dest_ip_set": re.compile(r"^ip6* daddr @(\S+)"),
    "dest_dispatch": re.compile(r"^ip6* daddr \. meta l4proto \. th dport vmap @(\S+)$"),
    "port_dispatch": re.compile(r"^meta l4proto \. th dport vmap @(\S+)$"),
    "dest_not_in": re.compile(r"^ip6* daddr != \{([^}]*)\}"),
    "dest_in": re.compile(r"^ip6* daddr \{([^}]*)\}"),
    "dest": re.compile(r"^ip6* daddr (!= )?(\S+)"),
    "dest_local": re.compile(r"^fib daddr type local"),
    "dport": re.compile(r"^(tcp|udp|sctp) dport (\d+)"),
    "src_not_in": re.compile(r"^ip6* saddr != \{([^}]*)\}"),
    "src_set": re.compile(r"^ip6* saddr @(\S+)"),
    "src": re.compile(r"^ip6* saddr (!= )?(\S+)"),
    "src_local": re.compile(r"^fib saddr type local"),
    "masq": re.compile(r"^jump mark-for-masquerade$"),
    "jump": re.compile(r"^(jump|goto) (\S+)$"),
    "return": re.compile(r"^return$"),
    "verdict": re.compile(r"^(drop|reject)$"),
    "dnat": re.compile(r"^meta l4proto (tcp|udp|sctp) dnat to (\S+)$"),
    "numgen": re.compile(r"^numgen random mod \d+ vmap \{(.*)\}$"),
}
_NUMGEN_ENTRY = re.compile(r"\d+ : goto (\S+)")


def _addr_matches(ip: str, rule_addr: str) -> bool:
    if "/" in rule_addr:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(rule_addr, strict=False)
    return ipaddress.ip_address(ip) == ipaddress.ip_address(rule_addr)


@dataclass
class Tracer:
    table: FakeTable
    node_ips: frozenset[str]
    matches: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    masq: bool = False

    def _elements(self, name: str) -> dict[str, str]:
        return self.table.containers[name].values

    def run_chain(self, chain: str, src: str, proto: str, dst: str, dport: str) -> bool:
        for raw in self.table.chains[chain].rules:
            rule = _IGNORED.sub("", raw)
            while rule:
                rule = rule.lstrip(" ")
                p = _PATTERNS
                if m := p["dest_ip_set"].match(rule):
                    rule = rule[m.end() :]
                    if dst not in self._elements(m.group(1)):
                        rule = ""
                elif m := p["dest_dispatch"].match(rule):
                    value = self._elements(m.group(1)).get(f"{dst} . {proto} . {dport}")
                    rule = value or ""
                elif m := p["port_dispatch"].match(rule):
                    value = self._elements(m.group(1)).get(f"{proto} . {dport}")
                    rule = value or ""
                elif m := p["dest_not_in"].match(rule):
                    rule = rule[m.end() :]
                    if any(_addr_matches(dst, a.strip()) for a in m.group(1).split(",")):
                        rule = ""
                elif m := p["dest_in"].match(rule):
                    rule = rule[m.end() :]
                    if not any(_addr_matches(dst, a.strip()) for a in m.group(1).split(",")):
                        rule = ""
                elif m := p["dest"].match(rule):
                    rule = rule[m.end() :]
                    if _addr_matches(dst, m.group(2)) != (m.group(1) is None):
                        rule = ""
                elif m := p["dest_local"].match(rule):
                    rule = rule[m.end() :]
                    if dst not in self.node_ips:
                        rule = ""
                elif m := p["dport"].match(rule):
                    rule = rule[m.end() :]
                    if (proto, dport) != (m.group(1), m.group(2)):
                        rule = ""
                elif m := p["src_not_in"].match(rule):
                    rule = rule[m.end() :]
                    if any(_addr_matches(src, a.strip()) for a in m.group(1).split(",")):
                        rule = ""
                elif m := p["src_set"].match(rule):
                    # Affinity sets are empty for new connections.
                    rule = ""
                elif m := p["src"].match(rule):
                    rule = rule[m.end() :]
                    if _addr_matches(src, m.group(2)) != (m.group(1) is None):
                        rule = ""
                elif m := p["src_local"].match(rule):
                    rule = rule[m.end() :]
                    if src not in self.node_ips:
                        rule = ""
                elif p["masq"].match(rule):
                    self.matches.append(raw)
                    self.masq = True
                    rule = ""
                elif m := p["jump"].match(rule):
                    self.matches.append(raw)
                    if self.run_chain(m.group(2), src, proto, dst, dport):
                        return True
                    if m.group(1) == "goto":
                        return False
                    rule = ""
                elif m := p["verdict"].match(rule):
                    self.matches.append(raw)
                    self.outputs.append(m.group(1).upper())
                    return True
                elif p["return"].match(rule):
                    self.matches.append(raw)
                    return False
                elif m := p["dnat"].match(rule):
                    self.matches.append(raw)
                    self.outputs.append(m.group(2))
                    return True
                elif m := p["numgen"].match(rule):
                    for target in _NUMGEN_ENTRY.findall(m.group(1)):
                        self.matches.append(raw)
                        self.run_chain(target, src, proto, dst, dport)
                    return True
                elif rule.startswith("update @"):
                    rule = ""
                else:
                    raise AssertionError(f"tracer: unmatched rule {raw!r}")
        return False


def trace_packet(
    table: FakeTable, src: str, proto: str, dst: str, dport: int, node_ips: frozenset[str]
) -> Tracer:
    """Upstream's tracePacket: filter-prerouting-pre-dnat, nat-prerouting, the DNAT, then
    filter-forward and (unless that ended it) filter-input."""
    t = Tracer(table, node_ips)
    port = str(dport)
    if t.run_chain("filter-prerouting-pre-dnat", src, proto, dst, port):
        return t
    t.run_chain("nat-prerouting", src, proto, dst, port)
    if t.outputs:
        host = t.outputs[0].rsplit(":", 1)[0].strip("[]")
        dst = host
    if t.run_chain("filter-forward", src, proto, dst, port):
        return t
    t.run_chain("filter-input", src, proto, dst, port)
    return t


# --- a backend over a FakeTable -------------------------------------------------------


class FakeBackend:
    """NftBackend's interface over a FakeTable; counts transactions and can be told to fail.

    fast=True applies transactions the way NftBackend's fast path does (steps.split): the
    nft steps in their inline form, the netlink steps as their upstream-form lines, each
    step a transaction of its own."""

    netns = None

    def __init__(
        self, table: FakeTable | None = None, *, fast: bool = False, chunk_ops: int = 20_000
    ) -> None:
        self.table = table or FakeTable()
        self.runs: list[str] = []
        self.fail_next: str | None = None
        self.fast = fast
        self.chunk_ops = chunk_ops
        self.steps: list[list[str]] = []

    def apply(self, tx: Transaction) -> None:
        if not self.fast:
            self.run(tx.text())
            return
        steps = split(tx, chunk_ops=self.chunk_ops)
        self.steps.append([s.kind for s in steps])
        for step in steps:
            if step.kind == "nft":
                self.run(step.script(tx))
            else:
                step.messages(tx)  # encodable
                self.run("".join(op_line(tx, op) + "\n" for op in step.ops))

    def version(self) -> tuple[int, int, int]:
        return (1, 0, 6)

    def run(self, data: str) -> None:
        if not data:
            return
        self.runs.append(data)
        if self.fail_next is not None:
            reason, self.fail_next = self.fail_next, None
            raise NftError("nft rejected the transaction", stderr=reason, input_data=data)
        try:
            self.table.apply(data)
        except FakeNftError as err:
            stderr = f"/dev/stdin:{err.line_number}:1-1: Error: {err.reason}\n"
            raise NftError(
                "nft rejected the transaction", returncode=1, stderr=stderr, input_data=data
            ) from err

    def tables(self) -> list[TableRef]:
        return [TableRef("ip", "kube-proxy")] if self.table.exists else []

    def table_exists(self, family: str, name: str) -> bool:
        return TableRef(family, name) in self.tables()

    def delete_chains(self, family: str, table: str, chains: list[str]) -> None:
        # The kernel deletes a chain with its rules; nft's text form needs a flush first.
        missing = [c for c in chains if c not in self.table.chains]
        if missing:
            raise NftError(f"deleting chains: No such file or directory: {missing}")
        self.run(
            "".join(
                f"flush chain {family} {table} {c}\ndelete chain {family} {table} {c}\n"
                for c in chains
            )
        )

    def chains(self, family: str, table: str) -> list[str]:
        return list(self.table.chains) if self.table.exists else []

    def chains_with_rules(self, family: str, table: str) -> set[str] | None:
        if not self.table.exists:
            return set()
        return {name for name, chain in self.table.chains.items() if chain.rules}

    def sets(self, family: str, table: str) -> list[str]:
        return [k for k, c in self.table.containers.items() if c.kind == "set"]

    def elements(
        self, kind: str, family: str, table: str, name: str
    ) -> list[tuple[str, str, str | None]]:
        if not self.table.exists or name not in self.table.containers:
            raise NftError("nft list failed", stderr="Error: No such file or directory")
        out = []
        for key, line in self.table.containers[name].elements.items():
            m = _ELEMENT_RE.match(line.split(WHERE, 1)[1].strip())
            assert m is not None
            comment = shlex.split(m.group(3))[0] if m.group(3) else None
            out.append((key, m.group(4) or "", comment))
        return out

    def delete_table(self, family: str, name: str) -> bool:
        if not self.table_exists(family, name):
            return False
        self.run(f"delete table {family} {name}\n")
        return True
