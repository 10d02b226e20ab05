"""Walk a new connection through `table ip kube-proxy` (or kproxy's compact layout's
`table ip kproxy-compact`) as the kernel lists it.

Base chains run per hook in priority order, as netfilter does for the first packet:

* from outside: prerouting (filter-prerouting-pre-dnat at dstnat-10, nat-prerouting at
  dstnat) -> routing -> forward (filter-forward) or input (filter-input) -> postrouting
  (nat-postrouting);
* from the node: output (filter-output-pre-dnat, nat-output, filter-output) -> postrouting.

Statements are evaluated as far as kube-proxy's rules need (payload addresses and ports,
meta l4proto / mark, ct state, fib … type local, named and anonymous sets and verdict maps,
mark arithmetic). `numgen random mod N vmap {…}` forks into one branch per entry (1/N
each), and so does the compact layout's `dnat to … . numgen random mod N map @M`, one per
slot element (its rule per protocol only for packets of that protocol). Affinity sets are
looked up in their elements as listed (with their timeouts), so the walk knows whether
this client sticks. Other tables in the ruleset are not evaluated.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from kproxy.dataplane.nftables.names import service_port_of
from kproxy.ops.inspect.branch import Branch as _Branch
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
)
from kproxy.ops.inspect.nftables_reader import (
    NftTable,
    expr_text,
    stmt_text,
    verdict_of,
)

MAX_STEPS = 20000
PROTO_NUMBERS = {"6": "tcp", "17": "udp", "132": "sctp", "1": "icmp"}
UNKNOWN = object()
CONTINUE = "continue"
# Maps whose misses are worth a line in the trace.
NAMED_LOOKUPS = (
    "service-ips",
    "service-nodeports",
    "no-endpoint-services",
    "no-endpoint-nodeports",
    "firewall-ips",
)


@dataclass
class _RuleAt:
    """A rule under evaluation: the base chain and call frames its branch is in, the
    packet, where finished branches go, and what the rule noted and did so far."""

    base: str
    rule: Any
    frames: list[list[Any]]
    br: _Branch
    pkt: Packet
    out: list[tuple[_Branch, str, Step | None]]
    notes: list[str]
    actions: list[str]


class NftWalker:
    def __init__(self, table: NftTable, local_addresses: list[str] | None) -> None:
        self.table = table
        self.local = local_addresses
        self.notes: list[str] = []
        self._budget = MAX_STEPS

    def trace(self, pkt: Packet) -> Walk:
        self.notes = [
            f"only table {self.table.family} {self.table.name} is evaluated (not other "
            "nftables tables or iptables rules)"
        ]
        if self.local is None:
            self.notes.append(
                "the node's local addresses are unknown: fib … type local cannot be evaluated"
            )
        outcomes: list[Outcome] = []
        first = "output" if pkt.from_node else "prerouting"
        for br, verdict, step in self._hook(first, [_Branch(1.0)], pkt):
            if verdict in (DROP, REJECT):
                outcomes.append(self._final(br, verdict, step, pkt))
                continue
            if pkt.from_node:
                later: list[tuple[_Branch, str, Step | None]] = [(br, ACCEPT, step)]
            else:
                dst = self._dst(br, pkt)[0]
                hook = "input" if self._is_local(dst) else "forward"
                later = self._hook(hook, [br], pkt)
                if hook == "input":
                    for b2, v2, s2 in later:
                        if v2 not in (DROP, REJECT):
                            b2.notes.append(
                                f"{dst} is a local address: delivered to the node itself"
                            )
                        outcomes.append(
                            self._final(
                                b2, v2 if v2 in (DROP, REJECT) else ACCEPT, s2, pkt, local=True
                            )
                        )
                    continue
            for b2, v2, s2 in later:
                if v2 in (DROP, REJECT):
                    outcomes.append(self._final(b2, v2, s2, pkt))
                    continue
                for b3, v3, s3 in self._hook("postrouting", [b2], pkt):
                    outcomes.append(
                        self._final(b3, v3 if v3 in (DROP, REJECT) else ACCEPT, s3, pkt)
                    )
        return Walk(outcomes, self.notes)

    def _hook(
        self, hook: str, branches: list[_Branch], pkt: Packet
    ) -> list[tuple[_Branch, str, Step | None]]:
        """Run every base chain of a hook in priority order, for each branch."""
        current: list[tuple[_Branch, str, Step | None]] = [(b, ACCEPT, None) for b in branches]
        for chain in self.table.base_chains(hook):
            nxt: list[tuple[_Branch, str, Step | None]] = []
            for br, verdict, step in current:
                if verdict in (DROP, REJECT):
                    nxt.append((br, verdict, step))
                    continue
                out: list[tuple[_Branch, str, Step | None]] = []
                self._exec(chain.name, [[chain.name, 0]], br.fork(), pkt, out)
                nxt += out
            current = nxt
        return current

    # -- outcome ------------------------------------------------------------------------------

    def _final(
        self, br: _Branch, verdict: str, step: Step | None, pkt: Packet, *, local: bool = False
    ) -> Outcome:
        dnat = _hostport(br.dnat) if br.dnat else None
        if verdict in (DROP, REJECT):
            where = step.where() if step else "?"
            comment = ""
            if step is not None and step.chain == "reject-chain":
                origin = next((s for s in reversed(br.steps[:-1]) if "no-endpoint" in s.text), None)
                if origin is not None:
                    where = origin.where()
                    comment = f" ({origin.action})"
            elif step is not None and step.rule is None:
                where = f"the policy of {step.chain}"
            elif step is not None and step.action.startswith("@"):
                comment = f" ({step.action})"  # the map element that said drop / reject
            elif step is not None and step.chain.startswith("firewall-"):
                svc = service_port_of(step.chain)
                comment = f" ({svc}: {pkt.src} is outside its loadBalancerSourceRanges)"
            return Outcome(
                br.prob,
                tuple(br.conditions),
                br.steps,
                verdict,
                dnat=dnat,
                service=br.service,
                reason=f"{verdict} by {where}{comment}",
                notes=br.notes,
            )
        masq = None if local else br.masquerade
        if br.dnat is not None:
            return Outcome(
                br.prob,
                tuple(br.conditions),
                br.steps,
                DNAT,
                dnat=dnat,
                service=br.service,
                masquerade=masq,
                notes=br.notes,
            )
        dst, dport = self._dst(br, pkt)
        where = "delivered to the node itself" if local else f"goes on to {dst}:{dport} unchanged"
        return Outcome(
            br.prob,
            tuple(br.conditions),
            br.steps,
            ACCEPT,
            service=br.service,
            masquerade=masq,
            reason=f"not DNATed: no service element matched {pkt}; the packet {where}",
            notes=br.notes,
        )

    # -- chains -------------------------------------------------------------------------------

    def _exec(
        self,
        base: str,
        frames: list[list[Any]],
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
            chain_name, index = frames[-1]
            chain = self.table.chains.get(chain_name)
            rules = chain.rules if chain else []
            if chain is None:
                br.notes.append(f"chain {chain_name} does not exist")
            if index >= len(rules):
                frames.pop()
                if not frames:
                    policy = (self.table.chains[base].policy or "accept").upper()
                    step = Step(
                        self.table.name, base, None, "", f"end of chain: policy {policy.lower()}"
                    )
                    br.steps.append(step)
                    out.append((br, DROP if policy == "DROP" else ACCEPT, step))
                    return
                continue
            frames[-1][1] = index + 1
            verdict = self._rule(base, rules[index], 0, frames, br, pkt, out)
            if verdict == "forked":
                return
            if verdict is not None:
                out.append((br, verdict, br.steps[-1] if br.steps else None))
                return

    def _rule(
        self,
        base: str,
        rule: Any,
        start: int,
        frames: list[list[Any]],
        br: _Branch,
        pkt: Packet,
        out: list[tuple[_Branch, str, Step | None]],
    ) -> str | None:
        """Evaluate one rule from statement `start`; returns a verdict that ends this base
        chain ("ACCEPT"/"DROP"/"REJECT"/"DNAT"), "forked" when the branch was split and
        handled, or None to go on with the next rule (or a jumped-to chain)."""
        notes: list[str] = []
        actions: list[str] = []

        def step(action: str) -> None:
            acts = "; ".join([*actions, action]) if action else "; ".join(actions)
            br.steps.append(
                Step(
                    self.table.name,
                    rule.chain,
                    rule.number,
                    rule.text,
                    acts or "matched",
                    handle=rule.handle,
                    notes=tuple(notes),
                )
            )
            if br.service is None and "/" in rule.chain:  # a service's own chain
                br.service = service_port_of(rule.chain) or None

        for pos in range(start, len(rule.expr)):
            stmt = rule.expr[pos]
            if not isinstance(stmt, dict) or len(stmt) != 1:
                notes.append(f"cannot evaluate {stmt!r}; assuming it continues")
                continue
            ((op, arg),) = stmt.items()
            if op == "match":
                res = self._match(arg, br, pkt)
                if res is False:
                    return None
                if res is None:
                    notes.append(f"cannot evaluate {stmt_text(stmt)}; assuming it may match")
                continue
            if op == "vmap":
                key = arg.get("key")
                if isinstance(key, dict) and "numgen" in key:
                    at = _RuleAt(base, rule, frames, br, pkt, out, notes, actions)
                    return self._numgen(at, arg)
                value = self._value(key, br, pkt)
                data = arg.get("data")
                found, label, comment = self._lookup(value, data)
                if found is UNKNOWN:
                    notes.append(f"cannot evaluate {stmt_text(stmt)}; assuming no element matches")
                    return None
                if found is None:
                    if isinstance(data, str) and data[1:] in NAMED_LOOKUPS:
                        step(f"no element {_value_text(value)} in {label}: continue")
                    return None
                named = f" ({comment})" if comment else ""
                actions.append(f"{label}: element {_value_text(value)}{named} : {stmt_text(found)}")
                if comment and br.service is None:
                    br.service = comment
                if isinstance(found, dict) and len(found) == 1 and br.service is None:
                    target = verdict_of(found)[1]
                    if target:
                        br.service = service_port_of(target) or None
                step("")
                return self._verdict(found, frames, base)
            if op in ("jump", "goto", "return", "accept", "drop", "continue", "reject", "queue"):
                step(stmt_text(stmt))
                return self._verdict(stmt, frames, base)
            if op == "dnat" and isinstance(arg, dict) and isinstance(arg.get("addr"), dict):
                at = _RuleAt(base, rule, frames, br, pkt, out, notes, actions)
                return self._dnat_map(at, arg["addr"])
            if op in ("dnat", "redirect"):
                addr = arg.get("addr") if isinstance(arg, dict) else None
                port = arg.get("port") if isinstance(arg, dict) else None
                host = str(addr) if addr is not None else ((self.local or ["(local)"])[0])
                br.dnat = (host, int(port) if isinstance(port, int) else pkt.dport)
                step(f"DNAT to {_hostport(br.dnat)}")
                return DNAT
            if op in ("masquerade", "snat"):
                br.masquerade = True
                step(
                    "masquerade (SNAT to the outgoing interface's address)"
                    if op == "masquerade"
                    else stmt_text(stmt)
                )
                return ACCEPT
            if op == "mangle":
                target = arg.get("key")
                if isinstance(target, dict) and target.get("meta", {}).get("key") == "mark":
                    val = self._value(arg.get("value"), br, pkt)
                    if isinstance(val, int):
                        br.mark = val & 0xFFFFFFFF
                        actions.append(f"mark {br.mark:#x}")
                        continue
                notes.append(f"cannot evaluate {stmt_text(stmt)}; assuming it continues")
                continue
            if op == "set":
                actions.append(f"{arg.get('op')} the client in {arg.get('set')} (session affinity)")
                continue
            if op in ("counter", "log", "limit", "notrack", "quota", "ct"):
                continue
            notes.append(f"cannot evaluate {stmt_text(stmt)}; assuming it continues")
        step("")
        return None

    def _numgen(self, at: _RuleAt, vmap: dict[str, Any]) -> str | None:
        """`numgen random mod N vmap { K : verdict, ... }` (upstream's endpoint pick): one
        branch per listed slot, 1/N each, going on with the slot's verdict."""
        mod = int(vmap["key"]["numgen"].get("mod", 1)) or 1
        offset = int(vmap["key"]["numgen"].get("offset", 0) or 0)
        data = vmap.get("data")
        entries = data.get("set", []) if isinstance(data, dict) else None
        if entries is None:
            at.notes.append("cannot evaluate a numgen vmap on a named map; assuming no element")
            return None
        listed = 0
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)):
                continue
            if not offset <= entry[0] < offset + mod:
                continue
            listed += 1
            action = f"numgen = {entry[0]} (probability 1/{mod}): {stmt_text(entry[1])}"
            taken = self._slot(at, mod, action)
            if taken.service is None:
                taken.service = service_port_of(at.rule.chain) or None
            sub = [list(f) for f in at.frames]
            verdict = self._verdict(entry[1], sub, at.base)
            if verdict is not None:
                at.out.append((taken, verdict, taken.steps[-1]))
            else:
                self._exec(at.base, sub, taken, at.pkt, at.out)
        return self._slots_end(at.br, mod, listed, "entries")

    def _dnat_map(self, at: _RuleAt, addr: dict[str, Any]) -> str | None:
        """`dnat to KEY . numgen random mod N [offset K] map @M` (the compact layout's pick):
        one branch per slot K..K+N-1 (1/N each), DNATed to the slot's element; a slot without
        an element is a lookup miss, and the rule does not match."""
        br, pkt = at.br, at.pkt
        lookup = addr.get("map")
        parts = (lookup.get("key") or {}).get("concat") if isinstance(lookup, dict) else None
        data = lookup.get("data") if isinstance(lookup, dict) else None
        gen = parts[-1].get("numgen") if parts and isinstance(parts[-1], dict) else None
        nset = self.table.sets.get(data[1:]) if isinstance(data, str) else None
        if any(_transport(x) not in (None, pkt.proto) for x in parts or []):
            return None  # `udp dport` in the key: nft matches udp first (meta l4proto)
        head = [self._value(x, br, pkt) for x in (parts or [])[:-1]]
        if not isinstance(gen, dict) or nset is None or any(v is UNKNOWN for v in head):
            at.notes.append(f"cannot evaluate dnat to {expr_text(addr)}; assuming no element")
            return None
        mod = int(gen.get("mod", 1)) or 1
        offset = int(gen.get("offset", 0) or 0)
        listed = 0
        for slot in range(offset, offset + mod):
            el = next((e for e in nset.elements if self._elem_matches(e.key, (*head, slot))), None)
            found = el.value if el is not None else None
            value = found.get("concat") if isinstance(found, dict) else None
            if not (isinstance(value, list) and len(value) == 2):
                continue
            listed += 1
            dnat = (str(value[0]), int(value[1]))
            key = " . ".join(str(v) for v in (*head, slot))
            action = (
                f"numgen = {slot} (probability 1/{mod}): {data} element {key} : "
                f"DNAT to {_hostport(dnat)}"
            )
            taken = self._slot(at, mod, action)
            taken.dnat = dnat
            at.out.append((taken, DNAT, taken.steps[-1]))
        return self._slots_end(br, mod, listed, f"elements in {data}")

    def _slot(self, at: _RuleAt, mod: int, action: str) -> _Branch:
        """The branch of one numgen slot: probability 1/mod of the rule's, its step recorded."""
        taken = at.br.fork()
        taken.prob = None if taken.prob is None else taken.prob / mod
        rule = at.rule
        taken.steps.append(
            Step(
                self.table.name,
                rule.chain,
                rule.number,
                rule.text,
                "; ".join([*at.actions, action]),
                handle=rule.handle,
                notes=tuple(at.notes),
            )
        )
        return taken

    @staticmethod
    def _slots_end(br: _Branch, mod: int, listed: int, what: str) -> str | None:
        """Every slot had its branch ("forked"); else the slots without one are a lookup
        miss, the rule does not match, and the branch goes on with their probability."""
        if listed >= mod:
            return "forked"
        br.prob = None if br.prob is None else br.prob * (mod - listed) / mod
        br.notes.append(f"numgen mod {mod} has only {listed} {what}")
        return None

    def _verdict(self, v: Any, frames: list[list[Any]], base: str) -> str | None:
        verb, target = verdict_of(v)
        if verb in ("jump", "goto") and target:
            if verb == "goto":
                frames.pop()
            frames.append([target, 0])
            return None
        if verb == "return":
            frames.pop()
            if not frames:
                policy = (self.table.chains[base].policy or "accept").upper()
                return DROP if policy == "DROP" else ACCEPT
            return None
        if verb == "accept":
            return ACCEPT
        if verb == "drop":
            return DROP
        if verb == "reject":
            return REJECT
        if verb == "continue":
            return None
        return ACCEPT  # queue: leaves netfilter's hands

    # -- expressions --------------------------------------------------------------------------

    def _dst(self, br: _Branch, pkt: Packet) -> tuple[str, int]:
        if br.dnat is not None:
            return br.dnat[0], br.dnat[1] if br.dnat[1] is not None else pkt.dport
        return pkt.dst, pkt.dport

    def _is_local(self, addr: str) -> bool | None:
        try:
            if ipaddress.ip_address(addr).is_loopback:
                return True
        except ValueError:
            return None
        if self.local is None:
            return None
        return addr in self.local

    def _value(self, e: Any, br: _Branch, pkt: Packet) -> Any:
        if isinstance(e, int | str) and not (isinstance(e, str) and e.startswith("@")):
            return e
        if not isinstance(e, dict) or len(e) != 1:
            return UNKNOWN
        ((op, arg),) = e.items()
        dst, dport = self._dst(br, pkt)
        if op == "payload":
            proto, fld = arg.get("protocol"), arg.get("field")
            if proto == "ip":
                return {"saddr": pkt.src, "daddr": dst, "protocol": pkt.proto}.get(fld, UNKNOWN)
            if proto in ("th", "tcp", "udp", "sctp"):
                if proto != "th" and proto != pkt.proto:
                    return UNKNOWN
                if fld == "dport":
                    return dport
                if fld == "sport":
                    return pkt.sport if pkt.sport is not None else UNKNOWN
            return UNKNOWN
        if op == "meta":
            key = arg.get("key")
            if key in ("l4proto", "protocol"):
                return pkt.proto if key == "l4proto" else "ip"
            if key == "mark":
                return br.mark
            if key == "nfproto":
                return "ipv4"
            return UNKNOWN
        if op == "ct":
            key = arg.get("key")
            if key == "state" and not arg.get("dir"):
                return frozenset({"new"})
            if key == "status":
                return frozenset({"dnat"} if br.dnat else set())
            return UNKNOWN
        if op == "fib":
            flags = set(arg.get("flags", []))
            if arg.get("result") != "type" or not flags & {"saddr", "daddr"}:
                return UNKNOWN
            addr = pkt.src if "saddr" in flags else dst
            local = self._is_local(addr)
            if local is None:
                return UNKNOWN
            return "local" if local else "unicast"
        if op == "concat":
            parts = [self._value(x, br, pkt) for x in arg]
            return UNKNOWN if any(p is UNKNOWN for p in parts) else tuple(parts)
        if op in ("&", "|", "^"):
            a, b = (self._value(x, br, pkt) for x in arg)
            if isinstance(a, int) and isinstance(b, int):
                return a & b if op == "&" else a | b if op == "|" else a ^ b
            return UNKNOWN
        return UNKNOWN

    def _match(self, m: dict[str, Any], br: _Branch, pkt: Packet) -> bool | None:
        left = self._value(m.get("left"), br, pkt)
        if left is UNKNOWN:
            return None
        right = m.get("right")
        op = m.get("op", "==")
        if isinstance(left, frozenset):  # ct state / status flags
            wanted = (
                {right}
                if isinstance(right, str)
                else set(right)
                if isinstance(right, list)
                else set()
            )
            hit: bool | None = bool(left & wanted)
        else:
            hit = self._member(left, right)
        if hit is None:
            return None
        if op in ("==", "in"):
            return hit
        if op == "!=":
            return not hit
        if op in ("<", ">", "<=", ">=") and isinstance(left, int) and isinstance(right, int):
            return {"<": left < right, ">": left > right, "<=": left <= right, ">=": left >= right}[
                op
            ]
        return None

    def _member(self, value: Any, right: Any) -> bool | None:
        """value == right, or value in the set right stands for."""
        if isinstance(right, str) and right.startswith("@"):
            nset = self.table.sets.get(right[1:])
            if nset is None:
                return None
            return any(self._elem_matches(e.key, value) for e in nset.elements)
        if isinstance(right, dict) and "set" in right:
            items = right["set"] if isinstance(right["set"], list) else [right["set"]]
            return any(
                self._elem_matches(
                    i["concat"] if isinstance(i, dict) and "concat" in i else [i], value
                )
                for i in items
            )
        return self._part_matches(right, value)

    def _elem_matches(self, key: list[Any], value: Any) -> bool:
        values = list(value) if isinstance(value, tuple) else [value]
        if len(key) != len(values):
            return False
        return all(self._part_matches(k, v) is True for k, v in zip(key, values, strict=True))

    def _part_matches(self, part: Any, value: Any) -> bool | None:
        if isinstance(part, dict) and "elem" in part:
            part = part["elem"].get("val")
        if isinstance(part, dict) and "prefix" in part:
            p = part["prefix"]
            return in_network(str(value), f"{p['addr']}/{p['len']}")
        if isinstance(part, dict) and "range" in part:
            lo, hi = part["range"]
            try:
                if isinstance(value, int):
                    return int(lo) <= value <= int(hi)
                a = ipaddress.ip_address(str(value))
                return ipaddress.ip_address(str(lo)) <= a <= ipaddress.ip_address(str(hi))
            except (TypeError, ValueError):
                return None
        if isinstance(part, dict):
            return None
        return _norm(part) == _norm(value)

    def _lookup(self, value: Any, data: Any) -> tuple[Any, str, str | None]:
        """The verdict a vmap gives for value: (verdict | None for a miss | UNKNOWN, label,
        the element's comment)."""
        if value is UNKNOWN:
            return UNKNOWN, "", None
        if isinstance(data, str) and data.startswith("@"):
            nset = self.table.sets.get(data[1:])
            if nset is None:
                return UNKNOWN, data, None
            for el in nset.elements:
                if self._elem_matches(el.key, value):
                    return el.value, data, el.comment
            return None, data, None
        if isinstance(data, dict) and "set" in data:
            for entry in data["set"]:
                if isinstance(entry, list) and len(entry) == 2:
                    key = (
                        entry[0]["concat"]
                        if isinstance(entry[0], dict) and "concat" in entry[0]
                        else [entry[0]]
                    )
                    if self._elem_matches(key, value):
                        return entry[1], "vmap", None
            return None, "vmap", None
        return UNKNOWN, expr_text(data), None


def _norm(x: Any) -> str:
    text = str(x).lower()
    return PROTO_NUMBERS.get(text, text)


def _transport(e: Any) -> str | None:
    """The protocol of a `tcp|udp|sctp dport` payload expression (None for others)."""
    arg = e.get("payload") if isinstance(e, dict) else None
    proto = arg.get("protocol") if isinstance(arg, dict) else None
    return proto if proto in ("tcp", "udp", "sctp") else None


def _value_text(value: Any) -> str:
    if isinstance(value, tuple):
        return " . ".join(str(v) for v in value)
    return str(value)


def _hostport(d: tuple[str, int | None]) -> str:
    host, port = d
    host_text = f"[{host}]" if ":" in host else host
    return f"{host_text}:{port}" if port is not None else host_text
