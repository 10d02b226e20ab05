"""nftables mode: apply NftablesPlans to `table ip kube-proxy` with `nft -f` transactions
(or, in the compact layout, to `table ip kproxy-compact`: layouts.py; the apply is the same).

Apply strategy (upstream's syncProxyRules, with kproxy's mirror instead of re-listing):

* Every sync first deletes, in a transaction of its own, chains that went stale at least
  STALE_CHAIN_DELAY ago (kernels before 6.2 notice a dropped vmap reference to a chain only
  a little later, so a stale chain is flushed at once and deleted on a later sync).
* A full sync (the first one, after any failure, and whenever the caller asks) rewrites the
  table setup and every service's chains, and diffs map/set elements against what the
  kernel holds (read back with `nft -j list`; a map that cannot be read is flushed and
  refilled). The first full sync of a process also adds and deletes every base chain, so a
  changed hook or priority can be applied, and keeps existing endpoint chains whose
  affinity state is unchanged (their name fixes their rules) instead of rewriting them.
* A partial sync writes only what changed: the chains of service ports whose ServicePort
  value changed (add + flush + rules) and the element adds/deletes of those ports, diffed
  against kproxy's mirror of the table (a changed value is delete + add). The kernel is not
  listed on partial syncs; the mirror is rebuilt from the kernel on every full sync.
* A rejected transaction changes nothing in the kernel (nft transactions are atomic): the
  error names the line, the input is kept in state_dir, and the next sync is full.
* A full sync writes only what changed (as a partial sync) while the kernel provably holds
  the mirror: the namespace's nf_tables generation grows by one per committed batch,
  anyone's, so when it moved by exactly our own commits since the last full sync's read,
  nothing else touched the ruleset (the iptables mode's docstring has the reasoning). At
  10,000 services that is the difference between ~30 s of hourly rewrite and nothing.

How a transaction reaches the kernel is the backend's business (backend.NftBackend): by
default in "fast" steps (steps.py) that write the same objects without making nft 1.0.6
dump the whole table first, which is what made a one-service change cost ~0.9 s at 10,000
services; fast=False pipes upstream's text form to one `nft -f -`. With fast steps a sync
is a short sequence of atomic transactions, each leaving a consistent table; if one fails
the next sync is full.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from kproxy.dataplane.base import (
    Dataplane,
    DataplaneUnavailable,
    OwnedObject,
    SyncError,
    SyncResult,
)
from kproxy.dataplane.custody import Custody
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables import names as n
from kproxy.dataplane.nftables.backend import NftBackend, NftError, TableRef
from kproxy.dataplane.nftables.layouts import DEFAULT_LAYOUT, make_planner
from kproxy.dataplane.nftables.plan import (
    CONTAINERS,
    FAMILY,
    Element,
    NftablesPlan,
)
from kproxy.dataplane.nftables.transaction import (
    SyncWrite,
    TableState,
    Transaction,
    stale_chain_deletions,
    write_sync,
)
from kproxy.host.commands import Runner, in_netns, run_command
from kproxy.model.objects import Snapshot

log = logging.getLogger("kproxy.nftables")

MIN_NFT_VERSION = (1, 0, 1)
MIN_KERNEL_VERSION = (5, 13)
SKIP_KERNEL_CHECK_ENV = "KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK"
FAILED_TRANSACTION = "nftables-failed-transaction.nft"
FAILED_ERROR = "nftables-failed-transaction.error"
FAILED_FULL_TRANSACTION = "nftables-failed-transaction.full.nft"


class Backend(Protocol):
    netns: str | None

    def run(self, data: str) -> None: ...
    def apply(self, tx: Transaction) -> None: ...
    def tables(self) -> list[TableRef]: ...
    def table_exists(self, family: str, name: str) -> bool: ...
    def chains(self, family: str, table: str) -> list[str]: ...
    def chains_with_rules(self, family: str, table: str) -> set[str] | None: ...
    def sets(self, family: str, table: str) -> list[str]: ...
    def elements(
        self, kind: str, family: str, table: str, name: str
    ) -> list[tuple[str, str, str | None]]: ...
    def delete_table(self, family: str, name: str) -> bool: ...
    def delete_chains(self, family: str, table: str, chains: list[str]) -> None: ...


def _kernel_version(release: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_nftables(
    netns: str | None = None,
    *,
    runner: Runner | None = None,
    kernel_release: str | None = None,
    environ: dict[str, str] | None = None,
) -> None:
    """Upstream's preconditions for nftables mode; DataplaneUnavailable says what to fix."""
    run = runner or run_command
    env = os.environ if environ is None else environ
    if runner is None and shutil.which("nft") is None:
        raise DataplaneUnavailable(
            "nftables mode needs the nft command (nftables >= 1.0.1), which is not installed: "
            "install the 'nftables' package (Debian/Ubuntu: apt-get install nftables)"
        )
    backend = NftBackend(netns=netns, runner=run)
    version = backend.version()
    if version is None:
        raise DataplaneUnavailable(
            "nftables mode needs the nft command (nftables >= 1.0.1), and `nft --version` "
            "failed: install or repair the 'nftables' package"
        )
    if version < MIN_NFT_VERSION:
        have = ".".join(map(str, version))
        raise DataplaneUnavailable(
            f"nftables mode needs nft >= 1.0.1 (older versions parse the whole ruleset and can "
            f"be locked out by other programs' rules); this node has nft {have}: upgrade the "
            "'nftables' package"
        )
    if not env.get(SKIP_KERNEL_CHECK_ENV):
        release = kernel_release if kernel_release is not None else platform.release()
        kernel = _kernel_version(release)
        if kernel is None:
            raise DataplaneUnavailable(
                f"could not read the kernel version ({release!r}); set "
                f"{SKIP_KERNEL_CHECK_ENV}=1 to skip the check"
            )
        if kernel < MIN_KERNEL_VERSION:
            raise DataplaneUnavailable(
                f"nftables mode needs Linux kernel 5.13 or later (kernel {release} is too old): "
                f"upgrade the kernel, use another proxy mode, or set {SKIP_KERNEL_CHECK_ENV}=1 "
                "to skip this check (as upstream allows)"
            )
    proc = run(in_netns(["nft", "--check", "add", "table", "ip", "kproxy-probe"], netns), None)
    if proc.returncode != 0:
        raise DataplaneUnavailable(
            "the kernel refused an nftables test transaction (`nft --check add table ip "
            f"kproxy-probe`: {proc.stderr.strip()}): load nf_tables (modprobe nf_tables) or use "
            "another proxy mode"
        )


class NftablesDataplane(Dataplane):
    mode = "nftables"

    def __init__(
        self,
        facts: NodeFacts,
        options: RuleOptions,
        *,
        netns: str | None = None,
        state_dir: Path | None = None,
        backend: Backend | None = None,
        fast: bool = True,
        service_cidrs: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        keep_last_write: bool = False,
        layout: str = DEFAULT_LAYOUT,
    ) -> None:
        """keep_last_write: keep each sync's whole transaction in last_write (tests and
        benchmarks read it); the daemon does not: at 10,000 services a full sync's is ~130 MB
        that would live until the next sync (through a switch's after-record, say).
        layout: "upstream" or "compact" (layouts.py)."""
        self.facts = facts
        self.options = options
        self.netns = netns
        self.backend: Backend = backend or NftBackend(netns=netns, fast=fast)
        self.planner = make_planner(layout, facts, options, service_cidrs=service_cidrs)
        self.layout = layout
        self.table = self.planner.setup.table
        self.state_dir = state_dir
        self.clock = clock
        self._state: TableState | None = None  # None: unknown, the next sync is full
        # Whether the kernel provably holds _state (module docstring); only consulted while
        # _state is known. A test's backend may have no generation to read.
        self._custody = Custody(getattr(self.backend, "generation", lambda: None))
        self._base_chains_recreated = False  # upstream's "flushed"
        self._synced_once = False
        self.last_plan: NftablesPlan | None = None
        self.keep_last_write = keep_last_write
        self.last_write: SyncWrite | None = None
        self.last_stale_deletion: list[str] = []
        # Seconds per phase of the last sync (stale_delete, plan, read, write, apply).
        self.last_timings: dict[str, float] = {}
        # For upstream's kubeproxy_sync_proxy_rules_nftables_{sync,cleanup}_failures_total.
        self.sync_failures = 0
        self.cleanup_failures = 0

    @classmethod
    def check(cls, netns: str | None = None, *, runner: Runner | None = None) -> None:
        """Raise DataplaneUnavailable unless nftables mode can run here (nft >= 1.0.1,
        kernel >= 5.13 unless KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK is set, and a
        kernel that accepts an nftables transaction)."""
        check_nftables(netns, runner=runner)

    # --- sync --------------------------------------------------------------------------

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
        now = self.clock()
        timings: dict[str, float] = {}
        self.last_timings = timings
        started = time.perf_counter()
        if self._state is None:
            full = True
        stale_removed = self._delete_stale_chains(now)
        cleanup_failed = stale_removed is None
        if stale_removed is None:
            full = True  # what is stale and what exists is no longer known exactly
            stale_removed = 0
        proven = full and self._state is not None and self._custody.holds()
        write_all = full and not proven
        timings["stale_delete"] = time.perf_counter() - started
        mark = time.perf_counter()
        plan = self.planner.plan(snapshot)
        self.last_plan = plan
        timings["plan"] = time.perf_counter() - mark
        mark = time.perf_counter()
        skip: set[str] | None = None
        flush: list[str] = []
        if write_all:
            self._custody.begin()  # the state the read below sees
            state, flush = self._read_kernel(plan)
            timings["read"] = time.perf_counter() - mark
            mark = time.perf_counter()
            if not self._synced_once:
                skip = self._reusable_endpoint_chains(plan, state)
        else:
            assert self._state is not None
            state = self._state
        write = write_sync(
            plan,
            state,
            full=write_all,
            recreate_base_chains=not self._base_chains_recreated,
            skip_endpoint_chains=skip,
            flush_containers=flush,
            now=now,
        )
        self.last_write = write if self.keep_last_write else None
        timings["write"] = time.perf_counter() - mark
        mark = time.perf_counter()
        try:
            self._apply(write.tx)
        except NftError as err:
            self._state = None
            self.sync_failures += 1
            kept = self._keep_failed(write.tx, err)
            raise SyncError(f"nftables sync failed: {err}", kept_input=kept) from err
        timings["apply"] = time.perf_counter() - mark
        self._state = write.commit(state)
        self._base_chains_recreated = True
        self._synced_once = True
        total = plan.rules_total
        return SyncResult(
            full=full,
            services=len(plan.blocks),
            rewritten=len(write.rewritten),
            stale_removed=stale_removed,
            rules_written={"nftables": write.rules_written},
            rules_total={"nftables": total},
            pieces=1,
            kernel_unchanged=proven,
            cleanup_failures=int(cleanup_failed),
        )

    def distrust_kernel(self) -> None:
        """Make the next full sync read and rewrite everything (an operator asked for it)."""
        self._custody.end()

    def _apply(self, tx: Transaction) -> None:
        """backend.apply, keeping custody when the generation moved by our commits only."""
        start = getattr(self.backend, "commits", None)
        if start is None:  # a backend that does not count its commits proves nothing
            self._custody.end()
            self.backend.apply(tx)
            return
        with self._custody.own_commits(lambda: self.backend.commits - start):  # type: ignore[attr-defined]
            self.backend.apply(tx)

    def _delete_stale_chains(self, now: float) -> int | None:
        """Delete chains stale for long enough; None when that transaction failed."""
        self.last_stale_deletion = []
        state = self._state
        if state is None or not state.stale:
            return 0
        tx, due = stale_chain_deletions(state, now, self.table)
        if not due:
            return 0
        try:
            self._apply(tx)
        except NftError as err:
            log.error("could not delete %d stale chains (next sync is full): %s", len(due), err)
            self.cleanup_failures += 1
            self._state = None
            return None
        for chain in due:
            state.stale.pop(chain, None)
            state.chains.discard(chain)
        self.last_stale_deletion = due
        log.info("deleted %d stale nftables chains", len(due))
        return len(due)

    def _read_kernel(self, plan: NftablesPlan) -> tuple[TableState, list[str]]:
        """The table as the kernel holds it (for a full sync), and the containers that could
        not be read (to be flushed). Stale-chain times are kept from the mirror."""
        old = self._state
        state = TableState()
        flush: list[str] = []
        try:
            exists = self.backend.table_exists(FAMILY, self.table)
        except NftError as err:
            log.warning("cannot list nftables tables: %s", err)
            exists = True
        if not exists:
            return state, flush
        try:
            state.chains = {
                c for c in self.backend.chains(FAMILY, self.table) if n.is_service_chain(c)
            }
        except NftError as err:
            log.warning("cannot list the chains of %s %s: %s", FAMILY, self.table, err)
        try:
            state.affinity_sets = {
                s for s in self.backend.sets(FAMILY, self.table) if n.is_affinity_set(s)
            }
        except NftError as err:
            log.warning("cannot list the sets of %s %s: %s", FAMILY, self.table, err)
        for container in self.planner.setup.service_containers:
            kind = CONTAINERS[container][0]
            try:
                listed = self.backend.elements(kind, FAMILY, self.table, container)
            except NftError as err:
                if not err.not_found:
                    log.warning("cannot read %s %s (flushing it): %s", kind, container, err)
                    flush.append(container)
                continue
            state.elements[container] = {
                key: Element(container, key, value, comment) for key, value, comment in listed
            }
        if old is not None:
            state.stale = {c: t for c, t in old.stale.items() if c in state.chains}
        return state, flush

    def _reusable_endpoint_chains(self, plan: NftablesPlan, state: TableState) -> set[str]:
        """Endpoint chains a restarted proxy need not rewrite: they exist with their rules,
        and their affinity set exists exactly when the service wants affinity (upstream's
        epChainSkipUpdate). An empty one is a chain a killed proxy had flushed as stale and
        not yet deleted: reused, it would send the service's traffic nowhere."""
        filled = self.backend.chains_with_rules(FAMILY, n.TABLE)
        if filled is None:
            return set()
        keep: set[str] = set()
        for block in plan.blocks.values():
            wanted_sets = {s.name for s in block.affinity_sets}
            for chain in block.endpoint_chains:
                if chain not in state.chains or chain not in filled:
                    continue
                affinity_set = n.AFFINITY_PREFIX + chain[len(n.ENDPOINT_PREFIX) :]
                if (affinity_set in wanted_sets) == (affinity_set in state.affinity_sets):
                    keep.add(chain)
        return keep

    def _keep_failed(self, tx: Transaction, err: NftError) -> str:
        """Log and keep the rejected input (the text nft or the kernel refused; when the sync
        was applied in steps, also the whole transaction in upstream's form)."""
        log.error("%s", err)
        ctx = err.context()
        if ctx:
            log.error("rejected input around the failing line:\n%s", ctx)
        data = err.input_data or tx.text()
        if self.state_dir is None:
            return data
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            path = self.state_dir / FAILED_TRANSACTION
            path.write_text(data)
            full = self.state_dir / FAILED_FULL_TRANSACTION
            if data != tx.text():
                full.write_text(tx.text())
            elif full.exists():
                full.unlink()
            (self.state_dir / FAILED_ERROR).write_text(
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {err}\n{err.stderr}"
            )
            log.error("the rejected input is kept in %s", path)
        except OSError as oserr:
            log.warning("could not keep the failed transaction: %s", oserr)
        return data

    @property
    def nftables_layout(self) -> str:
        return self.layout

    def drifted(self) -> bool:
        """True when the table we programmed is gone (deleted behind our back)."""
        if self._state is None:
            return False
        try:
            present = self.backend.table_exists(FAMILY, self.table)
        except NftError as err:
            log.warning("cannot check for the nftables table: %s", err)
            return False
        if not present:
            log.warning("table %s %s is gone: full resync", FAMILY, self.table)
        return not present

    def detach(self) -> None:
        """Take nftables mode out of the packet path in one transaction: delete the base
        chains (and with them the jumps into our chains). The rest of the table stays until
        cleanup(); established connections keep their conntrack translation. The next sync
        is full, which adds the base chains again."""
        try:
            present = self.backend.table_exists(FAMILY, self.table)
        except NftError as err:
            raise SyncError(f"could not detach nftables mode: {err}") from err
        self._state = None
        if not present:
            return
        base = [bc.name for bc in self.planner.setup.base_chains]
        try:
            # One netlink batch: the kernel deletes each base chain with its rules, and no
            # nft process has to dump the table first (seconds at 10,000 services).
            self.backend.delete_chains(FAMILY, self.table, base)
            return
        except NftError as err:
            log.info("netlink detach failed (%s); detaching with nft instead", err)
        tx = Transaction(FAMILY, self.table)
        for bc in self.planner.setup.base_chains:
            tx.add_chain(bc.name)  # so that the delete cannot fail on a missing chain
            tx.flush_chain(bc.name)  # a chain with rules cannot be deleted
            tx.delete_chain(bc.name)
        try:
            self.backend.run(tx.text())
        except NftError as err:
            raise SyncError(f"could not detach nftables mode: {err}") from err

    # --- ownership and cleanup ---------------------------------------------------------

    def owned(self) -> list[OwnedObject]:
        """This layout's tables (the other layout's are not this dataplane's: during a
        switch between the layouts they are the other side's)."""
        from kproxy.dataplane.nftables.cleanup import owned_tables

        return owned_tables(self.backend, layout=self.layout)

    def cleanup(self, *, dry_run: bool = False) -> list[OwnedObject]:
        from kproxy.dataplane.nftables.cleanup import cleanup

        found = cleanup(self.backend, dry_run=dry_run, layout=self.layout)
        if not dry_run:
            self._state = None
            self._base_chains_recreated = False
            self._synced_once = False
        return found
