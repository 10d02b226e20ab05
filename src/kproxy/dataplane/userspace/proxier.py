"""userspace mode: the Dataplane the sync loop drives (listener table + redirect rules).

One sync, make-before-break in both directions:

1. make sure the workers run (adopt live ones, start missing ones);
2. publish the new listener table, still including the listeners that are going away,
   and wait until every worker has applied it (new ports are listening);
3. apply the redirect rules with one ``iptables-restore --noflush`` (our chains only;
   missing jumps from the built-in chains are checked with -C and added, full syncs only);
4. publish the table without the retired listeners: their rules are gone, so nothing new
   arrives there, and their open connections drain.

A port a worker cannot bind (another program holds it) is marked bad and the listener moves
to another port in the same sync. Nothing is torn down when the controller exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kproxy.conntrack import Conntrack, ConntrackEntry, ConntrackError, DeleteFilter
from kproxy.dataplane.base import Dataplane, OwnedObject, SyncError, SyncResult
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import (
    IptablesBackend,
    IptablesError,
    RestoreError,
    chosen_backend,
    rule_spec,
)
from kproxy.dataplane.userspace import fdlimit, render
from kproxy.dataplane.userspace.cleanup import OUR_CHAINS, userspace_chain
from kproxy.dataplane.userspace.control import (
    PORTS_FILE,
    SUBDIR,
    ControlError,
    WorkerSet,
    read_json,
    write_json_atomic,
)
from kproxy.dataplane.userspace.render import (
    CANARY_CHAIN,
    HANDOFF_RULE,
    JUMPS,
    ROUTE_TABLE,
    RULE_PRIORITY,
    TPROXY_MARK,
    UserspacePlan,
    jump_rule,
    parse_port_range,
    render_plan,
)
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.host.commands import in_netns, run_command
from kproxy.model.objects import Snapshot

log = logging.getLogger("kproxy.userspace")


BIND_RETRIES = 3
# A worker acknowledges a table once it has opened its new listeners, so the wait grows
# with their number (10,000 took longer than the fixed 5 s in UML, failing the switch).
ACK_PER_NEW_LISTENER = 0.005


class UserspaceDataplane(Dataplane):
    mode = "userspace"
    moves_udp_flows = True  # its workers do

    def __init__(
        self,
        backend: IptablesBackend,
        facts: NodeFacts,
        options: RuleOptions,
        *,
        state_dir: Path | None = None,
        workers: int | None = None,
        port_range: str = "",
        udp_idle_timeout: float = 0.25,
        max_connections: int = fdlimit.DEFAULT_MAX_CONNECTIONS,
        engine: str | None = None,
        ack_timeout: float = 5.0,
    ) -> None:
        self.backend = backend
        self.facts = facts
        self.options = options
        self.state_dir = Path(state_dir) if state_dir is not None else DEFAULT_STATE_DIR
        self.port_range = parse_port_range(port_range)
        self.ack_timeout = ack_timeout
        worker_args = [
            "--max-connections",
            str(max_connections),
            "--udp-idle-timeout",
            str(udp_idle_timeout),
        ]
        if engine is not None:
            worker_args += ["--engine", engine]
        self.workers = WorkerSet(
            self.state_dir,
            count=max(1, workers or os.cpu_count() or 1),
            netns=backend.netns,
            worker_args=worker_args,
        )
        saved = read_json(self.workers.dir / PORTS_FILE)
        saved = saved if isinstance(saved, dict) else {}
        self._ports: dict[str, int] = {
            str(k): int(v) for k, v in dict(saved.get("ports", {})).items()
        }
        self._bad_ports: set[int] = {int(p) for p in saved.get("bad", ())}
        # The last table the workers applied; after a restart, the one on disk (its
        # listeners stay open until this controller's first restore has replaced the rules).
        self._table: dict[str, Any] | None = None
        old = self.workers.read_table()
        if old is not None and isinstance(old.get("listeners"), list):
            self._table = {k: v for k, v in old.items() if k not in ("generation", "workers")}
        self._rules: str | None = None  # last restore input applied
        self.last_plan: UserspacePlan | None = None

    # --- sync --------------------------------------------------------------------------------

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
        if self._rules is None:
            full = True
        try:
            self.workers.acquire()
            _adopted, started = self.workers.ensure()
        except ControlError as err:
            raise SyncError(f"userspace workers: {err}") from err
        if started:
            full = True
        plan = self._publish(snapshot, force=full)
        text = plan.text()
        jumps = self._missing_jumps() if full else []
        wrote = 0
        if full or jumps or text != self._rules:
            data = _with_jumps(text, jumps)
            try:
                self.backend.restore(data)
            except RestoreError as err:
                self._rules = None
                self._keep_failed(data, err)
                raise SyncError(f"iptables restore failed: {err}", kept_input=data) from err
            except IptablesError as err:
                self._rules = None
                raise SyncError(f"iptables restore failed: {err}") from err
            self._rules = text
            wrote = sum(plan.rule_counts().values())
        if full:
            self._ensure_policy_route()
        # Retired listeners: no rule points at them any more; let them go.
        final = self._worker_table(plan)
        if final != self._table:
            self.workers.write_table(final)
            self._table = final
        self._save_ports(plan.ports)
        return SyncResult(
            full=full,
            services=len(snapshot.services),
            rewritten=len(plan.listeners),
            rules_written={t: (len(r) if wrote else 0) for t, r in plan.rules.items()},
            rules_total=plan.rule_counts(),
        )

    def _worker_table(self, plan: UserspacePlan) -> dict[str, Any]:
        table = plan.worker_table()
        table["node_addresses"] = sorted({*self.facts.local_addresses, *self.facts.node_ips})
        return table

    def _publish(self, snapshot: Snapshot, *, force: bool) -> UserspacePlan:
        """Steps 2 (and the bind-error retry): the staged table is applied by every worker."""
        for _ in range(BIND_RETRIES):
            plan = render_plan(
                snapshot,
                self.facts,
                self.options,
                previous_ports=self._ports,
                port_range=self.port_range,
                avoid_ports=set(self._ports.values()),
                bad_ports=self._bad_ports,
            )
            self.last_plan = plan
            staged = self._worker_table(plan)
            if self._table is not None:
                new_keys = {lst["key"] for lst in staged["listeners"]}
                staged["listeners"] += [
                    lst for lst in self._table["listeners"] if lst["key"] not in new_keys
                ]
            if staged == self._table and not force:
                return plan
            before = {lst["key"] for lst in (self._table or {}).get("listeners", ())}
            opening = sum(1 for lst in staged["listeners"] if lst["key"] not in before)
            try:
                generation = self.workers.write_table(staged)
                applied = self.workers.wait_applied(
                    generation, self.ack_timeout + ACK_PER_NEW_LISTENER * opening
                )
            except (ControlError, OSError) as err:
                raise SyncError(f"userspace workers did not take the table: {err}") from err
            self._table = staged
            bad, unopened = self._listen_errors(applied, plan)
            if unopened:
                raise SyncError(unopened)
            if not bad:
                return plan
            self._bad_ports |= bad
            log.error(
                "proxy ports %s are taken by another program; moving those listeners",
                ", ".join(map(str, sorted(bad))),
            )
        raise SyncError(f"cannot bind proxy ports (bad ports: {sorted(self._bad_ports)})")

    @staticmethod
    def _listen_errors(applied: dict[int, Any], plan: UserspacePlan) -> tuple[set[int], str]:
        """What the workers could not listen on: the proxy ports another program holds
        (moved to other ports), and why listeners failed otherwise (the open-file limit,
        say: moving them would not help; empty if none)."""
        ports = plan.ports
        taken: set[int] = set()
        failure = ""
        for index, info in sorted(applied.items()):
            errors = dict(info.status.get("errors", {}))
            # A worker from before error kinds were reported: every error was a bind error.
            kinds = dict(info.status.get("error_kinds") or {})
            failed = []
            for key in errors:
                if key not in ports:
                    continue
                if kinds.get(key, "in-use") == "in-use":
                    taken.add(ports[key])
                else:
                    failed.append(key)
            if failed and not failure:
                more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
                failure = (
                    f"userspace worker {index} could not open {len(failed)} of "
                    f"{len(ports)} listeners: {errors[failed[0]]}{more}"
                )
        return taken, failure

    def _save_ports(self, ports: dict[str, int]) -> None:
        self._ports = dict(ports)
        try:
            write_json_atomic(
                self.workers.dir / PORTS_FILE,
                {"ports": self._ports, "bad": sorted(self._bad_ports)},
            )
        except OSError as err:
            log.warning("cannot persist the proxy-port allocation: %s", err)

    def _jumps_in_place(self) -> list[tuple[str, str, str, bool]]:
        """(table, verb, rule, present) of every jump from a built-in chain, from the rules
        of those built-in chains only (not an `iptables -C` per jump, each of which reloads
        the whole table, nor a save of whole tables: during a switch to iptables mode the nat
        table also holds the new mode's 320,000 rules at 10,000 services, and saving it made
        the cut-over take 21.9 s)."""
        chains: dict[str, set[str]] = {}
        for table, chain, *_ in JUMPS:
            chains.setdefault(table, set()).add(chain)
        try:
            outlines = self.backend.builtin_outlines(chains)
        except IptablesError as err:
            log.warning("could not read the jumps in place: %s", err)
            outlines = {}
        out = []
        for table, chain, extra, comment, target, verb in JUMPS:
            rule = jump_rule(chain, extra, comment, target)
            try:
                present = self.backend.rule_present(table, rule, outlines.get(table))
            except IptablesError as err:
                log.warning("could not check jump %r: %s", rule, err)
                present = False
            out.append((table, verb, rule, present))
        return out

    def _missing_jumps(self) -> list[tuple[str, str]]:
        return [(t, f"{verb} {rule}") for t, verb, rule, ok in self._jumps_in_place() if not ok]

    def _keep_failed(self, data: str, err: RestoreError) -> None:
        log.error("%s", err)
        ctx = err.context()
        if ctx:
            log.error("rejected input around the failing line:\n%s", ctx)
        try:
            self.workers.dir.mkdir(parents=True, exist_ok=True)
            (self.workers.dir / "failed-restore.txt").write_text(data)
            (self.workers.dir / "failed-restore.error").write_text(
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {err}\n"
            )
        except OSError as oserr:
            log.warning("could not keep the failed restore input: %s", oserr)

    # --- the policy route for source-preserving connections ----------------------------------

    def _ip(self, *args: str) -> tuple[int, str]:
        proc = run_command(in_netns(["ip", "-4", *args], self.backend.netns))
        return proc.returncode, proc.stdout + proc.stderr

    def _policy_route_state(self) -> tuple[bool, bool]:
        _rc, rules = self._ip("rule", "show", "pref", str(RULE_PRIORITY))
        _rc2, routes = self._ip("route", "show", "table", str(ROUTE_TABLE))
        return f"lookup {ROUTE_TABLE}" in rules, "local default" in routes

    def _ensure_policy_route(self) -> None:
        have_rule, have_route = self._policy_route_state()
        mark = f"{TPROXY_MARK:#x}/{TPROXY_MARK:#x}"
        if not have_route:
            rc, out = self._ip(
                "route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", str(ROUTE_TABLE)
            )
            if rc:
                log.warning("cannot add the transparent-proxy route: %s", out.strip())
        if not have_rule:
            rc, out = self._ip(
                "rule",
                "add",
                "fwmark",
                mark,
                "lookup",
                str(ROUTE_TABLE),
                "pref",
                str(RULE_PRIORITY),
            )
            if rc:
                log.warning("cannot add the transparent-proxy rule: %s", out.strip())

    # --- drift, ownership, cleanup -----------------------------------------------------------

    @property
    def iptables_flavour(self) -> str:
        return self.backend.flavour

    def drifted(self) -> bool:
        if self._rules is None:
            return False
        try:
            canary = self.backend.chain_exists("nat", CANARY_CHAIN)
        except IptablesError as err:
            log.warning("cannot check the canary chain: %s", err)
            canary = True
        if not canary:
            log.warning("canary chain %s is gone: rules were flushed; full resync", CANARY_CHAIN)
            return True
        live = self.workers.workers()
        if len(live) < self.workers.count:
            log.warning(
                "userspace workers missing (%d of %d live); full resync",
                len(live),
                self.workers.count,
            )
            return True
        rule, route = self._policy_route_state()
        if not (rule and route):
            log.warning("the transparent-proxy policy route is gone; full resync")
            return True
        return False

    def detach(self) -> None:
        """Out of the packet path in one restore: delete the jumps from the built-in chains
        (all tables in one input, nat first). Workers keep serving the connections they
        have; their redirects keep their conntrack translation. A full sync re-attaches."""
        lines: dict[str, list[str]] = {"nat": [], "filter": [], "mangle": []}
        for table, _verb, rule, present in self._jumps_in_place():
            if present:
                lines[table].append(f"-D {rule}")
        text = "".join(f"*{t}\n" + "\n".join(ls) + "\nCOMMIT\n" for t, ls in lines.items() if ls)
        if text:
            try:
                self.backend.restore(text)
            except IptablesError as err:
                raise SyncError(f"could not detach userspace mode: {err}") from err
        self._rules = None  # the next sync is full and puts the jumps back

    def owned(self, *, rules: bool = True) -> list[OwnedObject]:
        """Its chains and jumps (unless not rules), workers and policy route."""
        from kproxy.dataplane.iptables.cleanup import _target, owned_state

        found = []
        for obj in owned_state(self.backend) if rules else ():
            name = _target(obj.name) if obj.kind == "iptables-rule" else obj.name
            if name in OUR_CHAINS:
                found.append(obj)
        for index, info in sorted(self.workers.workers().items()):
            found.append(
                OwnedObject(
                    "process",
                    "userspace",
                    f"pid {info.pid}",
                    f"userspace worker {index} of {self.state_dir}",
                )
            )
        rule, route = self._policy_route_state()
        if rule:
            found.append(
                OwnedObject(
                    "ip-rule",
                    "ipv4",
                    f"pref {RULE_PRIORITY}",
                    f"fwmark {TPROXY_MARK:#x} lookup {ROUTE_TABLE} (transparent proxy replies)",
                )
            )
        if route:
            found.append(
                OwnedObject(
                    "ip-route",
                    "ipv4",
                    f"table {ROUTE_TABLE}",
                    "local default dev lo (transparent proxy replies)",
                )
            )
        return found

    def cleanup(self, *, dry_run: bool = False, rules: bool = True) -> list[OwnedObject]:
        """Rules first (nothing new is steered to the workers), then workers, then routes.
        rules=False: the chains are someone else's to remove (they went already)."""
        from kproxy.dataplane.iptables.cleanup import cleanup_input

        owned = self.owned(rules=rules)
        if dry_run:
            return owned
        ipt = [o for o in owned if o.kind.startswith("iptables")]
        if ipt:
            self.backend.restore(cleanup_input(ipt))
        # Between the rules and the workers: nothing new is redirected any more, and the
        # workers still answer until the flows have left them.
        flows = self._udp_flows()
        handed_off = self._start_handoff(flows)
        self._forget_datagram_flows(flows)
        self.workers.stop_all()
        if handed_off:
            self._end_handoff()
        if any(o.kind == "ip-rule" for o in owned):
            self._ip("rule", "del", "pref", str(RULE_PRIORITY))
        if any(o.kind == "ip-route" for o in owned):
            self._ip("route", "flush", "table", str(ROUTE_TABLE))
        with contextlib.suppress(OSError):
            self.workers.table_path.unlink()
        self._rules = None
        self._table = None
        return owned

    def close(self) -> None:
        """Release the controller lock (the workers keep running)."""
        self.workers.release()

    def _udp_listeners(self) -> list[Mapping[str, Any]]:
        listeners = (self._table or {}).get("listeners", [])
        return [lst for lst in listeners if lst.get("protocol") == "udp"]

    def _udp_flows(self) -> list[ConntrackEntry] | None:
        """The UDP conntrack entries, when there are UDP listeners (None: none, or the table
        could not be read, which is logged)."""
        if not self._udp_listeners():
            return None
        try:
            return Conntrack(self.backend.netns).list_entries("udp")
        except (ConntrackError, OSError) as err:
            log.warning("cannot read the conntrack entries of UDP flows to the workers: %s", err)
            return None

    def _start_handoff(self, flows: list[ConntrackEntry] | None) -> bool:
        """Before the UDP flows' conntrack entries go: the workers send their replies from
        the service address, untracked (udp.py), so a reply in flight when an entry goes is
        not lost. True if the raw-table rule that leaves them untracked was added."""
        table = self._table or {}
        udp = self._udp_listeners()
        if not udp or not self.workers.workers():
            return False
        try:
            self.backend.restore(f"*raw\n-I {HANDOFF_RULE}\nCOMMIT\n")
        except IptablesError as err:
            log.warning("cannot hand UDP flows over (%s): a reply in flight may be lost", err)
            return False
        peers = remapped_clients(flows or (), udp)
        try:
            generation = self.workers.write_table(
                {**table, "udp_handoff": True, "udp_handoff_peers": peers}
            )
            self.workers.wait_applied(generation, self.ack_timeout)
        except (ControlError, OSError) as err:
            log.warning("userspace workers did not take the UDP hand-off: %s", err)
        return True

    def _end_handoff(self) -> None:
        try:
            self.backend.delete_rule("raw", rule_spec(HANDOFF_RULE))
        except IptablesError as err:
            log.warning("cannot remove the UDP hand-off rule from raw OUTPUT: %s", err)

    def _forget_datagram_flows(self, flows: list[ConntrackEntry] | None) -> None:
        """Delete the conntrack entries of UDP flows redirected to the workers (flows: the
        UDP entries listed after the rules went, so no redirected flow is missing).

        A UDP client that keeps its 5-tuple stays one conntrack entry, whose translation to
        a proxy port outlives the rules; once the workers are gone every datagram of the
        flow would be refused, for as long as the flow keeps the entry alive. With the entry
        gone, the next datagram is NEW and whatever serves the service now takes it."""
        if not flows:
            return
        conntrack = Conntrack(self.backend.netns)
        try:
            filters = redirected_flow_filters(flows, self._udp_listeners())
            deleted = conntrack.delete_many(filters)
        except (ConntrackError, OSError) as err:
            log.warning("cannot clear the conntrack entries of UDP flows to the workers: %s", err)
            return
        if deleted:
            log.info("cleared %d conntrack entries of UDP flows to the workers", deleted)


def _redirected(entry: ConntrackEntry, by_port: Mapping[int, set[str]]) -> bool:
    """Was this UDP flow sent to a listener's destination and answered from its port?"""
    dests = by_port.get(entry.reply_sport or -1, set())
    return (
        f"{entry.orig_dst}:{entry.orig_dport}" in dests or f"nodePort {entry.orig_dport}" in dests
    )


def _destinations_by_port(listeners: Iterable[Mapping[str, Any]]) -> dict[int, set[str]]:
    by_port: dict[int, set[str]] = {}
    for lst in listeners:
        by_port.setdefault(int(lst["port"]), set()).update(lst.get("destinations", ()))
    return by_port


def remapped_clients(
    entries: Iterable[ConntrackEntry], listeners: Iterable[Mapping[str, Any]]
) -> dict[str, int]:
    """Redirected UDP flows whose client port conntrack remapped (the redirect's reply tuple
    clashed with another entry): "client ip:port the worker sees" -> the client's port."""
    by_port = _destinations_by_port(listeners)
    return {
        f"{e.orig_src}:{e.reply_dport}": e.orig_sport
        for e in entries
        if e.proto == "udp"
        and e.orig_dport is not None
        and e.orig_sport is not None
        and e.reply_dport is not None
        and e.reply_dport != e.orig_sport
        and e.reply_dst == e.orig_src
        and _redirected(e, by_port)
    }


def redirected_flow_filters(
    entries: Iterable[ConntrackEntry], listeners: Iterable[Mapping[str, Any]]
) -> list[DeleteFilter]:
    """Deletes for the UDP flows among entries that were redirected to a listener: sent to
    one of its destinations ("ip:port", "nodePort N") and answered from its proxy port.
    One filter per (destination, port, proxy address) (each filter costs a table dump),
    unless a flow another mode translated shares it: then one per redirected flow."""
    by_port = _destinations_by_port(listeners)
    ours: dict[tuple[str, int, str], list[ConntrackEntry]] = {}
    foreign: set[tuple[str, int, str]] = set()
    for e in entries:
        if e.proto != "udp" or e.orig_dport is None:
            continue
        key = (e.orig_dst, e.orig_dport, e.reply_src)
        if _redirected(e, by_port):
            ours.setdefault(key, []).append(e)
        else:
            foreign.add(key)
    filters: list[DeleteFilter] = []
    for (dst, dport, proxy), flows in sorted(ours.items()):
        if (dst, dport, proxy) not in foreign:
            filters.append(DeleteFilter("udp", orig_dst=dst, orig_dport=dport, reply_src=proxy))
            continue
        filters += [
            DeleteFilter(
                "udp",
                orig_src=e.orig_src,
                orig_sport=e.orig_sport,
                orig_dst=dst,
                orig_dport=dport,
                reply_src=proxy,
            )
            for e in flows
        ]
    return filters


def clean_userspace_leftovers(
    state_dir: Path, *, netns: str | None = None, dry_run: bool = False
) -> list[OwnedObject]:
    """What a node running another mode should remove of userspace mode, for leftovers.py:
    the workers of `state_dir` and the policy route. Not the chains: they are upstream's
    userspace chains, which the iptables cleanup of both backends removes (and lists)
    before this runs; reading them again cost two iptables-nft-saves, seconds each on a
    large node (iptables-nft fetches every table of the family, nftables mode's too)."""
    # The backend is only the namespace here: nothing of iptables is read or written.
    backend = IptablesBackend("legacy", netns=netns)
    dp = UserspaceDataplane(backend, NodeFacts(), RuleOptions(), state_dir=state_dir)
    try:
        return dp.cleanup(dry_run=dry_run, rules=False)
    finally:
        dp.close()


def saved_ports(state_dir: Path) -> dict[str, int]:
    """The persisted proxy-port allocation of a state dir (for `kproxy render`), or {}."""
    saved = read_json(Path(state_dir) / SUBDIR / PORTS_FILE)
    if not isinstance(saved, dict):
        return {}
    return {str(k): int(v) for k, v in dict(saved.get("ports", {})).items()}


def create_userspace_dataplane(
    *,
    options: RuleOptions,
    node_ips: tuple[str, ...] = (),
    iptables_backend_choice: str = "auto",
    state_dir: Path | None = None,
    workers: int | None = None,
    port_range: str = "",
) -> tuple[UserspaceDataplane, NodeFacts]:
    """What registry.create_dataplane does for mode "userspace" (same arguments)."""
    from kproxy.dataplane.nodefacts import detect_node_facts

    backend = chosen_backend(iptables_backend_choice)
    facts = detect_node_facts(backend=backend, node_ips=node_ips)
    if workers is None and os.environ.get("KPROXY_USERSPACE_WORKERS", "").isdigit():
        workers = int(os.environ["KPROXY_USERSPACE_WORKERS"])  # benchmarks and debugging
    log.info(
        "userspace mode: iptables backend %s, %s workers",
        backend.flavour,
        workers or os.cpu_count(),
    )
    dataplane = UserspaceDataplane(
        backend, facts, options, state_dir=state_dir, workers=workers, port_range=port_range
    )
    return dataplane, facts


def _with_jumps(text: str, jumps: list[tuple[str, str]]) -> str:
    """Put the missing jump lines right before each table's COMMIT."""
    if not jumps:
        return text
    out: list[str] = []
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
        if line == "COMMIT":
            out += [rule for t, rule in jumps if t == table]
        out.append(line)
    return "\n".join(out) + "\n"


__all__ = [
    "UserspaceDataplane",
    "clean_userspace_leftovers",
    "create_userspace_dataplane",
    "redirected_flow_filters",
    "remapped_clients",
    "render",
    "saved_ports",
    "userspace_chain",
]
