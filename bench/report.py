"""BENCHMARKS.md from one bench run's figures: machine, method, goals, tables, problems."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.render_bench import RenderFigures
from bench.rss_bench import RssFigures
from bench.stats import Stat, fmt_s, fmt_stat
from bench.sync_bench import GIANT_TIMEOUT, KINDS, PARTS, SyncFigures

RENDER_GOAL = 0.5  # s, render of 10,000 services
LEGACY_RATIO_GOAL = 1.2  # x the bare restore
NFT_FULL_GOAL = 6.0  # s, full sync of 5,000 services
NFT_PARTIAL_GOAL = 0.1  # s, one-service partial at 10,000
RSS_GOAL = 150.0  # MB at 10,000 services


@dataclass
class Results:
    machine: dict[str, str]
    command: str
    repeats: int
    sizes: list[int]
    backends: list[str]
    render: list[RenderFigures] = field(default_factory=list)
    syncs: list[SyncFigures] = field(default_factory=list)
    sweep: dict[int, float] = field(default_factory=dict)
    sweep_size: int = 0
    rss: list[RssFigures] = field(default_factory=list)
    membreak: dict[str, dict[str, object]] = field(default_factory=dict)
    membreak_size: int = 0
    membreak_traced_size: int = 0
    load_end: str = ""
    wall_s: float = 0.0

    def sync(self, backend: str, size: int) -> SyncFigures | None:
        return next((s for s in self.syncs if s.backend == backend and s.size == size), None)


def _ratio(a: Stat, b: Stat) -> float | None:
    if a.median is None or not b.median:
        return None
    return a.median / b.median


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _cores(st: Stat) -> str:
    return "-" if st.median is None else f"{st.median:.2f}"


def _mb(n: float) -> str:
    return f"{n:.0f} MB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return [*out, ""]


def _extrapolate(points: dict[int, float], target: int) -> float | None:
    """Power law through the two largest measured points."""
    if len(points) < 2:
        return None
    (n1, t1), (n2, t2) = sorted(points.items())[-2:]
    if t1 <= 0 or t2 <= 0 or n1 == n2:
        return None
    b = math.log(t2 / t1) / math.log(n2 / n1)
    return t2 * (target / n2) ** b


# --- goals ---------------------------------------------------------------------------------


def goals(res: Results) -> list[list[str]]:
    rows: list[list[str]] = []
    render = next((r for r in res.render if r.size == 10000), None)
    if render is not None and render.cold.median is not None:
        rows.append(
            [
                "render of 10,000 services ≤ 0.5 s",
                f"{fmt_s(render.cold.median)} median, {fmt_s(render.cold.best)} best",
                _met(render.cold.median <= RENDER_GOAL),
            ]
        )
    else:
        rows.append(["render of 10,000 services ≤ 0.5 s", "not measured (size not run)", "-"])
    if "legacy" in res.backends:
        for kind in ("initial", "resync", "partial"):
            ratios = []
            for size in res.sizes:
                fig = res.sync("legacy", size)
                if fig is not None:
                    ratios.append((size, _ratio(fig.ours[kind], fig.bare[kind])))
            valid = [r for _, r in ratios if r is not None]
            text = ", ".join(f"{_fmt_ratio(r)} at {s:,}" for s, r in ratios)
            rows.append(
                [
                    f"legacy {kind} sync ≤ 1.2 x bare restore of the same input",
                    text or "not measured",
                    _met(all(r <= LEGACY_RATIO_GOAL for r in valid)) if valid else "-",
                ]
            )
    if "nft" in res.backends:
        fig = res.sync("nft", 5000)
        for kind in ("initial", "resync", "trusted"):
            what = (
                "resync, kernel unchanged since kproxy's last write" if kind == "trusted" else kind
            )
            label = f"nft full sync ({what}) of 5,000 services ≤ 6 s"
            if fig is None or fig.ours[kind].median is None:
                rows.append([label, "not measured (size not run)", "-"])
                continue
            med = fig.ours[kind].median
            assert med is not None
            value = f"{fmt_s(med)}, {fig.pieces.get(kind, 0)} pieces"
            if kind == "initial" and fig.workaround:
                rows.append(
                    [
                        label,
                        f"**fails** as shipped (bug 1); {value} with the bench workaround",
                        "**not met**",
                    ]
                )
            else:
                rows.append([label, value, _met(med <= NFT_FULL_GOAL)])
        fig = res.sync("nft", 10000)
        label = "nft one-service partial sync at 10,000 services ≤ 100 ms"
        if fig is None or fig.ours["partial"].median is None:
            rows.append([label, "not measured (size not run)", "-"])
        else:
            med = fig.ours["partial"].median
            snap = fig.snapshot.median or 0.0
            rows.append(
                [
                    label,
                    f"{fmt_s(med)} median of {len(fig.ours['partial'].values)} "
                    f"(+ {fmt_s(snap)} tracker snapshot before it)",
                    _met(med <= NFT_PARTIAL_GOAL),
                ]
            )
    for fig in (f for f in res.rss if f.size == 10000):
        rows.append(
            [
                f"RSS ≤ 150 MB at 10,000 services ({fig.backend})",
                f"VmRSS {_mb(fig.rss_mb)} after the first sync, VmHWM {_mb(fig.hwm_mb)}",
                _met(fig.rss_mb <= RSS_GOAL and fig.hwm_mb <= RSS_GOAL),
            ]
        )
    if not any(f.size == 10000 for f in res.rss):
        rows.append(["RSS ≤ 150 MB at 10,000 services", "not measured (size not run)", "-"])
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


# --- sections ------------------------------------------------------------------------------


def _machine(res: Results) -> list[str]:
    out = ["## Machine and run", ""]
    rows = [[k, v] for k, v in res.machine.items()]
    rows.append(["load average at end", res.load_end])
    rows.append(["command", f"`{res.command}`"])
    rows.append(
        [
            "repeats",
            f"median of {res.repeats} (runs slower than 60 s: once, "
            'marked "1 run"); partial syncs: 3 per repeat, each a different service',
        ]
    )
    rows.append(["bench wall time", f"{res.wall_s / 60:.1f} min"])
    return out + _table(["", ""], rows)


def _render(res: Results) -> list[str]:
    if not res.render:
        return []
    out = [
        "## Parse + snapshot and render (in-process, no kernel)",
        "",
        "parse + snapshot = `snapshot_from_objects` over the object dicts; render (cold) = "
        "`IptablesRenderer(...).plan(snapshot).text()` from a fresh renderer with the "
        "chain-name cache cleared; render (warm) = the same renderer again (all blocks "
        "cached). Median / best.",
        "",
    ]
    rows = []
    for f in res.render:
        rows.append(
            [
                f"{f.size:,}",
                f"{f.lines:,} / {f.bytes / 1e6:.1f} MB",
                f"{fmt_stat(f.parse)} / {fmt_s(f.parse.best)}",
                f"{fmt_stat(f.cold)} / {fmt_s(f.cold.best)}",
                f"{fmt_stat(f.warm)} / {fmt_s(f.warm.best)}",
                _cores(f.foreign),
            ]
        )
    return out + _table(
        [
            "services",
            "restore input (lines / bytes)",
            "parse + snapshot",
            "render (cold)",
            "render (warm)",
            "others (cores)",
        ],
        rows,
    )


def _syncs(res: Results) -> list[str]:
    out: list[str] = []
    for backend in res.backends:
        figs = [f for f in res.syncs if f.backend == backend]
        if not figs:
            continue
        out += [
            f"## Sync: iptables-{backend}",
            "",
            "ours = `IptablesDataplane.sync()` (plan + every tool call it makes); bare = "
            f"the exact restore input(s) it sent, fed to `iptables-{backend}-restore "
            "--noflush` in a fresh namespace brought to the same state. initial = full "
            "sync into an empty namespace; resync = full sync over the populated one "
            "(same dataplane, as the periodic full sync; on nft after another program's "
            "commit in the namespace); trusted = the next full sync, nothing but kproxy "
            "having changed the kernel (nft: only changes written); partial = the 10 endpoints of "
            "one service replaced (ChangeTracker event), `sync(full=False)`.",
            "",
        ]
        rows = []
        for f in figs:
            row = [f"{f.size:,}"]
            for kind in KINDS:
                row += [
                    fmt_stat(f.ours[kind]),
                    fmt_stat(f.bare[kind]),
                    _fmt_ratio(_ratio(f.ours[kind], f.bare[kind])),
                ]
            rows.append(row)
        header = ["services"]
        for kind in KINDS:
            header += [f"{kind} ours", f"{kind} bare", "ratio"]
        out += _table(header, rows)
        rows = []
        for f in figs:
            rows.append(
                [f"{f.size:,}"]
                + [
                    f"{f.pieces.get(k, 0)} / {f.input_lines.get(k, 0):,} / "
                    f"{f.input_bytes.get(k, 0) / 1e6:.2f} MB"
                    for k in KINDS
                ]
                + [
                    fmt_stat(f.snapshot),
                    ", ".join(f"{t}: {n:,}" for t, n in sorted(f.rules_in_kernel.items())),
                ]
            )
        out += [
            "Inputs (restore calls / lines / bytes), the tracker snapshot a partial "
            "sync starts from, and the rules in the kernel after the first repeat:",
            "",
        ]
        out += _table(
            ["services", *[f"{k} input" for k in KINDS], "snapshot (partial)", "rules in kernel"],
            rows,
        )
        out += [
            "Where a sync's time goes (medians): plan = renderer.plan, save = "
            "the iptables-save a full sync reads its chains and jumps from, check = "
            "`iptables -C` of jumps not found in that save, restore = iptables-restore "
            "calls, other = the rest of sync(). "
            "others = CPU cores' worth of unrelated work on the machine during the "
            "measurement (median; 1.0 = one of the 2 cores taken).",
            "",
        ]
        rows = []
        for f in figs:
            for kind in KINDS:
                rows.append(
                    [
                        f"{f.size:,}",
                        kind,
                        *[fmt_s(f.parts[kind][p].median) for p in PARTS],
                        _cores(f.foreign[kind]),
                        _cores(f.foreign_bare[kind]),
                    ]
                )
        out += _table(["services", "sync", *PARTS, "others (ours)", "others (bare)"], rows)
        if backend == "nft" and any(f.attached.median is not None for f in figs):
            out += [
                "Kernel share of a partial sync: one service's rewrite (the last partial "
                "input without its stale-chain deletion) restored bare 3 times with the "
                "jumps from the built-in chains in place, then 3 times after deleting "
                "them (nothing reachable from a hook any more):",
                "",
            ]
            out += _table(
                ["services", "with jumps (as in production)", "without jumps"],
                [
                    [f"{f.size:,}", fmt_stat(f.attached), fmt_stat(f.detached)]
                    for f in figs
                    if f.attached.median is not None
                ],
            )
        if backend == "nft":
            out += _giant(res, figs)
    return out


def _giant(res: Results, figs: list[SyncFigures]) -> list[str]:
    out = [
        "### nft: split full sync vs the same input as one restore",
        "",
        "The initial full sync's pieces merged into ONE restore input (all declarations, "
        "then all rules, then -X), loaded into a fresh namespace after >= 10 s of quiet.",
        "",
    ]
    # Measured one-restore times; a load stopped at the timeout counts as a lower bound.
    measured: dict[int, float] = {}
    lower = False
    for f in figs:
        if f.giant.median is not None:
            measured[f.size] = f.giant.median
        elif f.giant.note.startswith(">"):
            measured[f.size] = GIANT_TIMEOUT
            lower = True
    rows = []
    for f in figs:
        one = fmt_stat(f.giant)
        if f.giant.median is None and not f.giant.note.startswith(">"):
            est = _extrapolate(measured, f.size)
            bound = "≥ " if lower else "~"
            one = "not run" + (f" (extrapolated {bound}{fmt_s(est)})" if est else "")
        speed = _ratio(f.giant, f.ours["initial"]) if f.giant.median else None
        rows.append(
            [
                f"{f.size:,}",
                f"{fmt_stat(f.ours['initial'])} ({f.pieces.get('initial', 0)} pieces)",
                fmt_stat(f.bare["initial"]),
                one,
                _fmt_ratio(speed),
                _cores(f.giant_foreign),
            ]
        )
    out += _table(
        [
            "services",
            "split sync (ours)",
            "same pieces, bare",
            "one restore, bare",
            "one restore / split",
            "others during one restore",
        ],
        rows,
    )
    if res.sweep:
        out += [
            f"Initial nft full sync of {res.sweep_size:,} services with other piece "
            "sizes (`IptablesDataplane(piece_services=...)`, one run each):",
            "",
        ]
        out += _table(
            ["services per piece", "initial full sync"],
            [[str(k), fmt_s(v)] for k, v in sorted(res.sweep.items())],
        )
    return out


def _rss(res: Results) -> list[str]:
    if not res.rss:
        return []
    out = [
        "## Memory of `kproxy run`",
        "",
        "The real daemon (`python -m kproxy.cli run --source DIR --config CONFIG "
        "--state-dir ... --node-ip ... --iptables-backend B`) in a fresh namespace, one "
        "YAML file per service; /proc/PID/status read once status.json reports the first "
        "sync, and again 5 s after the start-up leftover scan (it reads whole rule dumps "
        "beside the running mode) has reported.",
        "",
    ]
    rows = []
    for f in res.rss:
        rows.append(
            [
                f.backend,
                f"{f.size:,}",
                _mb(f.rss_mb),
                _mb(f.hwm_mb),
                _mb(f.steady_rss_mb),
                fmt_s(f.first_sync_s),
                fmt_s(f.sync_duration_s),
                f"{f.idle_cpu_pct:.0f} %",
                f.workaround or "-",
            ]
        )
    out += _table(
        [
            "backend",
            "services",
            "VmRSS after 1st sync",
            "VmHWM",
            "VmRSS steady (after the leftover scan)",
            "start → 1st sync",
            "1st sync",
            "idle CPU (1 core)",
            "note",
        ],
        rows,
    )
    if res.membreak:
        out += _membreak(res)
    return out


def _membreak(res: Results) -> list[str]:
    plain = res.membreak.get("rss", {})
    traced = res.membreak.get("trace", {})
    stages_p = plain.get("stages", []) if isinstance(plain, dict) else []
    stages_t = traced.get("stages", []) if isinstance(traced, dict) else []
    traced_n = res.membreak_traced_size or res.membreak_size
    out = [
        f"### Where the memory goes ({res.membreak_size:,} services, in-process)",
        "",
        "The daemon's pieces built one after the other in a fresh interpreter "
        "(`python -m bench.membreak`), the sync going to a backend that runs nothing. "
        f"VmRSS from a run without tracemalloc at {res.membreak_size:,} services; traced "
        f"= Python heap still allocated (tracemalloc, separate run at {traced_n:,} "
        "services: tracemalloc is slow; the structures scale linearly).",
        "",
    ]
    rows = []
    prev_rss = prev_tr = 0.0
    for i, st in enumerate(stages_p):
        rss = float(st["rss_mb"])
        tr_row = stages_t[i] if i < len(stages_t) else {}
        tr = float(tr_row.get("traced_mb", 0.0))
        rows.append(
            [
                str(st["stage"]),
                f"{rss:.0f} MB",
                f"{rss - prev_rss:+.0f} MB",
                f"{tr:.0f} MB" if tr_row else "-",
                f"{tr - prev_tr:+.0f} MB" if tr_row else "-",
            ]
        )
        prev_rss, prev_tr = rss, tr
    out += _table(
        ["after", f"VmRSS ({res.membreak_size:,})", "Δ", f"traced ({traced_n:,})", "Δ traced"], rows
    )
    sites = traced.get("top_sites", []) if isinstance(traced, dict) else []
    if sites:
        out += [
            f"Biggest live allocation sites at the end ({traced_n:,} services, "
            "tracemalloc, by line):",
            "",
        ]
        out += _table(
            ["site", "MB", "blocks"],
            [[f"`{s['site']}`", f"{s['mb']:.1f}", f"{s['count']:,}"] for s in sites],
        )
    return out


def _problems(res: Results) -> list[str]:
    lines = []
    for f in res.syncs:
        for p in dict.fromkeys(f.problems):
            lines.append(f"- {f.backend} {f.size:,}: {p}")
    for r in res.rss:
        if r.workaround or r.problem:
            lines.append(f"- rss {r.backend} {r.size:,}: {r.workaround or r.problem}")
    if not lines:
        return []
    return ["## Problems seen during the run", "", *lines, ""]


def render_markdown(res: Results) -> str:
    out = [
        "# kproxy benchmarks",
        "",
        "Written by `make bench` (`bench/run.py`). Every load ran in a throw-away network "
        "namespace (`kpb-*`), one fresh namespace per measured sequence, deleted "
        "afterwards; the host namespace was not touched. Numbers are wall-clock seconds "
        "on a shared 2-core VM: other work on the machine shows up as noise (see the "
        "load averages).",
        "",
    ]
    out += _machine(res)
    out += ["## Goals", ""]
    out += _table(["goal", "measured", "verdict"], goals(res))
    out += _render(res)
    out += _syncs(res)
    out += _rss(res)
    out += _problems(res)
    return "\n".join(out).rstrip() + "\n"
