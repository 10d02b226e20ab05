"""`make bench`: render, sync and memory figures of kproxy's iptables mode -> BENCHMARKS.md.

    .venv/bin/python -m bench.run [--sizes 1000,5000,10000] [--backends nft,legacy]
                                  [--repeats 3] [--out BENCHMARKS.md] [--quick]

Needs root (network namespaces). Everything kernel-side runs in namespaces named kpb-*
that the bench creates and deletes; the host namespace is never touched. --quick is a
smoke run (1,000 services, 1 repeat, no one-restore nft load) written to a temp file
unless --out is given. See bench/sync_bench.py for what each figure measures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import machine, render_bench, rss_bench, sync_bench, workload
from bench.report import Results, render_markdown

SWEEP_SIZE = 5000
TRACE_MAX = 5000
SWEEP_PIECES = (25, 50, 100)  # 250, the shipped value, is the main nft figure

_t0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _t0:7.1f}s] {msg}", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in ("nft", "legacy")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad}; use nft and/or legacy")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--sizes", type=_ints, default=None, help="default 1000,5000,10000")
    ap.add_argument("--backends", type=_names, default=["nft", "legacy"])
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--out", type=Path, default=None, help="default BENCHMARKS.md")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw figures")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1,000 services, 1 repeat")
    ap.add_argument("--no-rss", action="store_true", help="skip the kproxy run memory part")
    ap.add_argument("--keep-workdir", action="store_true")
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [1000] if args.quick else [1000, 5000, 10000]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.out is None:
        args.out = (
            Path(tempfile.gettempdir()) / "kproxy-BENCHMARKS-quick.md"
            if args.quick
            else Path("BENCHMARKS.md")
        )
    return args


def _preflight() -> None:
    if os.geteuid() != 0:
        sys.exit("bench: needs root (it creates network namespaces)")
    for tool in ("ip", "iptables-nft-restore", "iptables-legacy-restore"):
        if shutil.which(tool) is None:
            sys.exit(f"bench: {tool} not found (run `make tools`)")


def rss_plan(backends: list[str], sizes: list[int]) -> list[tuple[str, int]]:
    """Memory barely depends on the backend: every size on one (legacy if asked: its first
    sync is quicker), the largest size on the others too."""
    main_backend = "legacy" if "legacy" in backends else backends[0]
    plan = [(main_backend, s) for s in sizes]
    plan += [(b, max(sizes)) for b in backends if b != main_backend]
    return plan


def _membreak(sources: dict[str, Path], config: Path, flavour: str) -> dict[str, dict[str, object]]:
    """VmRSS stages from sources["rss"], tracemalloc stages from sources["trace"]."""
    out: dict[str, dict[str, object]] = {}
    for mode, extra in (("rss", []), ("trace", ["--trace"])):
        argv = [
            sys.executable,
            "-m",
            "bench.membreak",
            "--source",
            str(sources[mode]),
            "--config",
            str(config),
            "--flavour",
            flavour,
            *extra,
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"membreak {mode} failed: {proc.stderr[-2000:]}")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _preflight()
    command = ".venv/bin/python -m bench.run " + shlex.join(
        list(argv) if argv is not None else sys.argv[1:]
    )
    workdir = Path(tempfile.mkdtemp(prefix="kproxy-bench-"))
    logging.basicConfig(
        filename=str(workdir / "kproxy.log"),
        level=logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
    )
    res = Results(
        machine=machine.describe(),
        command=command.strip(),
        repeats=args.repeats,
        sizes=args.sizes,
        backends=args.backends,
    )
    log(f"machine: {res.machine}")
    log(f"workdir {workdir} (kproxy log: {workdir / 'kproxy.log'})")
    config = workdir / "kproxy-config.yaml"
    config.write_text(workload.CONFIG_YAML)
    options = workload.options(config)
    failures: list[str] = []

    def attempt(what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as err:
            log(f"FAILED {what}: {err}")
            failures.append(f"{what}: {type(err).__name__}: {str(err)[:400]}")
            logging.getLogger("bench").error("%s failed:\n%s", what, traceback.format_exc())

    try:
        for size in args.sizes:
            log(f"render {size}")
            attempt(
                f"render {size}",
                lambda s=size: res.render.append(render_bench.measure(s, options, args.repeats)),
            )
        for backend in args.backends:
            for size in args.sizes:
                log(f"sync {backend} {size}")
                bench = sync_bench.SyncBench(backend, size, options, log)
                giant = not args.quick
                attempt(
                    f"sync {backend} {size}",
                    lambda b=bench, g=giant: res.syncs.append(b.run(args.repeats, giant=g)),
                )
        if "nft" in args.backends and SWEEP_SIZE in args.sizes and not args.quick:
            log(f"nft piece-size sweep at {SWEEP_SIZE}")
            res.sweep_size = SWEEP_SIZE
            attempt(
                "piece sweep",
                lambda: res.sweep.update(
                    sync_bench.piece_sweep(SWEEP_SIZE, options, SWEEP_PIECES, log)
                ),
            )
        if not args.no_rss:
            for backend, size in rss_plan(args.backends, args.sizes):
                log(f"rss {backend} {size}")
                attempt(
                    f"rss {backend} {size}",
                    lambda b=backend, s=size: res.rss.append(rss_bench.measure(b, s, workdir, log)),
                )
            biggest = max(args.sizes)
            # tracemalloc makes the daemon's start ~5x slower: trace a mid size (the same
            # structures, proportionally) to stay inside the time budget.
            traced = max([s for s in args.sizes if s <= TRACE_MAX] or [min(args.sizes)])
            log(f"memory breakdown at {biggest} (traced at {traced})")
            res.membreak_size, res.membreak_traced_size = biggest, traced

            def breakdown() -> None:
                source, cfg = rss_bench.prepare_files(workdir, biggest)
                small, _ = rss_bench.prepare_files(workdir, traced)
                res.membreak = _membreak({"rss": source, "trace": small}, cfg, args.backends[0])

            attempt("memory breakdown", breakdown)
    finally:
        res.load_end = machine.loadavg()
        res.wall_s = time.monotonic() - _t0
        text = render_markdown(res)
        if failures:
            text += "\n## Parts that failed\n\n" + "\n".join(f"- {f}" for f in failures) + "\n"
        args.out.write_text(text)
        log(f"wrote {args.out}")
        if args.json:
            args.json.write_text(json.dumps(_raw(res), indent=1))
        if args.keep_workdir:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


def _raw(res: Results) -> dict[str, object]:
    return {
        "machine": res.machine,
        "command": res.command,
        "repeats": res.repeats,
        "render": [r.to_json() for r in res.render],
        "syncs": [s.to_json() for s in res.syncs],
        "sweep": res.sweep,
        "rss": [r.to_json() for r in res.rss],
        "membreak": res.membreak,
        "wall_s": res.wall_s,
    }


if __name__ == "__main__":
    sys.exit(main())
