"""Full and partial syncs of IptablesDataplane in fresh namespaces, against the bare restore.

One repeat at one size on one backend is:

1. ours, in a fresh namespace A: initial full sync (empty tables), resync (a full sync over
   the populated tables, same dataplane: the periodic full sync, after some other
   software's nf_tables commit in the namespace, so the nft backend cannot trust the
   kernel), trusted (the next full sync, with nothing but kproxy having changed the kernel:
   on nft it writes only what changed, on legacy it is another resync), then one-service
   partial syncs (the 10 endpoints of one service replaced through a ChangeTracker event);
2. bare, in a fresh namespace B: the exact restore inputs the dataplane sent in step 1,
   each fed to `iptables-<flavour>-restore --noflush`, in the same order, so every timed
   load starts from the same kernel state as ours did;
3. nft only, at sizes <= GIANT_MAX: the same initial input merged into ONE restore, in a
   fresh namespace C (what the sync would cost without splitting).

Namespaces are deleted after use and the machine is left to go quiet before the next load.
"""

from __future__ import annotations

import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from bench import netns, workload
from bench.contention import Meter
from bench.fixes import BUG1_MESSAGE, MarkMasqFirstDataplane
from bench.stats import ONCE_ABOVE, Stat
from kproxy.dataplane.base import SyncError
from kproxy.dataplane.facts import RuleOptions
from kproxy.dataplane.iptables import names
from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.iptables.proxier import IptablesDataplane
from kproxy.dataplane.iptables.render import IptablesPlan
from kproxy.model.objects import ServicePortName, Snapshot
from kproxy.model.snapshot import ChangeTracker

GIANT_MAX = 5000  # one-restore nft loads above this take ~10 min (lab §2.2): not run
GIANT_REPEAT_MAX = 2000  # above this the one-restore nft load is run once
GIANT_TIMEOUT = 180.0  # s: a one-restore load still running then is stopped and reported so
KINDS = ("initial", "resync", "trusted", "partial")
PARTIALS = 3  # one-service partial syncs per repeat, each a different service
PARTS = ("plan", "save", "check", "restore", "other")


class TimedBackend(IptablesBackend):
    """The production backend, recording each restore input and the time per tool call."""

    def __init__(self, flavour: str, ns: str) -> None:
        super().__init__(flavour, netns=ns)
        self.inputs: list[str] = []
        self.spent: dict[str, float] = defaultdict(float)

    def restore(self, data: str, *, noflush: bool = True, counters: bool = True) -> None:
        t0 = time.perf_counter()
        try:
            super().restore(data, noflush=noflush, counters=counters)
        finally:
            self.spent["restore"] += time.perf_counter() - t0
        self.inputs.append(data)

    def save(self, table: str | None = None) -> str:
        t0 = time.perf_counter()
        try:
            return super().save(table)
        finally:
            self.spent["save"] += time.perf_counter() - t0

    def check_rule(self, table: str, spec: Sequence[str]) -> bool:
        t0 = time.perf_counter()
        try:
            return super().check_rule(table, spec)
        finally:
            self.spent["check"] += time.perf_counter() - t0

    def take(self) -> tuple[list[str], dict[str, float]]:
        inputs, spent = self.inputs, dict(self.spent)
        self.inputs, self.spent = [], defaultdict(float)
        return inputs, spent


@dataclass
class SyncFigures:
    backend: str
    size: int
    ours: dict[str, Stat] = field(default_factory=lambda: {k: Stat() for k in KINDS})
    bare: dict[str, Stat] = field(default_factory=lambda: {k: Stat() for k in KINDS})
    # per kind, per part (plan/save/check/restore/other): seconds of each repeat
    parts: dict[str, dict[str, Stat]] = field(
        default_factory=lambda: {k: {p: Stat() for p in PARTS} for k in KINDS}
    )
    # CPU cores' worth of other work on the machine during each measurement (contention.py)
    foreign: dict[str, Stat] = field(default_factory=lambda: {k: Stat() for k in KINDS})
    foreign_bare: dict[str, Stat] = field(default_factory=lambda: {k: Stat() for k in KINDS})
    snapshot: Stat = field(default_factory=Stat)  # tracker.snapshot() after the change
    giant: Stat = field(default_factory=Stat)  # nft: the initial input as one restore
    giant_foreign: Stat = field(default_factory=Stat)
    # nft: the same one-service rewrite restored with / without the jumps from the built-in
    # chains (the kernel validates every chain reachable from a hook on each commit)
    attached: Stat = field(default_factory=Stat)
    detached: Stat = field(default_factory=Stat)
    pieces: dict[str, int] = field(default_factory=dict)
    input_bytes: dict[str, int] = field(default_factory=dict)
    input_lines: dict[str, int] = field(default_factory=dict)
    rules_in_kernel: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    workaround: str = ""  # set when the production code failed and bench.fixes was used

    def to_json(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "size": self.size,
            "ours": {k: v.to_json() for k, v in self.ours.items()},
            "bare": {k: v.to_json() for k, v in self.bare.items()},
            "parts": {k: {p: s.to_json() for p, s in v.items()} for k, v in self.parts.items()},
            "foreign": {k: v.to_json() for k, v in self.foreign.items()},
            "foreign_bare": {k: v.to_json() for k, v in self.foreign_bare.items()},
            "snapshot": self.snapshot.to_json(),
            "giant": self.giant.to_json(),
            "giant_foreign": self.giant_foreign.to_json(),
            "attached": self.attached.to_json(),
            "detached": self.detached.to_json(),
            "pieces": self.pieces,
            "input_bytes": self.input_bytes,
            "input_lines": self.input_lines,
            "rules_in_kernel": self.rules_in_kernel,
            "problems": self.problems,
            "workaround": self.workaround,
        }


def _foreign_commit(ns: str) -> None:
    """One nf_tables commit of "some other software" in the namespace (an empty table)."""
    argv = netns.exec_argv(ns, ["nft", "add", "table", "ip", "kpb_other"])
    subprocess.run(argv, check=True, capture_output=True)


def bare_restore(
    ns: str, flavour: str, inputs: Sequence[str], *, timeout: float | None = None
) -> float:
    """Feed inputs one after the other to iptables-<flavour>-restore --noflush; seconds.
    With a timeout the restore (our child) is killed and TimeoutExpired raised."""
    argv = netns.exec_argv(ns, [f"iptables-{flavour}-restore", "--noflush"])
    t0 = time.perf_counter()
    for i, data in enumerate(inputs):
        proc = subprocess.run(
            argv, input=data, capture_output=True, text=True, check=False, timeout=timeout
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"bare restore {i + 1}/{len(inputs)} in {ns} failed: {proc.stderr.strip()[:500]}"
            )
    return time.perf_counter() - t0


def merge_pieces(pieces: Sequence[str]) -> str:
    """The pieces of a split sync as one restore input: per table all declarations, then
    all rules (jumps included), then the -X lines."""
    tables: dict[str, tuple[list[str], list[str], list[str]]] = {}
    current: tuple[list[str], list[str], list[str]] | None = None
    for piece in pieces:
        for line in piece.splitlines():
            if line.startswith("*"):
                current = tables.setdefault(line[1:], ([], [], []))
            elif line == "COMMIT" or current is None:
                current = None if line == "COMMIT" else current
            elif line.startswith(":"):
                current[0].append(line)
            elif line.startswith("-X "):
                current[2].append(line)
            else:
                current[1].append(line)
    out: list[str] = []
    for table in sorted(tables, key=lambda t: (t != "filter", t)):
        decls, rules, deletes = tables[table]
        out += [f"*{table}", *dict.fromkeys(decls), *rules, *deletes, "COMMIT"]
    return "\n".join(out) + "\n"


def count_rules(ns: str, flavour: str) -> dict[str, int]:
    """'-A' lines per table, from a full save (a full legacy save creates no tables)."""
    proc = subprocess.run(
        netns.exec_argv(ns, [f"iptables-{flavour}-save"]),
        capture_output=True,
        text=True,
        check=True,
    )
    counts: dict[str, int] = {}
    table = ""
    for line in proc.stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
            counts[table] = 0
        elif line.startswith("-A "):
            counts[table] += 1
    return counts


class _Timed:
    """Wraps the dataplane's renderer.plan to time the planning inside a sync."""

    def __init__(self, dp: IptablesDataplane) -> None:
        self.seconds = 0.0
        self._plan = dp.renderer.plan
        dp.renderer.plan = self  # type: ignore[method-assign]

    def __call__(
        self,
        snapshot: Snapshot,
        *,
        rewrite: set[ServicePortName] | None = None,
        existing_chains: Iterable[str] = (),
    ) -> IptablesPlan:
        t0 = time.perf_counter()
        try:
            return self._plan(snapshot, rewrite=rewrite, existing_chains=existing_chains)
        finally:
            self.seconds += time.perf_counter() - t0


def _settle(flavour: str, size: int, *, heavy: bool = False) -> None:
    """After a namespace was deleted (a kernel worker frees its tables, which slows the next
    load): wait until the machine is quiet, at most a few seconds (other work on a shared
    machine would otherwise keep us waiting). Before a one-restore nft load wait >= 10 s."""
    if heavy:
        netns.wait_quiet(min_wait=10.0, max_wait=15.0, busy_below=0.2)
    else:
        netns.wait_quiet(min_wait=1.0, max_wait=3.0, busy_below=0.2)


def _between_steps() -> None:
    """Between two syncs in one namespace: nothing is being freed, a short pause only."""
    time.sleep(0.3)


Step = tuple[str, list[str]]  # (kind, the restore inputs the dataplane sent for it)


class SyncBench:
    def __init__(
        self,
        flavour: str,
        size: int,
        options: RuleOptions,
        log: Callable[[str], None],
        *,
        partials: int = PARTIALS,
    ) -> None:
        self.dp_class: type[IptablesDataplane] = IptablesDataplane
        self.flavour = flavour
        self.size = size
        self.options = options
        self.log = log
        self.partials = partials
        self.fig = SyncFigures(flavour, size)
        self.tracker: ChangeTracker = workload.tracker(size)
        self._generation = 0
        self._initial_inputs: list[str] = []

    def run(self, repeats: int, *, giant: bool) -> SyncFigures:
        previous: list[Step] | None = None
        for r in range(repeats):
            if r % 2 == 1 and previous is not None:
                # Alternate who goes first, so neither side always follows a deletion.
                self._bare(previous, r)
                _settle(self.flavour, self.size)
                steps = self._ours_or_fix(r)
            else:
                steps = self._ours_or_fix(r)
                _settle(self.flavour, self.size)
                self._bare(steps, r)
            _settle(self.flavour, self.size)
            previous = steps
            if any(self.fig.ours[k].values[-1] > ONCE_ABOVE for k in KINDS):
                for k in KINDS:
                    self.fig.ours[k].note = "1 run: slower than 60 s"
                break
        if giant and self.flavour == "nft":
            self._giant(repeats)
        return self.fig

    # -- ours -------------------------------------------------------------------------------

    def _ours_or_fix(self, r: int) -> list[Step]:
        try:
            return self._ours(r)
        except SyncError as err:
            if self.dp_class is not IptablesDataplane or BUG1_MESSAGE not in str(err):
                raise
            self._fall_back(err)
            return self._ours(r)

    def _ours(self, r: int) -> list[Step]:
        fig = self.fig
        steps: list[Step] = []
        with netns.fresh() as ns:
            backend = TimedBackend(self.flavour, ns)
            backend.version()  # the daemon reads it (random-fully) before its first sync
            names.port_proto_hash.cache_clear()  # a fresh process has no name cache either
            dp = self.dp_class(backend, workload.facts(), self.options)
            timer = _Timed(dp)
            snap = self.tracker.snapshot()
            plan = ["initial", "resync", "trusted", *["partial"] * self.partials]
            for n, kind in enumerate(plan):
                if n:
                    _between_steps()
                if kind == "partial":
                    t0 = time.perf_counter()
                    snap = self._change(r * self.partials + n)
                    fig.snapshot.add(time.perf_counter() - t0)
                if kind == "resync" and self.flavour == "nft":
                    _foreign_commit(ns)
                timer.seconds = 0.0
                with Meter() as meter:
                    t0 = time.perf_counter()
                    result = dp.sync(snap, full=(kind != "partial"))
                    took = time.perf_counter() - t0
                fig.ours[kind].add(took)
                fig.foreign[kind].add(meter.foreign_cores)
                data, spent = backend.take()
                steps.append((kind, data))
                spent["plan"] = timer.seconds
                spent["other"] = took - sum(spent.get(p, 0.0) for p in PARTS if p != "other")
                for p in PARTS:
                    fig.parts[kind][p].add(spent.get(p, 0.0))
                fig.pieces[kind] = result.pieces
                fig.input_bytes[kind] = sum(len(d) for d in data)
                fig.input_lines[kind] = sum(d.count("\n") for d in data)
                if kind == "partial" and result.rewritten != 1:
                    fig.problems.append(f"partial rewrote {result.rewritten} services, not 1")
                trusted = kind == "trusted" and self.flavour == "nft"
                if result.kernel_unchanged != trusted:
                    fig.problems.append(f"{kind}: kernel_unchanged={result.kernel_unchanged}")
                self.log(
                    f"    {self.flavour} {self.size} #{r + 1} ours {kind}: {took:.3f} s "
                    f"({result.pieces} piece(s); others {meter.foreign_cores:.2f} cores)"
                )
            if not fig.rules_in_kernel:
                fig.rules_in_kernel = count_rules(ns, self.flavour)
        if not self._initial_inputs:
            self._initial_inputs = steps[0][1]
        return steps

    def _fall_back(self, err: SyncError) -> None:
        """The production initial sync hit bug 1 (bench/fixes.py): say so, use the fix."""
        for stats in (self.fig.ours, self.fig.foreign, *self.fig.parts.values()):
            for st in stats.values():
                st.values.clear()
        self.fig.snapshot.values.clear()
        self.fig.workaround = "bug 1: split initial sync rejected, see bench/fixes.py"
        self.fig.problems.append(f"production initial full sync FAILED: {str(err)[:300]}")
        self.log(
            f"    {self.flavour} {self.size}: production initial sync failed (bug 1); "
            "measuring with the bench workaround"
        )
        self.dp_class = MarkMasqFirstDataplane
        _settle(self.flavour, self.size)

    def _change(self, n: int) -> Snapshot:
        self._generation += 1
        i = (n * 7919 + 17) % self.size
        return workload.change_one(self.tracker, i, self._generation)

    # -- bare -------------------------------------------------------------------------------

    def _bare(self, steps: list[Step], r: int) -> None:
        with netns.fresh() as ns:
            for n, (kind, data) in enumerate(steps):
                if n:
                    _between_steps()
                with Meter() as meter:
                    took = bare_restore(ns, self.flavour, data)
                self.fig.bare[kind].add(took)
                self.fig.foreign_bare[kind].add(meter.foreign_cores)
                self.log(
                    f"    {self.flavour} {self.size} #{r + 1} bare {kind}: {took:.3f} s "
                    f"(others {meter.foreign_cores:.2f} cores)"
                )
            if r == 0:
                counts = count_rules(ns, self.flavour)
                if counts != self.fig.rules_in_kernel:
                    self.fig.problems.append(
                        f"bare restores left {counts} rules, the dataplane "
                        f"{self.fig.rules_in_kernel}"
                    )
                if self.flavour == "nft":
                    self._kernel_share(ns, steps)

    def _kernel_share(self, ns: str, steps: list[Step]) -> None:
        """Time one service's rewrite (the last partial minus its stale-chain deletion) with
        the jumps from the built-in chains in place, then again after deleting them."""
        lines = steps[-1][1][0].splitlines()
        stale = {line[3:] for line in lines if line.startswith("-X ")}
        rewrite = (
            "\n".join(
                line
                for line in lines
                if not line.startswith("-X ")
                and not (line.startswith(":") and line[1:].split(" ")[0] in stale)
            )
            + "\n"
        )
        undo: dict[str, list[str]] = {}
        for piece in steps[0][1]:
            table = ""
            for line in piece.splitlines():
                if line.startswith("*"):
                    table = line[1:]
                elif line.startswith("-I "):
                    undo.setdefault(table, []).append("-D " + line[3:])
        for _ in range(3):
            _between_steps()
            self.fig.attached.add(bare_restore(ns, self.flavour, [rewrite]))
        bare_restore(
            ns,
            self.flavour,
            ["".join(f"*{t}\n" + "\n".join(ls) + "\nCOMMIT\n" for t, ls in undo.items())],
        )
        for _ in range(3):
            _between_steps()
            self.fig.detached.add(bare_restore(ns, self.flavour, [rewrite]))
        self.log(
            f"    {self.flavour} {self.size} one-service rewrite, bare: "
            f"{self.fig.attached.median:.3f} s attached, "
            f"{self.fig.detached.median:.3f} s without the built-in chain jumps"
        )

    # -- one giant restore (nft) ------------------------------------------------------------

    def _giant(self, repeats: int) -> None:
        if self.size > GIANT_MAX:
            self.fig.giant.note = "not run"
            return
        data = merge_pieces(self._initial_inputs)
        runs = 1 if self.size > GIANT_REPEAT_MAX else repeats
        for _ in range(runs):
            _settle(self.flavour, self.size, heavy=self.size >= 5000)
            with netns.fresh() as ns:
                self.log(
                    f"    {self.flavour} {self.size} bare one-restore full load "
                    f"({len(data) / 1e6:.1f} MB)..."
                )
                try:
                    with Meter() as meter:
                        took = bare_restore(ns, self.flavour, [data], timeout=GIANT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.fig.giant.note = f"> {GIANT_TIMEOUT:.0f} s: stopped, 1 run"
                    self.log(
                        f"    {self.flavour} {self.size} bare one-restore: still running "
                        f"after {GIANT_TIMEOUT:.0f} s, stopped"
                    )
                    break
                self.fig.giant.add(took)
                self.fig.giant_foreign.add(meter.foreign_cores)
                self.log(
                    f"    {self.flavour} {self.size} bare one-restore: {took:.2f} s "
                    f"(others {meter.foreign_cores:.2f} cores)"
                )
            if took > ONCE_ABOVE:
                break
        _settle(self.flavour, self.size, heavy=self.size >= 5000)


def piece_sweep(
    size: int, options: RuleOptions, piece_sizes: Sequence[int], log: Callable[[str], None]
) -> dict[int, float]:
    """nft initial full sync at one size with other PIECE_SERVICES values (one run each)."""
    out: dict[int, float] = {}
    cls: type[IptablesDataplane] = IptablesDataplane
    snapshot = workload.tracker(size).snapshot()
    for ps in piece_sizes:
        _settle("nft", size)
        for attempt in (1, 2):
            with netns.fresh() as ns:
                backend = TimedBackend("nft", ns)
                backend.version()
                dp = cls(backend, workload.facts(), options, piece_services=ps)
                t0 = time.perf_counter()
                try:
                    result = dp.sync(snapshot, full=True)
                except SyncError as err:
                    if attempt == 2 or BUG1_MESSAGE not in str(err):
                        raise
                    cls = MarkMasqFirstDataplane
                    continue
                out[ps] = time.perf_counter() - t0
            log(
                f"    nft {size} initial with {ps} services per piece: {out[ps]:.2f} s "
                f"({result.pieces} pieces)"
            )
            break
    _settle("nft", size)
    return out
