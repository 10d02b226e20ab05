"""How long a one-service change takes in nftables mode, and why (issue: 620 ms at 10k).

For each N (services x 10 endpoints, bench/workload.py), in a throwaway namespace:

1. load the table with a full sync (kproxy's fast apply; optionally also upstream's form);
2. change the 10 endpoints of one service, several times, and time the whole sync with
   (a) upstream's form: the transaction text piped to one `nft -f -` (what knftables does),
   (b) kproxy's fast apply (steps.py: cache-free nft forms plus netlink deletes);
3. probe what a small `nft -f` costs, one effect at a time:
   - a command that makes nft 1.0.6 fill its object cache (`add element`): every chain and
     set of the table is dumped from the kernel first;
   - the same element written as `add set ... { elements = { } }` (table cache only);
   - one rule in a new, unreferenced chain (`add chain X { rule ; }`): no cache, but the
     kernel re-validates every chain reachable from a base chain at commit;
   - `add element` twice through one long-lived libnftables context (ctypes): the second
     call refetches the cache anyway (the generation changed with our own commit);
4. optionally (--probe-layout), the validation cost of the same small commit in a table with
   one chain per service and no endpoint chains (a flatter layout), to show that the kernel
   cost follows the number of reachable chains.

--layout compact (or both) runs the same in kproxy's compact layout (dataplane/nftables/
compact.py), and beside kproxy's full sync times the bare `nft -f` of the very same
transaction text in a fresh namespace (the tool alone, same run), with CPU seconds beside
wall times (a loaded machine stretches wall times, CPU much less) and the process's peak RSS.
`--services 1000,10000,20000 --layout compact --bare --no-probes` is the compact layout's
scaling run.

Every sync runs as the daemon's sync loop runs it: with the cyclic garbage collector paused,
and a full sync followed by settling the heap (kproxy.memory; its time is shown apart).

Run as root from the repository: `.venv/bin/python -m bench.nft_incremental --services 1000,10000`.
Every nft command runs inside the bench namespace (bench/netns.py); nothing else is touched.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import time
from collections.abc import Callable

from bench import netns, workload
from kproxy.dataplane.facts import RuleOptions
from kproxy.dataplane.nftables.proxier import NftablesDataplane
from kproxy.memory import collector_paused, settle_after_full_sync
from kproxy.model.snapshot import ChangeTracker

LIBNFT_PROBE = r"""
import ctypes, sys, time
lib = ctypes.CDLL("libnftables.so.1")
lib.nft_ctx_new.restype = ctypes.c_void_p
lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
ctx = lib.nft_ctx_new(0)
lib.nft_ctx_buffer_error(ctx)
for i in range(3):
    t0 = time.perf_counter()
    rc = lib.nft_run_cmd_from_buffer(
        ctx, f"add element ip kube-proxy cluster-ips {{ 10.255.9.{i} }}\n".encode())
    print(f"{rc} {1000 * (time.perf_counter() - t0):.1f}")
"""


def ms(seconds: float) -> str:
    return f"{1000 * seconds:7.1f}"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def nft_time(ns: str, text: str, repeats: int = 3) -> float:
    """Best of `repeats` wall times of `nft -f -` with `text` (must succeed every time)."""
    return nft_times(ns, text, repeats)[0]


def nft_times(ns: str, text: str, repeats: int = 3) -> tuple[float, float]:
    """(wall, CPU of nft) of the fastest of `repeats` runs of `nft -f -` with `text`. The
    CPU (user + system, the kernel's work in the commit included) is what a loaded machine
    distorts least."""
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        start, cpu = time.perf_counter(), children_cpu()
        proc = subprocess.run(
            netns.exec_argv(ns, ["nft", "-f", "-"]), input=text, text=True, capture_output=True
        )
        best = min(best, (time.perf_counter() - start, children_cpu() - cpu))
        if proc.returncode != 0:
            raise RuntimeError(f"nft failed: {proc.stderr}")
    return best


def peak_rss_mb() -> float:
    """VmHWM of this process (the bench holds the tracker as the daemon does)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def probes(ns: str, repeats: int) -> None:
    print(f"  probes (best of {repeats}, ms):")
    # Each probe writes something new so that it is never a no-op.
    cases: list[tuple[str, Callable[[int], str]]] = [
        (
            "add element (nft fills its chain+set cache)",
            lambda i: f"add element ip kube-proxy cluster-ips {{ 10.255.0.{i} }}\n",
        ),
        (
            "same element as add set { elements } (table cache only)",
            lambda i: 'add set ip kube-proxy cluster-ips { type ipv4_addr ; comment "Active'
            f' ClusterIPs" ; elements = {{ 10.255.1.{i} }} }}\n',
        ),
        (
            "one rule in a new unreferenced chain (kernel validation)",
            lambda i: f"add chain ip kube-proxy probe-{i} {{ ip daddr 10.255.2.{i} jump"
            " mark-for-masquerade ; }\n",
        ),
        ("add chain alone (nft start-up + commit)", lambda i: f"add chain ip kube-proxy e-{i}\n"),
    ]
    for label, text in cases:
        best = min(nft_time(ns, text(i), repeats=1) for i in range(repeats))
        print(f"    {ms(best)}  {label}")
    proc = subprocess.run(
        netns.exec_argv(ns, ["python3", "-c", LIBNFT_PROBE]), text=True, capture_output=True
    )
    calls = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("0 ")]
    if calls:
        print(f"    {'  '.join(calls)}  add element x3 through one libnftables context")
    else:
        print(f"    (libnftables probe failed: {proc.stderr.strip()[:120]})")


def one_size(
    n: int, repeats: int, text_full: bool, probe: bool, layout: str = "upstream", bare: bool = False
) -> None:
    t = workload.tracker(n)
    opts = RuleOptions(cluster_cidrs=(workload.CLUSTER_CIDR,))
    print(
        f"N={n} services x {workload.ENDPOINTS_PER_SERVICE} endpoints, {layout} layout",
        flush=True,
    )
    with netns.fresh() as ns:
        if text_full:
            dp = NftablesDataplane(workload.facts(), opts, netns=ns, fast=False, layout=layout)
            start = time.perf_counter()
            dp.sync(t.snapshot(), full=True)
            print(f"  full sync, upstream form (one nft -f): {time.perf_counter() - start:.2f} s")
            subprocess.run(netns.exec_argv(ns, ["nft", "delete", "table", "ip", dp.table]))
            netns.wait_quiet()
        dp = NftablesDataplane(
            workload.facts(), opts, netns=ns, fast=True, keep_last_write=True, layout=layout
        )
        snapshot = t.snapshot()
        start, cpu, rss = time.perf_counter(), time.process_time(), peak_rss_mb()
        with collector_paused():
            dp.sync(snapshot, full=True)
        took, took_cpu = time.perf_counter() - start, time.process_time() - cpu
        settled = settle_after_full_sync()
        steps = len(dp.backend.last_steps)  # type: ignore[attr-defined]
        tm = dp.last_timings
        print(
            f"  full sync, kproxy fast apply: {took:.2f} s, CPU {took_cpu:.2f} s ({steps} steps; "
            f"plan {tm['plan']:.2f} s, write {tm['write']:.2f} s, apply {tm['apply']:.2f} s; "
            f"then heap settled in {settled:.2f} s; peak RSS of this process "
            f"{rss:.0f} -> {peak_rss_mb():.0f} MB)",
            flush=True,
        )
        if bare:
            assert dp.last_write is not None
            text = dp.last_write.tx.text()
            netns.wait_quiet()
            with netns.fresh() as other:
                took, nft_cpu = nft_times(other, text, repeats=1)
            print(
                f"  bare `nft -f` of the same transaction (text form), fresh namespace: "
                f"{took:.2f} s, CPU {nft_cpu:.2f} s ({text.count(chr(10))} lines)"
            )
        netns.wait_quiet()
        resyncs(dp, ns, t)
        generation = 0
        for label, fast in (("upstream form, one nft -f", False), ("kproxy fast apply", True)):
            dp.backend.fast = fast  # type: ignore[attr-defined]
            total, phases = [], {"plan": [], "write": [], "apply": [], "stale_delete": []}
            ops = 0
            for r in range(repeats + 1):
                generation += 1
                snap = workload.change_one(t, n // 2 + generation, generation)
                start = time.perf_counter()
                with collector_paused():
                    dp.sync(snap, full=False)
                elapsed = time.perf_counter() - start
                if r == 0:
                    continue  # the first one also deletes the previous series' stale chains
                total.append(elapsed)
                for k in phases:
                    phases[k].append(dp.last_timings.get(k, 0.0))
                assert dp.last_write is not None
                ops = len(dp.last_write.tx)
            med = {k: ms(statistics.median(v)).strip() for k, v in phases.items()}
            print(
                f"  one-service change, {label}: median {ms(statistics.median(total))} ms "
                f"(min {ms(min(total))}, max {ms(max(total))}; {ops} operations; plan "
                f"{med['plan']}, write {med['write']}, apply {med['apply']}, stale-chain "
                f"delete {med['stale_delete']})",
                flush=True,
            )
        if probe and layout == "upstream":
            probes(ns, repeats)


def resyncs(dp: NftablesDataplane, ns: str, t: ChangeTracker) -> None:
    """The periodic full sync twice: with nothing but kproxy having changed the kernel
    (custody holds: only changes written), then after another program's commit."""
    for label, foreign in (("kernel unchanged", False), ("after another program's commit", True)):
        if foreign:
            subprocess.run(netns.exec_argv(ns, ["nft", "add", "table", "ip", "kpb_other"]))
        start = time.perf_counter()
        with collector_paused():
            result = dp.sync(t.snapshot(), full=True)
        took = time.perf_counter() - start
        settle_after_full_sync()
        print(
            f"  full resync, {label}: {took:.2f} s (kernel_unchanged={result.kernel_unchanged}, "
            f"{result.rewritten} services rewritten)",
            flush=True,
        )
        netns.wait_quiet()


def layout_probe(n: int) -> None:
    """A table with one chain per service (3 rules, no endpoint chains, no anonymous sets):
    how much does the same small commit cost there?"""
    lines = [
        "add table ip kube-proxy",
        "add chain ip kube-proxy mark-for-masquerade",
        "add rule ip kube-proxy mark-for-masquerade mark set mark or 0x00004000",
        "add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service :"
        " verdict ; }",
        "add chain ip kube-proxy services",
        "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
        "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }",
        "add rule ip kube-proxy nat-prerouting jump services",
        "add chain ip kube-proxy nat-output { type nat hook output priority -100 ; }",
        "add rule ip kube-proxy nat-output jump services",
    ]
    for i in range(n):
        ip = f"10.{96 + i // 65536}.{i // 256 % 256}.{i % 256}"
        chain = f"service-{i}"
        lines.append(
            f"add chain ip kube-proxy {chain} {{ ip daddr {ip} ip saddr != 10.128.0.0/9 "
            f"jump mark-for-masquerade ; ip saddr 10.128.0.1 jump mark-for-masquerade ; "
            f"meta l4proto tcp dnat to 10.128.0.1:8080 ; }}"
        )
        lines.append(f"add element ip kube-proxy service-ips {{ {ip} . tcp . 80 : goto {chain} }}")
    with netns.fresh() as ns:
        nft_time(ns, "\n".join(lines) + "\n", repeats=1)
        netns.wait_quiet()
        cost = nft_time(
            ns, "add chain ip kube-proxy probe { ip daddr 10.255.2.1 jump mark-for-masquerade ; }\n"
        )
        print(
            f"  flat layout probe, N={n}: one rule in a new chain costs {ms(cost)} ms "
            f"({n} service chains, no endpoint chains)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--services", default="1000,10000", help="comma-separated N values")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--text-full", action="store_true", help="also time upstream's one-transaction full sync"
    )
    parser.add_argument("--no-probes", action="store_true")
    parser.add_argument("--probe-layout", action="store_true")
    parser.add_argument(
        "--layout",
        choices=("upstream", "compact", "both"),
        default="upstream",
        help="nftables layout(s) to measure",
    )
    parser.add_argument(
        "--bare", action="store_true", help="also time the bare `nft -f` of the full sync's text"
    )
    args = parser.parse_args()
    layouts = ("upstream", "compact") if args.layout == "both" else (args.layout,)
    for n in (int(x) for x in args.services.split(",")):
        for layout in layouts:
            one_size(n, args.repeats, args.text_full, not args.no_probes, layout, args.bare)
            netns.wait_quiet()
        if args.probe_layout:
            layout_probe(n)
        netns.wait_quiet()


if __name__ == "__main__":
    main()
