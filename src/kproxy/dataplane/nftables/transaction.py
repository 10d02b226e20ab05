"""Write `nft -f` transactions: one `add|flush|delete table|chain|set|map|element|rule` command
per line, in the text form knftables (and so upstream kube-proxy) writes.

`write_sync` turns a plan plus a mirror of what the kernel holds (TableState) into the
transaction of one sync, the way upstream's syncProxyRules does:

* full sync: the table setup (add table; the first time in a process also add+delete every
  base chain so that a changed priority or hook can be applied; add+flush base and
  top-level chains with their rules; sets and maps), then every service's chains;
* partial sync: only the chains of service ports whose plan changed (add + flush + rules);
* both: map/set elements are diffed against the mirror (a changed value is delete + add;
  a full sync onto an empty mirror, a new table, writes every element without a diff, in
  the compact layout as one bulk op per container, see add_elements),
  chains no longer used are flushed at once and remembered as stale (deleted >= 1 s later,
  in a transaction of their own, see stale_chain_deletions), affinity sets no longer used
  are deleted at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kproxy.dataplane.nftables import names as n
from kproxy.dataplane.nftables.plan import (
    ADDR_TYPE,
    COMPACT_SERVICE_CONTAINERS,
    CONTAINERS,
    FAMILY,
    REJECT_CHAIN_COMMENT,
    BaseChain,
    Chain,
    Element,
    NftablesPlan,
    ServiceBlock,
    type_clause,
)
from kproxy.model.objects import ServicePortName

# Seconds a flushed stale chain is kept before it is deleted (upstream: kernels before 6.2
# notice a dropped vmap reference to a chain only a little later).
STALE_CHAIN_DELAY = 1.0
# Elements per `add element` statement in the text of add_elements: nft parses a grouped
# statement much faster than one statement per element.
ELEMENTS_PER_STATEMENT = 1000


def quote(text: str) -> str:
    """Go's %q for the ASCII comments kube-proxy writes."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def element_text(el: Element) -> str:
    """An element as nft writes it inside `{ }`: key, comment, value."""
    comment = f" comment {quote(el.comment)}" if el.comment is not None else ""
    return f"{el.key}{comment} : {el.value}" if el.value else f"{el.key}{comment}"


def element_statements(where: str, container: str, elements: tuple[Element, ...]) -> list[str]:
    """`add element` statements of up to ELEMENTS_PER_STATEMENT elements each."""
    step = ELEMENTS_PER_STATEMENT
    return [
        f"add element {where} {container} {{ "
        + ", ".join(map(element_text, elements[i : i + step]))
        + " }"
        for i in range(0, len(elements), step)
    ]


@dataclass(frozen=True, slots=True)
class TxOp:
    """One operation of a transaction, structured (for renderers other than the text)."""

    verb: str  # add | flush | delete
    kind: str  # table | chain | rule | set | map | element
    name: str  # chain, set or map name ("" for the table); the chain for rules
    body: str = ""  # the text after the name (rule text, "{ ... }" definitions)
    element: Element | None = None
    stale: bool = False  # a flush of a chain that went stale
    base: bool = False  # a base chain definition
    # Adds of many elements to one set/map as one op (add_elements); element is None then.
    elements: tuple[Element, ...] = ()


class Transaction:
    """An nft transaction for one table; every method appends one operation (one line)."""

    def __init__(self, family: str = FAMILY, table: str = n.TABLE) -> None:
        self.family = family
        self.table = table
        self.where = f"{family} {table}"
        # Lines, or bulk element ops whose text is made only when someone asks (lines).
        self._lines: list[str | TxOp] = []
        self._pending = False
        self.ops: list[TxOp] = []
        # Indexes into ops where a new service port's objects start.
        self.marks: list[int] = []
        # Whether new elements (and container flushes) go to the kernel over netlink with the
        # element changes (steps.split): the compact layout's, whose partial syncs then need
        # no nft at all and whose full syncs change elements in one batch.
        self.netlink_adds = False

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def lines(self) -> list[str]:
        """The transaction as `nft -f` lines, one command each."""
        if self._pending:
            out: list[str] = []
            for item in self._lines:
                if isinstance(item, str):
                    out.append(item)
                else:
                    out += element_statements(self.where, item.name, item.elements)
            self._lines = list(out)
            self._pending = False
        return self._lines  # type: ignore[return-value]

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    def _op(self, op: TxOp, line: str) -> None:
        self.ops.append(op)
        self._lines.append(line)

    def mark(self) -> None:
        """Note that the objects of another service port follow (a place to split)."""
        self.marks.append(len(self.ops))

    # -- tables and chains --------------------------------------------------------------

    def add_table(self, comment: str | None = None) -> None:
        body = f" {{ comment {quote(comment)} ; }}" if comment else ""
        self._op(TxOp("add", "table", "", body), f"add table {self.where}{body}")

    def delete_table(self) -> None:
        self._op(TxOp("delete", "table", ""), f"delete table {self.where}")

    def add_chain(
        self, name: str, base: BaseChain | None = None, comment: str | None = None
    ) -> None:
        parts = []
        if base is not None:
            parts.append(f"type {base.type} hook {base.hook} priority {base.priority} ;")
        if comment:
            parts.append(f"comment {quote(comment)} ;")
        body = f" {{ {' '.join(parts)} }}" if parts else ""
        self._op(
            TxOp("add", "chain", name, body, base=base is not None),
            f"add chain {self.where} {name}{body}",
        )

    def flush_chain(self, name: str, *, stale: bool = False) -> None:
        self._op(TxOp("flush", "chain", name, stale=stale), f"flush chain {self.where} {name}")

    def delete_chain(self, name: str) -> None:
        self._op(TxOp("delete", "chain", name), f"delete chain {self.where} {name}")

    def ensure_chain(self, name: str) -> None:
        """add + flush: the chain exists and holds only what this transaction adds."""
        self.add_chain(name)
        self.flush_chain(name)

    def add_rule(self, chain: str, rule: str) -> None:
        self._op(TxOp("add", "rule", chain, rule), f"add rule {self.where} {chain} {rule}")

    # -- sets, maps, elements -----------------------------------------------------------

    def add_container(
        self,
        kind: str,
        name: str,
        type_: str,
        *,
        flags: Iterable[str] = (),
        timeout: int | None = None,
        comment: str | None = None,
    ) -> None:
        parts = [f"{type_clause(type_)} ;"]
        flags = list(flags)
        if flags:
            parts.append(f"flags {','.join(flags)} ;")
        if timeout is not None:
            parts.append(f"timeout {timeout}s ;")
        if comment:
            parts.append(f"comment {quote(comment)} ;")
        body = f"{{ {' '.join(parts)} }}"
        self._op(TxOp("add", kind, name, body), f"add {kind} {self.where} {name} {body}")

    def flush_container(self, kind: str, name: str) -> None:
        self._op(TxOp("flush", kind, name), f"flush {kind} {self.where} {name}")

    def delete_container(self, kind: str, name: str) -> None:
        self._op(TxOp("delete", kind, name), f"delete {kind} {self.where} {name}")

    def add_element(self, el: Element) -> None:
        self._op(
            TxOp("add", "element", el.container, element=el),
            f"add element {self.where} {el.container} {{ {element_text(el)} }}",
        )

    def add_elements(self, container: str, elements: tuple[Element, ...]) -> None:
        """Add many elements to one set/map: one op, written as grouped `add element`
        statements (element_statements) when the text is asked for."""
        if elements:
            op = TxOp("add", "element", container, elements=elements)
            self.ops.append(op)
            self._lines.append(op)
            self._pending = True

    def delete_element(self, container: str, key: str) -> None:
        self._op(
            TxOp("delete", "element", container, element=Element(container, key)),
            f"delete element {self.where} {container} {{ {key} }}",
        )


@dataclass
class TableState:
    """What kproxy believes the kernel's table holds (a mirror kept between syncs)."""

    elements: dict[str, dict[str, Element]] = field(
        default_factory=lambda: {c: {} for c in COMPACT_SERVICE_CONTAINERS}
    )
    # Service chains (names with "/") that exist, in use or stale.
    chains: set[str] = field(default_factory=set)
    affinity_sets: set[str] = field(default_factory=set)
    # chain -> monotonic time it became stale (flushed, to be deleted later).
    stale: dict[str, float] = field(default_factory=dict)
    # The shared chains last written (their names are also in `chains`).
    shared: dict[str, Chain] = field(default_factory=dict)
    # The blocks last written, per service port (partial syncs compare against these).
    blocks: dict[ServicePortName, ServiceBlock] = field(default_factory=dict)
    # container -> key -> the service port whose element the kernel holds (of the ports
    # claiming a key, the last by name), and for keys two or more ports claim, all of them.
    owner: dict[str, dict[str, ServicePortName]] = field(default_factory=dict)
    claimants: dict[tuple[str, str], set[ServicePortName]] = field(default_factory=dict)


@dataclass
class SyncWrite:
    """One sync's transaction, and the changes to the mirror once it is committed.

    The mirror is not touched until commit(): a rejected transaction leaves it as it was."""

    tx: Transaction
    full: bool
    blocks: dict[ServicePortName, ServiceBlock]
    rewritten: set[ServicePortName] = field(default_factory=set)
    stale_flushed: list[str] = field(default_factory=list)
    rules_written: int = 0
    # Replacements for the whole mirror (full syncs) or the changed parts (partial syncs).
    chains: set[str] = field(default_factory=set)
    chains_gone: set[str] = field(default_factory=set)
    affinity_sets: set[str] = field(default_factory=set)
    affinity_sets_gone: set[str] = field(default_factory=set)
    stale: dict[str, float] = field(default_factory=dict)
    stale_revived: set[str] = field(default_factory=set)
    # Partial syncs: the changed keys (None: gone), their owner and claimants (None: fewer
    # than two). Full syncs: the whole element mirror, owners and claimants.
    elements: dict[tuple[str, str], Element | None] = field(default_factory=dict)
    owner: dict[tuple[str, str], ServicePortName | None] = field(default_factory=dict)
    claimants: dict[tuple[str, str], set[ServicePortName] | None] = field(default_factory=dict)
    all_elements: dict[str, dict[str, Element]] = field(default_factory=dict)
    all_owners: dict[str, dict[str, ServicePortName]] = field(default_factory=dict)
    all_claimants: dict[tuple[str, str], set[ServicePortName]] = field(default_factory=dict)
    shared: dict[str, Chain] = field(default_factory=dict)

    def commit(self, state: TableState) -> TableState:
        """Apply this write to `state` (in place) once the kernel accepted the transaction."""
        if self.full:
            state.chains = set(self.chains)
            state.affinity_sets = set(self.affinity_sets)
            state.stale = dict(self.stale)
            state.elements = {c: {} for c in COMPACT_SERVICE_CONTAINERS}
            state.elements.update(self.all_elements)
            state.owner = dict(self.all_owners)
            state.claimants = dict(self.all_claimants)
        else:
            state.chains |= self.chains
            state.affinity_sets -= self.affinity_sets_gone
            state.affinity_sets |= self.affinity_sets
            state.stale.update(self.stale)
        for chain in self.stale_revived:
            state.stale.pop(chain, None)
        for (container, key), el in self.elements.items():
            if el is None:
                state.elements[container].pop(key, None)
            else:
                state.elements[container][key] = el
        for (container, key), name in self.owner.items():
            if name is None:
                state.owner.get(container, {}).pop(key, None)
            else:
                state.owner.setdefault(container, {})[key] = name
        for ck, names in self.claimants.items():
            if names:
                state.claimants[ck] = names
            else:
                state.claimants.pop(ck, None)
        state.blocks = self.blocks
        state.shared = self.shared
        return state


def write_setup(tx: Transaction, plan: NftablesPlan, *, recreate_base_chains: bool) -> int:
    """The fixed part of the table in upstream's order; returns the number of rules written."""
    setup = plan.setup
    tx.add_table(setup.table_comment)
    for name in setup.early_containers:
        _add_container(tx, name)
    if recreate_base_chains:
        for bc in setup.base_chains:
            tx.add_chain(bc.name)
            tx.delete_chain(bc.name)
    for bc in setup.base_chains:
        tx.add_chain(bc.name, bc)
        tx.flush_chain(bc.name)
    created: set[str] = set()
    for dst, src, rule in setup.jumps:
        _ensure_once(tx, dst, created)
        tx.add_rule(src, rule)
    for chain in setup.top_chains:
        _ensure_once(tx, chain, created)
    for chain, rule in setup.masquerade_rules:
        tx.add_rule(chain, rule)
    _add_container(tx, n.CLUSTER_IPS_SET)
    for rule in setup.cluster_ips_check_rules:
        tx.add_rule(n.CLUSTER_IPS_CHECK_CHAIN, rule)
    _write_nodeport_ips(tx, plan)
    _add_container(tx, n.NO_ENDPOINT_SERVICES_MAP)
    _add_container(tx, n.NO_ENDPOINT_NODEPORTS_MAP)
    tx.add_chain(n.REJECT_CHAIN, comment=REJECT_CHAIN_COMMENT)
    tx.flush_chain(n.REJECT_CHAIN)
    tx.add_rule(n.REJECT_CHAIN, "reject")
    tx.add_rule(n.SERVICE_ENDPOINTS_CHECK_CHAIN, setup.service_endpoints_check_rule)
    tx.add_rule(n.NODEPORT_ENDPOINTS_CHECK_CHAIN, setup.nodeport_endpoints_check_rule)
    _add_container(tx, n.FIREWALL_IPS_MAP)
    _ensure_once(tx, n.FIREWALL_CHECK_CHAIN, created)
    tx.add_rule(n.FIREWALL_CHECK_CHAIN, setup.firewall_check_rule)
    _add_container(tx, n.SERVICE_IPS_MAP)
    _add_container(tx, n.SERVICE_NODEPORTS_MAP)
    for rule in setup.services_rules:
        tx.add_rule(n.SERVICES_CHAIN, rule)
    return len(setup.rules)


def _add_container(tx: Transaction, name: str) -> None:
    kind, type_, comment = CONTAINERS[name]
    tx.add_container(kind, name, type_, comment=comment)


def _ensure_once(tx: Transaction, chain: str, created: set[str]) -> None:
    if chain not in created:
        created.add(chain)
        tx.ensure_chain(chain)


def _write_nodeport_ips(tx: Transaction, plan: NftablesPlan) -> None:
    kind, type_, comment = CONTAINERS[n.NODEPORT_IPS_SET]
    # add + delete when the set must not exist: a bare delete fails if it is missing.
    tx.add_container(kind, n.NODEPORT_IPS_SET, type_, comment=comment)
    ips = plan.setup.nodeport_ips
    if ips is None:
        tx.delete_container(kind, n.NODEPORT_IPS_SET)
        return
    tx.flush_container(kind, n.NODEPORT_IPS_SET)
    for ip in ips:
        tx.add_element(Element(n.NODEPORT_IPS_SET, ip))


def write_block(
    tx: Transaction, block: ServiceBlock, skip: frozenset[str] | set[str] = frozenset()
) -> int:
    """A service port's chains (add + flush), affinity sets and rules; chains in `skip` are
    left as the kernel has them. Returns the number of rules written."""
    chains = [c for c in block.chains if c.name not in skip]
    for chain in chains:
        tx.ensure_chain(chain.name)
    # Affinity sets exist before the rules that look them up or update them.
    for s in block.affinity_sets:
        tx.add_container("set", s.name, ADDR_TYPE, flags=("dynamic", "timeout"), timeout=s.timeout)
    written = 0
    for chain in chains:
        for rule in chain.rules:
            tx.add_rule(chain.name, rule)
        written += len(chain.rules)
    return written


def write_sync(
    plan: NftablesPlan,
    state: TableState,
    *,
    full: bool,
    recreate_base_chains: bool = False,
    skip_endpoint_chains: set[str] | None = None,
    flush_containers: Iterable[str] = (),
    now: float = 0.0,
) -> SyncWrite:
    """The transaction of one sync against the mirror `state` (not modified; see commit).

    skip_endpoint_chains: endpoint chains known to be right in the kernel already (the first
    sync after a restart: an endpoint chain's name fixes its rules, upstream's
    epChainSkipUpdate). flush_containers: maps/sets whose elements could not be read, to be
    emptied and refilled (upstream's readOrReset).
    """
    tx = Transaction(FAMILY, plan.setup.table)
    out = SyncWrite(tx, full, plan.blocks, shared=plan.shared)
    if full:
        out.rules_written += write_setup(tx, plan, recreate_base_chains=recreate_base_chains)
        for container in flush_containers:
            tx.flush_container(CONTAINERS[container][0], container)
    # Shared chains before the blocks and elements that go to them; a shared chain's rules
    # depend on its name and the node's options only, so it is rewritten when they differ.
    declared = full
    for name in sorted(plan.shared):
        chain = plan.shared[name]
        if full or state.shared.get(name) != chain:
            if not declared:  # nft resolves the maps the rules name only in its own input
                declared = True
                for container in plan.setup.early_containers:
                    _add_container(tx, container)
            tx.ensure_chain(name)
            for rule in chain.rules:
                tx.add_rule(name, rule)
            out.rules_written += len(chain.rules)
    tx.netlink_adds = plan.setup.netlink_element_adds

    changed: list[ServicePortName] = []
    skip = skip_endpoint_chains or set()
    if not full and plan.base is not None and plan.base is state.blocks:
        # The mirror holds the planner's previous plan: only rebuilt ports can differ.
        candidates: Iterable[ServicePortName] = plan.rebuilt
        removed = plan.removed & state.blocks.keys()
    else:
        candidates = plan.blocks
        removed = set(state.blocks) - set(plan.blocks)
    for name in candidates:
        if full or state.blocks.get(name) is not plan.blocks[name]:
            changed.append(name)
    changed.sort()
    for name in changed:
        block = plan.blocks[name]
        if full or state.blocks.get(name) != block:
            tx.mark()
            chains_skip = block.endpoint_chains & skip if skip else frozenset()
            out.rules_written += write_block(tx, block, chains_skip)
            out.rewritten.add(name)
    changed += sorted(removed)

    # Chains and affinity sets no longer used: a chain is flushed when it becomes stale (and
    # again on full syncs) and deleted later; an affinity set is deleted at once.
    if full:
        now_used = plan.service_chains() | plan.shared.keys()
        gone = state.chains - now_used
        out.affinity_sets = set(plan.affinity_sets())
        gone_sets = state.affinity_sets - out.affinity_sets
        out.chains = now_used | gone
        out.stale = {c: state.stale.get(c, now) for c in gone}
    else:
        before: set[str] = set()
        now_used = set()
        sets_before: set[str] = set()
        for name in changed:
            if (old := state.blocks.get(name)) is not None:
                before.update(c.name for c in old.chains)
                sets_before.update(s.name for s in old.affinity_sets)
            if (block := plan.blocks.get(name)) is not None:
                now_used.update(c.name for c in block.chains)
                out.affinity_sets.update(s.name for s in block.affinity_sets)
        before.update(state.shared.keys() - plan.shared.keys())
        now_used.update(plan.shared.keys() - state.shared.keys())
        gone = (before - now_used) & state.chains
        gone_sets = (sets_before - out.affinity_sets) & state.affinity_sets
        out.chains = now_used
        out.affinity_sets_gone = gone_sets
        out.stale = {c: now for c in gone if c not in state.stale}
    for chain in sorted(gone):
        if chain not in state.stale:
            out.stale_flushed.append(chain)
        if full or chain not in state.stale:
            tx.flush_chain(chain, stale=True)
    out.stale_revived = now_used & set(state.stale)
    for name in sorted(gone_sets):
        tx.delete_container("set", name)

    _write_elements(out, plan, state, changed)
    return out


def _write_elements(
    out: SyncWrite, plan: NftablesPlan, state: TableState, changed: list[ServicePortName]
) -> None:
    """Element adds and deletes for the keys the changed service ports touch (all keys on a
    full sync). A key claimed by two ports takes the element of the later port by name."""
    if out.full:
        _write_all_elements(out, plan, state)
        return
    claims: dict[tuple[str, str], set[ServicePortName]] = {}

    def claimed(key: tuple[str, str]) -> set[ServicePortName]:
        got = claims.get(key)
        if got is None:
            if key in state.claimants:
                got = set(state.claimants[key])
            else:
                holder = state.owner.get(key[0], {}).get(key[1])
                got = {holder} if holder is not None else set()
            claims[key] = got
        return got

    for name in changed:
        if (old := state.blocks.get(name)) is not None:
            for el in old.elements:
                claimed((el.container, el.key)).discard(name)
        if (block := plan.blocks.get(name)) is not None:
            for el in block.elements:
                claimed((el.container, el.key)).add(name)
    adds: list[Element] = []
    deletes: list[tuple[str, str]] = []
    for key in sorted(claims):
        container, k = key
        names = claims[key]
        want = None
        winner = max(names) if names else None
        if winner is not None:
            want = next(el for el in plan.blocks[winner].elements if (el.container, el.key) == key)
        out.owner[key] = winner
        out.claimants[key] = names if len(names) > 1 else None
        have = state.elements.get(container, {}).get(k)
        if want == have:
            continue
        if have is not None:
            deletes.append(key)
        out.elements[key] = want
        if want is not None:
            adds.append(want)
    for container, k in deletes:
        out.tx.delete_element(container, k)
    for el in adds:
        out.tx.add_element(el)


def _write_all_elements(out: SyncWrite, plan: NftablesPlan, state: TableState) -> None:
    """A full sync's elements: every claimed key gets its winner's element, the mirror's
    other keys go. One pass over the blocks in name order (a later claimant overwrites);
    nothing is diffed where the mirror is empty (a new table, or containers refilled)."""
    containers = sorted(plan.setup.service_containers)
    want: dict[str, dict[str, Element]] = {c: {} for c in containers}
    owner: dict[str, dict[str, ServicePortName]] = {c: {} for c in containers}
    claimants = out.all_claimants
    blocks = plan.blocks
    for name in sorted(blocks):
        for el in blocks[name].elements:
            container, key = el[0], el[1]
            holders = owner[container]
            holder = holders.get(key)
            if holder is not None:
                if holder == name:
                    continue  # a port's first element of a key is the one it means
                claimants.setdefault((container, key), {holder}).add(name)
            want[container][key] = el
            holders[key] = name
    out.all_elements = want
    out.all_owners = owner
    bulk = plan.setup.netlink_element_adds
    adds: list[tuple[str, list[Element]]] = []
    deletes: list[tuple[str, list[str]]] = []
    for container in sorted(set(containers) | {c for c, els in state.elements.items() if els}):
        wanted = want.get(container, {})
        have = state.elements.get(container)
        if not have:
            new = list(wanted.values())
        else:
            new = [el for key, el in wanted.items() if have.get(key) != el]
            gone = [key for key, el in have.items() if wanted.get(key) != el]
            if gone:
                deletes.append((container, gone if bulk else sorted(gone)))
        if new:
            adds.append((container, new if bulk else sorted(new, key=_element_key)))
    tx = out.tx
    for container, keys in deletes:
        for key in keys:
            tx.delete_element(container, key)
    for container, els in adds:
        if bulk:
            tx.add_elements(container, tuple(els))
        else:
            for el in els:
                tx.add_element(el)


def _element_key(el: Element) -> str:
    return el.key


def stale_chain_deletions(
    state: TableState, now: float, table: str = n.TABLE
) -> tuple[Transaction, list[str]]:
    """The separate transaction deleting chains stale for longer than STALE_CHAIN_DELAY."""
    tx = Transaction(FAMILY, table)
    due = sorted(c for c, t in state.stale.items() if now - t >= STALE_CHAIN_DELAY)
    for chain in due:
        tx.delete_chain(chain)
    return tx, due
