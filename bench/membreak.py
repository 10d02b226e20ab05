"""Where kproxy's memory goes: the daemon's pieces built in-process, stage by stage.

Run as `python -m bench.membreak --source DIR --config FILE [--trace]` (bench.run starts
it in a subprocess so every measurement starts from a clean interpreter). Stages follow
what `kproxy run` holds after its first sync: the file source (object digests kept for
diffing) feeding the ChangeTracker (parsed objects), the snapshot (ServicePorts), and one
full sync (renderer cache, applied state). The sync goes to a backend whose
runner answers like iptables without running anything, so no kernel is involved.

Without --trace: VmRSS after each stage. With --trace: tracemalloc current/peak after each
stage, plus the biggest allocation sites still alive at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fake_runner(argv: Sequence[str], input_data: str | None) -> subprocess.CompletedProcess[str]:
    out = "iptables v1.8.9 (nf_tables)\n" if "--version" in argv else ""
    return subprocess.CompletedProcess(list(argv), 0, out, "")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--flavour", default="nft")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args(argv)

    stages: list[dict[str, Any]] = []

    def mark(name: str) -> None:
        gc.collect()
        row: dict[str, Any] = {"stage": name, "rss_mb": _rss_mb()}
        if args.trace:
            current, peak = tracemalloc.get_traced_memory()
            row["traced_mb"] = current / 2**20
            row["traced_peak_mb"] = peak / 2**20
            tracemalloc.reset_peak()
        stages.append(row)

    mark("interpreter")
    # What `kproxy run` imports (cli pulls in typer/rich, proxy_cli is run's package; the
    # daemon the rest).
    import kproxy.cli
    import kproxy.proxy_cli  # noqa: F401
    from bench import workload
    from kproxy.config import load_config, rule_options
    from kproxy.daemon import Daemon  # noqa: F401
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.iptables.proxier import IptablesDataplane
    from kproxy.memory import release_free_heap
    from kproxy.model.snapshot import ChangeTracker
    from kproxy.sources.files import FileSource

    if args.trace:
        tracemalloc.start(1)
    mark("imports")
    # As in the daemon, the source hands its batches straight to the change tracker.
    tracker = ChangeTracker(workload.NODE_NAME)
    source = FileSource(args.source)
    source.start(tracker.apply)
    source.stop()
    mark("file source + change tracker (parsed objects)")
    snapshot = tracker.snapshot()
    mark("+ snapshot (ServicePorts)")
    options = rule_options(load_config(args.config))
    backend = IptablesBackend(args.flavour, runner=_fake_runner)
    dp = IptablesDataplane(backend, workload.facts(), options)
    dp.sync(snapshot, full=True)
    mark("+ full sync (renderer cache, applied state)")
    trim_seconds = release_free_heap()
    mark("after malloc_trim(0) (freed heap returned to the OS)")

    top: list[dict[str, Any]] = []
    if args.trace:
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        for stat in snap.statistics("lineno")[:12]:
            frame = stat.traceback[0]
            top.append(
                {
                    "site": f"{_short(frame.filename)}:{frame.lineno}",
                    "mb": stat.size / 2**20,
                    "count": stat.count,
                }
            )
    keep = (source, tracker, snapshot, dp)  # alive until here on purpose
    out = {"stages": stages, "top_sites": top, "hwm_mb": _hwm_mb(), "alive": len(keep)}
    print(json.dumps({**out, "trim_seconds": trim_seconds}))


def _short(filename: str) -> str:
    for marker in ("/src/kproxy/", "/site-packages/", "/lib/python"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


if __name__ == "__main__":
    main()
