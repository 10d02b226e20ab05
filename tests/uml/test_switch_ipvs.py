"""Live switches into and out of ipvs mode under load, inside UML (the only kernel with IPVS).

As tests/test_switch_kernel.py on the host: `kproxy run` on the lab node, fresh TCP
connections every few ms, long-lived TCP connections pinging every 100 ms and a UDP flow,
then `kproxy switch --to MODE` over the admin socket. Zero failed requests and zero dropped
long-lived connections in every pair. The iptables layer is iptables-legacy (G9); the
nftables pairs need nf_tables for ip, which only kproxy's own UML kernel has. The
long-lived connections are opened in the mode the node starts in, so each direction keeps
connections that were set up by the old mode's translation.

One kproxy serves the whole module (starting one costs seconds in UML): each test takes
it in the mode the previous one left it in, which the tests are ordered for (ipvs ->
userspace -> ipvs, ipvs -> nftables -> ipvs, ipvs -> iptables, iptables -> ipvs ->
iptables, then nftables -> ipvs -> nftables on a fresh node), as a node switched again and
again would be. A test run alone, or after a failed one, gets a fresh kproxy on
a wiped node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kproxy.dataplane.userspace.control import WORKER_MODULE
from kproxy.dataplane.userspace.render import ROUTE_TABLE, RULE_PRIORITY
from kproxy.lab.load import LoadHarness, LoadResult
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from kproxy.leftovers import clean_leftovers
from kproxy.server.admin import SOCKET_NAME, AdminUnavailable, call
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write
from tests.support.uml import Guest

pytestmark = pytest.mark.kernel

PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
WEB = ("10.96.0.10", 80)
DNS = ("10.96.0.53", 53)
# Upstream's userspace-mode chain names (kproxy's userspace mode uses them too).
USERSPACE_CHAINS = (
    "KUBE-PORTALS-CONTAINER",
    "KUBE-PORTALS-HOST",
    "KUBE-NODEPORT-CONTAINER",
    "KUBE-NODEPORT-HOST",
    "KUBE-NODEPORT-NON-LOCAL",
)
# Logged when datagrams waited while a retiring ipvs mode's UDP virtual server went.
HELD = "while ipvs let go of their flows"
STEPS = ["check", "snapshot", "anchor", "program", "verify", "cut-over", "remove"]


def start(lab: Lab, tmp: Path, mode: str) -> ProxyProcess:
    src = tmp / "objects"
    src.mkdir(parents=True, exist_ok=True)
    write(src / "node.yaml", node())
    write(
        src / "web.yaml",
        service("web", WEB[0], [port("http", WEB[1], 8080)]),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
    )
    write(
        src / "dns.yaml",
        service("dns", DNS[0], [port("dns", DNS[1], 8080, protocol="UDP")]),
        endpoint_slice("dns", [endpoint(ip) for ip in PODS], [port("dns", 8080, protocol="UDP")]),
    )
    cfg = tmp / f"{mode}.yaml"
    cfg.write_text(proxy_config(mode))
    proxy = ProxyProcess(
        lab, src, config=cfg, args=["--iptables-backend", "legacy"], workdir=tmp / "kp"
    )
    return proxy.start(timeout=60)


def switch(proxy: ProxyProcess, to: str, timeout: float = 120) -> dict[str, Any]:
    """The switch over the admin socket, as `kproxy switch` sends it after its preflight
    (the preflight alone takes ~40 s in UML; tests/test_switch_kernel.py runs the CLI)."""
    request = {"op": "switch", "to": to, "timeout": timeout}
    try:
        return call(proxy.state_dir / SOCKET_NAME, request, timeout)
    except AdminUnavailable as exc:
        pytest.fail(f"{exc}; kproxy's log:\n{proxy.log_tail(40)}")


def nft_table(lab: Lab) -> str:
    """nftables mode's table in the node ("" without it, or without nf_tables for ip)."""
    return lab.exec(lab.node_ns, ["nft", "list", "table", "ip", "kube-proxy"], check=False).stdout


def live_modes(lab: Lab) -> set[str]:
    """Which modes are in the node's packet path (iptables-legacy, IPVS, nftables' base
    chains: a cut-over out of nftables deletes them first)."""
    save = lab.exec(lab.node_ns, ["iptables-legacy-save"]).stdout
    modes: set[str] = set()
    if "hook prerouting" in nft_table(lab):
        modes.add("nftables")
    if "-A PREROUTING" in save and "-j KUBE-SVC-" in save:
        modes.add("iptables")
    if "-j KUBE-PORTALS-CONTAINER" in save:
        modes.add("userspace")
    vs = [ln for ln in lab.exec(lab.node_ns, ["ipvsadm", "-S", "-n"]).stdout.splitlines()]
    if (
        any(ln.startswith("-A ") for ln in vs)
        or "kube-ipvs0" in lab.exec(lab.node_ns, ["ip", "-o", "link"]).stdout
    ):
        modes.add("ipvs")
    return modes


def leftovers(lab: Lab, mode: str = "ipvs") -> list[str]:
    """A mode's state anywhere in the node (must be gone after a switch out of it): ipvs's,
    nftables' (its table) or userspace's (its chains, its workers, the transparent-proxy
    policy route)."""
    if mode == "nftables":
        return ["table ip kube-proxy"] if nft_table(lab) else []
    if mode == "userspace":
        save = lab.exec(lab.node_ns, ["iptables-legacy-save"]).stdout
        found = sorted({c for c in USERSPACE_CHAINS if f":{c} " in save})
        found += [f"worker {pid}" for pid in userspace_workers()]
        if lab.exec(lab.node_ns, ["ip", "rule", "show", "pref", str(RULE_PRIORITY)]).stdout:
            found.append(f"ip rule {RULE_PRIORITY}")
        routes = ["ip", "route", "show", "table", str(ROUTE_TABLE)]
        if lab.exec(lab.node_ns, routes, check=False).stdout.strip():
            found.append(f"route table {ROUTE_TABLE}")
        return found
    out = []
    if lab.exec(lab.node_ns, ["ipvsadm", "-S", "-n"]).stdout.strip():
        out.append("virtual servers")
    if "kube-ipvs0" in lab.exec(lab.node_ns, ["ip", "-o", "link"]).stdout:
        out.append("kube-ipvs0")
    sets = lab.exec(lab.node_ns, ["ipset", "list", "-n"], check=False).stdout.split()
    out += [s for s in sets if s.startswith("KUBE-")]
    save = lab.exec(lab.node_ns, ["iptables-legacy-save"]).stdout
    out += [c for c in ("KUBE-IPVS-FILTER", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER") if c in save]
    return out


def userspace_workers() -> list[int]:
    """PIDs of userspace worker processes (in the guest, only this test's proxy runs)."""
    pids = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = path.read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if WORKER_MODULE.encode() in argv:
            pids.append(int(path.parent.name))
    return pids


def wipe(lab: Lab, proxy: ProxyProcess | None) -> None:
    """Every mode's state off the node (what `kproxy cleanup` removes, and the workers of
    the proxy's state dir), IPVS's and conntrack's tables emptied."""
    if proxy is not None:
        proxy.stop()
    clean_leftovers(
        None, netns=lab.node_ns, state_dir=proxy.state_dir if proxy is not None else None
    )
    lab.exec(lab.node_ns, ["ipvsadm", "-C"], check=False)
    lab.exec(lab.node_ns, ["conntrack", "-F"], check=False)


@dataclass
class Node:
    """The module's lab node and the kproxy serving it, handed from test to test."""

    lab: Lab
    tmp: Path
    proxy: ProxyProcess | None = None
    starts: int = 0

    def serving(self, mode: str) -> ProxyProcess:
        """The kproxy, in `mode`: the one the previous test left if it serves that mode,
        else a fresh one on a wiped node."""
        proxy = self.proxy
        if (
            proxy is not None
            and proxy.proc is not None
            and proxy.proc.poll() is None
            and proxy.status().get("mode") == mode
        ):
            return proxy
        self.reset()
        self.starts += 1
        self.proxy = start(self.lab, self.tmp / f"run{self.starts}", mode)
        return self.proxy

    def reset(self) -> None:
        """Stop the kproxy and wipe the node (a lab node nobody served is clean)."""
        if self.proxy is not None:
            wipe(self.lab, self.proxy)
        self.proxy = None


@pytest.fixture(scope="module")
def module_node(lab_module: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node_ = Node(lab_module, tmp_path_factory.mktemp("switch-ipvs"))
    yield node_
    node_.reset()


@pytest.fixture
def switch_node(module_node: Node, request: pytest.FixtureRequest) -> Iterator[Node]:
    """The module's node; a test that fails leaves it to be wiped (the next test gets a
    fresh kproxy), whatever mode or draining state it stopped in."""
    failed = request.session.testsfailed
    yield module_node
    if request.session.testsfailed > failed:
        module_node.reset()


def alone(lab: Lab, report: dict[str, Any]) -> bool:
    """The switch's new mode is the only one in the node's packet path."""
    return live_modes(lab) == {report["to_mode"]}


def run_switches(
    where: Node,
    first: str,
    targets: list[str],
    settled: Callable[[Lab, dict[str, Any]], bool] = alone,
) -> tuple[list[dict[str, Any]], LoadResult]:
    """From `first`, switch to each target under load; after each switch wait (10 s at
    most) until the node is `settled` for that report."""
    lab, proxy = where.lab, where.serving(first)
    # The streams are open once start() returns; the switch's first steps take seconds,
    # with the rest of the load in the old mode.
    load = LoadHarness(lab, tcp=WEB, udp=DNS).start()
    reports: list[dict[str, Any]] = []
    try:
        for to in targets:
            began = load._now()
            report = switch(proxy, to)
            report["_window"] = (began, load._now())
            assert report.get("ok"), (report, proxy.log_tail(30))
            reports.append(report)
            # Out of ipvs, a virtual server busy with a request in flight drains for a
            # moment (reaped every 2 s).
            t0 = time.monotonic()
            assert wait_for(lambda: settled(lab, report), 10), (  # noqa: B023
                report["to_mode"],
                live_modes(lab),
                leftovers(lab),
                leftovers(lab, "userspace"),
            )
            report["_settled"] = round(time.monotonic() - t0, 2)
            time.sleep(0.5)
    finally:
        result = load.stop()
    durations = "; ".join(
        f"{r['from_mode']}->{r['to_mode']} {r['duration']:.2f} s in {r['_window']}, settled"
        f" in {r['_settled']} s ("
        + ", ".join(f"{s['name']} {s['seconds']:.2f}" for s in r["steps"])
        + ")"
        for r in reports
    )
    print(f"switch durations in UML: {durations}; load: {result.summary()}")
    assert result.fresh_sent > 50 and result.pings_sent > 30 and result.udp_sent > 10, (
        result.summary()
    )
    # Fresh connections and UDP never fail; long-lived ones are the caller's to judge.
    failed = [*result.fresh_failed, *result.udp_failed]
    assert not failed, (durations, result.summary(), failed[:5])
    for r in reports:
        assert [s["name"] for s in r["steps"]][: len(STEPS)] == STEPS, r["steps"]
    return reports, result


def ipvs_state(lab: Lab) -> tuple[list[str], list[str]]:
    """(virtual servers, kube-ipvs0 addresses) in the node."""
    vs = [
        " ".join(ln.split()[:3])
        for ln in lab.exec(lab.node_ns, ["ipvsadm", "-S", "-n"]).stdout.splitlines()
        if ln.startswith("-A ")
    ]
    shown = lab.exec(
        lab.node_ns, ["ip", "-o", "-4", "addr", "show", "dev", "kube-ipvs0"], check=False
    )
    addrs = [ln.split()[3].split("/")[0] for ln in shown.stdout.splitlines()]
    return sorted(vs), sorted(addrs)


def wait_for(check: Any, timeout: float) -> Any:
    """check() until it is truthy or timeout s passed; its last value."""
    end = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < end:
        time.sleep(0.2)
    return value


def through_and_back(where: Node, via: str) -> tuple[list[dict[str, Any]], str]:
    """ipvs -> `via` -> ipvs under load, with what every such round must show: no request
    fails and no stream drops; out of ipvs only the streams' virtual server (and its VIP)
    stays, draining, while their datagrams wait for IPVS to let go (ipvs/hold.py); back in
    ipvs, the reaper stops and the new ipvs mode adopts the kept virtual server, and
    nothing of `via` is left. Returns the two reports and kproxy's log of the round."""

    def settled(lab: Lab, report: dict[str, Any]) -> bool:
        if report["to_mode"] == via:
            return (
                live_modes(lab) == {via, "ipvs"}
                and ipvs_state(lab) == (["-A -t 10.96.0.10:80"], ["10.96.0.10"])
                and leftovers(lab) == ["virtual servers", "kube-ipvs0"]
            )
        return (
            live_modes(lab) == {"ipvs"}
            and ipvs_state(lab)
            == (["-A -t 10.96.0.10:80", "-A -u 10.96.0.53:53"], sorted([DNS[0], WEB[0]]))
            and leftovers(lab, via) == []
        )

    proxy = where.serving("ipvs")
    logged = proxy.log_path.stat().st_size
    reports, result = run_switches(where, "ipvs", [via, "previous"], settled)
    assert [r["to_mode"] for r in reports] == [via, "ipvs"]
    assert result.streams_dropped == 0 and result.failures == 0, result.summary()
    remove = next(s for s in reports[0]["steps"] if s["name"] == "remove")
    assert "draining 1 virtual servers: TCP 10.96.0.10:80" in remove["detail"], remove
    with proxy.log_path.open() as f:
        f.seek(logged)
        log = f.read()
    assert HELD in log, log[-3000:]
    assert "stopped reaping with draining 1 virtual servers" in log, log[-3000:]
    assert "drained after" not in log, "the reaper deleted what the new ipvs mode adopted"
    return reports, log


def test_ipvs_to_userspace_and_back_keeps_the_connections_ipvs_set_up(switch_node: Node) -> None:
    """ipvs -> userspace -> ipvs under load: no request fails, no stream drops.

    This direction, not userspace -> ipvs -> userspace: the long-lived connections are
    opened in the first mode, and a userspace worker ends the connections it proxies when
    its mode goes (as upstream's userspace proxy did), so only connections IPVS set up can
    outlive both switches. They exercise the whole drain path: out of ipvs their virtual
    server is kept and drains (everything else of ipvs goes at once) while new flows take
    userspace's DNAT to the node's own address, which IPVS in LOCAL_IN sees too; back into
    ipvs, the reaper stops and the new ipvs mode adopts the kept virtual server instead
    of deleting and re-creating it, so the connections keep flowing through it."""
    reports, log = through_and_back(switch_node, "userspace")
    assert any("KUBE-PORTALS-CONTAINER" in r for r in reports[1]["removed"]), reports[1]
    # The UDP flow went through a worker: its redirect is forgotten before the workers go.
    assert "conntrack entries of UDP flows to the workers" in log, log[-3000:]


def test_ipvs_to_nftables_and_back_keeps_the_connections_ipvs_set_up(
    switch_node: Node, guest: Guest
) -> None:
    """ipvs -> nftables -> ipvs under load: no request fails, no stream drops.

    As the userspace pair above: the streams IPVS set up keep their virtual server, which
    drains while new flows take nftables' DNAT in prerouting (before IPVS sees them in
    LOCAL_IN); back into ipvs, the new ipvs mode adopts the kept virtual server, and
    nftables' table goes (base chains first, at the cut-over)."""
    guest.require_nftables()
    reports, _ = through_and_back(switch_node, "nftables")
    assert any("kube-proxy" in r for r in reports[1]["removed"]), reports[1]["removed"]


def test_ipvs_to_iptables_keeps_connections_ipvs_set_up(switch_node: Node) -> None:
    """ipvs -> iptables under load: no fresh TCP or UDP request fails, and the 5 long-lived
    connections IPVS set up survive (their virtual server drains instead of going) and keep
    answering; once they close, the kept virtual server and kube-ipvs0 are reaped."""
    lab, proxy = switch_node.lab, switch_node.serving("ipvs")
    load = LoadHarness(lab, tcp=WEB, udp=DNS).start()
    try:
        report = switch(proxy, "iptables")
        assert report.get("ok"), (report, proxy.log_tail(30))
        assert [s["name"] for s in report["steps"]][: len(STEPS)] == STEPS, report["steps"]
        remove = next(s for s in report["steps"] if s["name"] == "remove")
        assert "draining 1 virtual servers: TCP 10.96.0.10:80" in remove["detail"], remove
        pings_at_switch = load.result.pings_sent
        # The streams keep pinging (every 100 ms) through the drained one.
        wait_for(lambda: load.result.pings_sent - pings_at_switch > 50, 10)
        # Drained: only the web virtual server (the streams' one) and its VIP stay; the
        # UDP one, the other addresses, the ipsets and ipvs-only chains are gone already.
        assert ipvs_state(lab) == (["-A -t 10.96.0.10:80"], ["10.96.0.10"]), ipvs_state(lab)
        rest = [x for x in leftovers(lab) if x not in ("virtual servers", "kube-ipvs0")]
        assert rest == [], rest
        assert "iptables" in live_modes(lab)
    finally:
        result = load.stop()
    print(f"ipvs->iptables in UML: {report['duration']:.2f} s; load: {result.summary()}")
    assert result.pings_sent - pings_at_switch > 50, result.summary()
    assert result.fresh_sent > 50 and result.udp_sent > 10, result.summary()
    assert result.streams_dropped == 0, result.summary()
    assert result.pings_failed == [] and result.fresh_failed == [], (
        result.summary(),
        result.pings_failed[:5],
        result.fresh_failed[:5],
    )
    # The UDP flow keeps its 5-tuple: IpvsDataplane.retire() holds its datagrams while its
    # virtual server and conntrack entries go, then the next one takes the new mode's DNAT.
    assert result.udp_failed == [], (result.summary(), result.udp_failed[:5])
    held = [ln for ln in proxy.log_tail(60).splitlines() if HELD in ln]
    assert held, proxy.log_tail(60)
    print(held[-1])
    # The streams close (their agent exits): the reaper deletes what it kept.
    lab.agent(lab.client_ns[-1]).close()
    assert wait_for(lambda: leftovers(lab) == [], 15), (
        leftovers(lab),
        [
            ln
            for ln in lab.exec(lab.node_ns, ["cat", "/proc/net/ip_vs_conn"]).stdout.splitlines()
            if "TIME_WAIT" not in ln
        ],
        lab.exec(lab.node_ns, ["ipvsadm", "-L", "-n"]).stdout,
        [ln for ln in proxy.log_tail(200).splitlines() if "drain" in ln or " W " in ln],
    )
    assert "drained after" in proxy.log_tail(40), proxy.log_tail(40)
    assert live_modes(lab) == {"iptables"}


def test_iptables_to_ipvs_and_back_under_load_fails_nothing(switch_node: Node) -> None:
    """iptables -> ipvs -> iptables: connections set up by iptables DNAT survive both."""
    reports, result = run_switches(switch_node, "iptables", ["ipvs", "previous"])
    assert [r["to_mode"] for r in reports] == ["ipvs", "iptables"]
    assert result.streams_dropped == 0 and result.failures == 0, result.summary()
    assert any("KUBE-SVC-" in r for r in reports[0]["removed"]), reports[0]["removed"]
    remove = next(s for s in reports[1]["steps"] if s["name"] == "remove")
    assert any("kube-ipvs0" in r for r in reports[1]["removed"]) or (
        "kube-ipvs0 kept" in remove["detail"]
    ), (reports[1]["removed"], remove)
    assert leftovers(switch_node.lab) == []


def test_nftables_to_ipvs_and_back_under_load_fails_nothing(
    switch_node: Node, guest: Guest
) -> None:
    """nftables -> ipvs -> nftables: connections set up by nftables' DNAT survive both (the
    switch's conntrack anchor holds the NAT hooks while nftables' table goes)."""
    guest.require_nftables()
    reports, result = run_switches(switch_node, "nftables", ["ipvs", "previous"])
    assert [r["to_mode"] for r in reports] == ["ipvs", "nftables"]
    assert result.streams_dropped == 0 and result.failures == 0, result.summary()
    assert any("kube-proxy" in r for r in reports[0]["removed"]), reports[0]["removed"]
    remove = next(s for s in reports[1]["steps"] if s["name"] == "remove")
    assert any("kube-ipvs0" in r for r in reports[1]["removed"]) or (
        "kube-ipvs0 kept" in remove["detail"]
    ), (reports[1]["removed"], remove)
    assert leftovers(switch_node.lab) == []
