"""Properties of every mode's output in a real kernel, over generated objects.

One throw-away network namespace serves the whole module (made and removed by a fixture,
even on failure) and is emptied before every example. Per example:

* the render is accepted by the kernel's own parser: `iptables-restore --test` (nft and
  legacy backends) for iptables and userspace mode, `nft -c -f` for nftables mode,
  `ipset restore` for ipvs mode's sets (and `iptables-restore --test` for its rules, which
  need those sets). IPVS virtual servers need the ip_vs module, which only the UML tests
  have: that part of ipvs mode is not checked here.
* applied for real by the mode's dataplane, what kproxy's own readers (ops.inspect) read
  back is exactly what the snapshot defines: for each service port its frontends and the
  endpoints (or refusal) and affinity of each; then a partial sync to another set of
  objects reads back as that set, and a full resync changes nothing.

Examples are few, 25 per test (the module runs in about a minute on a loaded 2-core
machine; its time is printed at the end). Not derandomized: each run explores new
examples, and a failing one is replayed first from the local Hypothesis database.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.iptables.proxier import IptablesDataplane
from kproxy.dataplane.iptables.render import render_full as iptables_render
from kproxy.dataplane.ipvs.ipset import IpsetClient, sync_lines
from kproxy.dataplane.ipvs.plan import IpvsPlanner
from kproxy.dataplane.ipvs.render import ipset_restore
from kproxy.dataplane.nftables.layouts import LAYOUTS, dataplane_name
from kproxy.dataplane.nftables.proxier import NftablesDataplane
from kproxy.dataplane.nftables.render import render_full as nftables_render
from kproxy.dataplane.userspace.render import render_text as userspace_render
from kproxy.host.commands import in_netns
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import snapshot_from_objects
from kproxy.ops.inspect import drift
from kproxy.ops.inspect.destinations import expected_destinations
from kproxy.ops.inspect.ipvs import parse_ipset_save
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import ANY_ADDRESS, NODE_PORT, VirtualServer
from kproxy.ops.inspect.readers import READERS
from tests.support.lab import LAB_SKIP_REASON, LAB_SUPPORTED
from tests.support.strategies import NODE, World, any_world_histories, node_facts, rule_options

pytestmark = pytest.mark.kernel

KERNEL = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
FLAVOURS = ("nft", "legacy")
# Every legacy table a mode writes: restored empty (without --noflush), it loses its chains.
EMPTY_LEGACY = "".join(f"*{t}\nCOMMIT\n" for t in ("filter", "nat", "mangle", "raw"))

COUNTERS = re.compile(r"\[\d+:\d+\]")


def run(netns: str, argv: list[str], data: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(in_netns(argv, netns), input=data, capture_output=True, text=True)


def accepted(netns: str, argv: list[str], data: str) -> None:
    proc = run(netns, argv, data)
    assert proc.returncode == 0, f"{' '.join(argv)} rejected the render: {proc.stderr}\n{data}"


class Namespace:
    """The module's namespace, emptied between examples."""

    def __init__(self) -> None:
        self.name = f"kprop-{uuid.uuid4().hex[:8]}"
        self.legacy_used = False

    def empty(self) -> None:
        # iptables first: its rules reference the ipsets.
        for argv, data in (
            (["nft", "flush", "ruleset"], None),
            (["iptables-legacy-restore"], EMPTY_LEGACY if self.legacy_used else None),
            (["ipset", "destroy"], None),
        ):
            if argv[0] == "iptables-legacy-restore" and data is None:
                continue
            proc = run(self.name, argv, data)
            assert proc.returncode == 0, proc.stderr

    def source(self) -> KernelSource:
        return KernelSource(self.name)


@pytest.fixture(scope="module")
def netns() -> Iterator[Namespace]:
    if not LAB_SUPPORTED:
        pytest.skip(f"lab unavailable: {LAB_SKIP_REASON}")
    ns = Namespace()
    subprocess.run(["ip", "netns", "add", ns.name], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "delete", ns.name], check=False)


def snap(objects: list[dict[str, Any]]) -> Snapshot:
    return snapshot_from_objects(objects, NODE)


# --- what the kernel should hold, and what it holds ------------------------------------------

# (proto, address, port) -> (endpoints, refusal verdict, affinity timeout, source ranges)
Frontends = dict[
    tuple[str, str, int], tuple[frozenset[str], str | None, int | None, frozenset[str]]
]


def model_frontends(snapshot: Snapshot, facts: NodeFacts) -> Frontends | None:
    """What the snapshot defines, per frontend (NodePorts on any local address); None when
    service ports share a frontend (which of them gets it differs between modes)."""
    ports = {(str(sp.name), sp.protocol.lower): sp for sp in snapshot.services.values()}
    node_ip = ipaddress.ip_address(facts.node_ips[0])
    out: Frontends = {}
    for e in drift.expected(snapshot):
        key = (e.proto, e.address, e.port)
        if key in out:
            return None
        ranges: set[str] = set()
        sp = ports[e.service, e.proto]
        # Source ranges guard an LB IP whenever the service has endpoints anywhere (also
        # when its traffic is dropped for want of local ones).
        if e.kind == drift.LOAD_BALANCER and sp.any_endpoints:
            ranges.update(sp.load_balancer_source_ranges)
            # The node may reach its LB IPs when a range holds the node's IP (upstream).
            if any(node_ip in ipaddress.ip_network(r) for r in ranges):
                ranges.update(f"{ip}/32" for ip in sp.load_balancer_ips)
        out[key] = (frozenset(e.endpoints), e.verdict, e.persistent, source_ranges(ranges))
    return out


def source_ranges(texts: Iterable[str]) -> frozenset[str]:
    """Ranges as the smallest set of networks: iptables-save writes an address as /32, nft
    without, and nft merges adjacent ones into a range "a-b"."""
    nets: list[ipaddress.IPv4Network] = []
    for text in texts:
        low, dash, high = text.partition("-")
        if dash:
            first, last = ipaddress.IPv4Address(low), ipaddress.IPv4Address(high)
            nets += ipaddress.summarize_address_range(first, last)
        else:
            nets.append(ipaddress.IPv4Network(text))
    return frozenset(str(n) for n in ipaddress.collapse_addresses(nets))


def kernel_frontends(servers: list[VirtualServer]) -> Frontends:
    out: Frontends = {}
    for vs in servers:
        address = ANY_ADDRESS if vs.kind == NODE_PORT else vs.address
        key = (vs.proto, address, vs.port)
        value = (
            frozenset(rs.addr for rs in vs.endpoints),
            vs.verdict,
            vs.persistent if not vs.verdict else None,
            source_ranges(vs.source_ranges),
        )
        # A NodePort may be listed once per node address; each must say the same.
        assert out.setdefault(key, value) == value, f"{key}: {out[key]} and {value}"
    return out


def reads_back_as(netns: Namespace, dataplane: str, snapshot: Snapshot, facts: NodeFacts) -> None:
    """The dataplane, read by kproxy's own reader, programs exactly the snapshot."""
    (reader,) = [r for r in READERS if r.dataplane == dataplane]
    source = netns.source()
    view = reader.load(source)
    assert view is not None and view.live, f"{dataplane}: {view and view.detail}"
    assert set(reader.destinations(source)) == expected_destinations(snapshot)
    servers = view.services()
    expected = model_frontends(snapshot, facts)
    if expected is not None:
        assert drift.compare(servers, snapshot) == []
        assert kernel_frontends(servers) == expected


# --- iptables mode ---------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", FLAVOURS)
@KERNEL
@given(pair=any_world_histories(), facts=node_facts(), options=rule_options())
def test_iptables_render_is_accepted_and_reads_back_as_the_model(
    netns: Namespace, flavour: str, pair: list[World], facts: NodeFacts, options: RuleOptions
) -> None:
    netns.empty()
    netns.legacy_used |= flavour == "legacy"
    before, after = snap(pair[0]), snap(pair[1])
    accepted(
        netns.name,
        [f"iptables-{flavour}-restore", "--test"],
        iptables_render(before, facts, options),
    )
    backend = IptablesBackend(flavour, netns=netns.name)
    plane = IptablesDataplane(backend, facts, options)
    plane.sync(before, full=True)
    reads_back_as(netns, f"iptables-{flavour}", before, facts)
    plane.sync(after, full=False)
    reads_back_as(netns, f"iptables-{flavour}", after, facts)
    partial = tables(backend)
    plane.distrust_kernel()  # the full resync reads the tables and writes everything
    plane.sync(after, full=True)
    assert tables(backend) == partial


def tables(backend: IptablesBackend) -> list[str]:
    """The save without its timestamps and counters."""
    return [COUNTERS.sub("[0:0]", line) for line in backend.save().splitlines() if line[:1] != "#"]


# --- nftables mode ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@KERNEL
@given(pair=any_world_histories(), facts=node_facts(), options=rule_options())
def test_nftables_render_is_accepted_and_reads_back_as_the_model(
    netns: Namespace, layout: str, pair: list[World], facts: NodeFacts, options: RuleOptions
) -> None:
    """Both layouts, each read back by its own reader ("nftables", "nftables-compact")."""
    netns.empty()
    before, after = snap(pair[0]), snap(pair[1])
    render = nftables_render(before, facts, options, layout=layout)
    accepted(netns.name, ["nft", "-c", "-f", "-"], render)
    plane = NftablesDataplane(facts, options, netns=netns.name, layout=layout)
    dataplane = dataplane_name(layout)
    plane.sync(before, full=True)
    reads_back_as(netns, dataplane, before, facts)
    plane.sync(after, full=False)
    reads_back_as(netns, dataplane, after, facts)


# --- ipvs mode: ipsets and iptables rules (virtual servers need ip_vs: UML tests) ------------


@KERNEL
@given(pair=any_world_histories(), facts=node_facts(), options=rule_options())
def test_ipvs_ipsets_restore_and_read_back_as_the_plan(
    netns: Namespace, pair: list[World], facts: NodeFacts, options: RuleOptions
) -> None:
    netns.empty()
    netns.legacy_used = True
    planner = IpvsPlanner(facts, options)
    before = planner.plan(snap(pair[0]))
    accepted(netns.name, ["ipset", "restore"], ipset_restore(before.sets))
    for flavour in FLAVOURS:
        accepted(netns.name, [f"iptables-{flavour}-restore", "--test"], before.iptables_text())
    assert ipsets(netns) == before.sets
    after = planner.plan(snap(pair[1]))
    IpsetClient(netns.name).restore(sync_lines(after.sets, before.sets, create=False))
    assert ipsets(netns) == after.sets


def ipsets(netns: Namespace) -> dict[str, set[str]]:
    text = netns.source().ipset_save()
    assert text is not None
    return {name: entries for name, (_type, entries) in parse_ipset_save(text).items()}


# --- userspace mode: its rules -----------------------------------------------------------------


@KERNEL
@given(pair=any_world_histories(), facts=node_facts(), options=rule_options())
def test_userspace_render_is_accepted(
    netns: Namespace, pair: list[World], facts: NodeFacts, options: RuleOptions
) -> None:
    netns.legacy_used = True
    text = userspace_render(snap(pair[0]), facts, options)
    for flavour in FLAVOURS:
        accepted(netns.name, [f"iptables-{flavour}-restore", "--test"], text)
