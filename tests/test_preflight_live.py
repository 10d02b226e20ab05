"""Preflight inside a running kproxy: its own objects and mode, the same findings as reading
everything again, and no whole-table read; the admin op `preflight` and the CLI's use of it."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kproxy.daemon import Daemon
from kproxy.dataplane.iptables.backend import command_wait_flags
from kproxy.dataplane.kernel_dump import KernelDump
from kproxy.dataplane.nftables.layouts import LAYOUTS, dataplane_name
from kproxy.ops.inputs import OpsInputs
from kproxy.ops.inspect.model import Destination
from kproxy.ops.preflight import run_preflight
from kproxy.ops.preflight.cli import ask_running
from kproxy.ops.preflight.findings import ordered
from kproxy.ops.preflight.live import PATH_LIVE, PATH_READ
from kproxy.ops.preflight.run import PreflightResult
from kproxy.server.admin import AdminServer, AdminTarget
from tests.support.objects import endpoint, endpoint_slice, node, port, service
from tests.support.preflight_fakes import FakeNode, live_state, recorded

PODS = ["10.244.1.10", "10.244.2.10"]
SAVE = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-AAAA - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-AAAA
-A KUBE-SERVICES -d 10.96.9.9/32 -p tcp -m comment --comment "old/gone:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-BBBB
COMMIT
"""  # noqa: E501
# What the iptables-nft reader finds in SAVE.
PROGRAMMED = {
    "iptables-nft": {
        Destination("10.96.0.10", "tcp", 80): "default/web:http",
        Destination("10.96.9.9", "tcp", 80): "old/gone:http",
    }
}


def objects() -> list[dict[str, Any]]:
    """Services of every kind the object checks tell apart."""
    return [
        node(),
        service("web", "10.96.0.10", [port("http", 80, 8080)], selector={"app": "web"}),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
        service("api", "10.96.0.30", [port("https", 443, 8443)], selector={"app": "api"}),
        service("twin", "10.96.0.10", [port("http", 80, 8080)]),
        service("db", "10.96.0.50", [port("pg", 5432, 5432)]),
        endpoint_slice("db", [endpoint(PODS[0])], [port("pg", 5432)]),
        service("zero", "10.96.0.40", [port("http", 0, 8080)]),
        service("pending", "", [port("http", 80)]),
        endpoint_slice("pending", [endpoint("10.244.0.5")], [port("http", 80)]),
        endpoint_slice("ghost", [endpoint("10.244.0.6")], [port("http", 80)]),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "alias", "namespace": "default"},
            "spec": {"type": "ExternalName", "externalName": "pending.default.svc.cluster.local"},
        },
    ]


def never_read(_netns: str | None) -> dict[str, Any]:
    raise AssertionError("the kernel state sections were read")


def facts(result: PreflightResult) -> list[tuple[str, str, str, str]]:
    return sorted((f.id, f.severity.value, f.subject, f.found) for f in result.findings)


def live_preflight(
    fake: FakeNode, target: str, families: list[str], **settings: Any
) -> PreflightResult:
    """Preflight as the running kproxy answers it: its objects and programmed state given."""
    return run_preflight(
        target,
        access=fake.access(),
        families=families,
        snapshot_taker=never_read,
        node_name="node1",
        live=live_state(objects(), "iptables", "nft", PROGRAMMED),
        **settings,
    )


@pytest.fixture
def fake(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path / "root")


def test_the_running_proxys_objects_give_the_findings_of_reading_them_again(
    fake: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Leftovers read the kernel itself beside a running proxy: the kernel test compares them.
    monkeypatch.setattr("kproxy.leftovers.leftovers_by_mode", lambda *_a, **_k: [])
    families = ["objects", "dataplane"]
    read = run_preflight(
        "nftables",
        access=fake.access(),
        families=families,
        snapshot_taker=recorded(nft=SAVE),
        objects=objects(),
        node_name="node1",
        current_mode="iptables",
    )
    live = live_preflight(fake, "nftables", families)
    ids = {f.id for f in read.findings}
    # every object check and the consistency check found something here
    assert {"objects.port-zero", "objects.no-endpoints", "objects.destination-collision"} <= ids
    assert {"objects.no-cluster-ip-referenced", "objects.orphan-slices"} <= ids
    assert {"dataplane.missing-services", "dataplane.extra-services"} <= ids
    assert facts(live) == facts(read)
    assert (read.path, live.path) == (PATH_READ, PATH_LIVE)
    assert live.current_mode == "iptables" and live.current_flavour == "nft"
    assert not [argv for argv in fake.ran if argv[0].endswith("-save")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nftables_mode_reads_the_plane_of_its_own_layout(
    fake: FakeNode, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """A kproxy serving nftables mode reads its layout's dataplane alone: the other
    layout's has no table, and every service would be reported missing."""
    monkeypatch.setattr("kproxy.leftovers.leftovers_by_mode", lambda *_a, **_k: [])
    web = [
        node(),
        service("web", "10.96.0.10", [port("http", 80, 8080)], selector={"app": "web"}),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
    ]
    plane = dataplane_name(layout)
    programmed = {plane: {Destination("10.96.0.10", "tcp", 80): "default/web:http"}}
    state = live_state(web, "nftables", programmed=programmed, layout=layout)
    reader, read = state.plane_reader, []

    def reading(name: str, netns: str | None) -> dict[Destination, str]:
        read.append(name)
        return reader(name, netns)

    state.plane_reader = reading
    result = run_preflight(
        "iptables",
        access=fake.access(),
        families=["dataplane"],
        snapshot_taker=never_read,
        node_name="node1",
        live=state,
    )
    assert read == [plane]
    assert result.current_mode == "nftables" and not result.findings, result.findings


def test_a_switchs_preflight_leaves_the_backup_to_the_switch(
    fake: FakeNode, tmp_path: Path
) -> None:
    result = live_preflight(
        fake, "nftables", ["backup"], state_dir=tmp_path / "state", backup_at_switch=True
    )
    assert [f.id for f in result.findings] == ["backup.at-switch"] and result.safe
    assert not (tmp_path / "state").exists()


def test_kube_chains_per_backend_by_name_without_a_save(
    fake: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    chains = {
        "nat": ["KUBE-SERVICES", "KUBE-SVC-AAAA"],
        "filter": ["KUBE-FIREWALL"],
        "kube-proxy": ["services"],
    }
    asked: list[str] = []

    def by_table(_dump: object, family: str) -> dict[str, list[str]]:
        asked.append(family)
        return chains

    monkeypatch.setattr(KernelDump, "nft_chains_by_table", by_table)
    monkeypatch.setattr(KernelDump, "iptables_tables_exist", lambda _dump, _flavour: True)
    fake.command(["cat", "/proc/net/ip_tables_names"], out="nat\n")
    fake.command(["iptables-legacy-save"], out="*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n")
    result = live_preflight(fake, "iptables", ["kernel"])
    both = next(f for f in result.findings if f.id == "iptables.both-backends")
    assert both.facts == {"nft": ["KUBE-SERVICES", "KUBE-SVC-AAAA"], "legacy": ["KUBE-SERVICES"]}
    assert asked == ["ip"] and ["iptables-nft-save"] not in fake.ran


def test_the_localnet_guard_is_read_from_its_chain_alone(fake: FakeNode) -> None:
    """Beside a running kproxy (which reads no save) route_localnet's guard is looked for in
    KUBE-FIREWALL of each backend that has a filter table, and found in either."""
    fake.sysctls({"net/ipv4/conf/all/route_localnet": 1})
    wait = command_wait_flags((1, 8, 9))
    for flavour in ("nft", "legacy"):
        fake.command([f"iptables-{flavour}", "--version"], out="iptables v1.8.9\n")
    listing = {
        fl: [f"iptables-{fl}", *wait, "-t", "filter", "-S", "KUBE-FIREWALL"]
        for fl in ("nft", "legacy")
    }
    guard = (
        "-N KUBE-FIREWALL\n"
        '-A KUBE-FIREWALL -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m comment --comment "block incoming '
        'localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n'
    )

    def exposed() -> bool:
        found = live_preflight(fake, "nftables", ["sysctls"]).ids()
        return "sysctl.route-localnet-exposed" in found

    assert exposed()
    # no legacy table: legacy is not asked (its listing would create the table)
    assert listing["nft"] in fake.ran and listing["legacy"] not in fake.ran
    fake.command(listing["nft"], out=guard)
    assert not exposed()
    fake.command(listing["nft"], rc=1, err="iptables: No chain/target/match by that name.\n")
    fake.command(["cat", "/proc/net/ip_tables_names"], out="nat\nfilter\n")
    fake.command(listing["legacy"], out=guard)
    assert not exposed()
    assert not [argv for argv in fake.ran if argv[0].endswith("-save")]


def test_the_serving_dataplanes_proof_stands_for_reading_its_plane(fake: FakeNode) -> None:
    """A dataplane that proves what the kernel holds (Dataplane.proven_dumps) is not read
    again: its dumps give the destinations the consistency check compares."""
    state = live_state(objects(), "iptables", "nft", {})

    def no_reading(_plane: str, _netns: str | None) -> dict[Destination, str]:
        raise AssertionError("the kernel was read though the dataplane proved it")

    state.plane_reader = no_reading
    state.proven = {"iptables-nft": SAVE}
    result = run_preflight(
        "nftables",
        access=fake.access(),
        families=["dataplane"],
        snapshot_taker=never_read,
        node_name="node1",
        live=state,
    )
    assert state.programmed(None) == PROGRAMMED
    found = {f.id: f for f in result.findings}
    assert found["dataplane.extra-services"].facts["extra"] == ["tcp 10.96.9.9:80"]


def test_a_result_survives_its_json(fake: FakeNode) -> None:
    result = live_preflight(fake, "nftables", ["objects"])
    again = PreflightResult.from_dict(json.loads(result.to_json()))
    assert again.to_dict() == result.to_dict() and again.findings == ordered(result.findings)


def test_the_running_nftables_kproxy_sees_a_switch_to_its_other_layout(fake: FakeNode) -> None:
    """Beside kproxy serving nftables mode (upstream's layout, started so): a switch to the
    compact layout is a layout change, and naming no layout is its own layout again."""
    state = live_state(objects(), "nftables", layout="upstream")
    status = {"mode": "nftables", "nftables_layout": "upstream"}
    status["started_nftables_layout"] = "upstream"

    def ask(layout: str | None) -> PreflightResult:
        return run_preflight(
            "nftables",
            access=fake.access(),
            families=["config"],
            snapshot_taker=never_read,
            node_name="node1",
            live=state,
            status=status,
            target_layout=layout,
        )

    compact = ask("compact")
    assert (compact.current_layout, compact.target_layout) == ("upstream", "compact")
    assert "mode.layout-change" in compact.ids() and "mode.same" not in compact.ids()
    again = PreflightResult.from_dict(json.loads(compact.to_json()))
    assert (again.current_layout, again.target_layout) == ("upstream", "compact")
    assert again.verdict() == "SAFE: nothing blocks a switch to nftables (compact layout)"
    same = ask(None)
    assert same.target_layout == "upstream" and "mode.same" in same.ids()


# --- the admin op and the CLI ---------------------------------------------------------------


def daemon_stub(result: PreflightResult, started: bool = True) -> Any:
    """What Daemon._preflight_request uses of the daemon."""
    seen: list[tuple[str, str | None, bool]] = []
    done = threading.Event()
    if started:
        done.set()

    def preflight(target: str, layout: str | None, *, backup_at_switch: bool) -> PreflightResult:
        seen.append((target, layout, backup_at_switch))
        return result

    return SimpleNamespace(first_sync_done=done, preflight=preflight, seen=seen)


def test_the_preflight_op_checks_its_request(
    fake: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kproxy.daemon.PREFLIGHT_START_GRACE", 0.01)
    result = PreflightResult("nftables", "iptables", "nft", "node1", None, findings=[])
    stub = daemon_stub(result)
    answer = Daemon._preflight_request(stub, {"to": "nftables", "backup": "switch"})
    assert answer == {"ok": True, "result": result.to_dict()}
    assert stub.seen == [("nftables", None, True)]
    assert "one of" in Daemon._preflight_request(stub, {"to": "nftabels"})["error"]
    compact = {"to": "nftables", "nftables_layout": "compact"}
    assert Daemon._preflight_request(stub, compact)["ok"]
    assert stub.seen[-1] == ("nftables", "compact", False)
    for bad in ({"to": "nftables", "nftables_layout": "compat"}, {**compact, "to": "ipvs"}):
        error = Daemon._preflight_request(stub, bad)["error"]
        assert error == (
            "preflight's 'nftables_layout' must be one of upstream, compact, with 'to': nftables"
        )
    assert len(stub.seen) == 2
    assert (
        "'switch' or 'write'"
        in Daemon._preflight_request(stub, {"to": "ipvs", "backup": 1})["error"]
    )
    starting = daemon_stub(result, started=False)
    assert "still starting" in Daemon._preflight_request(starting, {"to": "ipvs"})["error"]
    assert starting.seen == []


def test_the_cli_asks_the_running_proxy_over_tcp_with_its_token(
    fake: FakeNode, tmp_path: Path
) -> None:
    result = live_preflight(fake, "nftables", ["objects"])
    stub = daemon_stub(result)
    srv = AdminServer(
        tmp_path / "admin.sock",
        {"preflight": lambda req: Daemon._preflight_request(stub, req)},
        tcp_address=("127.0.0.1", 0),
    )
    srv.start()
    try:
        address = srv.tcp_bound
        assert address is not None
        token = srv.token_path.read_text().strip()
        running = {"mode": "iptables", "pid": 1}
        good = OpsInputs(tmp_path, admin=AdminTarget(address=address, token=token), status=running)
        got, note = ask_running(good, "nftables", backup="switch", layout="compact")
        assert note is None and got is not None
        assert got.path == PATH_LIVE and got.findings == ordered(result.findings)
        assert stub.seen == [("nftables", "compact", True)]
        bad = OpsInputs(tmp_path, admin=AdminTarget(address=address, token="x"), status=running)
        refused, why = ask_running(bad, "nftables", backup="write")
        assert refused is None and why is not None and "unauthorized" in why
        assert len(stub.seen) == 1
    finally:
        srv.stop()
    nobody = OpsInputs(tmp_path, status=None)
    assert ask_running(nobody, "nftables", backup="write") == (None, None)


def test_kproxy_switch_asks_preflight_for_the_layout_it_switches_to(tmp_path: Path) -> None:
    """`kproxy switch --to nftables --nftables-layout compact`: the running kproxy is asked
    for the preflight of that layout, then for that switch; `--to previous`: the preflight
    of the previous mode in its layout."""
    from typer.testing import CliRunner

    from kproxy.cli import app
    from kproxy.server.admin import SOCKET_NAME

    answer = PreflightResult("nftables", "nftables", None, "node1", None, findings=[])
    answer.current_layout, answer.target_layout = "upstream", "compact"
    stub = daemon_stub(answer)
    switches: list[dict[str, object]] = []
    status = {"mode": "nftables", "nftables_layout": "upstream"}
    status |= {"previous_mode": "nftables", "previous_nftables_layout": "compact"}

    def switch(request: dict[str, object]) -> dict[str, object]:
        switches.append(request)
        return {"ok": False, "error": "not here", "from_mode": "nftables", "to_mode": "nftables"}

    srv = AdminServer(
        tmp_path / SOCKET_NAME,
        {
            "status": lambda _req: {"ok": True, **status},
            "preflight": lambda req: Daemon._preflight_request(stub, req),
            "switch": switch,
        },
    )
    srv.start()
    try:
        runner = CliRunner()
        args = ["switch", "--to", "nftables", "--nftables-layout", "compact", "--json"]
        out = runner.invoke(app, [*args[:-1], "--state-dir", str(tmp_path)])
        assert out.exit_code == 1, out.output
        assert "preflight: nothing blocks a switch to nftables (compact layout)" in out.output
        assert stub.seen == [("nftables", "compact", True)]
        assert switches[0]["nftables_layout"] == "compact"
        # `kproxy preflight` asks the same, and its JSON names the layouts.
        args[0] = "preflight"
        out = runner.invoke(app, [*args, "--state-dir", str(tmp_path)])
        assert out.exit_code == 0 and stub.seen[-1] == ("nftables", "compact", False)
        doc = json.loads(out.stdout)
        assert (doc["target_layout"], doc["current_layout"]) == ("compact", "upstream")
        out = runner.invoke(app, ["switch", "--to", "previous", "--state-dir", str(tmp_path)])
        assert stub.seen[-1] == ("nftables", "compact", True)
        assert switches[-1]["to"] == "previous" and "nftables_layout" not in switches[-1]
    finally:
        srv.stop()
