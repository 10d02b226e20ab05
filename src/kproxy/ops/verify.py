"""`kproxy verify`: the golden-metric verdict the seeds run by hand after a switch.

Seven things, each against a threshold (defaults from the seeds' runbook):

* sync-p99 - p99 of kubeproxy_sync_proxy_rules_duration_seconds (the running proxy's
  /metrics histogram; over the window when syncs happened in it, else since start) < 2 s;
* services - service ports the dataplane programs (read back from the kernel by the
  inspect readers) == service ports the running proxy has (admin socket `status`);
* rss, cpu - of the running proxy (pid from `status`) and, in userspace mode, its workers:
  VmRSS < 512 MiB, CPU time over wall time < 0.3 core (from /proc/PID/stat);
* failures - restore / sync failures (kubeproxy_sync_proxy_rules_iptables_restore_failures,
  …_nftables_sync_failures, kproxy_sync_failures: deltas over the window, since start for a
  single look) <= 0;
* sync-progress - >= 1 successful sync per minute while changes wait: a breach when changes
  are queued (last queued timestamp > last sync timestamp) and the last successful sync is
  older than a minute, in two consecutive samples without a sync in between (one sample
  alone cannot tell a stuck proxy from one that is about to sync).

The evaluation (parse_metrics, histogram_quantile, parse_proc_*, evaluate) is pure and
works on Samples; Collector takes them from a live node.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from kproxy.cli_common import checked
from kproxy.config.addresses import parse_port, split_host_port
from kproxy.config.durations import parse_duration, parse_positive_duration
from kproxy.defaults import DEFAULT_STATE_DIR

SYNC_HISTOGRAM = "kubeproxy_sync_proxy_rules_duration_seconds"
LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
LAST_QUEUED = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"
RESTORE_FAILURES = (
    "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
)
SYNC_FAILURES = "kproxy_sync_failures_total"  # every mode (userspace and ipvs too)
ONE_LOOK_GAP = 1.0  # seconds between the two samples of a single look (CPU needs two)
MIB = 1024 * 1024


@dataclass(frozen=True)
class Thresholds:
    sync_p99: float = 2.0  # seconds: p99 must stay below
    rss: int = 512 * MIB  # bytes: RSS must stay below
    cpu: float = 0.3  # cores: must stay below
    failures: int = 0  # restore/sync failures allowed
    syncs_per_minute: float = 1.0  # at least, while changes are pending

    @property
    def stall(self) -> float:
        """The longest a pending change may wait for a sync, in seconds."""
        return 60.0 / self.syncs_per_minute


# --- parsers -------------------------------------------------------------------------------------


@dataclass
class Metrics:
    """One /metrics scrape: sample name -> [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.samples

    def total(self, name: str) -> float | None:
        """The sum over every label set (None: no such series)."""
        values = self.samples.get(name)
        return None if values is None else sum(v for _labels, v in values)

    def gauge(self, name: str) -> float | None:
        """The largest value over every label set (timestamps of both IP families)."""
        values = self.samples.get(name)
        return None if not values else max(v for _labels, v in values)

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """Cumulative (le, count) of a histogram, summed over its other labels, by le."""
        out: dict[float, float] = {}
        for labels, value in self.samples.get(f"{histogram}_bucket", ()):
            le = float(labels.get("le", "+Inf"))
            out[le] = out.get(le, 0.0) + value
        return sorted(out.items())


def parse_metrics(text: str) -> Metrics:
    """Prometheus text exposition -> Metrics (prometheus-client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    m = Metrics()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            m.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return m


def bucket_delta(
    first: list[tuple[float, float]], last: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The observations between two scrapes (the later one alone after a counter reset)."""
    before = dict(first)
    delta = [(le, count - before.get(le, 0.0)) for le, count in last]
    return last if any(c < 0 for _le, c in delta) else delta


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (le, count) buckets: linear inside
    the bucket the rank falls in; the highest finite bound when it falls into +Inf."""
    if not buckets:
        return None
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            inside = count - prev_count
            if inside <= 0:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / inside
        prev_le, prev_count = le, count
    return prev_le


def max_observation_bound(buckets: list[tuple[float, float]], total: float) -> float | None:
    """An upper bound of the largest observation: the histogram's sum minus the least every
    other observation can be (its bucket's lower edge). With few syncs a quantile is close to
    the maximum, and interpolation inside a wide bucket (1-2 s) overstates it."""
    prev_le, prev_count = 0.0, 0.0
    lower_sum, top_lower = 0.0, None
    for le, count in sorted(buckets):
        inside = count - prev_count
        if inside > 0:
            lower_sum += inside * prev_le
            top_lower = prev_le
        prev_le, prev_count = le, count
    if top_lower is None:
        return None
    return total - (lower_sum - top_lower)


def parse_proc_status(text: str) -> int | None:
    """VmRSS of /proc/PID/status, in bytes."""
    m = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(utime + stime, starttime) of /proc/PID/stat, in clock ticks."""
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12]), int(fields[19])


def parse_size(text: str) -> int:
    """'512Mi', '512MiB', '1G', '800M', '536870912' -> bytes (Ki/Mi/Gi binary, K/M/G decimal)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"invalid size {text!r} (e.g. 512Mi, 1Gi, 800M)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = " KMGT".index(unit) if unit else 0
    return int(number * (1024 if binary else 1000) ** power)


# --- samples -------------------------------------------------------------------------------------


@dataclass
class ProcSample:
    pid: int
    role: str  # "proxy" | "worker N"
    rss: int | None
    cpu_ticks: int
    starttime: int


@dataclass
class Sample:
    """Everything one look at the node gives."""

    time: float  # wall clock (the metrics' timestamps are wall clock)
    mono: float
    status: dict[str, Any] | None = None
    status_error: str = ""
    metrics: Metrics | None = None
    metrics_error: str = ""
    procs: list[ProcSample] = field(default_factory=list)
    dataplane_services: int | None = None
    dataplane_error: str = ""
    # False when the proxy synced (or had changes pending) while the dataplane was read:
    # its count cannot be compared with the status.
    stable: bool = True


@dataclass
class Check:
    name: str
    ok: bool | None  # None: could not be evaluated (not a breach)
    value: str
    limit: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "value": self.value,
            "limit": self.limit,
            "detail": self.detail,
        }


@dataclass
class Verdict:
    checks: list[Check]
    samples: int
    window: float  # seconds between the first and the last sample

    @property
    def breaches(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    @property
    def ok(self) -> bool:
        return not self.breaches

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "breaches": [c.name for c in self.breaches],
                "samples": self.samples,
                "window_seconds": round(self.window, 3),
                "checks": [c.to_json() for c in self.checks],
            },
            indent=2,
        )

    def text(self) -> str:
        lines = [
            f"kproxy verify: {self.samples} sample{'s' * (self.samples != 1)} over "
            f"{self.window:.0f} s",
        ]
        for c in self.checks:
            mark = {True: "ok     ", False: "BREACH ", None: "n/a    "}[c.ok]
            limit = f"  (limit {c.limit})" if c.limit else ""
            detail = f"  - {c.detail}" if c.detail else ""
            lines.append(f"  {mark}{c.name:<14} {c.value}{limit}{detail}")
        if self.ok:
            lines.append("verdict: healthy")
        else:
            names = ", ".join(c.name for c in self.breaches)
            lines.append(
                f"verdict: {len(self.breaches)} breach{'es' * (len(self.breaches) > 1)}: {names}"
            )
        return "\n".join(lines) + "\n"

    def progress(self) -> str:
        return ", ".join(
            f"{c.name} {c.value}{'' if c.ok is not False else ' (BREACH)'}" for c in self.checks
        )


# --- evaluation ----------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / MIB:.0f} MiB"


def _scraped(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.metrics is not None]


def _running(samples: list[Sample]) -> Check:
    down = [s for s in samples if s.status is None]
    pids = [int(s.status["pid"]) for s in samples if s.status is not None and "pid" in s.status]
    if down:
        return Check("running", False, "no", "", down[0].status_error or "no admin status")
    if len(set(pids)) > 1:
        return Check(
            "running", False, "restarted", "", f"the proxy's pid changed: {pids[0]} -> {pids[-1]}"
        )
    mode = samples[-1].status.get("mode") if samples[-1].status else "?"
    return Check("running", True, f"pid {pids[-1] if pids else '?'}, {mode} mode", "")


def _sync_p99(samples: list[Sample], th: Thresholds) -> Check:
    scraped = _scraped(samples)
    limit = f"< {th.sync_p99:g} s"
    if not scraped:
        return Check("sync-p99", None, "n/a", limit, "no metrics")
    last = scraped[-1].metrics.buckets(SYNC_HISTOGRAM)  # type: ignore[union-attr]
    if not last:
        return Check("sync-p99", None, "n/a", limit, f"{SYNC_HISTOGRAM} is not exposed")
    first, final = scraped[0].metrics, scraped[-1].metrics
    assert first is not None and final is not None
    window = bucket_delta(first.buckets(SYNC_HISTOGRAM), last)
    total = final.total(f"{SYNC_HISTOGRAM}_sum") or 0.0
    in_window = window[-1][1] if len(scraped) > 1 else 0.0
    if in_window > 0 and window is not last:
        buckets, where = window, "in the window"
        total -= first.total(f"{SYNC_HISTOGRAM}_sum") or 0.0
    else:
        buckets, where = last, "since the proxy started"
    count = buckets[-1][1]
    p99 = histogram_quantile(0.99, buckets)
    if p99 is None:
        return Check("sync-p99", None, "n/a", limit, "no sync observed yet")
    detail = f"over {count:.0f} syncs {where}"
    bound = max_observation_bound(buckets, total)
    if bound is not None and bound < p99:
        p99 = max(bound, 0.0)
        detail += " (bounded by the histogram's sum: few syncs)"
    return Check("sync-p99", p99 < th.sync_p99, f"{p99:.3f} s", limit, detail)


def _services(samples: list[Sample]) -> Check:
    rows = [s for s in samples if s.status is not None]
    if not rows:
        return Check("services", None, "n/a", "dataplane == snapshot", "no admin status")
    errors = [s.dataplane_error for s in rows if s.dataplane_error]
    compared = [
        (s, int(s.status.get("services", 0)))  # type: ignore[union-attr]
        for s in rows
        if s.stable and s.dataplane_services is not None
    ]
    if not compared:
        why = errors[-1] if errors else "the proxy was syncing during every sample"
        return Check("services", None, "n/a", "dataplane == snapshot", why)
    for s, want in compared:
        if s.dataplane_services != want:
            return Check(
                "services",
                False,
                f"{s.dataplane_services} in the dataplane, {want} in the snapshot",
                "equal",
                f"at {time.strftime('%H:%M:%S', time.localtime(s.time))}, read back from the "
                "kernel while no change was pending",
            )
    s, want = compared[-1]
    return Check("services", True, f"{want} service ports", "equal", f"{len(compared)} comparisons")


def _rss(samples: list[Sample], th: Thresholds) -> Check:
    limit = f"< {_mib(th.rss)}"
    totals = [(sum(p.rss or 0 for p in s.procs), s) for s in samples if s.procs and s.procs[0].rss]
    if not totals:
        return Check("rss", None, "n/a", limit, "the proxy's /proc entry is not readable")
    peak, at = max(totals, key=lambda t: t[0])
    parts = ", ".join(f"{p.role} {_mib(p.rss or 0)}" for p in at.procs)
    detail = f"peak ({parts})" if len(at.procs) > 1 else "peak"
    return Check("rss", peak < th.rss, _mib(peak), limit, detail)


def _cpu(samples: list[Sample], th: Thresholds, clk_tck: int) -> Check:
    limit = f"< {th.cpu:g} core"
    with_procs = [s for s in samples if s.procs]
    if len(with_procs) < 2:
        return Check("cpu", None, "n/a", limit, "needs two samples")
    first, last = with_procs[0], with_procs[-1]
    seconds = last.mono - first.mono
    before = {(p.pid, p.starttime): p.cpu_ticks for p in first.procs}
    ticks = 0
    for p in last.procs:
        # A process started during the window counts from zero.
        ticks += p.cpu_ticks - before.get((p.pid, p.starttime), 0)
    if seconds <= 0:
        return Check("cpu", None, "n/a", limit, "no time between the samples")
    cores = ticks / clk_tck / seconds
    who = "the proxy" + (f" and {len(last.procs) - 1} workers" if len(last.procs) > 1 else "")
    return Check("cpu", cores < th.cpu, f"{cores:.3f} core", limit, f"{who}, over {seconds:.1f} s")


def _failures_of(m: Metrics) -> tuple[float, float]:
    upstream = sum(m.total(n) or 0.0 for n in RESTORE_FAILURES)
    return upstream, m.total(SYNC_FAILURES) or 0.0


def _failures(samples: list[Sample], th: Thresholds, single: bool) -> Check:
    scraped = _scraped(samples)
    limit = f"<= {th.failures}"
    if not scraped:
        return Check("failures", None, "n/a", limit, "no metrics")
    up, anymode = _failures_of(scraped[-1].metrics)  # type: ignore[arg-type]
    where = "since the proxy started"  # a single look has no window to speak of
    if not single and len(scraped) > 1:
        up_first, any_first = _failures_of(scraped[0].metrics)  # type: ignore[arg-type]
        if up >= up_first and anymode >= any_first:
            up, anymode, where = up - up_first, anymode - any_first, "in the window"
        else:
            where = "since the proxy restarted"
    worst = max(up, anymode)
    return Check(
        "failures",
        worst <= th.failures,
        f"{worst:.0f}",
        limit,
        f"{where}: restore/sync failures {up:.0f} (upstream counters), "
        f"failed syncs {anymode:.0f} (any mode)",
    )


def _sync_count(s: Sample) -> float:
    return (s.metrics.total(f"{SYNC_HISTOGRAM}_count") if s.metrics else None) or 0.0


def _progress(samples: list[Sample], th: Thresholds) -> Check:
    scraped = _scraped(samples)
    limit = f">= {th.syncs_per_minute:g}/min while changes wait"
    if not scraped:
        return Check("sync-progress", None, "n/a", limit, "no metrics")

    def stalled(s: Sample) -> tuple[bool, float, float]:
        m = s.metrics
        assert m is not None
        last, queued = m.gauge(LAST_SYNC) or 0.0, m.gauge(LAST_QUEUED) or 0.0
        return queued > last and s.time - last > th.stall, last, queued

    for a, b in itertools.pairwise(scraped):
        sa, last_a, _qa = stalled(a)
        sb, last_b, queued_b = stalled(b)
        if sa and sb and last_a == last_b:
            since = f"for {b.time - last_b:.0f} s" if last_b else "since the proxy started"
            return Check(
                "sync-progress",
                False,
                f"no sync {since}",
                limit,
                f"changes pending (last queued {b.time - queued_b:.0f} s ago) and no successful "
                f"sync {since}, in consecutive samples {b.time - a.time:.0f} s apart",
            )
    first, last = scraped[0], scraped[-1]
    syncs = _sync_count(last) - _sync_count(first)
    minutes = (last.time - first.time) / 60
    m = last.metrics
    assert m is not None
    age = last.time - (m.gauge(LAST_SYNC) or 0.0)
    rate = f", {syncs / minutes:.1f} syncs/min in the window" if minutes >= 1 and syncs >= 0 else ""
    return Check(
        "sync-progress", True, f"last sync {age:.0f} s ago", limit, f"{syncs:.0f} syncs{rate}"
    )


def evaluate(
    samples: list[Sample],
    th: Thresholds | None = None,
    clk_tck: int = 100,
    *,
    single: bool = False,
) -> Verdict:
    """The verdict over a window of samples (the first and the last bound the window).

    single: the samples are one look (two samples a second apart), not a window: failure
    counters count since the proxy started."""
    th = th or Thresholds()
    if not samples:
        raise ValueError("no samples")
    checks = [_running(samples)]
    if samples[-1].status is None and all(s.status is None for s in samples):
        return Verdict(checks, len(samples), samples[-1].mono - samples[0].mono)
    unreachable = [s for s in samples if s.metrics is None]
    if unreachable:
        checks.append(Check("metrics", False, "unreachable", "", unreachable[-1].metrics_error))
    checks += [
        _sync_p99(samples, th),
        _services(samples),
        _rss(samples, th),
        _cpu(samples, th, clk_tck),
        _failures(samples, th, single),
        _progress(samples, th),
    ]
    return Verdict(checks, len(samples), samples[-1].mono - samples[0].mono)


# --- collecting from a live node -----------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def proc_sample(pid: int, role: str, proc: Path = Path("/proc")) -> ProcSample | None:
    stat = _read(proc / str(pid) / "stat")
    status = _read(proc / str(pid) / "status")
    if stat is None or status is None:
        return None
    ticks, start = parse_proc_stat(stat)
    return ProcSample(pid, role, parse_proc_status(status), ticks, start)


def _cmdline_flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def metrics_url_of(pid: int, proc: Path = Path("/proc")) -> str:
    """Where the running proxy serves /metrics: its --metrics-bind-address, else its
    --config file's metricsBindAddress (relative to its working directory), else the
    default; a wildcard host means loopback."""
    from kproxy.config import ConfigError, ProxyConfig, load_config

    raw = (proc / str(pid) / "cmdline").read_bytes() if (proc / str(pid)).exists() else b""
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    address = _cmdline_flag(argv, "--metrics-bind-address")
    if address is None:
        config = _cmdline_flag(argv, "--config")
        cfg = ProxyConfig()
        if config is not None:
            path = Path(config)
            if not path.is_absolute():
                path = Path(os.readlink(proc / str(pid) / "cwd")) / path
            # Unreadable now: the default then (the proxy validated it when it started).
            with contextlib.suppress(ConfigError, OSError):
                cfg = load_config(path)
        address = cfg.metrics_bind_address
    return metrics_url(address)


def metrics_url(address: str) -> str:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/metrics"


def dataplane_service_count(mode: str, netns: str | None = None) -> tuple[int | None, str]:
    """Service ports the kernel programs in `mode`, read back by the inspect readers."""
    from kproxy.ops.inspect.kernel import KernelSource
    from kproxy.ops.inspect.readers import ModeSelectionError, select

    try:
        selection = select(KernelSource(netns), mode)
    except ModeSelectionError as err:
        return None, str(err)
    live = [v for v in selection.views if v.live]
    if not live:
        return 0, ""
    names = {vs.service for v in live for vs in v.services() if vs.service}
    # ipvs mode keeps no service names in the kernel: its reader counts them itself.
    counted = sum(v.service_count() for v in live if hasattr(v, "service_count"))
    return len(names) + counted, ""


class Collector:
    """Takes Samples from the running proxy of one state dir, in this network namespace."""

    def __init__(
        self,
        state_dir: Path,
        *,
        metrics_address: str | None = None,
        fetch: Callable[[str], str] | None = None,
        admin: Callable[[], dict[str, Any]] | None = None,
        count_services: Callable[[str], tuple[int | None, str]] = dataplane_service_count,
        proc: Path = Path("/proc"),
    ) -> None:
        self.state_dir = state_dir
        self.metrics_address = metrics_address
        self._fetch = fetch or _http_get
        self._admin = admin or self._admin_status
        self._count = count_services
        self.proc = proc
        self._url: str | None = metrics_url(metrics_address) if metrics_address else None

    def _admin_status(self) -> dict[str, Any]:
        from kproxy.server.admin import SOCKET_NAME, call

        return call(self.state_dir / SOCKET_NAME, {"op": "status"}, timeout=10)

    def _status(self) -> tuple[dict[str, Any] | None, str]:
        from kproxy.server.admin import AdminUnavailable

        try:
            st = self._admin()
        except AdminUnavailable as err:
            return None, str(err)
        if not st.get("ok", True) or "pid" not in st:
            return None, str(st.get("error", "the admin socket gave no status"))
        return st, ""

    def _procs(self, status: dict[str, Any]) -> list[ProcSample]:
        out: list[ProcSample] = []
        main = proc_sample(int(status["pid"]), "proxy", self.proc)
        if main is None:
            return out
        out.append(main)
        if status.get("mode") == "userspace":
            from kproxy.dataplane.userspace.control import WorkerSet

            for index, info in sorted(WorkerSet(self.state_dir, count=0).workers().items()):
                p = proc_sample(info.pid, f"worker {index}", self.proc)
                if p is not None:
                    out.append(p)
        return out

    def check_namespace(self, pid: int) -> str | None:
        """Why this process cannot verify that proxy, or None."""
        try:
            theirs = os.stat(self.proc / str(pid) / "ns" / "net").st_ino
            ours = os.stat(self.proc / "self" / "ns" / "net").st_ino
        except OSError:
            return None
        if theirs == ours:
            return None
        name = next(
            (
                e.name
                for e in (Path("/run/netns").iterdir() if Path("/run/netns").is_dir() else ())
                if _ino(e) == theirs
            ),
            None,
        )
        how = f"ip netns exec {name} kproxy verify …" if name else "nsenter -n -t PID"
        return (
            f"the proxy (pid {pid}) runs in another network namespace; its metrics and its "
            f"dataplane are there: run {how}"
        )

    def sample(self) -> Sample:
        s = Sample(time.time(), time.monotonic())
        s.status, s.status_error = self._status()
        if s.status is None:
            return s
        pid = int(s.status["pid"])
        if self._url is None:
            self._url = metrics_url_of(pid, self.proc)
        try:
            s.metrics = parse_metrics(self._fetch(self._url))
        except (OSError, ValueError) as err:
            s.metrics_error = f"{self._url}: {err}"
        s.procs = self._procs(s.status)
        s.dataplane_services, s.dataplane_error = self._count(str(s.status.get("mode")))
        after, _err = self._status()
        s.stable = (
            after is not None
            and not s.status.get("pending")
            and not after.get("pending")
            and after.get("syncs") == s.status.get("syncs")
            and after.get("generation") == s.status.get("generation")
        )
        return s


def _ino(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # our own metrics URL
        return resp.read().decode()


def run(
    collector: Collector,
    thresholds: Thresholds,
    *,
    duration: float | None = None,
    interval: float = 5.0,
    progress: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clk_tck: int | None = None,
    first: Sample | None = None,
) -> Verdict:
    """Sample once (two samples ONE_LOOK_GAP apart) or every `interval` for `duration`
    (`first`: a sample already taken, which starts the window)."""
    tck = clk_tck or os.sysconf("SC_CLK_TCK")
    samples = [first or collector.sample()]
    if samples[0].status is None:
        return evaluate(samples, thresholds, tck)
    if duration is None:
        sleep(ONE_LOOK_GAP)
        samples.append(collector.sample())
        return evaluate(samples, thresholds, tck, single=True)
    start = samples[0].mono
    while True:
        left = duration - (time.monotonic() - start)
        if left <= 0:
            break
        sleep(min(interval, left))
        samples.append(collector.sample())
        if progress is not None:
            elapsed = samples[-1].mono - start
            partial = evaluate(samples, thresholds, tck)
            progress(f"[{elapsed:6.0f} s / {duration:.0f} s] {partial.progress()}")
    return evaluate(samples, thresholds, tck)


# --- the command ---------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    app.command("verify")(verify_command)


def _at_least_zero(value: float) -> float:
    if not 0 <= value < math.inf:
        raise ValueError(f"{value} must be 0 or more (and finite)")
    return value


def _more_than_zero(value: float) -> float:
    if not 0 < value < math.inf:
        raise ValueError(f"{value} must be more than 0 (and finite)")
    return value


def _metrics_address(text: str) -> str:
    # HOST:PORT; HOST an IP or a name (empty: this machine).
    parts = split_host_port(text)
    if parts is None or not re.fullmatch(r"[A-Za-z0-9.:_-]*", parts[0]):
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:10249)")
    parse_port(parts[1])
    return text


def verify_command(
    for_: Annotated[
        str | None,
        typer.Option(
            "--for",
            help="Watch for this long (e.g. 30m), sampling every --interval; "
            "default: one look now.",
            callback=checked(parse_positive_duration),
        ),
    ] = None,
    interval: Annotated[
        str,
        typer.Option(
            "--interval",
            help="Between samples with --for (e.g. 5s).",
            callback=checked(parse_positive_duration),
        ),
    ] = "5s",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable verdict.")] = False,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="The state dir of the kproxy to verify.")
    ] = DEFAULT_STATE_DIR,
    metrics_address: Annotated[
        str | None,
        typer.Option(
            "--metrics-address",
            help="host:port of its /metrics (default: from its flags and config file).",
            callback=checked(_metrics_address),
        ),
    ] = None,
    max_sync_p99: Annotated[
        str,
        typer.Option(
            "--max-sync-p99",
            help="p99 sync duration must stay below.",
            callback=checked(parse_positive_duration),
        ),
    ] = "2s",
    max_rss: Annotated[
        str,
        typer.Option(
            "--max-rss",
            help="RSS must stay below (512Mi, 1Gi, 800M).",
            callback=checked(parse_size),
        ),
    ] = "512Mi",
    max_cpu: Annotated[
        float,
        typer.Option(
            "--max-cpu", help="CPU in cores must stay below.", callback=checked(_at_least_zero)
        ),
    ] = 0.3,
    max_failures: Annotated[
        int,
        typer.Option(
            "--max-failures",
            help="Restore/sync failures allowed.",
            callback=checked(_at_least_zero),
        ),
    ] = 0,
    min_sync_rate: Annotated[
        float,
        typer.Option(
            "--min-syncs-per-minute",
            help="Successful syncs while changes wait.",
            callback=checked(_more_than_zero),
        ),
    ] = 1.0,
) -> None:
    """The golden-metric verdict after a switch: sync p99, service count in the dataplane vs
    the proxy's snapshot, RSS, CPU, restore/sync failures and sync progress of the running
    kproxy. Exit code 0 when healthy, 1 naming each breach, 2 for bad arguments. Run it in
    the proxy's network namespace."""
    from kproxy.cli_common import fail
    from kproxy.ops.inputs import ops_inputs

    # The option callbacks checked every value.
    duration = parse_duration(for_) if for_ is not None else None
    step = parse_duration(interval)
    thresholds = Thresholds(
        sync_p99=parse_duration(max_sync_p99),
        rss=parse_size(max_rss),
        cpu=max_cpu,
        failures=max_failures,
        syncs_per_minute=min_sync_rate,
    )
    inputs = ops_inputs(state_dir=state_dir)
    collector = Collector(inputs.state_dir, metrics_address=metrics_address)
    first = collector.sample()
    if first.status is not None:
        why = collector.check_namespace(int(first.status["pid"]))
        if why is not None:
            raise fail(why)

    def progress(line: str) -> None:
        typer.echo(line, err=True)

    verdict = run(
        collector,
        thresholds,
        duration=duration,
        interval=step,
        progress=progress,
        first=first,
    )
    typer.echo(verdict.to_json() if as_json else verdict.text(), nl=False)
    raise typer.Exit(0 if verdict.ok else 1)
