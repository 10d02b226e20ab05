"""kproxy doctor on recorded kernels: the rules are rendered by kproxy itself from one set of
objects, the doctor reads another (what the API says now), so every layer can be broken on
purpose. The lab versions are in test_doctor_kernel.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kproxy.conntrack import ConntrackEntry, parse_entry
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.render import JUMPS, jump_rule, render_full
from kproxy.model.snapshot import snapshot_from_objects
from kproxy.ops.doctor import DoctorResult, run_doctor
from kproxy.ops.inspect import RecordedSource
from kproxy.ops.preflight.findings import Severity
from tests.support.objects import endpoint, endpoint_slice, node, port, service
from tests.support.preflight_fakes import FakeNode, recorded

NODE_IP = "10.100.0.1"
PODS = ("10.244.0.2", "10.244.0.3")
NODE_CHECKS = ("config", "kernel", "sysctls", "conntrack")  # dataplane reads the real netns


def web(*eps: str, **spec: Any) -> list[dict[str, Any]]:
    return [
        service("web", "10.96.0.10", [port("http", 80, 8080)], selector={"app": "web"}, **spec),
        endpoint_slice("web", [endpoint(ip) for ip in eps], [port("http", 8080)]),
    ]


def dns(*eps: str) -> list[dict[str, Any]]:
    return [
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")], selector={"a": "b"}),
        endpoint_slice("dns", [endpoint(ip) for ip in eps], [port("dns", 8080, protocol="UDP")]),
    ]


def save_of(objects: list[dict[str, Any]]) -> str:
    """The iptables-save a node running kproxy for these objects would show."""
    snap = snapshot_from_objects([node(), *objects], "node1")
    facts = NodeFacts(node_ips=(NODE_IP,), local_addresses=(NODE_IP, "127.0.0.1"))
    restore = render_full(snap, facts, RuleOptions(cluster_cidrs=("10.244.0.0/16",)))
    builtin = {"filter": ("INPUT", "FORWARD", "OUTPUT"), "nat": ("PREROUTING", "OUTPUT")}
    out: list[str] = []
    for line in restore.splitlines():
        out.append(line)
        if line.startswith("*"):
            table = line[1:]
            out += [f":{c} ACCEPT [0:0]" for c in builtin[table]]
            out += [f"-A {jump_rule(c, e, m, t)}" for tb, c, e, m, t in JUMPS if tb == table]
    return "\n".join(out) + "\n"


def flows(*lines: str) -> list[ConntrackEntry]:
    out = [parse_entry(line) for line in lines]
    assert all(out)
    return [e for e in out if e is not None]


def doctor(
    tmp_path: Path,
    objects: list[dict[str, Any]] | None,
    kernel: list[dict[str, Any]] | None = None,
    *,
    service: str | None = None,
    conntrack: list[ConntrackEntry] | None = None,
    answers: dict[tuple[str, int], str] | None = None,
    empty_kernel: bool = False,
) -> DoctorResult:
    kernel_objects = objects if kernel is None else kernel
    save = "*nat\nCOMMIT\n" if empty_kernel or kernel_objects is None else save_of(kernel_objects)
    fake = FakeNode(tmp_path / "root")
    probed: list[tuple[str, int]] = []

    def prober(targets: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
        probed.extend(targets)
        return {t: (answers or {}).get(t, "ok") for t in targets}

    return run_doctor(
        service,
        access=fake.access(),
        objects=[node(), *objects] if objects is not None else None,
        node_name="node1",
        snapshot_taker=recorded(nft=save),
        kernel_source=RecordedSource(iptables={"nft": save}, local_addresses=[NODE_IP]),
        conntrack_entries=conntrack or [],
        prober=prober,
        node_families=NODE_CHECKS,
    )


def ids(result: DoctorResult) -> list[str]:
    return [f.id for f in result.all_findings]


def test_a_healthy_service_is_ok_at_every_layer(tmp_path: Path) -> None:
    result = doctor(tmp_path, web(*PODS), service="default/web")
    report = result.service("default/web")
    assert report.layers == dict.fromkeys(("object", "endpoints", "kernel", "conntrack"), "ok")
    assert report.broken_layer is None and result.exit_code == 0
    assert result.mode == "iptables" and result.dataplanes == ["iptables-nft"]


def test_a_service_that_does_not_exist(tmp_path: Path) -> None:
    report = doctor(tmp_path, web(*PODS), service="default/nope").service("default/nope")
    assert report.broken_layer == "object" and report.findings[0].id == "object.missing"
    assert report.layers["kernel"] == "not checked"


def test_an_invalid_service_is_broken_at_the_object(tmp_path: Path) -> None:
    objs = [*web(*PODS), service("zero", "10.96.0.11", [port("p", 0, 8080)])]
    report = doctor(tmp_path, objs, kernel=web(*PODS), service="default/zero").service(
        "default/zero"
    )
    f = report.findings[0]
    assert f.id == "object.rejected" and "spec.ports[0].port" in f.found
    assert report.broken_layer == "object"


def test_a_headless_service_is_not_proxied_by_design(tmp_path: Path) -> None:
    objs = [*web(*PODS), service("db", "None", [port("pg", 5432)])]
    result = doctor(tmp_path, objs, kernel=web(*PODS), service="default/db")
    f = result.service("default/db").findings[0]
    assert f.id == "object.not-proxied" and f.severity is Severity.INFO
    assert result.exit_code == 0


def test_no_endpoints_and_no_ready_endpoints(tmp_path: Path) -> None:
    none = doctor(tmp_path, web(), service="default/web").service("default/web")
    f = none.findings[0]
    assert f.id == "endpoints.none" and "selects app=web" in f.found
    assert f.facts["symptom"].startswith("connection refused") and none.broken_layer == "endpoints"
    objs = [
        service("web", "10.96.0.10", [port("http", 80, 8080)]),
        endpoint_slice("web", [endpoint(PODS[0], ready=False)], [port("http", 8080)]),
    ]
    sick = doctor(tmp_path, objs, service="default/web").service("default/web")
    assert sick.findings[0].id == "endpoints.not-ready" and "not ready" in sick.findings[0].found


def test_a_named_target_port_without_endpoints(tmp_path: Path) -> None:
    objs = [
        service("web", "10.96.0.10", [port("http", 80, "http"), port("m", 9090, "metrics")]),
        endpoint_slice("web", [endpoint(PODS[0])], [port("http", 8080)]),
    ]
    report = doctor(tmp_path, objs, service="default/web").service("default/web")
    (f,) = [f for f in report.findings if f.id == "endpoints.named-port"]
    assert "'metrics'" in f.found and report.broken_layer == "endpoints"


def test_endpoints_that_do_not_answer(tmp_path: Path) -> None:
    one_down = {(PODS[0], 8080): "refused"}
    some = doctor(tmp_path, web(*PODS), service="default/web", answers=one_down)
    f = next(f for f in some.all_findings if f.id == "endpoints.unreachable")
    assert f.severity is Severity.WARN and "10.244.0.2:8080 (refused)" in f.found
    all_down = {(ip, 8080): "timeout" for ip in PODS}
    none = doctor(tmp_path, web(*PODS), service="default/web", answers=all_down)
    assert none.service("default/web").broken_layer == "endpoints"
    assert (
        "ip route get 10.244.0.2"
        in next(f for f in none.all_findings if f.layer == "endpoints").fix
    )


def test_a_stale_reject_rule_for_a_service_that_has_endpoints_now(tmp_path: Path) -> None:
    """The kernel still holds the rules of a time without endpoints (#102314's shape)."""
    report = doctor(tmp_path, web(*PODS), kernel=web(), service="default/web").service(
        "default/web"
    )
    f = next(f for f in report.findings if f.layer == "kernel")
    assert f.id == "kernel.stale-reject" and "REJECT" in f.found
    assert "#102314" in f.facts["seen"] and report.broken_layer == "kernel"


def test_a_service_missing_from_the_kernel(tmp_path: Path) -> None:
    objs = [*web(*PODS), *dns(*PODS)]
    result = doctor(tmp_path, objs, kernel=web(*PODS))
    assert result.service("default/dns").broken_layer == "kernel"
    f = next(f for f in result.service("default/dns").findings if f.layer == "kernel")
    assert f.id == "kernel.missing" and result.service("default/web").broken_layer is None


def test_endpoints_in_the_kernel_that_the_objects_do_not_have(tmp_path: Path) -> None:
    report = doctor(tmp_path, web(PODS[0]), kernel=web(*PODS), service="default/web")
    f = next(f for f in report.all_findings if f.layer == "kernel")
    assert f.id == "kernel.drift" and "10.244.0.3:8080" in f.found
    assert f.severity is Severity.WARN


def test_the_service_does_not_answer_while_its_endpoints_do(tmp_path: Path) -> None:
    answers = {("10.96.0.10", 80): "timeout"}
    report = doctor(tmp_path, web(*PODS), service="default/web", answers=answers)
    f = next(f for f in report.all_findings if f.layer == "kernel")
    assert f.id == "kernel.probe-failed" and "kproxy trace --from 10.100.0.1" in f.fix[0]


def test_no_dataplane_in_the_kernel(tmp_path: Path) -> None:
    result = doctor(tmp_path, web(*PODS), empty_kernel=True, service="default/web")
    f = next(f for f in result.all_findings if f.layer == "kernel")
    assert f.id == "kernel.no-dataplane" and result.mode is None


def test_stale_udp_flows_and_unreplied_connections(tmp_path: Path) -> None:
    ct = flows(
        "ipv4 2 udp 17 25 src=10.244.0.9 dst=10.96.0.53 sport=40000 dport=53 "
        "src=10.244.0.7 dst=10.244.0.9 sport=8080 dport=40000 mark=0 use=1",
        "ipv4 2 tcp 6 110 SYN_SENT src=10.100.0.2 dst=10.96.0.10 sport=5000 dport=80 "
        "[UNREPLIED] src=10.244.0.2 dst=10.100.0.2 sport=8080 dport=5000 mark=0 use=1",
    )
    result = doctor(tmp_path, [*web(*PODS), *dns(*PODS)], conntrack=ct)
    stale = next(f for f in result.all_findings if f.id == "conntrack.stale-udp")
    assert stale.facts["stale"] == ["10.244.0.7"] and stale.severity is Severity.BLOCK
    assert stale.fix[0] == (
        "conntrack -D -p udp --orig-dst 10.96.0.53 --orig-port-dst 53 --reply-src 10.244.0.7"
    )
    assert result.service("default/dns").broken_layer == "conntrack"
    unreplied = next(f for f in result.all_findings if f.id == "conntrack.unreplied")
    assert unreplied.facts["unreplied"] == 1 and unreplied.subject == "default/web"


def test_without_objects_the_kernel_is_the_only_witness(tmp_path: Path) -> None:
    save = save_of([*web(), *dns(*PODS)])
    result = run_doctor(
        access=FakeNode(tmp_path).access(),
        node_name="node1",
        snapshot_taker=recorded(nft=save),
        kernel_source=RecordedSource(iptables={"nft": save}, local_addresses=[NODE_IP]),
        conntrack_entries=[],
        prober=lambda t: dict.fromkeys(t, "ok"),
        node_families=NODE_CHECKS,
    )
    assert [s.service for s in result.services] == ["default/dns", "default/web"]
    f = result.service("default/web").findings[0]
    assert f.id == "endpoints.none" and f.layer == "kernel" and "REJECT" in f.found
    assert result.service("default/dns").healthy


def test_json_and_text_say_which_layer_broke(tmp_path: Path) -> None:
    from rich.console import Console

    result = doctor(tmp_path, web(*PODS), kernel=web(), service="default/web")
    doc = json.loads(result.to_json())
    (svc,) = doc["services"]
    assert svc["broken_layer"] == "kernel" and doc["exit_code"] == 1
    assert svc["findings"][0]["layer"] == "kernel" and "symptom" in svc["findings"][0]["facts"]
    console = Console(record=True, width=200, color_system=None)
    result.print_text(console)
    text = console.export_text()
    assert "default/web: broken at the kernel layer" in text
    assert "symptom: connection refused although the pods are up" in text
    assert "seen in the field: #102314" in text


@pytest.mark.parametrize("bad", ["web", "a/b/c"])
def test_service_names_need_a_namespace(bad: str) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kproxy.cli",
            "doctor",
            "--service",
            bad,
            "--state-dir",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2 and "NAMESPACE/NAME" in out.stderr
