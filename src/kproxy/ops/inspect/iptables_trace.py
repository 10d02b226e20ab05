"""Walk a new connection through the iptables rules the kernel holds.

The order is netfilter's for the first packet of a connection (the raw and mangle tables
are not evaluated):

* from outside the node: nat PREROUTING -> routing -> filter FORWARD (or filter INPUT when
  the destination, after DNAT, is a local address) -> nat POSTROUTING;
* from the node itself: nat OUTPUT -> filter OUTPUT -> nat POSTROUTING.

Matches are evaluated as far as kube-proxy's rules need (addresses, protocols and ports,
addrtype LOCAL, conntrack state, marks, comments, nfacct); `-m statistic` forks the walk into
one branch per outcome with its probability; `-m recent --rcheck` (ClientIP affinity) is
answered from the kernel's /proc/net/xt_recent list when it can be read, otherwise the walk
forks on the condition. A match it cannot decide is reported ("cannot evaluate …; assuming
it may match") and treated as matching.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kproxy.ops.inspect.branch import Branch as _Branch
from kproxy.ops.inspect.iptables_rules import (
    BUILTIN_CHAINS,
    MatchModule,
    Option,
    Rule,
    Table,
    service_of_comment,
)
from kproxy.ops.inspect.kernel import KernelSource, parse_recent
from kproxy.ops.inspect.model import (
    ACCEPT,
    DNAT,
    DROP,
    REJECT,
    Outcome,
    Packet,
    Step,
    Walk,
    in_network,
    split_hostport,
)

MAX_STEPS = 20000
PROTO_NUMBERS = {"6": "tcp", "17": "udp", "132": "sctp", "1": "icmp", "136": "udplite"}
# Targets that do not end the walk of a chain and change nothing we track.
CONTINUING_TARGETS = {
    "LOG",
    "NFLOG",
    "ULOG",
    "TRACE",
    "CT",
    "NOTRACK",
    "TCPMSS",
    "AUDIT",
    "CHECKSUM",
    "CLASSIFY",
    "DSCP",
    "TOS",
    "TTL",
    "NFQUEUE",
    "CONNMARK",
    "CONNSECMARK",
    "SECMARK",
}
MASQ_TARGETS = {"MASQUERADE", "SNAT"}
TERMINAL = {ACCEPT, DROP, REJECT, DNAT, "MASQUERADE"}


@dataclass
class _Fork:
    kind: str  # "statistic" | "recent"
    probability: float | None = None
    condition: str = ""  # for "recent": the condition of the matching branch
    negation: str = ""  # … and of the other one


class IptablesWalker:
    def __init__(
        self,
        tables: dict[str, Table],
        local_addresses: list[str] | None,
        source: KernelSource | None = None,
    ) -> None:
        self.tables = tables
        self.local = local_addresses
        self.source = source
        self.notes: list[str] = []
        self._budget = MAX_STEPS
        self._jiffies: tuple[int, int] | None | bool = False  # False: not read yet

    # -- public -------------------------------------------------------------------------------

    def trace(self, pkt: Packet) -> Walk:
        self.notes = []
        for name in ("raw", "mangle"):
            t = self.tables.get(name)
            if t is not None and t.has_rules():
                self.notes.append(f"the {name} table has rules; they are not evaluated")
        if self.local is None:
            self.notes.append(
                "the node's local addresses are unknown: addrtype matches cannot be evaluated"
            )
        outcomes: list[Outcome] = []
        start = _Branch(prob=1.0)
        nat_chain = "OUTPUT" if pkt.from_node else "PREROUTING"
        for br, verdict, step in self._run("nat", nat_chain, start, pkt):
            if verdict in (DROP, REJECT):
                outcomes.append(self._final(br, verdict, step, pkt))
                continue
            dst = self._dst(br, pkt)
            local = self._is_local(dst[0])
            fchain = "OUTPUT" if pkt.from_node else "INPUT" if local else "FORWARD"
            for br2, v2, step2 in self._run("filter", fchain, br, pkt):
                if v2 in (DROP, REJECT):
                    outcomes.append(self._final(br2, v2, step2, pkt))
                    continue
                if fchain == "INPUT":
                    br2.notes.append(f"{dst[0]} is a local address: delivered to the node itself")
                    outcomes.append(self._final(br2, ACCEPT, step2, pkt, local=True))
                    continue
                for br3, v3, step3 in self._run("nat", "POSTROUTING", br2, pkt):
                    if v3 in (DROP, REJECT):
                        outcomes.append(self._final(br3, v3, step3, pkt))
                        continue
                    outcomes.append(self._final(br3, ACCEPT, step3, pkt))
        return Walk(outcomes, self.notes)

    # -- phases -------------------------------------------------------------------------------

    def _final(
        self, br: _Branch, verdict: str, step: Step | None, pkt: Packet, *, local: bool = False
    ) -> Outcome:
        dst = self._dst(br, pkt)
        if verdict in (DROP, REJECT):
            where = step.where() if step else "?"
            why = ""
            if step is not None and step.rule is None:
                where = f"the policy of {step.table} {step.chain}"
            else:
                comment = _comment_of(step.text) if step else None
                why = f" ({comment})" if comment else ""
            return Outcome(
                br.prob,
                tuple(br.conditions),
                br.steps,
                verdict,
                dnat=_hostport(br.dnat) if br.dnat else None,
                service=br.service,
                reason=f"{verdict} by {where}{why}",
                notes=br.notes,
            )
        masq = None if local else br.masquerade
        if br.dnat is not None:
            return Outcome(
                br.prob,
                tuple(br.conditions),
                br.steps,
                DNAT,
                dnat=_hostport(br.dnat),
                service=br.service,
                masquerade=masq,
                notes=br.notes,
            )
        where = (
            "delivered to the node itself" if local else f"goes on to {dst[0]}:{dst[1]} unchanged"
        )
        return Outcome(
            br.prob,
            tuple(br.conditions),
            br.steps,
            ACCEPT,
            service=br.service,
            masquerade=masq,
            reason=f"not DNATed: no service rule matched {pkt}; the packet {where}",
            notes=br.notes,
        )

    def _run(
        self, table: str, chain: str, br: _Branch, pkt: Packet
    ) -> list[tuple[_Branch, str, Step | None]]:
        """Every way through one built-in chain: (branch, verdict, the step that decided)."""
        t = self.tables.get(table)
        if t is None or not t.has_chain(chain):
            br = br.fork()
            br.notes.append(f"no {table} {chain} chain in this backend: nothing to evaluate")
            return [(br, ACCEPT, None)]
        out: list[tuple[_Branch, str, Step | None]] = []
        self._exec(t, [[chain, 0]], br.fork(), pkt, out)
        return out

    def _exec(
        self,
        t: Table,
        frames: list[list[object]],
        br: _Branch,
        pkt: Packet,
        out: list[tuple[_Branch, str, Step | None]],
    ) -> None:
        while frames:
            self._budget -= 1
            if self._budget < 0:
                br.notes.append("trace stopped: too many steps (a rule loop?)")
                out.append((br, ACCEPT, None))
                return
            chain = str(frames[-1][0])
            index = int(frames[-1][1])  # type: ignore[call-overload]
            rules = t.rules(chain)
            if index >= len(rules):
                frames.pop()
                if not frames:
                    policy = t.policy(chain)
                    step = Step(t.name, chain, None, "", f"end of chain: policy {policy}")
                    br.steps.append(step)
                    out.append((br, DROP if policy == "DROP" else ACCEPT, step))
                    return
                continue
            frames[-1][1] = index + 1
            rule = rules[index]
            result, notes, fork = self._evaluate(rule, br, pkt)
            if result is False:
                br.notes += [f"{t.name} {chain} rule {rule.number}: {n}" for n in notes]
                continue
            if fork is not None:
                if fork.kind == "statistic":
                    p = fork.probability
                    taken = br.fork()
                    taken.scale(p)
                    self._step(
                        taken, rule, f"taken (probability {_p(p)}): {self._action(rule)}", notes
                    )
                    self._after_match(t, rule, [list(f) for f in frames], taken, pkt, out)
                    br.scale(None if p is None else 1 - p)
                    self._step(
                        br, rule, f"not taken (probability {_p(None if p is None else 1 - p)})", ()
                    )
                    continue
                # recent: the reader could not decide the client's affinity state.
                taken = br.fork()
                taken.conditions.append(fork.condition)
                self._step(taken, rule, self._action(rule), notes)
                self._after_match(t, rule, [list(f) for f in frames], taken, pkt, out)
                br.conditions.append(fork.negation)
                continue
            self._step(br, rule, self._action(rule), notes)
            verdict = self._apply(t, rule, frames, br, pkt)
            if verdict is not None:
                out.append((br, verdict, br.steps[-1]))
                return

    def _after_match(
        self,
        t: Table,
        rule: Rule,
        frames: list[list[object]],
        br: _Branch,
        pkt: Packet,
        out: list[tuple[_Branch, str, Step | None]],
    ) -> None:
        verdict = self._apply(t, rule, frames, br, pkt)
        if verdict is not None:
            out.append((br, verdict, br.steps[-1]))
            return
        self._exec(t, frames, br, pkt, out)

    def _step(
        self, br: _Branch, rule: Rule, action: str, notes: tuple[str, ...] | list[str]
    ) -> None:
        br.steps.append(
            Step(rule.table, rule.chain, rule.number, rule.text, action, notes=tuple(notes))
        )
        if br.service is None and rule.chain not in BUILTIN_CHAINS:
            br.service = service_of_comment(rule.comment)

    # -- targets ------------------------------------------------------------------------------

    def _action(self, rule: Rule) -> str:
        target = rule.target
        if target is None:
            return "matched (no target: continue)"
        if target == "DNAT":
            return f"DNAT to {rule.target_opt('--to-destination')}"
        if target == "MARK":
            return "MARK " + " ".join(f"{o.name} {o.value}" for o in rule.target_options)
        if target in (ACCEPT, DROP, REJECT, "RETURN", "MASQUERADE", "SNAT"):
            return target
        return f"{'goto' if rule.goto else 'jump'} {target}"

    def _apply(
        self, t: Table, rule: Rule, frames: list[list[object]], br: _Branch, pkt: Packet
    ) -> str | None:
        """Apply the rule's target; returns the verdict when it ends this chain walk."""
        target = rule.target
        if target is None:
            return None
        if target in (ACCEPT, DROP, REJECT):
            return target
        if target == "RETURN":
            frames.pop()
            if not frames:
                policy = t.policy(rule.chain)
                return DROP if policy == "DROP" else ACCEPT
            return None
        if target in ("DNAT", "REDIRECT"):
            if target == "DNAT":
                host, port = split_hostport(rule.target_opt("--to-destination") or "")
            else:
                host = "127.0.0.1" if pkt.from_node else (self.local or ["(local)"])[0]
                port = int(p) if (p := rule.target_opt("--to-ports") or "").isdigit() else None
            br.dnat = (host, port if port is not None else pkt.dport)
            return DNAT
        if target in MASQ_TARGETS:
            br.masquerade = True
            return "MASQUERADE"
        if target == "MARK":
            br.mark = _mark(br.mark, rule.target_options)
            return None
        if target in CONTINUING_TARGETS:
            if target == "CONNMARK":
                br.notes.append(f"{rule.chain} rule {rule.number}: CONNMARK is not evaluated")
            return None
        if t.has_chain(target):
            if rule.goto:
                frames.pop()
            frames.append([target, 0])
            return None
        br.notes.append(
            f"{t.name} {rule.chain} rule {rule.number}: cannot evaluate target {target}; "
            "assuming it continues"
        )
        return None

    # -- matches ------------------------------------------------------------------------------

    def _evaluate(
        self, rule: Rule, br: _Branch, pkt: Packet
    ) -> tuple[bool | None, tuple[str, ...], _Fork | None]:
        """(True / False / None = undecidable, notes, a fork to take)."""
        notes: list[str] = []
        undecided = False
        if rule.parse_error:
            notes.append(f"cannot parse the rule ({rule.parse_error}); assuming it may match")
            undecided = True
        src = pkt.src
        dst, dport = self._dst(br, pkt)
        for opt in rule.generic:
            res = self._generic(opt, src, dst, pkt)
            if res is None:
                notes.append(f"cannot evaluate {_opt_text(opt)}; assuming it may match")
                undecided = True
            elif res is False:
                return False, (), None
        fork: _Fork | None = None
        for m in rule.matches:
            if m.name in ("statistic", "recent") and fork is None:
                res, f, n = self._forking(m, pkt, rule)
                notes += n
                if res is False:
                    # Why an affinity check missed is part of the answer: keep it.
                    return False, tuple(n) if m.name == "recent" else (), None
                if f is not None:
                    fork = f
                continue
            res, n = self._module(m, br, pkt, dst, dport)
            notes += n
            if res is None:
                undecided = True
            elif res is False:
                return False, (), None
        return (None if undecided else True), tuple(notes), fork

    def _generic(self, opt: Option, src: str, dst: str, pkt: Packet) -> bool | None:
        name, value = opt.name, opt.value
        res: bool | None
        if name == "-s":
            res = in_network(src, value)
        elif name == "-d":
            res = in_network(dst, value)
        elif name == "-p":
            proto = PROTO_NUMBERS.get(value, value.lower())
            res = True if proto in ("all", "0") else proto == pkt.proto
        elif name == "-f":
            res = False  # the first packet of a connection is never a non-first fragment
        else:
            return None  # -i / -o: interfaces are not known
        if res is None:
            return None
        return not res if opt.negated else res

    def _module(
        self, m: MatchModule, br: _Branch, pkt: Packet, dst: str, dport: int
    ) -> tuple[bool | None, list[str]]:
        name = m.name
        if name in ("comment", "nfacct"):
            return True, []
        results: list[bool | None] = []
        notes: list[str] = []
        if name in ("tcp", "udp", "sctp", "udplite"):
            if pkt.proto != name:
                return False, []
            for opt in m.options:
                if opt.name in ("--dport", "--destination-port"):
                    results.append(_neg(opt, _port_in(dport, opt.value)))
                elif opt.name in ("--sport", "--source-port"):
                    results.append(
                        None if pkt.sport is None else _neg(opt, _port_in(pkt.sport, opt.value))
                    )
                elif opt.name == "--syn":
                    results.append(_neg(opt, pkt.proto == "tcp"))
                elif opt.name == "--tcp-flags" and len(opt.values) == 2:
                    results.append(_neg(opt, _tcp_flags(opt.values[0], opt.values[1])))
                else:
                    results.append(None)
        elif name == "multiport":
            for opt in m.options:
                if opt.name in ("--dports", "--destination-ports"):
                    results.append(_neg(opt, any(_port_in(dport, p) for p in opt.value.split(","))))
                elif opt.name == "--ports" and any(
                    _port_in(dport, p) for p in opt.value.split(",")
                ):
                    results.append(_neg(opt, True))
                else:
                    results.append(None)
        elif name == "addrtype":
            for opt in m.options:
                if opt.name in ("--dst-type", "--src-type"):
                    addr = dst if opt.name == "--dst-type" else pkt.src
                    res = self._addrtype(addr, opt.value)
                    results.append(None if res is None else _neg(opt, res))
                else:
                    results.append(None)  # --limit-iface-in / -out
        elif name in ("conntrack", "state"):
            states = {"NEW"}
            if name == "conntrack" and br.dnat is not None:
                states.add("DNAT")
            for opt in m.options:
                if opt.name in ("--ctstate", "--state"):
                    wanted = set(opt.value.upper().split(","))
                    results.append(_neg(opt, bool(wanted & states)))
                elif opt.name == "--ctorigdst":
                    results.append(_neg(opt, in_network(pkt.dst, opt.value)))
                elif opt.name == "--ctorigdstport":
                    results.append(_neg(opt, _port_in(pkt.dport, opt.value)))
                elif opt.name == "--ctproto":
                    proto = PROTO_NUMBERS.get(opt.value, opt.value.lower())
                    results.append(_neg(opt, proto == pkt.proto))
                else:
                    results.append(None)
        elif name == "mark":
            for opt in m.options:
                if opt.name == "--mark":
                    value, _, mask = opt.value.partition("/")
                    try:
                        v, k = int(value, 0), int(mask or "0xffffffff", 0)
                    except ValueError:
                        results.append(None)
                        continue
                    results.append(_neg(opt, (br.mark & k) == v))
                else:
                    results.append(None)
        else:
            results.append(None)
        if any(r is False for r in results):
            return False, []
        if any(r is None for r in results) or (not results and name not in ("tcp", "udp", "sctp")):
            text = f"-m {name} " + " ".join(_opt_text(o) for o in m.options)
            notes.append(f"cannot evaluate {text.strip()}; assuming it may match")
            return None, notes
        return True, notes

    def _addrtype(self, addr: str, types: str) -> bool | None:
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            return None
        wanted = set(types.upper().split(","))
        local = self._is_local(addr)
        if local is None and wanted & {"LOCAL", "UNICAST"}:
            return None
        kinds: set[str] = set()
        if local:
            kinds.add("LOCAL")
        elif ip.is_multicast:
            kinds.add("MULTICAST")
        elif str(ip) == "255.255.255.255":
            kinds.add("BROADCAST")
        else:
            kinds.add("UNICAST")
        if wanted - {"LOCAL", "UNICAST", "MULTICAST", "BROADCAST"}:
            return None if not wanted & kinds else True
        return bool(wanted & kinds)

    def _forking(
        self, m: MatchModule, pkt: Packet, rule: Rule
    ) -> tuple[bool | None, _Fork | None, list[str]]:
        if m.name == "statistic":
            mode = m.get("--mode")
            prob = m.get("--probability")
            if (mode is None or mode.value == "random") and prob is not None:
                try:
                    p = float(prob.value)
                except ValueError:
                    return (
                        None,
                        _Fork("statistic", None),
                        [f"cannot read probability {prob.value!r}"],
                    )
                return None, _Fork("statistic", 1 - p if prob.negated else p), []
            every = m.get("--every")
            if mode is not None and mode.value == "nth" and every and every.value.isdigit():
                p = 1 / int(every.value)
                return (
                    None,
                    _Fork("statistic", p),
                    [f"-m statistic --mode nth: shown as 1/{every.value}"],
                )
            return (
                None,
                _Fork("statistic", None),
                ["cannot evaluate -m statistic; its probability is unknown"],
            )
        # recent
        name_opt = m.get("--name")
        name = name_opt.value if name_opt else "DEFAULT"
        if m.get("--set") is not None:
            return True, None, [f"remembers the client in recent list {name} (session affinity)"]
        check = m.get("--rcheck") or m.get("--update")
        if check is None:
            return None, None, [f"cannot evaluate -m recent (list {name}); assuming it may match"]
        addr = pkt.dst if m.get("--rdest") is not None else pkt.src
        seconds_opt = m.get("--seconds")
        seconds = int(seconds_opt.value) if seconds_opt and seconds_opt.value.isdigit() else None
        res, note = self._recent(name, addr, seconds)
        if res is None:
            comment = rule.comment or ""
            endpoint = comment.split(" -> ", 1)[1] if " -> " in comment else name
            within = f", last {seconds} s" if seconds else ""
            cond = f"{addr} has affinity to {endpoint} (recent list {name}{within})"
            neg = f"{addr} has no affinity to {endpoint}"
            return None, _Fork("recent", condition=cond, negation=neg), [note] if note else []
        return _neg(check, res), None, [note] if note else []

    def _recent(self, name: str, addr: str, seconds: int | None) -> tuple[bool | None, str]:
        text = self.source.xt_recent(name) if self.source is not None else None
        if text is None:
            return None, f"cannot read /proc/net/xt_recent/{name}: the affinity state is unknown"
        entries = parse_recent(text)
        if addr not in entries:
            return False, f"{addr} has no entry in recent list {name}"
        if seconds is None:
            return True, f"{addr} is in recent list {name}"
        if self._jiffies is False:
            self._jiffies = self.source.jiffies() if self.source is not None else None
        if not self._jiffies:
            return (
                True,
                f"{addr} is in recent list {name} (its age is unknown; assuming < {seconds} s)",
            )
        now, hz = self._jiffies  # type: ignore[misc]
        age = (now - entries[addr]) / hz
        if age <= seconds:
            return (
                True,
                f"{addr} is in recent list {name}, last seen {age:.0f} s ago (< {seconds} s)",
            )
        return (
            False,
            f"{addr}'s entry in recent list {name} is {age:.0f} s old (expired, > {seconds} s)",
        )

    # -- helpers ------------------------------------------------------------------------------

    def _dst(self, br: _Branch, pkt: Packet) -> tuple[str, int]:
        if br.dnat is not None:
            return br.dnat[0], br.dnat[1] if br.dnat[1] is not None else pkt.dport
        return pkt.dst, pkt.dport

    def _is_local(self, addr: str) -> bool | None:
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            return None
        if ip.is_loopback:
            return True
        if self.local is None:
            return None
        return addr in self.local


def _neg(opt: Option, res: bool | None) -> bool | None:
    if res is None:
        return None
    return not res if opt.negated else res


def _port_in(port: int, spec: str) -> bool | None:
    lo, sep, hi = spec.partition(":")
    try:
        if sep:
            return int(lo or 0) <= port <= int(hi or 65535)
        return port == int(spec)
    except ValueError:
        return None


def _tcp_flags(mask: str, comp: str) -> bool:
    all_flags = {"SYN", "ACK", "FIN", "RST", "URG", "PSH", "ECE", "CWR"}

    def flags(text: str) -> set[str]:
        if text == "ALL":
            return all_flags
        return set() if text == "NONE" else set(text.split(","))

    return ({"SYN"} & flags(mask)) == flags(comp)


def _mark(mark: int, options: list[Option]) -> int:
    for opt in options:
        value, _, mask = opt.value.partition("/")
        try:
            v = int(value, 0)
            k = int(mask, 0) if mask else 0xFFFFFFFF
        except ValueError:
            continue
        if opt.name == "--set-xmark":
            mark = (mark & ~k & 0xFFFFFFFF) ^ v
        elif opt.name == "--set-mark":
            mark = (mark & ~k & 0xFFFFFFFF) | v
        elif opt.name == "--or-mark":
            mark |= v
        elif opt.name == "--and-mark":
            mark &= v
        elif opt.name == "--xor-mark":
            mark ^= v
    return mark


def _opt_text(opt: Option) -> str:
    neg = "! " if opt.negated else ""
    return f"{neg}{opt.name} {' '.join(opt.values)}".strip()


def _p(p: float | None) -> str:
    return "unknown" if p is None else f"{p:.4g}"


def _hostport(d: tuple[str, int | None]) -> str:
    host, port = d
    host_text = f"[{host}]" if ":" in host else host
    return f"{host_text}:{port}" if port is not None else host_text


def _comment_of(text: str) -> str | None:
    from kproxy.ops.inspect.iptables_rules import parse_rule

    return parse_rule(text).comment if text.startswith("-A ") else None
