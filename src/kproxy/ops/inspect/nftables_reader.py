"""nftables mode: the programmed services, read back from `nft -j list table ip kube-proxy`.

Layout (upstream-kube-proxy.md §2): `services` looks up `ip daddr . meta l4proto . th dport`
in the verdict map @service-ips (ClusterIPs -> service-/local- chains, external and LB IPs
-> external- chains) and NodePorts in @service-nodeports (on @nodeport-ips or every local
address); service chains pick an endpoint with one `numgen random mod N vmap {…}` rule
(after `ip saddr @affinity-… goto endpoint-…` for ClientIP affinity); endpoint chains DNAT.
Services without endpoints sit in @no-endpoint-services / @no-endpoint-nodeports
(goto reject-chain, or drop), LB source ranges in @firewall-ips -> firewall- chains.
The layout has no counters; rules that carry a `counter` statement are read if present.

kproxy's compact layout (dataplane/nftables/compact.py, `table ip kproxy-compact`, the
dataplane "nftables-compact") has the same maps, but their verdicts go to shared chains
(`dnat/internal/N`, `dnat/external-local/N/M`, …) whose rules DNAT with
`… . numgen random mod N [offset K] map @service-endpoints-PROTO` (NodePorts:
@nodeport-endpoints-PROTO), one rule and map per protocol: a service's endpoints are the
elements of its destination and slots K..K+N-1 in its protocol's map. Shared
chains name no service: the @service-ips / @service-nodeports elements name it in their
comment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kproxy.dataplane.nftables.layouts import (
    DEFAULT_LAYOUT,
    TABLES,
    dataplane_name,
)
from kproxy.dataplane.nftables.names import (
    ENDPOINT_MAP_PROTOCOLS,
    SHARED_PREFIX,
    is_shared_chain,
    service_port_of,
)
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import (
    ANY_ADDRESS,
    CLUSTER_IP,
    EXTERNAL,
    LOAD_BALANCER,
    NODE_PORT,
    Destination,
    Packet,
    RealServer,
    VirtualServer,
    Walk,
)

TABLE = "kube-proxy"
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
NODEPORT_IPS = "nodeport-ips"
CLUSTER_IPS = "cluster-ips"
NO_ENDPOINT_SERVICES = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
FIREWALL_IPS = "firewall-ips"
SERVICES_CHAIN = "services"
REJECT_CHAIN = "reject-chain"
VERDICTS = ("accept", "drop", "continue", "return", "jump", "goto", "queue", "reject")


@dataclass
class Element:
    key: list[Any]  # parts (one part for a plain set)
    value: Any = None  # verdict dict for verdict maps
    comment: str | None = None
    expires: float | None = None

    def key_text(self) -> str:
        return " . ".join(expr_text(p) for p in self.key)


@dataclass
class NftSet:
    name: str
    kind: str  # "set" | "map"
    type: Any = None
    timeout: int | None = None
    flags: tuple[str, ...] = ()
    elements: list[Element] = field(default_factory=list)


@dataclass
class NftRule:
    chain: str
    number: int  # 1-based within the chain
    handle: int | None
    expr: list[dict[str, Any]]
    comment: str | None = None

    @property
    def text(self) -> str:
        out = " ".join(stmt_text(s) for s in self.expr)
        if self.comment:
            out += f' comment "{self.comment}"'
        return out

    def counter(self) -> tuple[int, int] | None:
        for stmt in self.expr:
            c = stmt.get("counter") if isinstance(stmt, dict) else None
            if isinstance(c, dict) and "packets" in c:
                return int(c.get("packets", 0)), int(c.get("bytes", 0))
        return None


@dataclass
class NftChain:
    name: str
    type: str | None = None
    hook: str | None = None
    prio: int | None = None
    policy: str | None = None
    rules: list[NftRule] = field(default_factory=list)


@dataclass
class NftTable:
    family: str = "ip"
    name: str = TABLE
    chains: dict[str, NftChain] = field(default_factory=dict)
    sets: dict[str, NftSet] = field(default_factory=dict)

    def base_chains(self, hook: str) -> list[NftChain]:
        found = [c for c in self.chains.values() if c.hook == hook]
        return sorted(found, key=lambda c: c.prio if c.prio is not None else 0)


def parse_table(text: str, *, family: str = "ip", name: str = TABLE) -> NftTable | None:
    """`nft -j list table|ruleset` JSON -> the kube-proxy table (None when absent)."""
    try:
        items = json.loads(text or "{}").get("nftables", [])
    except (ValueError, AttributeError):
        return None
    table: NftTable | None = None
    pending_rules: list[dict[str, Any]] = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        if "table" in item:
            t = item["table"]
            if t.get("family") == family and t.get("name") == name:
                table = NftTable(family, name)
            continue
        body = next(iter(item.values()), None)
        if not isinstance(body, dict) or body.get("table") != name or body.get("family") != family:
            continue
        if "chain" in item:
            prio = body.get("prio")
            chain = NftChain(
                body["name"],
                body.get("type"),
                body.get("hook"),
                prio if isinstance(prio, int) else None,
                body.get("policy"),
            )
            if table is not None:
                table.chains[chain.name] = chain
        elif "set" in item or "map" in item:
            nset = _nft_set(body, "set" if "set" in item else "map")
            if table is not None:
                table.sets[nset.name] = nset
        elif "rule" in item:
            pending_rules.append(body)
    if table is None:
        return None
    for body in pending_rules:
        chain = table.chains.setdefault(body["chain"], NftChain(body["chain"]))
        chain.rules.append(
            NftRule(
                chain.name,
                len(chain.rules) + 1,
                body.get("handle"),
                list(body.get("expr", [])),
                body.get("comment"),
            )
        )
    return table


def _nft_set(body: dict[str, Any], kind: str) -> NftSet:
    timeout = body.get("timeout")
    return NftSet(
        body["name"],
        kind,
        body.get("type"),
        timeout if isinstance(timeout, int) else None,
        tuple(body.get("flags", ()) if isinstance(body.get("flags"), list) else ()),
        [_element(e, kind) for e in body.get("elem", [])],
    )


_MAP_OR_SET = re.compile(r'\{\s*"(map|set)"\s*:\s*')


def parse_set(text: str, name: str, *, family: str = "ip", table: str = TABLE) -> NftSet | None:
    """One set or map of the table from a `nft -j list map|table|ruleset` document (None:
    absent). Only that object is decoded: a table's document is ~100 MB at 10,000 services."""
    if f'"{name}"' not in text:
        return None
    decoder = json.JSONDecoder()
    for m in _MAP_OR_SET.finditer(text):
        try:
            body, _ = decoder.raw_decode(text, m.end())
        except ValueError:
            break  # not the document it seems: decode it whole
        if (
            isinstance(body, dict)
            and body.get("name") == name
            and body.get("table") == table
            and body.get("family") == family
        ):
            return _nft_set(body, m.group(1))
    whole = parse_table(text, family=family, name=table)
    return whole.sets.get(name) if whole is not None else None


def _element(raw: Any, kind: str) -> Element:
    value = None
    if kind == "map" and isinstance(raw, list) and len(raw) == 2:
        raw, value = raw
    comment = expires = None
    if isinstance(raw, dict) and "elem" in raw:
        inner = raw["elem"]
        comment = inner.get("comment")
        expires = inner.get("expires")
        raw = inner.get("val")
    parts = raw["concat"] if isinstance(raw, dict) and "concat" in raw else [raw]
    return Element(list(parts), value, comment, expires)


# --- text of expressions (nft's own syntax, as far as kube-proxy's rules go) -------------------


def expr_text(e: Any) -> str:
    if isinstance(e, bool):
        return str(e).lower()
    if isinstance(e, int | float):
        return str(e)
    if isinstance(e, str):
        return e
    if isinstance(e, list):
        return "{ " + ", ".join(expr_text(x) for x in e) + " }"
    if not isinstance(e, dict) or len(e) != 1:
        return json.dumps(e, separators=(",", ":"))
    ((op, arg),) = e.items()
    if op == "payload":
        return f"{arg.get('protocol')} {arg.get('field')}"
    if op == "meta":
        return f"meta {arg.get('key')}"
    if op == "ct":
        return f"ct {arg.get('key')}"
    if op == "fib":
        flags = " . ".join(arg.get("flags", []))
        return f"fib {flags} {arg.get('result')}"
    if op == "concat":
        return " . ".join(expr_text(x) for x in arg)
    if op == "prefix":
        return f"{expr_text(arg.get('addr'))}/{arg.get('len')}"
    if op == "range":
        return "-".join(expr_text(x) for x in arg)
    if op in ("&", "|", "^", "<<", ">>"):
        a, b = arg
        return f"{expr_text(a)} {op} {_hex(b)}"
    if op == "map":
        return f"{expr_text(arg.get('key'))} map {expr_text(arg.get('data'))}"
    if op == "numgen":
        offset = f" offset {arg['offset']}" if arg.get("offset") else ""
        return f"numgen {arg.get('mode')} mod {arg.get('mod')}{offset}"
    if op == "set":
        items = arg if isinstance(arg, list) else [arg]
        inner = []
        for item in items:
            if isinstance(item, list) and len(item) == 2:
                inner.append(f"{expr_text(item[0])} : {stmt_text(item[1])}")
            else:
                inner.append(expr_text(item))
        return "{ " + ", ".join(inner) + " }"
    if op == "elem":
        return expr_text(arg.get("val"))
    if op in VERDICTS:
        return stmt_text(e)
    return json.dumps(e, separators=(",", ":"))


def _hex(v: Any) -> str:
    return f"0x{v:08x}" if isinstance(v, int) else expr_text(v)


def stmt_text(s: Any) -> str:
    if not isinstance(s, dict) or len(s) != 1:
        return json.dumps(s, separators=(",", ":"))
    ((op, arg),) = s.items()
    if op == "match":
        left, right = arg.get("left"), arg.get("right")
        rel = arg.get("op", "==")
        binop = isinstance(left, dict) and any(k in left for k in "&|^")
        right_text = _hex(right) if binop else expr_text(right)
        rel_text = "" if rel in ("==", "in") and not binop else f"{rel} "
        return f"{expr_text(left)} {rel_text}{right_text}"
    if op == "vmap":
        return f"{expr_text(arg.get('key'))} vmap {expr_text(arg.get('data'))}"
    if op in ("jump", "goto"):
        return f"{op} {arg.get('target')}"
    if op in ("accept", "drop", "continue", "return"):
        return op
    if op == "reject":
        return (
            "reject"
            if not arg
            else "reject"
            + (f" with {arg.get('type')} {arg.get('expr')}" if arg.get("expr") else "")
        )
    if op in ("dnat", "snat"):
        addr = expr_text(arg.get("addr")) if arg.get("addr") is not None else ""
        port = f":{expr_text(arg['port'])}" if arg.get("port") is not None else ""
        return f"{op} to {addr}{port}"
    if op == "masquerade":
        flags = arg.get("flags") if isinstance(arg, dict) else None
        return "masquerade" + (f" {flags}" if isinstance(flags, str) else "")
    if op == "mangle":
        return f"{expr_text(arg.get('key'))} set {expr_text(arg.get('value'))}"
    if op == "set":
        return f"{arg.get('op')} {arg.get('set')} {{ {expr_text(arg.get('elem'))} }}"
    if op == "counter":
        if isinstance(arg, dict):
            return f"counter packets {arg.get('packets', 0)} bytes {arg.get('bytes', 0)}"
        return "counter"
    if op in ("log", "notrack", "limit", "quota"):
        return op
    return json.dumps(s, separators=(",", ":"))


# --- names -------------------------------------------------------------------------------------


def verdict_of(value: Any) -> tuple[str, str | None]:
    """{"goto": {"target": "x"}} -> ("goto", "x"); {"drop": null} -> ("drop", None)."""
    if isinstance(value, dict) and len(value) == 1:
        ((verb, arg),) = value.items()
        target = arg.get("target") if isinstance(arg, dict) else None
        return str(verb), target
    return str(value), None


def _only_verdict(rule: NftRule) -> tuple[str, str | None] | None:
    """A rule that is nothing but a jump/goto (no condition)."""
    if len(rule.expr) == 1:
        verb, target = verdict_of(rule.expr[0])
        if verb in ("jump", "goto"):
            return verb, target
    return None


def _match_set(rule: NftRule) -> str | None:
    for stmt in rule.expr:
        m = stmt.get("match") if isinstance(stmt, dict) else None
        if isinstance(m, dict) and isinstance(m.get("right"), str) and m["right"].startswith("@"):
            return m["right"][1:]
    return None


def service_ip_entries(service_ips: NftSet) -> Iterator[tuple[Destination, str, str]]:
    """(destination, chain, service port) of each @service-ips element: ClusterIPs (to
    service-/local- chains), external and LoadBalancer IPs (to external- chains); the
    service port from the chain's name, or (the compact layout's shared chains name none)
    the element's comment."""
    for el in service_ips.elements:
        if len(el.key) != 3:
            continue
        _, chain = verdict_of(el.value)
        if chain is None:
            continue
        ip, proto, port = (str(p) for p in el.key)
        yield Destination(ip, proto, int(port)), chain, service_port_of(chain) or el.comment or ""


def destinations(source: KernelSource, *, layout: str = DEFAULT_LAYOUT) -> dict[Destination, str]:
    """The service destinations of @service-ips -> their service port (from the chain;
    "" for a compact layout's shared chain)."""
    plane = dataplane_name(layout)
    text = source.nft_map(SERVICE_IPS, plane)
    service_ips = parse_set(text, SERVICE_IPS, table=TABLES[layout]) if text is not None else None
    if service_ips is None:
        return {}
    return {dest: name for dest, _chain, name in service_ip_entries(service_ips)}


@dataclass(frozen=True)
class Pick:
    """One DNAT of a compact shared chain: slots offset..offset+mod-1 of a map's elements
    for the packet's destination; conditional when the rule matches anything first."""

    mod: int
    offset: int
    container: str
    conditional: bool
    rule: NftRule
    proto: str | None  # the protocol whose packets the rule takes (None: any)


def shared_picks(chain: NftChain) -> list[Pick]:
    """The `dnat to KEY . numgen random mod N [offset K] map @M` rules of a shared chain."""
    out = []
    for rule in chain.rules:
        for stmt in rule.expr:
            d = stmt.get("dnat") if isinstance(stmt, dict) else None
            lookup = d.get("addr") if isinstance(d, dict) else None
            m = lookup.get("map") if isinstance(lookup, dict) else None
            if not isinstance(m, dict) or not str(m.get("data", "")).startswith("@"):
                continue
            parts = (m.get("key") or {}).get("concat", [])
            gen = next((p["numgen"] for p in parts if isinstance(p, dict) and "numgen" in p), None)
            if not isinstance(gen, dict):
                continue
            matches = [x["match"] for x in rule.expr if isinstance(x, dict) and "match" in x]
            protos = [str(mt.get("right")) for mt in matches if _is_l4proto_match(mt)]
            protos += [
                p["payload"]["protocol"]
                for p in parts
                if isinstance(p, dict)
                and isinstance(p.get("payload"), dict)
                and p["payload"].get("protocol") in ENDPOINT_MAP_PROTOCOLS
            ]
            out.append(
                Pick(
                    int(gen.get("mod", 0)) or 1,
                    int(gen.get("offset", 0) or 0),
                    str(m["data"])[1:],
                    len(matches) > sum(map(_is_l4proto_match, matches)),
                    rule,
                    protos[0] if protos else None,
                )
            )
    return out


def _is_l4proto_match(m: dict[str, Any]) -> bool:
    left = m.get("left")
    return m.get("op") in ("==", "in") and left == {"meta": {"key": "l4proto"}}


class NftablesView:
    mode = "nftables"

    def __init__(self, table: NftTable, source: KernelSource, layout: str = DEFAULT_LAYOUT) -> None:
        self.table = table
        self.source = source
        self.layout = layout
        self.dataplane = dataplane_name(layout)
        # endpoint map -> destination key -> slot -> element (slot_endpoints)
        self._slots: dict[str, dict[tuple[str, ...], dict[int, Element]]] = {}
        self.notes: list[str] = []
        self.has_counters = any(
            r.counter() is not None for c in table.chains.values() for r in c.rules
        )
        self.live, self.present, self.detail = self._detect()
        self._local = source.local_addresses()

    def _detect(self) -> tuple[bool, bool, str]:
        hooked = []
        for chain in self.table.chains.values():
            if (
                chain.type == "nat"
                and chain.hook in ("prerouting", "output")
                and any(_only_verdict(r) == ("jump", SERVICES_CHAIN) for r in chain.rules)
            ):
                hooked.append(chain.name)
        where = f"table {self.table.family} {self.table.name}"
        if not hooked:
            return False, True, f"{where} exists but no nat base chain jumps to services"
        return True, True, f"{where}: {' and '.join(sorted(hooked))} jump to services"

    def local_addresses(self) -> list[str] | None:
        return self._local

    # -- services ----------------------------------------------------------------------------

    def _set(self, name: str) -> NftSet:
        return self.table.sets.get(name) or NftSet(name, "set")

    def nodeport_addresses(self) -> list[str]:
        services = self.table.chains.get(SERVICES_CHAIN)
        for rule in services.rules if services else []:
            if not any(
                isinstance(s, dict) and s.get("vmap", {}).get("data") == f"@{SERVICE_NODEPORTS}"
                for s in rule.expr
            ):
                continue
            name = _match_set(rule)
            if name == NODEPORT_IPS:
                return [str(e.key[0]) for e in self._set(NODEPORT_IPS).elements]
            return [ANY_ADDRESS]
        return [ANY_ADDRESS]

    def services(self) -> list[VirtualServer]:
        found: dict[tuple[str, str, int], VirtualServer] = {}
        firewalled = {tuple(str(p) for p in e.key): e for e in self._set(FIREWALL_IPS).elements}
        cluster_ips = {str(e.key[0]) for e in self._set(CLUSTER_IPS).elements}
        for dest, chain, name in service_ip_entries(self._set(SERVICE_IPS)):
            ip, proto, port = dest.ip, dest.proto, str(dest.port)
            if chain.startswith(("service-", "local-", SHARED_PREFIX + "internal/")):
                kind = CLUSTER_IP
            else:
                kind = LOAD_BALANCER if (ip, proto, port) in firewalled else EXTERNAL
            vs = VirtualServer(proto, ip, dest.port, service=name, kind=kind, chain=chain)
            self._resolve(vs, chain, set())
            fw = firewalled.get((ip, proto, port))
            if fw is not None:
                self._firewall(vs, verdict_of(fw.value)[1])
            found[vs.key] = vs
        np_addrs = self.nodeport_addresses()
        for el in self._set(SERVICE_NODEPORTS).elements:
            if len(el.key) != 2:
                continue
            proto, port = (str(p) for p in el.key)
            _, chain = verdict_of(el.value)
            if chain is None:
                continue
            for addr in np_addrs:
                vs = VirtualServer(
                    proto,
                    addr,
                    int(port),
                    service=service_port_of(chain) or el.comment or "",
                    kind=NODE_PORT,
                    chain=chain,
                )
                self._resolve(vs, chain, set())
                found[vs.key] = vs
        for map_name, nodeport in ((NO_ENDPOINT_SERVICES, False), (NO_ENDPOINT_NODEPORTS, True)):
            for el in self._set(map_name).elements:
                parts = [str(p) for p in el.key]
                if nodeport and len(parts) == 2:
                    keys = [(parts[0], addr, int(parts[1])) for addr in np_addrs]
                elif not nodeport and len(parts) == 3:
                    keys = [(parts[1], parts[0], int(parts[2]))]
                else:
                    continue
                verb, target = verdict_of(el.value)
                verdict = "REJECT" if target == REJECT_CHAIN or verb == "reject" else verb.upper()
                for proto, addr, port in keys:
                    vs = found.get((proto, addr, port))
                    if vs is None:
                        kind = (
                            NODE_PORT
                            if nodeport
                            else (CLUSTER_IP if addr in cluster_ips else EXTERNAL)
                        )
                        vs = found[(proto, addr, port)] = VirtualServer(
                            proto, addr, port, service=el.comment or "", kind=kind, scheduler="none"
                        )
                    vs.verdict = verdict
                    vs.verdict_reason = (
                        f"@{map_name} element {el.key_text()}: {stmt_text(el.value)}"
                    )
                    if verdict == "DROP":
                        vs.local_only = True
        return list(found.values())

    def _firewall(self, vs: VirtualServer, chain: str | None) -> None:
        fw = self.table.chains.get(chain or "")
        if fw is None:
            vs.notes.append(f"firewall chain {chain} does not exist")
            return
        for rule in fw.rules:
            for stmt in rule.expr:
                m = stmt.get("match") if isinstance(stmt, dict) else None
                if isinstance(m, dict) and m.get("op") == "!=":
                    right = m.get("right")
                    items = right["set"] if isinstance(right, dict) and "set" in right else [right]
                    vs.source_ranges = tuple(expr_text(i) for i in items)

    def _resolve(self, vs: VirtualServer, chain_name: str, seen: set[str]) -> None:
        if chain_name in seen:
            vs.notes.append(f"chain loop at {chain_name}")
            return
        seen.add(chain_name)
        chain = self.table.chains.get(chain_name)
        if chain is None:
            vs.notes.append(f"chain {chain_name} does not exist (the map points nowhere)")
            return
        if is_shared_chain(chain_name):
            self._resolve_shared(vs, chain)
            return
        if chain_name.startswith("external-"):
            final = None
            for rule in chain.rules:
                only = _only_verdict(rule)
                if (
                    only
                    and only[0] == "goto"
                    and only[1]
                    and only[1].startswith(("local-", "service-"))
                ):
                    final = only[1]
                    break
            if final is None:
                vs.local_only = any("fib" in json.dumps(r.expr) for r in chain.rules)
                vs.scheduler = "none"
                vs.notes.append(
                    f"{chain_name} has no endpoint chain for traffic from outside the node "
                    "(Local policy without local endpoints)"
                )
                return
            if final.startswith("local-"):
                vs.local_only = True
            self._resolve(vs, final, seen)
            return
        if chain_name.startswith(("service-", "local-")):
            if chain_name.startswith("local-"):
                vs.local_only = True
            vs.scheduler = "numgen"
            for rule in chain.rules:
                name = _match_set(rule)
                if name and name.startswith("affinity-"):
                    vs.persistent = self._set(name).timeout
                for stmt in rule.expr:
                    vmap = stmt.get("vmap") if isinstance(stmt, dict) else None
                    if not isinstance(vmap, dict) or "numgen" not in (vmap.get("key") or {}):
                        continue
                    mod = int(vmap["key"]["numgen"].get("mod", 0)) or 1
                    data = vmap.get("data")
                    entries = data.get("set", []) if isinstance(data, dict) else []
                    listed = 0
                    for entry in entries:
                        if not (isinstance(entry, list) and len(entry) == 2):
                            continue
                        _, target = verdict_of(entry[1])
                        if target is None:
                            continue
                        rs = self._real_server(target)
                        rs.share = 1 / mod
                        listed += 1
                        vs.endpoints.append(rs)
                    if listed < mod:
                        vs.notes.append(
                            f"numgen mod {mod} has only {listed} entries: "
                            f"{(mod - listed) / mod * 100:.1f}% of new connections are not DNATed"
                        )
            if not vs.endpoints:
                vs.notes.append(f"{chain_name} has no endpoint dispatch")
            return
        if chain_name.startswith("endpoint-"):
            rs = self._real_server(chain_name)
            rs.share = 1.0
            vs.endpoints.append(rs)
            return
        vs.notes.append(f"unexpected chain {chain_name}")

    def slot_endpoints(self, container: str, key: tuple[str, ...]) -> dict[int, Element]:
        """The elements of an endpoint map for one destination (compact layout), by slot."""
        cache = self._slots
        if container not in cache:
            by_key: dict[tuple[str, ...], dict[int, Element]] = {}
            for el in self._set(container).elements:
                parts = [str(p) for p in el.key]
                if len(parts) >= 2 and parts[-1].isdigit():
                    by_key.setdefault(tuple(parts[:-1]), {})[int(parts[-1])] = el
            cache[container] = by_key
        return cache[container].get(key, {})

    def _resolve_shared(self, vs: VirtualServer, chain: NftChain) -> None:
        """A compact layout's shared chain: the pick that traffic from outside the node
        gets (the unconditional one; a Local policy's is offset past the cluster slots)."""
        vs.scheduler = "numgen"
        picks = [p for p in shared_picks(chain) if p.proto in (None, vs.proto)]
        final = next((p for p in reversed(picks) if not p.conditional), None)
        if chain.name.startswith(tuple(SHARED_PREFIX + k for k in ("external-", "nodeport-"))):
            vs.local_only = True
        if final is None:
            vs.scheduler = "none"
            vs.notes.append(
                f"{chain.name} has no endpoint pick for traffic from outside the node"
                + (" (Local policy without local endpoints)" if vs.local_only else "")
            )
            return
        key = (vs.proto, str(vs.port))
        if vs.kind != NODE_PORT:
            key = (vs.address, *key)
        slots = self.slot_endpoints(final.container, key)
        listed = 0
        for slot in range(final.offset, final.offset + final.mod):
            el = slots.get(slot)
            if el is None or not isinstance(el.value, dict):
                continue
            parts = el.value.get("concat", [])
            if len(parts) != 2:
                continue
            rs = RealServer(
                str(parts[0]), int(parts[1]), chain=f"{chain.name} @{final.container}[{slot}]"
            )
            rs.share = 1 / final.mod
            listed += 1
            vs.endpoints.append(rs)
        if listed < final.mod:
            vs.notes.append(
                f"numgen mod {final.mod} has only {listed} @{final.container} elements: "
                f"{(final.mod - listed) / final.mod * 100:.1f}% of new connections are not "
                "DNATed"
            )

    def _real_server(self, chain_name: str) -> RealServer:
        chain = self.table.chains.get(chain_name)
        for rule in chain.rules if chain else []:
            for stmt in rule.expr:
                d = stmt.get("dnat") if isinstance(stmt, dict) else None
                if isinstance(d, dict) and d.get("addr") is not None:
                    port = d.get("port")
                    counter = rule.counter()
                    return RealServer(
                        str(d["addr"]),
                        int(port) if isinstance(port, int) else 0,
                        chain=chain_name,
                        packets=counter[0] if counter else None,
                        bytes=counter[1] if counter else None,
                    )
        return RealServer("?", 0, chain=chain_name)

    # -- trace -------------------------------------------------------------------------------

    def trace(self, packet: Packet) -> Walk:
        from kproxy.ops.inspect.nftables_trace import NftWalker

        return NftWalker(self.table, self._local).trace(packet)


def load(source: KernelSource, *, layout: str = DEFAULT_LAYOUT) -> NftablesView | None:
    text = source.nft_table(dataplane_name(layout))
    if text is None:
        return None
    table = parse_table(text, name=TABLES[layout])
    return NftablesView(table, source, layout) if table is not None else None
