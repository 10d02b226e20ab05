"""ipvs mode: the Dataplane the sync loop drives (IPVS + kube-ipvs0 + ipsets + iptables).

One sync, in upstream's order:
  1. virtual servers and real servers: added, edited in place (scheduler, flags, timeout:
     the VIP never goes away) or, for removed endpoints, drained (see below);
  2. new service addresses bound on kube-ipvs0;
  3. ipset entries (one `ipset restore -exist` of the difference);
  4. the iptables layer (one `iptables-restore --noflush`, only when its text changed or on
     full syncs, which also add missing jumps from the built-in chains);
  5. superfluous kube-ipvs0 addresses unbound;
  6. stale virtual servers deleted: only kube-proxy's (cleanup.ownership), never inside
     ipvs.excludeCIDRs (upstream deletes every other virtual server of the family);
  7. drained real servers that went idle deleted.

Incremental: a full sync (the first, after a failure, every syncPeriod) diffs the plan
against a read of the kernel (one netlink service dump, one read of /proc/net/ip_vs, one
address dump, one `ipset save`); a partial sync diffs against kproxy's mirror of what it
applied, and skips every virtual server whose planned value is the object applied last
time. Netlink requests go out in batches.

Graceful termination (upstream's graceful_termination.go): a TCP real server that is no
longer wanted but still has active or inactive connections gets weight 0 and stays until
its connections are gone (checked every sync); UDP and SCTP real servers are deleted at
once (expire_nodest_conn=1 ends their flows). An endpoint that comes back while draining
gets weight 1 again (upstream deletes and re-adds it, which drops its connections).

Weights: real servers get weight 1; on the first sync of a process, existing real servers
with another weight are reset to 1 (upstream's initialSync); later syncs leave the weight
of a wanted real server alone, as upstream does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from kproxy.conntrack import Conntrack, ConntrackError, DeleteFilter
from kproxy.dataplane.base import (
    Dataplane,
    DataplaneUnavailable,
    OwnedObject,
    SyncError,
    SyncResult,
)
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import (
    IptablesBackend,
    IptablesError,
    RestoreError,
    chosen_backend,
    parse_save,
)
from kproxy.dataplane.ipvs import cleanup as ipvs_cleanup
from kproxy.dataplane.ipvs import drain as ipvs_drain
from kproxy.dataplane.ipvs import hold as ipvs_hold
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs import netlink as nl
from kproxy.dataplane.ipvs.dummy import DummyDevice
from kproxy.dataplane.ipvs.ipset import IpsetClient, IpsetError, sync_lines
from kproxy.dataplane.ipvs.netlink import IpvsNetlink, KernelDest, NetlinkError
from kproxy.dataplane.ipvs.nlsock import Request
from kproxy.dataplane.ipvs.plan import Dest, IpvsPlan, IpvsPlanner, VirtualServer, VSKey
from kproxy.host.commands import in_netns, run_command
from kproxy.model.objects import Snapshot

log = logging.getLogger("kproxy.ipvs")

FRESH_DUMP_LIMIT = 16  # above this many virtual servers, read /proc/net/ip_vs once instead
FAILED_RESTORE = "ipvs-iptables-failed-restore.txt"


@dataclass
class KernelState:
    """What the kernel holds (read on full syncs, then kept as kproxy's mirror)."""

    services: dict[VSKey, tuple[str, int, int]] = field(default_factory=dict)
    dests: dict[VSKey, dict[Dest, KernelDest]] = field(default_factory=dict)
    bound: set[str] = field(default_factory=set)
    node_addresses: frozenset[str] = frozenset()
    sets: dict[str, set[str]] = field(default_factory=dict)
    index: int = 0


@dataclass
class Op:
    request: Request
    key: VSKey
    commit: Callable[[KernelState], None]


class IpvsDataplane(Dataplane):
    mode = "ipvs"

    def __init__(
        self,
        backend: IptablesBackend,
        facts: NodeFacts,
        options: RuleOptions,
        *,
        netns: str | None = None,
        state_dir: Path | None = None,
        ipvs: IpvsNetlink | None = None,
        ipset: IpsetClient | None = None,
        dummy: DummyDevice | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.facts = facts
        self.options = options
        self.netns = netns
        self.state_dir = state_dir
        self.planner = IpvsPlanner(facts, options)
        self.exclude = ipvs_cleanup.parse_cidrs(options.ipvs_exclude_cidrs)
        self.ipvs = ipvs or IpvsNetlink(netns)
        self.ipset = ipset or IpsetClient(netns)
        self.dummy = dummy or DummyDevice(netns)
        self.clock = clock
        self._kernel: KernelState | None = None  # None: unknown, the next sync is full
        self._initial = True
        self._applied_vs: dict[VSKey, VirtualServer] = {}
        self._applied_iptables: str | None = None
        self._graceful: dict[tuple[VSKey, Dest], float] = {}
        self._problems: set[str] = set()
        self._retry_full = False
        self._recheck_iptables = False
        self.last_plan: IpvsPlan | None = None
        self.last_timings: dict[str, float] = {}
        self.sync_failures = 0
        self.op_failures = 0

    def close(self) -> None:
        for part in (self.ipvs, self.dummy):
            with contextlib.suppress(OSError):
                part.close()

    # --- node setup (upstream's NewProxier) --------------------------------------------------

    def prepare(self) -> None:
        """The sysctls upstream sets, and the IPVS timeouts if any is configured."""
        opts = self.options
        wanted: dict[str, int] = {"net/ipv4/vs/conntrack": 1}
        kernel = _kernel_version(platform.release())
        if kernel is not None and kernel < (4, 1):
            log.error("kernel %s is older than 4.1: net/ipv4/vs/conn_reuse_mode left alone", kernel)
        elif kernel is not None and kernel < (5, 9):
            wanted["net/ipv4/vs/conn_reuse_mode"] = 0  # #93297: fixed in the kernel in 5.9
        wanted["net/ipv4/vs/expire_nodest_conn"] = 1
        wanted["net/ipv4/vs/expire_quiescent_template"] = 1
        wanted["net/ipv4/ip_forward"] = 1
        if opts.ipvs_strict_arp:
            wanted["net/ipv4/conf/all/arp_ignore"] = 1
            wanted["net/ipv4/conf/all/arp_announce"] = 2
        self._sysctls(wanted)
        timeouts = (opts.ipvs_tcp_timeout, opts.ipvs_tcp_fin_timeout, opts.ipvs_udp_timeout)
        if any(t > 0 for t in timeouts):
            try:
                self.ipvs.set_timeouts(*(int(t) for t in timeouts))
            except NetlinkError as err:
                log.error("could not set the IPVS timeouts (tcp/tcpfin/udp %s): %s", timeouts, err)

    def _sysctls(self, wanted: dict[str, int]) -> None:
        if self.netns is None:
            from kproxy.sysctl import set_sysctl

            for name, value in wanted.items():
                if not set_sysctl(name, value):
                    raise DataplaneUnavailable(
                        f"ipvs mode needs sysctl {name}={value}, which failed"
                    )
            return
        # Another namespace: one process for all of them.
        args = [f"{k.replace('/', '.')}={v}" for k, v in wanted.items()]
        proc = run_command(in_netns(["sysctl", "-q", "-w", *args], self.netns))
        if proc.returncode != 0:
            raise DataplaneUnavailable(f"ipvs mode needs sysctls {args}: {proc.stderr.strip()}")

    # --- sync --------------------------------------------------------------------------------

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
        timings: dict[str, float] = {}
        self.last_timings = timings
        mark = time.perf_counter()
        self._retry_full = False
        if self._kernel is None:
            full = True
        try:
            kernel = self._read_kernel() if full else self._kernel
        except (NetlinkError, IpsetError, OSError) as err:
            self._kernel = None
            self.sync_failures += 1
            raise SyncError(f"ipvs sync: could not read the kernel state: {err}") from err
        assert kernel is not None
        timings["read"], mark = time.perf_counter() - mark, time.perf_counter()
        plan = self.planner.plan(snapshot, kernel.node_addresses)
        self.last_plan = plan
        self._log_problems(plan.problems)
        timings["plan"], mark = time.perf_counter() - mark, time.perf_counter()

        graceful = dict(self._graceful)
        ops, stale, changed = self._diff(plan, kernel, full)
        try:
            failed = self._apply(ops, plan, kernel)
        except SyncError:
            # The diff started and ended drains for weight edits the kernel never got; kept,
            # a real server wanted again would stay at weight 0 after the retry.
            self._graceful = graceful
            raise
        timings["ipvs"], mark = time.perf_counter() - mark, time.perf_counter()
        self._bind(plan, kernel)
        timings["bind"], mark = time.perf_counter() - mark, time.perf_counter()
        try:
            self.ipset.restore(sync_lines(plan.sets, kernel.sets, create=full))
        except IpsetError as err:
            self._fail()
            raise SyncError(f"ipvs sync: {err}", kept_input=err.input_data) from err
        kernel.sets = plan.sets
        timings["ipset"], mark = time.perf_counter() - mark, time.perf_counter()
        # The first partial sync after a full one writes the iptables layer again (with the
        # jump check): a mode switch out of iptables mode runs that mode's cleanup right
        # after our full sync, and it deletes the chains both modes name alike.
        rules_written = self._iptables(plan, full or self._recheck_iptables)
        self._recheck_iptables = full
        timings["iptables"], mark = time.perf_counter() - mark, time.perf_counter()
        self._unbind(plan, kernel)
        failed |= self._apply(stale, plan, kernel)
        self._drain(plan, kernel)
        timings["cleanup"] = time.perf_counter() - mark

        for key, vs in plan.virtual_servers.items():
            if key in failed:
                self._applied_vs.pop(key, None)
            else:
                self._applied_vs[key] = vs
        for key in [k for k in self._applied_vs if k not in plan.virtual_servers]:
            del self._applied_vs[key]
        # A failed bind means kube-ipvs0 is not what we think: read it again next time.
        self._kernel = None if self._retry_full else kernel
        self._initial = False
        return SyncResult(
            full=full,
            services=len(snapshot.services),
            rewritten=changed,
            stale_removed=len(stale),
            rules_written=rules_written,
            rules_total=plan.rules_total,
            pieces=1,
            objects={
                "ipvs_virtual_servers": len(plan.virtual_servers),
                "ipvs_real_servers": sum(
                    len(vs.destinations) for vs in plan.virtual_servers.values()
                ),
            },
        )

    def _fail(self) -> None:
        self._kernel = None
        self.sync_failures += 1

    def _read_kernel(self) -> KernelState:
        index = self.dummy.ensure()
        addrs = self.dummy.addresses(index)
        services = {s.key: s.attributes for s in self.ipvs.services()}
        all_dests = self.ipvs.all_dests()
        dests = {key: {(d.ip, d.port): d for d in all_dests.get(key, ())} for key in services}
        sets = self.ipset.save(n.SET_NAMES)
        return KernelState(
            services=services,
            dests=dests,
            bound=set(addrs.dummy),
            node_addresses=addrs.node,
            sets=sets,
            index=index,
        )

    def _fresh_dests(self, keys: Iterable[VSKey]) -> dict[VSKey, dict[Dest, KernelDest]]:
        """Current real servers (with connection counts) of a few virtual servers."""
        keys = list(keys)
        if len(keys) > FRESH_DUMP_LIMIT:
            every = self.ipvs.all_dests()
            return {k: {(d.ip, d.port): d for d in every.get(k, ())} for k in keys}
        return {k: {(d.ip, d.port): d for d in self.ipvs.dests(k)} for k in keys}

    def _log_problems(self, problems: list[str]) -> None:
        current = set(problems)
        for p in sorted(current - self._problems):
            log.warning("%s", p)
        self._problems = current

    # --- 1 and 6: the IPVS diff -------------------------------------------------------------

    def _diff(
        self, plan: IpvsPlan, kernel: KernelState, full: bool
    ) -> tuple[list[Op], list[Op], int]:
        fam = self.ipvs.family
        ops: list[Op] = []
        applied = self._applied_vs
        changed: list[VirtualServer] = []
        for key, vs in plan.virtual_servers.items():
            if not full and applied.get(key) is vs and key in kernel.services:
                continue
            changed.append(vs)
        if not full:
            # Removals decide on live connection counts; the mirror's are from the last read.
            removing = [
                vs.key for vs in changed if set(kernel.dests.get(vs.key, {})) - set(vs.destinations)
            ]
            if removing:
                kernel.dests.update(self._fresh_dests(removing))
        for vs in changed:
            self._diff_one(vs, kernel, ops, fam)

        stale: list[Op] = []
        known = frozenset(applied)
        for key in list(kernel.services):
            if key in plan.virtual_servers or ipvs_cleanup.excluded(key.address, self.exclude):
                continue
            why = ipvs_cleanup.ownership(
                key,
                bound=kernel.bound,
                sets=kernel.sets,
                node_addresses=kernel.node_addresses,
                known=known,
            )
            if why is None:
                continue
            log.info("deleting stale virtual server %s (%s)", key, why)
            stale.append(Op(nl.delete_service(fam, key), key, _drop_service(key)))
            for d in kernel.dests.get(key, {}):
                self._graceful.pop((key, d), None)
        return ops, stale, len(changed)

    def _diff_one(self, vs: VirtualServer, kernel: KernelState, ops: list[Op], fam: int) -> None:
        key = vs.key
        current = kernel.services.get(key)
        if current is None:
            ops.append(Op(nl.add_service(fam, vs), key, _set_service(key, vs.attributes)))
        elif current != vs.attributes:
            ops.append(Op(nl.edit_service(fam, vs), key, _set_service(key, vs.attributes)))
        have = kernel.dests.get(key, {}) if current is not None else {}
        want = vs.destinations
        for dest in want:
            kd = have.get(dest)
            ip, port = dest
            if kd is None:
                ops.append(Op(nl.add_dest(fam, key, ip, port, 1), key, _set_dest(key, dest, 1)))
                continue
            if self._graceful.pop((key, dest), None) is not None:
                log.info("real server %s:%d of %s is wanted again: weight 1", ip, port, key)
                ops.append(Op(nl.edit_dest(fam, key, ip, port, 1), key, _set_dest(key, dest, 1)))
            elif kd.fwd_method != n.FWD_MASQ or (self._initial and kd.weight != 1):
                weight = 1 if self._initial else kd.weight
                ops.append(
                    Op(nl.edit_dest(fam, key, ip, port, weight), key, _set_dest(key, dest, weight))
                )
        wanted = set(want)
        for dest, kd in have.items():
            if dest in wanted or (key, dest) in self._graceful:
                continue
            ip, port = dest
            if key.protocol in n.GRACEFUL_PROTOCOLS and kd.connections > 0:
                log.info(
                    "draining real server %s:%d of %s (%d active, %d inactive connections)",
                    ip,
                    port,
                    key,
                    kd.active,
                    kd.inactive,
                )
                self._graceful[(key, dest)] = self.clock()
                if kd.weight != 0:
                    ops.append(
                        Op(nl.edit_dest(fam, key, ip, port, 0), key, _set_dest(key, dest, 0))
                    )
            else:
                ops.append(Op(nl.delete_dest(fam, key, ip, port), key, _drop_dest(key, dest)))

    def _apply(self, ops: list[Op], plan: IpvsPlan, kernel: KernelState) -> set[VSKey]:
        """Send the ops; commit the successful ones to the mirror; log the failures once per
        virtual server, naming the service. Returns the virtual servers with a failure."""
        if not ops:
            return set()
        try:
            failures = self.ipvs.apply([op.request for op in ops])
        except OSError as err:
            self._fail()
            raise SyncError(f"ipvs sync: netlink failed: {err}") from err
        bad: dict[int, int] = {id(req): code for req, code in failures}
        by_vs: dict[VSKey, list[str]] = {}
        for op in ops:
            code = bad.get(id(op.request))
            if code is None:
                op.commit(kernel)
                continue
            verb = op.request.what.split(" ", 1)[0]
            if (verb == "add" and code == errno.EEXIST) or (
                verb == "delete" and code in (errno.ENOENT, errno.ESRCH)
            ):
                op.commit(kernel)  # already so: the mirror was behind; the kernel is right
                continue
            by_vs.setdefault(op.key, []).append(f"{op.request.what}: {os.strerror(code)}")
        for key, problems in by_vs.items():
            self.op_failures += len(problems)
            owner = plan.owners.get(key)
            hint = ""
            vs = plan.virtual_servers.get(key)
            if vs is not None and any(
                "add virtual server" in p and "No such file" in p for p in problems
            ):
                hint = f" (is the scheduler module ip_vs_{vs.scheduler} available?)"
            log.error(
                "service %s: %s%s",
                owner or "(stale)",
                "; ".join(problems[:3])
                + (f"; and {len(problems) - 3} more" if len(problems) > 3 else ""),
                hint,
            )
        # The kernel refused these, so it is unchanged: the mirror stays exact, and the next
        # sync retries them (they are not recorded as applied).
        return set(by_vs)

    # --- 2 and 5: kube-ipvs0 addresses ---------------------------------------------------------

    def _bind(self, plan: IpvsPlan, kernel: KernelState) -> None:
        missing = sorted(plan.bind_addresses - kernel.bound)
        if not missing:
            return
        failed = dict(self.dummy.bind(kernel.index, missing))
        for ip in missing:
            if ip in failed:
                log.error(
                    "could not bind %s to %s: %s", ip, n.DUMMY_DEVICE, os.strerror(failed[ip])
                )
            else:
                kernel.bound.add(ip)
        if failed:
            self._retry_full = True

    def _unbind(self, plan: IpvsPlan, kernel: KernelState) -> None:
        extra = sorted(kernel.bound - plan.bind_addresses)
        if not extra:
            return
        failed = dict(self.dummy.unbind(kernel.index, extra))
        for ip in extra:
            if ip in failed:
                log.error(
                    "could not unbind %s from %s: %s", ip, n.DUMMY_DEVICE, os.strerror(failed[ip])
                )
            else:
                kernel.bound.discard(ip)

    # --- 4: iptables --------------------------------------------------------------------------

    def _jump_lines(self) -> dict[str, list[str]]:
        """Restore lines adding the jumps from built-in chains that are missing."""
        try:
            tables = parse_save(self.backend.save())
        except IptablesError as err:
            log.warning("cannot read the iptables jumps (%s); not adding any", err)
            return {}
        out: dict[str, list[str]] = {}
        for table, chain, target, comment in n.JUMPS:
            rule = n.jump_rule(chain, target, comment)
            dump = tables.get(table)
            if dump is not None and f"-A {rule}" in dump.rules:
                continue
            out.setdefault(table, []).append(f"-I {chain} 1 {rule.split(' ', 1)[1]}")
        return out

    def _iptables(self, plan: IpvsPlan, full: bool) -> dict[str, int]:
        text = plan.iptables_text()
        if not full and text == self._applied_iptables:
            return {"nat": 0, "filter": 0}
        data = text
        if full:
            jumps = self._jump_lines()
            if jumps:
                data = _with_jumps(text, jumps)
        try:
            self.backend.restore(data)
        except (RestoreError, IptablesError) as err:
            self._keep_failed(data, err)
            self._applied_iptables = None
            self._fail()
            raise SyncError(f"ipvs sync: iptables restore failed: {err}", kept_input=data) from err
        self._applied_iptables = text
        return plan.rules_total

    def _keep_failed(self, data: str, err: Exception) -> None:
        log.error("%s", err)
        if isinstance(err, RestoreError) and err.context():
            log.error("rejected input around the failing line:\n%s", err.context())
        if self.state_dir is None:
            return
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            (self.state_dir / FAILED_RESTORE).write_text(data)
        except OSError as oserr:
            log.warning("could not keep the failed restore input: %s", oserr)

    # --- 7: graceful termination ------------------------------------------------------------

    def _drain(self, plan: IpvsPlan, kernel: KernelState) -> None:
        if not self._graceful:
            return
        keys = {k for k, _ in self._graceful}
        try:
            fresh = self._fresh_dests(keys)
        except OSError as err:
            log.warning("cannot read draining real servers: %s", err)
            return
        fam = self.ipvs.family
        ops: list[Op] = []
        for (key, dest), since in list(self._graceful.items()):
            current = fresh.get(key, {})
            kernel.dests.setdefault(key, {}).update(current)
            kd = current.get(dest)
            if key not in kernel.services or kd is None:
                del self._graceful[(key, dest)]
                kernel.dests.get(key, {}).pop(dest, None)
                continue
            if kd.connections == 0:
                log.info(
                    "real server %s:%d of %s is idle after %.0f s of draining: deleting",
                    dest[0],
                    dest[1],
                    key,
                    self.clock() - since,
                )
                ops.append(Op(nl.delete_dest(fam, key, *dest), key, _drop_dest(key, dest)))
        self._apply(ops, plan, kernel)
        for entry in list(self._graceful):
            key, dest = entry
            if dest not in kernel.dests.get(key, {}):
                del self._graceful[entry]  # deleted (or gone by itself)

    @property
    def draining(self) -> dict[tuple[VSKey, Dest], float]:
        """Real servers at weight 0 waiting for their connections to end (since when)."""
        return dict(self._graceful)

    # --- the rest of the Dataplane class ------------------------------------------------------

    @property
    def iptables_flavour(self) -> str:
        return self.backend.flavour

    def drifted(self) -> bool:
        """Our state is gone behind our back: the nat KUBE-SERVICES chain or kube-ipvs0."""
        if self._kernel is None:
            return False
        try:
            chain = self.backend.chain_exists("nat", "KUBE-SERVICES")
            dummy = self.dummy.lookup() is not None
        except (IptablesError, OSError) as err:
            log.warning("cannot check the ipvs state: %s", err)
            return False
        if not (chain and dummy):
            log.warning(
                "ipvs state lost (%s): full resync",
                "nat KUBE-SERVICES chain gone" if not chain else f"{n.DUMMY_DEVICE} gone",
            )
        return not (chain and dummy)

    def detach(self) -> None:
        """Out of the packet path in one restore: delete the jumps into ipvs mode's chains.
        Jumps into chains iptables mode uses under the same names are left alone while
        iptables mode owns them (it restored KUBE-SERVICES last). Virtual servers and
        addresses stay until cleanup(), so established connections keep flowing."""
        try:
            tables = parse_save(self.backend.save())
        except IptablesError as err:
            raise SyncError(f"could not detach ipvs mode: {err}") from err
        shared = not ipvs_cleanup.iptables_mode_owns_shared(tables)
        lines: dict[str, list[str]] = {}
        for table, chain, target, comment in n.JUMPS:
            if target in n.SHARED_CHAINS and not shared:
                continue
            rule = f"-A {n.jump_rule(chain, target, comment)}"
            dump = tables.get(table)
            if dump is not None and rule in dump.rules:
                lines.setdefault(table, []).append("-D" + rule[2:])
        text = "".join(f"*{t}\n" + "\n".join(ls) + "\nCOMMIT\n" for t, ls in lines.items())
        if text:
            try:
                self.backend.restore(text)
            except IptablesError as err:
                raise SyncError(f"could not detach ipvs mode: {err}") from err
        self._kernel = None
        self._applied_iptables = None

    def owned(self) -> list[OwnedObject]:
        return ipvs_cleanup.cleanup(
            self.backend,
            self.netns,
            dry_run=True,
            exclude_cidrs=self.options.ipvs_exclude_cidrs,
            known=self._applied_vs,
            clients=ipvs_cleanup.Clients(self.ipvs, self.dummy, self.ipset),
        )

    def cleanup(self, *, dry_run: bool = False) -> list[OwnedObject]:
        found = ipvs_cleanup.cleanup(
            self.backend,
            self.netns,
            dry_run=dry_run,
            exclude_cidrs=self.options.ipvs_exclude_cidrs,
            known=self._applied_vs,
            clients=ipvs_cleanup.Clients(self.ipvs, self.dummy, self.ipset),
        )
        if not dry_run:
            self._kernel = None
            self._applied_vs = {}
            self._applied_iptables = None
            self._graceful = {}
        return found

    def retire(self) -> tuple[list[OwnedObject], ipvs_drain.Draining]:
        """cleanup() for a live switch away from ipvs mode (kproxy.switch): everything goes
        except the TCP virtual servers that still carry connections and their kube-ipvs0
        addresses (and the link), which the returned Draining reaps once they are idle
        (see ipvs/drain.py). Returns what was removed and what is draining."""
        clients = ipvs_cleanup.Clients(self.ipvs, self.dummy, self.ipset)
        owned = ipvs_cleanup.virtual_servers(
            self.netns,
            dry_run=True,
            exclude_cidrs=self.options.ipvs_exclude_cidrs,
            known=self._applied_vs,
            clients=clients,
        )
        by_name = {str(s.key): s.key for s in self.ipvs.services()}
        keys = [by_name[o.name] for o in owned if o.name in by_name]
        try:
            dests: dict[VSKey, list[KernelDest]] | None = self.ipvs.all_dests()
        except OSError as err:
            log.warning("cannot read IPVS connection counts (%s): keeping every TCP one", err)
            dests = None
        draining = ipvs_drain.Draining(self.netns)
        draining.servers = ipvs_drain.busy(keys, dests, draining.conns or dict)
        idle = [k for k in keys if k not in draining.servers]
        self._delete_idle(idle, dests, draining)
        removed = [o for o in owned if by_name.get(o.name) not in draining.servers]
        chains = ipvs_cleanup.ipvs_iptables_objects(self.backend)
        if chains:
            ipvs_cleanup.remove_iptables(self.backend, chains)
        removed += chains
        if draining.servers:
            removed += self._unbind_all_but(draining)
        else:
            removed += ipvs_cleanup.remove_dummy(self.netns, dummy=self.dummy)
        removed += ipvs_cleanup.remove_ipsets(self.netns, ipset=self.ipset)
        self._kernel = None
        self._applied_vs = {}
        self._applied_iptables = None
        self._graceful = {}
        return removed, draining

    def _delete_idle(
        self,
        idle: list[VSKey],
        dests: Mapping[VSKey, list[KernelDest]] | None,
        draining: ipvs_drain.Draining,
    ) -> None:
        """Delete the idle virtual servers; the datagram flows of UDP/SCTP ones move to the
        new mode with their datagrams held meanwhile (ipvs/hold.py)."""
        flowing = [
            k
            for k in idle
            if k.protocol != "TCP"
            and (dests is None or any(d.active or d.inactive for d in dests.get(k, [])))
        ]
        with ipvs_hold.held(self.backend, self.netns, flowing) as hold:
            if hold is not None:
                # Replies to datagrams IPVS forwarded before the hold come back through it.
                time.sleep(ipvs_hold.REPLY_GRACE)
            elif self._forget_datagram_flows(flowing):
                time.sleep(ipvs_hold.REPLY_GRACE)
            for req, code in self.ipvs.delete_services(idle):
                if code not in (errno.ENOENT, errno.ESRCH):
                    log.warning("%s failed: %s", req.what, os.strerror(code))
            assert draining.conns is not None
            if hold is not None and not ipvs_hold.wait_expired(flowing, draining.conns):
                # IPVS deletes the conntrack entries of the flows it expires; these it kept.
                self._forget_datagram_flows(flowing)

    def _forget_datagram_flows(self, keys: Iterable[VSKey]) -> int:
        """Delete the conntrack entries of UDP/SCTP flows to virtual servers about to go.

        A UDP client keeps its 5-tuple, so its flow stays one conntrack entry that IPVS set
        up; deleting the virtual server first would drop the flow's next datagram (IPVS
        expires its entry on that packet). With the entry gone first, the next datagram is
        NEW and the new mode's DNAT (nat PREROUTING, before IPVS) takes it."""
        filters = [
            DeleteFilter(k.protocol.lower(), orig_dst=k.address, orig_dport=k.port) for k in keys
        ]
        if not filters:
            return 0
        try:
            deleted = Conntrack(self.netns).delete_many(filters)
        except (ConntrackError, OSError) as err:
            log.warning("cannot clear the conntrack entries of UDP/SCTP flows: %s", err)
            return 0
        if deleted:
            log.info("cleared %d conntrack entries of UDP/SCTP flows through ipvs", deleted)
        return deleted

    def _unbind_all_but(self, draining: ipvs_drain.Draining) -> list[OwnedObject]:
        """Unbind every kube-ipvs0 address but the draining virtual servers' (kept in
        draining.addresses)."""
        found = self.dummy.lookup()
        if found is None or found[1] != "dummy":
            return []
        index = found[0]
        bound = self.dummy.addresses(index).dummy
        draining.addresses = {k.address for k in draining.servers} & set(bound)
        extra = sorted(bound - draining.addresses)
        failed = dict(self.dummy.unbind(index, extra))
        for ip, code in failed.items():
            log.warning("could not unbind %s from %s: %s", ip, n.DUMMY_DEVICE, os.strerror(code))
        return [
            OwnedObject("address", n.DUMMY_DEVICE, ip, "a service address of ipvs mode")
            for ip in extra
            if ip not in failed
        ]


# --- mirror updates ---------------------------------------------------------------------------


def _set_service(key: VSKey, attrs: tuple[str, int, int]) -> Callable[[KernelState], None]:
    def commit(k: KernelState) -> None:
        k.services[key] = attrs
        k.dests.setdefault(key, {})

    return commit


def _drop_service(key: VSKey) -> Callable[[KernelState], None]:
    def commit(k: KernelState) -> None:
        k.services.pop(key, None)
        k.dests.pop(key, None)

    return commit


def _set_dest(key: VSKey, dest: Dest, weight: int) -> Callable[[KernelState], None]:
    def commit(k: KernelState) -> None:
        per = k.dests.setdefault(key, {})
        old = per.get(dest)
        per[dest] = (
            replace(old, weight=weight, fwd_method=n.FWD_MASQ)
            if old is not None
            else KernelDest(dest[0], dest[1], weight)
        )

    return commit


def _drop_dest(key: VSKey, dest: Dest) -> Callable[[KernelState], None]:
    def commit(k: KernelState) -> None:
        k.dests.get(key, {}).pop(dest, None)

    return commit


def _with_jumps(text: str, jumps: dict[str, list[str]]) -> str:
    out: list[str] = []
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
        if line == "COMMIT":
            out += jumps.get(table, [])
        out.append(line)
    return "\n".join(out) + "\n"


def _kernel_version(release: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else None


def create_ipvs_dataplane(
    *,
    options: RuleOptions,
    node_ips: tuple[str, ...] = (),
    iptables_backend_choice: str = "auto",
    state_dir: Path | None = None,
    netns: str | None = None,
) -> tuple[IpvsDataplane, NodeFacts]:
    """What registry.create_dataplane does for mode "ipvs": check the kernel (a clear error,
    never a fallback), set upstream's sysctls, build the dataplane."""
    from kproxy.dataplane.ipvs.check import check_ipvs_support
    from kproxy.dataplane.nodefacts import detect_node_facts

    check_ipvs_support(options.ipvs_scheduler, netns=netns)
    backend = chosen_backend(iptables_backend_choice, netns)
    facts = detect_node_facts(netns=netns, backend=backend, node_ips=node_ips)
    try:
        dataplane = IpvsDataplane(backend, facts, options, netns=netns, state_dir=state_dir)
    except nl.IpvsUnavailable as err:
        raise DataplaneUnavailable(str(err)) from err
    dataplane.prepare()
    log.info(
        "ipvs mode: scheduler %s, iptables backend %s, random-fully %s",
        options.ipvs_scheduler or n.DEFAULT_SCHEDULER,
        backend.flavour,
        facts.random_fully,
    )
    return dataplane, facts
