"""The narrow apply layer of nftables mode: `nft -f -` transactions and `nft -j` listings.

Every command can run inside a named network namespace (`ip netns exec NS nft ...`, the
same runner and prefix as the iptables backend), so tests and the lab never touch the
namespace the process runs in.

Transactions go to nft on stdin, as knftables does. nft names a rejected command as
`/dev/stdin:LINE:COLUMNS: Error: REASON`; NftError carries that line and its text.
Listings are nft's JSON (schema version 1).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from kproxy.dataplane.nftables.netlink import FAMILIES, NetlinkError, NftNetlink, delete_chain
from kproxy.dataplane.nftables.plan import ALL_SERVICE_CONTAINERS, netlink_types
from kproxy.dataplane.nftables.steps import netlink_ops, split
from kproxy.dataplane.nftables.transaction import Transaction
from kproxy.host.commands import Runner, in_netns, parse_version, run_command

log = logging.getLogger(__name__)
# nf_tables address families as nft names them (NFPROTO_*)
NFPROTO_NAMES: Final = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}

Version = tuple[int, int, int]
_ERROR_RE: Final = re.compile(r"^(?:/dev/stdin|-):(\d+):[\d-]+: Error: (.*)$", re.MULTILINE)
_NOT_FOUND: Final = ("No such file or directory",)
LINE_SHOWN_MAX: Final = 1000


class NftError(Exception):
    """nft failed; for a rejected transaction, names the first line it blamed."""

    def __init__(
        self,
        message: str,
        *,
        command: Sequence[str] = (),
        returncode: int = 0,
        stderr: str = "",
        input_data: str | None = None,
        netlink_line: int | None = None,
    ) -> None:
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr
        self.input_data = input_data
        self.line_number: int | None = None
        self.line_text: str | None = None
        self.reason = stderr.strip().splitlines()[0] if stderr.strip() else ""
        match = _ERROR_RE.search(stderr)
        if match is not None:
            self.line_number = int(match.group(1))
            self.reason = match.group(2).strip()
            if input_data is not None:
                lines = input_data.splitlines()
                if 1 <= self.line_number <= len(lines):
                    self.line_text = lines[self.line_number - 1]
        if netlink_line is not None and input_data is not None:
            self.line_number = netlink_line + 1
            self.line_text = input_data.splitlines()[netlink_line]
            self.reason = message.rsplit(": ", 1)[-1]
            shown = self.line_text
            if len(shown) > LINE_SHOWN_MAX:  # a netlink message carries up to 256 elements
                shown = shown[:LINE_SHOWN_MAX] + " ..."
            message = f"{message} (rejected: {shown!r})"
        elif self.line_number is not None:
            where = f"line {self.line_number}"
            if self.line_text is not None:
                where += f" ({self.line_text!r})"
            message = f"{message}: {where}: {self.reason}"
        elif self.reason:
            message = f"{message}: {self.reason}"
        super().__init__(message)

    @property
    def not_found(self) -> bool:
        return any(text in self.stderr for text in _NOT_FOUND)

    def context(self, radius: int = 2) -> str:
        """The rejected line with `radius` lines around it, numbered, marked with '=>'."""
        if self.line_number is None or self.input_data is None:
            return ""
        lines = self.input_data.splitlines()
        first = max(1, self.line_number - radius)
        last = min(len(lines), self.line_number + radius)
        return "\n".join(
            f"{'=>' if i == self.line_number else '  '} {i:6d}: {lines[i - 1]}"
            for i in range(first, last + 1)
        )


@dataclass(frozen=True, slots=True)
class TableRef:
    family: str
    name: str

    def __str__(self) -> str:
        return f"{self.family} {self.name}"


class NftBackend:
    """nft for one namespace: run transactions, list what a table holds.

    fast=True applies transactions in cache-free steps (steps.py: nft for rules and new
    elements, netlink for deletes and element changes); fast=False pipes the upstream-form
    text to one `nft -f -`."""

    def __init__(
        self,
        *,
        netns: str | None = None,
        runner: Runner | None = None,
        binary: str = "nft",
        fast: bool = True,
        chunk_ops: int | None = None,
    ) -> None:
        self.netns = netns
        self.binary = binary
        self.fast = fast
        self.chunk_ops = chunk_ops
        self._runner: Runner = runner or run_command
        self._version: Version | None = None
        self._netlink: NftNetlink | None = None
        self.last_steps: list[str] = []
        # Batches committed through this backend (each `nft -f` and each netlink batch):
        # with generation(), how a dataplane tells its own commits from anyone else's.
        self.commits = 0

    def __repr__(self) -> str:
        return f"NftBackend(netns={self.netns!r})"

    def _run(
        self, args: Sequence[str], input_data: str | None = None
    ) -> tuple[list[str], subprocess.CompletedProcess[str]]:
        argv = in_netns([self.binary, *args], self.netns)
        return argv, self._runner(argv, input_data)

    def version(self) -> Version | None:
        """`nft --version` (cached); None when nft is missing or says nothing readable."""
        if self._version is None:
            _, proc = self._run(["--version"])
            if proc.returncode != 0:
                return None
            self._version = parse_version(proc.stdout + proc.stderr)
        return self._version

    # -- transactions -----------------------------------------------------------------

    def run(self, data: str) -> None:
        """Apply one transaction atomically (`nft -f -`); NftError names the rejected line."""
        if not data:
            return
        argv, proc = self._run(["-f", "-"], data)
        if proc.returncode != 0:
            raise NftError(
                "nft rejected the transaction",
                command=argv,
                returncode=proc.returncode,
                stderr=proc.stderr,
                input_data=data,
            )
        self.commits += 1

    def apply(self, tx: Transaction) -> None:
        """Apply a transaction: in fast steps, or as one `nft -f -` (see the class doc)."""
        if not tx.ops:
            self.last_steps = []
            return
        if not self.fast:
            self.last_steps = ["nft"]
            self.run(tx.text())
            return
        kwargs = {} if self.chunk_ops is None else {"chunk_ops": self.chunk_ops}
        steps = split(tx, **kwargs)
        self.last_steps = [f"{s.kind}:{s.label}:{len(s.ops)}" for s in steps]
        for number, step in enumerate(steps, 1):
            where = f"step {number}/{len(steps)} ({step.label})"
            if step.kind == "nft":
                script = step.script(tx)
                try:
                    self.run(script)
                except NftError as err:
                    err.args = (f"{where}: {err}",)
                    raise
                continue
            if self._netlink is None:
                self._netlink = NftNetlink(self.netns, family=tx.family)
            messages = netlink_ops(tx, step.ops)
            try:
                self._netlink.run([m for m, _ in messages])
                self.commits += bool(messages)
            except (NetlinkError, OSError) as err:
                # One line per message: the error names the message the kernel refused.
                index = getattr(err, "index", None)
                raise NftError(
                    f"{where}: {err}",
                    input_data="".join(text() + "\n" for _, text in messages),
                    netlink_line=index,
                ) from err

    def delete_chains(self, family: str, table: str, chains: list[str]) -> None:
        """Delete chains, rules included, in one atomic netlink batch: no nft process and no
        object cache (nft would dump the whole table first: ~0.9 s at 10,000 services).
        Fails as a whole (NftError) if one of them does not exist or is still referenced."""
        if self._netlink is None:
            self._netlink = NftNetlink(self.netns, family=family)
        ops = [delete_chain(table, c) for c in chains]
        try:
            self._netlink.run(ops)
            self.commits += bool(ops)
        except (NetlinkError, OSError) as err:
            raise NftError(f"deleting chains {', '.join(chains)}: {err}") from err

    def generation(self) -> int | None:
        """The namespace's nf_tables ruleset generation (see NftNetlink.generation), or
        None when it cannot be read (or this backend's runner stands for the tools)."""
        if self._runner is not run_command:
            return None
        try:
            if self._netlink is None:
                self._netlink = NftNetlink(self.netns)
            return self._netlink.generation()
        except (NetlinkError, OSError) as err:
            log.debug("cannot read the nf_tables generation: %s", err)
            return None

    def close(self) -> None:
        if self._netlink is not None:
            self._netlink.close()
            self._netlink = None

    def check(self, data: str) -> None:
        """Validate a transaction in the kernel without committing it (`nft --check -f -`)."""
        argv, proc = self._run(["--check", "-f", "-"], data)
        if proc.returncode != 0:
            raise NftError(
                "nft --check rejected the transaction",
                command=argv,
                returncode=proc.returncode,
                stderr=proc.stderr,
                input_data=data,
            )

    # -- listings ---------------------------------------------------------------------

    def list_json(self, *what: str) -> list[dict[str, Any]]:
        """`nft -j list WHAT...` as the list of objects (metainfo dropped)."""
        argv, proc = self._run(["-j", "list", *what])
        if proc.returncode != 0:
            raise NftError(
                f"nft list {' '.join(what)} failed",
                command=argv,
                returncode=proc.returncode,
                stderr=proc.stderr,
            )
        try:
            data = json.loads(proc.stdout or "{}")
        except json.JSONDecodeError as err:
            raise NftError(f"nft list {' '.join(what)}: unreadable JSON ({err})") from err
        items = data.get("nftables", []) if isinstance(data, dict) else []
        meta = items[0].get("metainfo") if items and isinstance(items[0], dict) else None
        if meta is not None and meta.get("json_schema_version", 1) != 1:
            raise NftError(f"nft JSON schema version {meta.get('json_schema_version')} unknown")
        return [i for i in items if isinstance(i, dict) and "metainfo" not in i]

    def tables(self) -> list[TableRef]:
        try:
            if self._netlink is None:
                self._netlink = NftNetlink(self.netns)
            found = self._netlink.list_tables()
            if all(f in NFPROTO_NAMES for f, _ in found):
                return [TableRef(NFPROTO_NAMES[f], name) for f, name in found]
        except (NetlinkError, OSError) as err:
            log.debug("netlink table listing failed (%s); asking nft", err)
        return [
            TableRef(t["table"]["family"], t["table"]["name"])
            for t in self.list_json("tables")
            if "table" in t
        ]

    def table_exists(self, family: str, name: str) -> bool:
        try:
            if self._netlink is None:
                self._netlink = NftNetlink(self.netns, family=family)
            if self._netlink.family == FAMILIES[family]:
                return self._netlink.table_exists(name)
        except (NetlinkError, OSError, KeyError) as err:
            log.debug("netlink table lookup failed (%s); asking nft", err)
        return TableRef(family, name) in self.tables()

    def _family_netlink(self, family: str) -> NftNetlink | None:
        """The netlink client, when it speaks `family` and this backend runs the real
        tools (else callers ask nft)."""
        if self._runner is not run_command:
            return None
        if self._netlink is None:
            self._netlink = NftNetlink(self.netns, family=family)
        return self._netlink if self._netlink.family == FAMILIES.get(family) else None

    def chains_with_rules(self, family: str, table: str) -> set[str] | None:
        """The chains of a table that hold a rule, or None when that cannot be read (or
        this backend's runner stands for the tools)."""
        if self._runner is not run_command:
            return None
        try:
            if self._netlink is None:
                self._netlink = NftNetlink(self.netns, family=family)
            if self._netlink.family != FAMILIES[family]:
                return None
            return self._netlink.chains_with_rules(table)
        except (NetlinkError, OSError, KeyError) as err:
            log.debug("cannot dump the rules of %s %s: %s", family, table, err)
            return None

    def chains(self, family: str, table: str) -> list[str]:
        """Names of the chains of one table: one netlink dump (nft 1.0.6 `list chains`
        first fetches every set element of the family), `nft -j list chains` if that fails."""
        try:
            client = self._family_netlink(family)
            if client is not None:
                return client.chains_by_table().get(table, [])
        except (NetlinkError, OSError) as err:
            log.debug("netlink chain listing failed (%s); asking nft", err)
        return [
            c["chain"]["name"]
            for c in self.list_json("chains", family)
            if "chain" in c and c["chain"].get("table") == table
        ]

    def sets(self, family: str, table: str) -> list[str]:
        """Names of the named sets of one table (definitions only, no elements): one
        netlink dump, `nft -j list sets` if that fails."""
        try:
            client = self._family_netlink(family)
            if client is not None:
                return client.sets_by_table().get(table, [])
        except (NetlinkError, OSError) as err:
            log.debug("netlink set listing failed (%s); asking nft", err)
        return [
            s["set"]["name"]
            for s in self.list_json("sets", family)
            if "set" in s and s["set"].get("table") == table
        ]

    def elements(
        self, kind: str, family: str, table: str, name: str
    ) -> list[tuple[str, str, str | None]]:
        """(key, value, comment) of every element of a set or map, in nft's text form
        ("172.30.0.41 . tcp . 80", "goto service-...", "10.1.0.1 . 8080"); value "" for
        sets. The containers kproxy writes are read over netlink (one dump; `nft -j list`
        of 200,000 elements takes seconds), others with nft."""
        if name in ALL_SERVICE_CONTAINERS:
            try:
                client = self._family_netlink(family)
                if client is not None:
                    return client.elements(table, name, *netlink_types(name))
            except NetlinkError as err:
                if err.errno == errno.ENOENT:
                    raise NftError(
                        f"listing {kind} {family} {table} {name}: {err}",
                        stderr=os.strerror(errno.ENOENT),
                    ) from err
                log.debug("netlink element listing failed (%s); asking nft", err)
            except (OSError, ValueError, KeyError) as err:
                log.debug("netlink element listing failed (%s); asking nft", err)
        return self.nft_elements(kind, family, table, name)

    def nft_elements(
        self, kind: str, family: str, table: str, name: str
    ) -> list[tuple[str, str, str | None]]:
        """elements() as `nft -j list` shows them."""
        items = self.list_json(kind, family, table, name)
        out: list[tuple[str, str, str | None]] = []
        for item in items:
            body = item.get(kind)
            if not body:
                continue
            for elem in body.get("elem", []):
                key, value = (elem[0], elem[1]) if isinstance(elem, list) else (elem, None)
                comment = None
                if isinstance(key, dict) and "elem" in key:
                    comment = key["elem"].get("comment")
                out.append(
                    (element_key(key), "" if value is None else verdict_text(value), comment)
                )
        return out

    def delete_table(self, family: str, name: str) -> bool:
        """Delete a table; False when it did not exist."""
        try:
            self.run(f"delete table {family} {name}\n")
        except NftError as err:
            if err.not_found:
                return False
            raise
        return True


def element_key(value: Any) -> str:
    """An element key from nft JSON back to the text form kproxy writes."""
    if isinstance(value, dict):
        if "elem" in value:
            return element_key(value["elem"].get("val"))
        if "concat" in value:
            return " . ".join(element_key(v) for v in value["concat"])
        if "prefix" in value:
            p = value["prefix"]
            return f"{element_key(p['addr'])}/{p['len']}"
    return str(value)


def verdict_text(value: Any) -> str:
    """{"goto": {"target": "x"}} -> "goto x"; {"drop": null} -> "drop"; a map's data as
    element_key writes it ({"concat": ["10.1.0.1", 8080]} -> "10.1.0.1 . 8080")."""
    if isinstance(value, dict) and "concat" in value:
        return element_key(value)
    if isinstance(value, dict) and len(value) == 1:
        verb, arg = next(iter(value.items()))
        if isinstance(arg, dict) and "target" in arg:
            return f"{verb} {arg['target']}"
        return str(verb)
    return str(value)
