"""Memory of the real `kproxy run` at N services: VmRSS / VmHWM after its first sync.

kproxy runs as production runs it (`python -m kproxy.cli run --config ...`), inside a
fresh bench namespace via `ip netns exec`, with its objects from one of two sources:
`--source files` (the default) one YAML file per service (`--source DIR`); `--source api`
the same objects listed and watched from the lab's API server (kproxy.lab.kubeapi, served
by this process on the namespace's loopback; the config's clientConnection.kubeconfig names
it), as a production node reads them (that server is Python in this process, on the same
cores: its share of the API figure is what a real API server's would be). We
wait for status.json in its state dir to report syncs >= 1, then read /proc/<pid>/status;
then wait for the start-up leftover scan to finish (status.json's leftovers_removed: it
reads whole rule dumps beside the running mode), STEADY_WAIT seconds more, and read again
(steady state) together with the CPU the idle process uses over those seconds.

Beside the start -> first sync, with bare=True: the bare tool loading the same rules into a
fresh namespace (`kproxy render` of the same objects, config and mode, run in a fresh
namespace so that it detects the node facts the daemon detects; then `nft -f` of that text
in nftables mode, `iptables-<backend>-restore` in iptables mode). The iptables text is one
restore input: iptables-nft-restore of one input grows much faster than linearly with its
size, where the daemon splits its sync (bench.sync_bench times the bare restore of the same
pieces); the figure is fair for legacy and nftables mode only.

    .venv/bin/python -m bench.rss_bench [--sizes 10000] [--flavours nftables-compact]
        [--repeats 1] [--source files|api] [--no-bare]

Flavours: nft, legacy (iptables mode on that backend), nftables, nftables-compact.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import machine, netns, workload
from bench.fixes import BUG1_MESSAGE
from bench.nft_incremental import nft_times
from bench.sync_bench import bare_restore
from kproxy.dataplane.nftables.layouts import MODE as NFTABLES_MODE
from kproxy.dataplane.nftables.layouts import parse_target, target_name
from kproxy.lab.kubeapi import KubeApiServer, KubeApiStore

SOURCES = ("files", "api")
FIRST_SYNC_TIMEOUT = 600.0
STEADY_WAIT = 5.0
_FIRST_FULL_RE = re.compile(r"kproxy\.sync: full sync: .* ([\d.]+) s$", re.MULTILINE)


@dataclass
class RssFigures:
    backend: str
    size: int
    rss_mb: float = 0.0  # VmRSS right after the first sync
    hwm_mb: float = 0.0  # VmHWM (peak RSS) right after the first sync
    steady_rss_mb: float = 0.0  # VmRSS STEADY_WAIT seconds after the leftover scan
    leftovers_s: float = 0.0  # first sync -> the leftover scan reported done
    first_sync_s: float = 0.0  # process start -> status.json reports the first sync
    sync_duration_s: float = 0.0  # the first (full) sync itself, as kproxy logs it
    idle_cpu_pct: float = 0.0  # CPU of the idle process (polling), % of one core
    bare_s: float = 0.0  # the bare tool loading the same rules into a fresh namespace
    bare_tool: str = ""
    source: str = "files"  # where the daemon read its objects: files or api
    load: str = ""  # the load average when the first sync was reported
    workaround: str = ""
    problem: str = ""

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def _proc_status(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(path: Path) -> dict[str, object]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def prepare_files(workdir: Path, size: int, flavour: str = "legacy") -> tuple[Path, Path]:
    """The objects of `size` services and the config of the flavour's proxy mode."""
    source = workdir / f"objects-{size}"
    if not source.exists():
        workload.write_source(source, size)
    mode, _ = _flavour(flavour)
    config = workdir / f"kproxy-config-{mode}.yaml"
    config.write_text(workload.config_yaml(mode))
    return source, config


IPTABLES_BACKENDS = ("nft", "legacy")


def _flavour(flavour: str) -> tuple[str, list[str]]:
    """A measured flavour's proxy mode (for the config file: with one, --proxy-mode is
    ignored) and kproxy's own options for it: an iptables backend (iptables mode) or
    nftables mode's dataplane name ("nftables", "nftables-compact": the layout)."""
    if flavour in IPTABLES_BACKENDS:
        return "iptables", ["--iptables-backend", flavour]
    mode, layout = parse_target(flavour)
    if mode != NFTABLES_MODE:
        raise ValueError(f"unknown flavour {flavour!r} (nft, legacy, nftables, nftables-compact)")
    return mode, ["--nftables-layout", layout] if layout else []


def measure(
    flavour: str,
    size: int,
    workdir: Path,
    log: Callable[[str], None],
    *,
    bare: bool = False,
    objects_from: str = "files",
) -> RssFigures:
    """RSS of `kproxy run` at `size` services; flavour: "nft" or "legacy" (iptables mode on
    that backend), "nftables" or "nftables-compact" (nftables mode in a layout). bare: also
    time the bare tool loading the same rules (bare_load). objects_from: "files" or "api"."""
    source, config = prepare_files(workdir, size, flavour)
    fig = RssFigures(flavour, size, source=objects_from)
    store = _api_store(size) if objects_from == "api" else None
    try:
        _run_once(fig, source, config, workdir, precreate=False, log=log, store=store)
    except _Bug1:
        # A fresh node never gets its first sync on nft (bench/fixes.py bug 1). To still
        # see the memory, give the namespace the chain the first piece needs.
        fig.workaround = "bug 1: KUBE-MARK-MASQ pre-created in the namespace"
        log(f"    rss {flavour} {size}: first sync hit bug 1; retrying with the chain pre-created")
        netns.wait_quiet(min_wait=2.0, busy_below=0.2)
        _run_once(fig, source, config, workdir, precreate=True, log=log, store=store)
    if bare:
        netns.wait_quiet(min_wait=2.0, busy_below=0.2)
        fig.bare_tool, fig.bare_s = bare_load(flavour, source, config, workdir)
        log(f"    bare {fig.bare_tool} {fig.size}: {fig.bare_s:.2f} s (load {machine.loadavg()})")
    return fig


def rendered_rules(flavour: str, source: Path, config: Path, workdir: Path) -> Path:
    """`kproxy render` of what the daemon's first sync applies (same objects, config, mode
    and node IP), run in a fresh namespace so that the facts it detects are the daemon's.
    Kept in workdir (a render of 10,000 services takes a while)."""
    path = workdir / f"rules-{flavour}-{source.name}.txt"
    if path.exists():
        return path
    argv = [sys.executable, "-m", "kproxy.cli", "render", "--source", str(source)]
    argv += ["--config", str(config), "--node-ip", workload.NODE_IP]
    if flavour not in IPTABLES_BACKENDS:  # render has no backend option: the same text
        argv += _flavour(flavour)[1]
    with netns.fresh() as ns:
        proc = subprocess.run(netns.exec_argv(ns, argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"kproxy render failed: {proc.stderr.strip()[-800:]}")
    path.write_text(proc.stdout)
    return path


def bare_load(flavour: str, source: Path, config: Path, workdir: Path) -> tuple[str, float]:
    """(tool, wall seconds) of the bare tool loading the rendered rules into a fresh
    namespace: `nft -f` (nftables mode) or `iptables-<backend>-restore` (iptables mode)."""
    text = rendered_rules(flavour, source, config, workdir).read_text()
    with netns.fresh() as ns:
        if flavour in IPTABLES_BACKENDS:
            return f"iptables-{flavour}-restore", bare_restore(ns, flavour, [text])
        return "nft -f", nft_times(ns, text, repeats=1)[0]


class _Bug1(Exception):
    pass


def _api_store(size: int) -> KubeApiStore:
    """The lab's API server state holding the same objects as the file source."""
    store = KubeApiStore()
    for obj in workload.objects(size):
        store.apply(obj)
    return store


def _source_args(
    ns: str, source: Path, config: Path, state: Path, store: KubeApiStore | None
) -> tuple[list[str], KubeApiServer | None]:
    """The daemon's options naming its source, and the API front end it reads (if any): in
    the namespace, on its loopback, named by the config's kubeconfig as in production."""
    if store is None:
        return ["--source", str(source), "--config", str(config)], None
    server = KubeApiServer(store, netns=ns).start()
    kubeconfig = server.kubeconfig(state / "kubeconfig")
    api_config = state / "config.yaml"
    api_config.write_text(config.read_text() + f"clientConnection: {{kubeconfig: {kubeconfig}}}\n")
    return ["--config", str(api_config)], server


def _run_once(
    fig: RssFigures,
    source: Path,
    config: Path,
    workdir: Path,
    *,
    precreate: bool,
    log: Callable[[str], None],
    store: KubeApiStore | None = None,
) -> None:
    # a fresh state dir every run (repeats share the workdir): nothing of a previous run read
    state = Path(tempfile.mkdtemp(dir=workdir, prefix=f"state-{fig.backend}-{fig.size}-"))
    logfile = state.with_suffix(".log")
    with netns.fresh() as ns:
        if precreate:
            subprocess.run(
                netns.exec_argv(
                    ns, [f"iptables-{fig.backend}", "-t", "nat", "-N", "KUBE-MARK-MASQ"]
                ),
                check=True,
            )
        source_args, server = _source_args(ns, source, config, state, store)
        argv = netns.exec_argv(
            ns,
            [
                sys.executable,
                "-m",
                "kproxy.cli",
                "run",
                *source_args,
                "--state-dir",
                str(state),
                "--node-ip",
                workload.NODE_IP,
                *_flavour(fig.backend)[1],
            ],
        )
        with logfile.open("w") as out:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            st = _wait_first_sync(proc, state / "status.json", logfile)
            fig.first_sync_s = time.monotonic() - t0
            _check_mode(fig.backend, st, logfile)
            fig.load = machine.loadavg()
            mem = _proc_status(proc.pid)
            fig.rss_mb, fig.hwm_mb = mem["VmRSS"], mem["VmHWM"]
            found = _FIRST_FULL_RE.search(logfile.read_text(errors="replace"))
            fig.sync_duration_s = float(found.group(1)) if found else 0.0
            fig.leftovers_s = _wait_leftovers(proc, state / "status.json")
            cpu0 = _cpu_seconds(proc.pid)
            time.sleep(STEADY_WAIT)
            fig.idle_cpu_pct = 100 * (_cpu_seconds(proc.pid) - cpu0) / STEADY_WAIT
            fig.steady_rss_mb = _proc_status(proc.pid)["VmRSS"]
            log(
                f"    rss {fig.backend} {fig.size} ({fig.source}): RSS {fig.rss_mb:.0f} MiB, peak "
                f"{fig.hwm_mb:.0f} MiB, first sync after {fig.first_sync_s:.1f} s "
                f"(the sync itself {fig.sync_duration_s:.1f} s; load {fig.load})"
            )
        finally:
            _stop(proc)
            if server is not None:
                server.stop()


def _wait_first_sync(
    proc: subprocess.Popen[bytes], status: Path, logfile: Path
) -> dict[str, object]:
    deadline = time.monotonic() + FIRST_SYNC_TIMEOUT
    while time.monotonic() < deadline:
        st = _status(status)
        syncs = st.get("syncs", 0)
        if st.get("pid") == proc.pid and isinstance(syncs, int) and syncs >= 1:
            return st
        if proc.poll() is not None:
            raise RuntimeError(f"kproxy exited with {proc.returncode}; see {logfile}")
        if BUG1_MESSAGE in logfile.read_text(errors="replace"):
            raise _Bug1()
        time.sleep(0.1)
    raise TimeoutError(f"kproxy did not report a sync within {FIRST_SYNC_TIMEOUT:.0f} s")


def _check_mode(flavour: str, status: dict[str, object], logfile: Path) -> None:
    """The daemon runs the flavour's mode and layout (a flag the config overrides would
    silently measure another mode)."""
    mode, layout = str(status.get("mode")), status.get("nftables_layout")
    running = mode if flavour in IPTABLES_BACKENDS else target_name(mode, str(layout or ""))
    wanted = "iptables" if flavour in IPTABLES_BACKENDS else flavour
    if running != wanted:
        raise RuntimeError(f"kproxy runs {running}, not {wanted}; see {logfile}")


def _wait_leftovers(proc: subprocess.Popen[bytes], status: Path) -> float:
    started = time.monotonic()
    deadline = started + FIRST_SYNC_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        if _status(status).get("leftovers_removed") is not None:
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError("kproxy did not report its leftover scan as done")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the kproxy this module started (its pid only)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.rss_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--sizes", default="10000")
    ap.add_argument("--flavours", default="nftables-compact")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (flavour, size)")
    ap.add_argument(
        "--source",
        default="files",
        help="where the daemon reads its objects: files, api or both (files,api)",
    )
    ap.add_argument("--no-bare", action="store_true", help="skip the bare tool's figure")
    ap.add_argument("--workdir", type=Path, help="keep the objects and rules here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench: needs root (it creates network namespaces)")
    flavours = [f.strip() for f in args.flavours.split(",") if f.strip()]
    sources = [s.strip() for s in args.source.split(",") if s.strip()]
    if not sources or any(s not in SOURCES for s in sources):
        sys.exit(f"bench: --source {args.source!r}: files, api or files,api")
    for flavour in flavours:
        _flavour(flavour)  # an unknown flavour fails here, before any work
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kproxy-rss-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}s] {msg}", flush=True)

    rows: list[RssFigures] = []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            for flavour in flavours:
                for _ in range(args.repeats):
                    for objects_from in sources:
                        fig = measure(
                            flavour,
                            size,
                            workdir,
                            log,
                            bare=not args.no_bare,
                            objects_from=objects_from,
                        )
                        rows.append(fig)
                        print(json.dumps(fig.to_json()), flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        "\n| flavour | source | services | start → 1st sync | 1st sync itself | bare tool | bare"
        " | ratio | VmRSS after 1st sync | VmHWM | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for f in rows:
        ratio = f"{f.first_sync_s / f.bare_s:.2f}x" if f.bare_s else "-"
        bare = f"{f.bare_s:.2f} s" if f.bare_s else "-"
        print(
            f"| {f.backend} | {f.source} | {f.size:,} | {f.first_sync_s:.2f} s |"
            f" {f.sync_duration_s:.2f} s |"
            f" {f.bare_tool or '-'} | {bare} | {ratio} | {f.rss_mb:.0f} MiB | {f.hwm_mb:.0f} MiB"
            f" | {f.load} |"
        )
    for flavour in flavours:
        for objects_from in sources:
            ratios = [
                f.first_sync_s / f.bare_s
                for f in rows
                if f.backend == flavour and f.source == objects_from and f.bare_s
            ]
            if len(ratios) > 1:
                print(
                    f"{flavour} ({objects_from}): median ratio"
                    f" {statistics.median(ratios):.2f}x of {len(ratios)}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
