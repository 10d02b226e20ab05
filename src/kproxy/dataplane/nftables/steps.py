"""Apply a transaction in steps that avoid nft's expensive object cache ("fast apply").

Why: nft 1.0.6 dumps every chain and set of the table from the kernel before it evaluates
`add rule`, `add element` or any `delete`, and at 10,000 services (110,000 chains) that
costs ~0.9 s per invocation, however small the transaction (bench/nft_incremental.py).
The same objects can be written in forms that need only the table in the cache:

* the rules of a chain as `add chain T C { rule ; rule ; }` (appends, like `add rule`);
* elements as `add map T M { type ... ; comment ... ; elements = { ... } }` (adds, like
  `add element`; the definition is upstream's, unchanged);

and deletions (elements, stale chains, affinity sets) plus element value changes (a delete
and an add of the same key) go to the kernel as nf_tables netlink messages (netlink.py),
which need no cache at all. The kernel ends up with exactly the objects the upstream-form
transaction would have created; only the grouping into transactions differs:

1. nft: the table setup (full syncs), then the service ports' chains and rules, then new
   map/set elements -- split into pieces of at most `chunk_ops` operations at service port
   boundaries (a big single transaction makes the kernel's anonymous-set binding quadratic);
2. netlink, one atomic batch: element deletes and value changes; in the compact layout
   (Transaction.netlink_adds) also container flushes and every new element, so a full
   sync's hundreds of thousands of elements are one batch and no nft parses them;
3. nft: flushes of chains that went stale (after nothing points at them any more);
   netlink where new elements go over netlink too (the compact layout);
4. netlink: deletes of stale affinity sets (after the chains using them were flushed).

Every step is atomic and leaves a consistent table: chains exist before elements point at
them, an element changes in one batch, a chain is emptied only once nothing uses it.
Adjacent nft steps are merged while small, so a typical partial sync is one nft call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from kproxy.dataplane.nftables import names
from kproxy.dataplane.nftables import netlink as nl
from kproxy.dataplane.nftables.plan import (
    ALL_SERVICE_CONTAINERS,
    CONTAINERS,
    Element,
    netlink_types,
    type_clause,
)
from kproxy.dataplane.nftables.transaction import (
    Transaction,
    TxOp,
    element_statements,
    element_text,
    quote,
)

CHUNK_OPS = 20_000
# Elements per netlink message: the element list is one attribute, whose length is 16 bits.
NETLINK_ELEMENTS_MAX = 256


@dataclass
class Step:
    kind: str  # "nft" | "netlink"
    label: str
    ops: list[TxOp] = field(default_factory=list)

    def script(self, tx: Transaction) -> str:
        return render_inline(tx, self.ops)

    def messages(self, tx: Transaction) -> list[nl.Op]:
        return [m for m, _ in netlink_ops(tx, self.ops)]


def render_inline(tx: Transaction, ops: list[TxOp]) -> str:
    """nft text for ops, rules grouped per chain and elements per set/map."""
    out: list[str] = []
    where = tx.where
    i = 0
    while i < len(ops):
        op = ops[i]
        if op.kind == "rule" and op.verb == "add":
            rules = []
            while i < len(ops) and ops[i].kind == "rule" and ops[i].name == op.name:
                rules.append(ops[i].body)
                i += 1
            out.append(f"add chain {where} {op.name} {{ {' ; '.join(rules)} ; }}")
            continue
        if op.kind == "element" and op.verb == "add":
            items = []
            while (
                i < len(ops)
                and ops[i].kind == "element"
                and ops[i].verb == "add"
                and ops[i].name == op.name
            ):
                items += map(element_text, _elements(ops[i]))
                i += 1
            kind, type_, comment = CONTAINERS[op.name]
            head = f"add {kind} {where} {op.name} {{ {type_clause(type_)} ;"
            out.append(f"{head} comment {quote(comment)} ; elements = {{ {' , '.join(items)} }} }}")
            continue
        out.append(_line(where, op))
        i += 1
    return "".join(line + "\n" for line in out)


def _elements(op: TxOp) -> tuple[Element, ...]:
    """The elements an element op carries (one, or a bulk add's many)."""
    if op.elements:
        return op.elements
    assert op.element is not None
    return (op.element,)


def op_line(tx: Transaction, op: TxOp) -> str:
    """The upstream-form text of one op (for error messages); a bulk add's is its grouped
    statements, one per line."""
    if op.kind == "element" and op.verb == "add":
        if op.elements:
            return "\n".join(element_statements(tx.where, op.name, op.elements))
        el = op.element
        assert el is not None
        return f"add element {tx.where} {op.name} {{ {element_text(el)} }}"
    if op.kind == "rule":
        return f"add rule {tx.where} {op.name} {op.body}"
    return _line(tx.where, op)


def _line(where: str, op: TxOp) -> str:
    if op.kind == "table":
        return f"{op.verb} table {where}{op.body}"
    if op.kind == "element":
        assert op.element is not None
        return f"{op.verb} element {where} {op.name} {{ {op.element.key} }}"
    body = f" {op.body}" if op.body and not op.body.startswith(" ") else op.body
    return f"{op.verb} {op.kind} {where} {op.name}{body}"


def netlink_ops(tx: Transaction, ops: list[TxOp]) -> list[tuple[nl.Op, Callable[[], str]]]:
    """Netlink messages for deletes, flushes and element adds (elements grouped per
    container, in order), each with what makes the nft text of what it carries (for an
    error: a full sync's 200,000 element texts are not made when nothing fails)."""
    out: list[tuple[nl.Op, Callable[[], str]]] = []
    where = tx.where
    i = 0
    while i < len(ops):
        op = ops[i]
        if op.kind == "element":
            group: list[Element] = []
            while (
                i < len(ops)
                and ops[i].kind == "element"
                and ops[i].verb == op.verb
                and ops[i].name == op.name
            ):
                group += _elements(ops[i])
                i += 1
            key_type, data_type = netlink_types(op.name)
            delete = op.verb == "delete"
            for start in range(0, len(group), NETLINK_ELEMENTS_MAX):
                part = group[start : start + NETLINK_ELEMENTS_MAX]
                message = nl.set_elements(
                    tx.table,
                    op.name,
                    key_type,
                    [(el.key, el.value, el.comment) for el in part],
                    delete=delete,
                    data_type=data_type,
                )
                out.append((message, partial(_elements_line, op.verb, where, op.name, part)))
            continue
        if op.verb == "delete" and op.kind == "chain":
            out.append((nl.delete_chain(tx.table, op.name), partial(_line, where, op)))
        elif op.verb == "flush" and op.kind == "chain":
            out.append((nl.flush_chain(tx.table, op.name), partial(_line, where, op)))
        elif op.verb == "delete" and op.kind in ("set", "map"):
            out.append((nl.delete_set(tx.table, op.name), partial(_line, where, op)))
        elif op.verb == "flush" and op.kind in ("set", "map"):
            out.append((nl.flush_set(tx.table, op.name), partial(_line, where, op)))
        else:
            raise ValueError(f"no netlink form for {op}")
        i += 1
    return out


def _elements_line(verb: str, where: str, name: str, elements: list[Element]) -> str:
    items = [el.key for el in elements] if verb == "delete" else map(element_text, elements)
    return f"{verb} element {where} {name} {{ {', '.join(items)} }}"


def split(tx: Transaction, *, chunk_ops: int = CHUNK_OPS) -> list[Step]:
    """The steps that apply `tx` (see the module docstring); empty for an empty tx."""
    ops = tx.ops
    changed_keys = {
        (op.name, op.element.key)
        for op in ops
        if op.kind == "element" and op.verb == "delete" and op.element is not None
    }
    setup: list[TxOp] = []
    blocks: list[list[TxOp]] = []
    elements: list[TxOp] = []
    changes_delete: list[TxOp] = []
    changes_add: list[TxOp] = []
    stale: list[TxOp] = []
    drops: list[TxOp] = []
    marks = set(tx.marks)
    for index, op in enumerate(ops):
        if index in marks:
            blocks.append([])
        service_container = op.name in ALL_SERVICE_CONTAINERS and op.kind in (
            "element",
            "set",
            "map",
        )
        if op.kind == "element" and service_container:
            if op.verb == "delete":
                changes_delete.append(op)
            elif op.element is not None and (op.name, op.element.key) in changed_keys:
                changes_add.append(op)
            else:
                elements.append(op)
        elif op.verb == "flush" and service_container:
            elements.append(op)  # refilled in the same transaction
        elif op.kind == "chain" and op.verb == "flush" and op.stale:
            stale.append(op)
        elif op.verb == "delete" and (
            (op.kind == "set" and names.is_affinity_set(op.name))
            or (op.kind == "chain" and names.is_service_chain(op.name))
        ):
            drops.append(op)
        elif blocks:
            blocks[-1].append(op)
        else:
            setup.append(op)

    steps: list[Step] = []
    if setup:
        steps.append(Step("nft", "table setup", setup))
    pending: list[TxOp] = []
    for block in blocks:
        if pending and len(pending) + len(block) > chunk_ops:
            steps.append(Step("nft", "service chains", pending))
            pending = []
        pending += block
    if pending:
        steps.append(Step("nft", "service chains", pending))
    if tx.netlink_adds:
        # One batch: deletes, then flushes (containers refilled), then every add.
        flushes = [op for op in elements if op.verb == "flush"]
        changes_delete += flushes
        changes_add += [op for op in elements if op.verb != "flush"]
        elements = []
    for i in range(0, len(elements), chunk_ops):
        steps.append(Step("nft", "map elements", elements[i : i + chunk_ops]))
    if changes_delete or changes_add:
        steps.append(Step("netlink", "element deletes and changes", changes_delete + changes_add))
    if stale:
        steps.append(Step("netlink" if tx.netlink_adds else "nft", "stale chain flushes", stale))
    if drops:
        steps.append(Step("netlink", "deletes", drops))
    return _merge(steps, chunk_ops)


def _merge(steps: list[Step], chunk_ops: int) -> list[Step]:
    out: list[Step] = []
    for step in steps:
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.kind == step.kind == "nft"
            and len(prev.ops) + len(step.ops) <= chunk_ops
        ):
            prev.ops = prev.ops + step.ops
            prev.label = f"{prev.label}, {step.label}"
        else:
            out.append(step)
    return out
