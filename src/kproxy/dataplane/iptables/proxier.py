"""iptables mode: apply IptablesPlans through iptables-restore, full or partial.

Apply strategy (why it looks like this):
* Always `--noflush`: chains we declare are flushed and rewritten atomically, everything
  else (other software's rules, our jumps) stays. No moment without rules, ever.
* Partial syncs write only the chains of services whose ServicePort changed, and omit a
  whole table section when its top-level chains would be rewritten with identical rules.
* On the nft backend a large full sync is loaded in bounded pieces: service chains first
  (unreferenced until KUBE-SERVICES points at them), then the top-level chains in one
  piece, then stale chains. iptables-nft-restore is superlinear in input size, so this
  turns minutes into seconds; the order keeps every intermediate state consistent.
* Stale chains are found from what we last programmed, read from the kernel once at
  start (adoption) and on every full sync, instead of an iptables-save per sync.
* A legacy resync (a full sync of a daemon that knows what it programmed) reads the tables
  while its restore runs instead of before it, and repairs any drift the read shows (a
  missing jump, a chain someone else left) in one more restore. The read cannot change what
  the restore writes (every chain is declared and rewritten), and at 10,000 services it is
  1.7 s that the rules no longer wait for.
* An nft resync skips the rewrite when nothing but kproxy changed the kernel since its last
  full sync: the namespace's nf_tables generation grows by one per committed batch, anyone's,
  so when every step since that sync's read was one of our own restores (each moving the
  generation by exactly its own commits) the kernel holds what we last wrote, and the resync
  only writes what changed (like a partial sync). Any other commit in the namespace, a
  failure or a gap breaks that chain of custody and the next full sync rewrites everything.
  Upstream rewrites everything hourly regardless; at 5,000 services on the nft backend that
  is 7 s of table re-validation repeated for nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kproxy.dataplane.base import Dataplane, OwnedObject, SyncError, SyncResult
from kproxy.dataplane.custody import Custody
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables import names
from kproxy.dataplane.iptables.backend import (
    IptablesBackend,
    IptablesError,
    RestoreError,
    TableOutline,
    rule_chain,
)
from kproxy.dataplane.iptables.render import (
    JUMPS,
    KUBELET_FIREWALL_JUMPS,
    NAT_TOP_CHAINS,
    IptablesPlan,
    IptablesRenderer,
    jump_rule,
)
from kproxy.model.objects import ServicePort, ServicePortName, Snapshot

log = logging.getLogger("kproxy.iptables")

# Services per piece when a large full sync is split (nft backend only). iptables-nft-restore
# is superlinear in the size of each piece: 5,000 services load in 4.4 s at 50, 7.9 s at 250.
PIECE_SERVICES = 50
# Over a table that already serves (a resync), every piece's commit also re-validates every
# chain reachable from the built-in chains, a cost that grows with the table: the best piece
# size grows with its square root. 5,000 services: 32.4 s at 50 per piece, 20.1 s at 150,
# 22.5 s at 300, 32.6 s at 600 (bench namespace, 2026-12-01); sqrt(4.5 * 5000) = 150.
ATTACHED_PIECE_FACTOR = 4.5
# nat chains whose rules do not depend on services (written whole in a fresh node's piece 0).
FIXED_NAT_CHAINS = ("KUBE-POSTROUTING", "KUBE-MARK-MASQ")
CANARY_CHAIN = "KUBE-PROXY-CANARY"
SPLIT_THRESHOLD = 500


@dataclass
class AppliedState:
    services: dict[ServicePortName, ServicePort]
    chains: set[str]
    filter_rules: list[str]
    nat_top_rules: list[str]


class IptablesDataplane(Dataplane):
    mode = "iptables"

    def __init__(
        self,
        backend: IptablesBackend,
        facts: NodeFacts,
        options: RuleOptions,
        *,
        state_dir: Path | None = None,
        piece_services: int = PIECE_SERVICES,
    ) -> None:
        self.backend = backend
        self.facts = facts
        self.options = options
        self.renderer = IptablesRenderer(facts, options)
        self.state_dir = state_dir
        self.piece_services = piece_services
        self._applied: AppliedState | None = None
        # Whether the kernel provably holds what _applied describes (module docstring).
        self._custody = Custody(backend.generation)

    # --- sync --------------------------------------------------------------------------------

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
        applied = self._applied
        if applied is None:
            full = True
        # A full sync over a kernel that provably holds what we last wrote writes only what
        # changed; it still counts as the full sync it stands for.
        proven = full and applied is not None and self._custody.holds()
        write_all = full and not proven
        missing_top: list[str] = []
        outlines: dict[str, TableOutline] = {}
        reading: Future[dict[str, TableOutline]] | None = None
        if not write_all:  # a partial sync, or a full one over a provably unchanged kernel
            assert applied is not None
            existing = applied.chains
            rewrite = {
                n
                for n, sp in snapshot.services.items()
                if applied.services.get(n) is not sp and applied.services.get(n) != sp
            }
        elif applied is not None and self.backend.flavour == "legacy":
            # Checked after the restore (module docstring): our own record says which
            # chains exist, and the jumps were in place after the last sync.
            reading = _in_background(self.backend.outlines, ("nat", "filter"))
            existing = applied.chains
            rewrite = None
        else:
            self._custody.begin()  # the state the read below sees
            # One save serves both the stale-chain search and the jump check (-C per jump
            # would reload the whole table each time: 0.7 s per jump at 10,000 services).
            outlines = self.backend.outlines(("nat", "filter"))
            nat_chains = outlines["nat"].chains
            existing = {c for c in nat_chains if names.is_service_chain(c)}
            missing_top = [c for c in NAT_TOP_CHAINS if c not in nat_chains]
            rewrite = None
        # Not kept after the sync: a full sync's plan holds every chain's text (33 MB at
        # 10,000 services).
        plan = self.renderer.plan(snapshot, rewrite=rewrite, existing_chains=existing)
        include_filter = write_all or applied is None or plan.filter_rules != applied.filter_rules
        include_nat_top = (
            write_all or applied is None or plan.nat_top_rules != applied.nat_top_rules
        )
        jumps = self._missing_jumps(outlines) if write_all and reading is None else []
        if write_all:
            # The canary: an empty chain whose disappearance means someone flushed the table
            # under us (a firewall reload); upstream creates the same chain for the same reason.
            jumps.append(("nat", f":{CANARY_CHAIN} - [0:0]"))
        # The chains a resync rewrites are reachable: their commits pay for validation.
        nat_now = outlines.get("nat", TableOutline())
        attached = write_all and bool(existing) and "KUBE-SERVICES" in nat_now.chains
        pieces = self._pieces(
            plan,
            include_filter,
            include_nat_top,
            jumps,
            split=write_all,
            missing_top=missing_top,
            attached=attached,
        )
        for i, data in enumerate(pieces):
            self._restore(data, f"piece {i + 1}/{len(pieces)}")
        stale_repaired, verified = 0, True
        if reading is not None:
            repair, stale_repaired, verified = self._drift_repair(plan, reading)
            if repair:
                self._restore(repair, "drift repair")
                pieces.append(repair)
        # Unverified: the next sync is a full one that reads the tables first.
        self._applied = None
        if not verified:
            self._custody.end()
        else:
            self._applied = AppliedState(
                services=dict(snapshot.services),
                chains=plan.active_chains,  # not copied: nothing changes a plan after its sync
                filter_rules=plan.filter_rules,
                nat_top_rules=plan.nat_top_rules,
            )
        return SyncResult(
            full=full,
            services=len(snapshot.services),
            rewritten=len(plan.rewritten),
            stale_removed=len(plan.stale_chains) + stale_repaired,
            rules_written=plan.rules_written(
                include_filter=include_filter, include_nat_top=include_nat_top
            ),
            rules_total=dict(plan.rules_total),
            pieces=len(pieces),
            kernel_unchanged=proven,
        )

    def distrust_kernel(self) -> None:
        """Make the next full sync read and rewrite everything (an operator asked for it)."""
        self._custody.end()

    def proven_dumps(self) -> dict[str, str]:
        """nat KUBE-SERVICES as the last sync wrote it (every service's rules, declared
        with the chain), in save form, while custody holds: the rules the readers find
        service destinations in, without a save of the nat table (seconds at 10,000
        services)."""
        applied = self._applied
        if applied is None or not self._custody.holds():
            return {}
        rules = [r for r in applied.nat_top_rules if r.startswith("-A KUBE-SERVICES ")]
        text = "\n".join(["*nat", ":KUBE-SERVICES - [0:0]", *rules, "COMMIT"]) + "\n"
        return {f"iptables-{self.backend.flavour}": text}

    def _restore(self, data: str, which: str) -> None:
        try:
            # iptables-nft-restore commits once per table section.
            with self._custody.own_commits(lambda: data.count("\nCOMMIT\n")):
                self.backend.restore(data)
        except RestoreError as err:
            self._keep_failed(data, err)
            # Chains written by earlier pieces are consistent on their own, but what we
            # believe is applied is no longer exact: force the next sync to be full.
            self._applied = None
            raise SyncError(f"iptables restore failed ({which}): {err}", kept_input=data) from err
        except IptablesError as err:
            self._applied = None
            raise SyncError(f"iptables restore failed: {err}") from err

    def _drift_repair(
        self, plan: IptablesPlan, reading: Future[dict[str, TableOutline]]
    ) -> tuple[str, int, bool]:
        """After a resync whose tables were read while it ran: the restore input that adds
        the jumps someone removed and deletes service chains nothing of ours references
        ("" when the kernel holds what we believe), how many such chains, and whether the
        tables could be read at all."""
        try:
            outlines = reading.result()
        except IptablesError as err:
            log.warning("could not read the tables to check this resync: %s", err)
            return "", 0, False
        gone = set(plan.stale_chains)
        stale = sorted(
            c
            for c in outlines["nat"].chains
            if names.is_service_chain(c) and c not in plan.active_chains and c not in gone
        )
        jumps = self._missing_jumps(outlines)
        if not stale and not jumps:
            return "", 0, True
        log.warning(
            "the tables drifted from what kproxy programmed: %d jump(s) missing, %d stale "
            "chain(s); repairing",
            len(jumps),
            len(stale),
        )
        lines: list[str] = []
        for table in ("filter", "nat"):
            adds = [j for t, j in jumps if t == table]
            drop = stale if table == "nat" else []
            if adds or drop:
                lines += [f"*{table}", *(f":{c} - [0:0]" for c in drop)]
                lines += [*(f"-X {c}" for c in drop), *adds, "COMMIT"]
        return "\n".join(lines) + "\n", len(stale), True

    def _pieces(
        self,
        plan: IptablesPlan,
        include_filter: bool,
        include_nat_top: bool,
        jumps: list[tuple[str, str]],
        *,
        split: bool,
        missing_top: Sequence[str] = (),
        attached: bool = False,
    ) -> list[str]:
        jump_lines = {
            "filter": [j for t, j in jumps if t == "filter"],
            "nat": [j for t, j in jumps if t == "nat"],
        }
        if jump_lines["filter"]:
            include_filter = True
        if jump_lines["nat"]:
            include_nat_top = True
        big = split and self.backend.flavour == "nft" and len(plan.blocks) > SPLIT_THRESHOLD
        if not big:
            text = plan.text(
                include_filter=include_filter, include_nat_top=include_nat_top, jumps=jump_lines
            )
            return [text] if text else []
        pieces: list[str] = []
        if missing_top:
            # A fresh node: service chains jump to KUBE-MARK-MASQ, so the top-level nat
            # chains must exist before the first piece. Nothing jumps to them yet, so
            # creating them (with their fixed rules) changes no traffic.
            first = ["*nat", *(f":{c} - [0:0]" for c in missing_top)]
            first += [
                r
                for r in plan.nat_top_rules
                if r.split(" ", 2)[1] in missing_top and r.split(" ", 2)[1] in FIXED_NAT_CHAINS
            ]
            pieces.append("\n".join([*first, "COMMIT"]) + "\n")
        step = self.piece_services
        if attached:
            step = max(step, round(math.sqrt(ATTACHED_PIECE_FACTOR * len(plan.blocks))))
        for i in range(0, len(plan.blocks), step):
            pieces.append(
                "\n".join(plan.nat_section(plan.blocks[i : i + step], include_top=False)) + "\n"
            )
        top: list[str] = []
        if include_filter:
            top += plan.filter_section(jump_lines["filter"])
        if include_nat_top:
            top += plan.nat_section((), include_top=True, jumps=jump_lines["nat"])
        if top:
            pieces.append("\n".join(top) + "\n")
        stale = plan.stale_chains
        for i in range(0, len(stale), step * 10):
            pieces.append(
                "\n".join(plan.nat_section((), include_top=False, stale=stale[i : i + step * 10]))
                + "\n"
            )
        return pieces

    @property
    def iptables_flavour(self) -> str:
        return self.backend.flavour

    def drifted(self) -> bool:
        """True when the kernel lost our state behind our back (the canary chain is gone)."""
        if self._applied is None or self._custody.holds():
            return False
        try:
            present = self.backend.chain_exists("nat", CANARY_CHAIN)
        except IptablesError as err:
            log.warning("cannot check the canary chain: %s", err)
            return False
        if not present:
            log.warning(
                "canary chain %s is gone: rules were flushed by someone else; full resync",
                CANARY_CHAIN,
            )
            # Nothing we believe about the kernel holds: the resync reads it first.
            self._applied = None
        return not present

    def _jumps(self) -> list[tuple[str, str, str]]:
        """(table, position verb, rule) of every jump from a built-in chain into ours."""
        wanted = [
            (t, "-I", jump_rule(c, extra, comment, target))
            for t, c, extra, comment, target in JUMPS
        ]
        if self.renderer.localhost_nodeports:
            # kubelet's chain: never removed by detach (kubelet owns it and expects the jumps).
            wanted += [(t, "-A", f"{c} -j {target}") for t, c, target in KUBELET_FIREWALL_JUMPS]
        return wanted

    def _present(
        self, table: str, rule: str, outlines: dict[str, TableOutline] | None = None
    ) -> bool:
        try:
            return self.backend.rule_present(table, rule, (outlines or {}).get(table))
        except IptablesError as err:
            log.warning("could not check jump %r: %s", rule, err)
            return False

    def _missing_jumps(self, outlines: dict[str, TableOutline]) -> list[tuple[str, str]]:
        """Jump rules from built-in chains that are not in place, as restore lines."""
        return [
            (t, f"{verb} {rule}")
            for t, verb, rule in self._jumps()
            if not self._present(t, rule, outlines)
        ]

    def detach(self) -> None:
        """Take this mode out of the packet path in one restore: delete the jumps from the
        built-in chains (nat first, so DNAT moves as one step). Our chains stay until
        cleanup; established connections keep their conntrack translation."""
        lines: dict[str, list[str]] = {"nat": [], "filter": []}
        jumps = self._jumps()
        try:
            # Only the built-in chains the jumps sit in (nft: 0.3 s instead of a 14 s save
            # of both tables at 10,000 services).
            outlines = self.backend.builtin_outlines(
                {t: [rule_chain(f"-A {r}") for tt, _, r in jumps if tt == t] for t in lines}
            )
        except IptablesError as err:
            raise SyncError(f"could not detach iptables mode: {err}") from err
        for table, verb, rule in jumps:
            if verb == "-I" and self._present(table, rule, outlines):
                lines[table].append(f"-D {rule}")
        text = "".join(f"*{t}\n" + "\n".join(ls) + "\nCOMMIT\n" for t, ls in lines.items() if ls)
        if text:
            try:
                self.backend.restore(text)
            except IptablesError as err:
                raise SyncError(f"could not detach iptables mode: {err}") from err
        self._applied = None  # a later sync must re-attach (full)
        self._custody.end()

    def _keep_failed(self, data: str, err: RestoreError) -> None:
        log.error("%s", err)
        ctx = err.context()
        if ctx:
            log.error("rejected input around the failing line:\n%s", ctx)
        if self.state_dir is None:
            return
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            path = self.state_dir / "iptables-failed-restore.txt"
            path.write_text(data)
            (self.state_dir / "iptables-failed-restore.error").write_text(
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {err}\n"
            )
            log.error("the rejected restore input is kept in %s", path)
        except OSError as oserr:
            log.warning("could not keep the failed restore input: %s", oserr)

    # --- ownership and cleanup ---------------------------------------------------------------

    def owned(self) -> list[OwnedObject]:
        """iptables mode's chains in this backend (not other modes' chains, which may be
        serving right now: a switch to userspace mode shares the backend)."""
        from kproxy.dataplane.iptables.cleanup import iptables_mode_chain, owned_state

        return owned_state(self.backend, keep=lambda _t, chain: not iptables_mode_chain(chain))

    def cleanup(self, *, dry_run: bool = False) -> list[OwnedObject]:
        from kproxy.dataplane.iptables.cleanup import cleanup, iptables_mode_chain

        return cleanup(
            self.backend, dry_run=dry_run, keep=lambda _t, chain: not iptables_mode_chain(chain)
        )


def _in_background(
    read: Callable[[Sequence[str]], dict[str, TableOutline]], tables: Sequence[str]
) -> Future[dict[str, TableOutline]]:
    """Run `read(tables)` in a thread; the save it runs is a process of its own, so it takes
    the other core while this one renders and restores."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iptables-read")
    try:
        return pool.submit(read, tables)
    finally:
        pool.shutdown(wait=False)
