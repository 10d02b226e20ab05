"""`kproxy rollout` verbs against the lab's API server, with simulated node agents."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kproxy.cli import app
from kproxy.cluster.rollout import cli as rollout_cli
from kproxy.cluster.rollout import spec as rollout_spec
from kproxy.cluster.rollout import status as st
from kproxy.lab.kubeapi import KubeApiServer, KubeApiStore
from kproxy.sources.clientsettings import ClientSettings
from tests.support.rollout import Agents, node, phase, running, wait_for

runner = CliRunner()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[KubeApiStore, Path]]:
    store = KubeApiStore()
    with KubeApiServer(store) as server:
        yield store, server.kubeconfig(tmp_path / "kc")


def kproxy(kc: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["rollout", *args, "--kubeconfig", str(kc)])
    return result.exit_code, result.output


def test_the_cli_names_the_kind_the_model_does() -> None:
    assert rollout_cli.KIND == rollout_spec.KIND


def test_plan_shows_batches_preflight_and_the_estimate(api: tuple[KubeApiStore, Path]) -> None:
    store, kc = api
    with Agents(store, ["n1", "n2", "n3"]) as agents:
        agents.sims["n3"].block = "mode.nft-missing: nft is not installed"
        code, out = kproxy(kc, "plan", "--to", "nftables", "--stages", "1,100%", "--soak", "5m")
    assert code == 0, out
    assert "Rollout plan: 2 node(s) to nftables (selector: every node)" in out
    assert "n3: BLOCKED: mode.nft-missing: nft is not installed" in out
    assert "n3: preflight: mode.nft-missing" in out  # skipped
    assert "Estimated duration: 12m" in out  # 2 switches of ~1 min and 2 soaks of 5 min
    for n in store.objects("Node"):  # the requests are taken back
        assert "proxy.kproxy.io/preflight-request" not in n["metadata"].get("annotations", {})


def test_plan_json_and_blockers_exit_1(api: tuple[KubeApiStore, Path]) -> None:
    store, kc = api
    store.apply(node("bare", None))
    with Agents(store, ["n1"]):
        code, out = kproxy(kc, "plan", "--to", "ipvs", "--json", "--preflight-timeout", "1")
    assert code == 1
    plan = json.loads(out[out.index("{") :])
    assert plan["target"] == "ipvs" and plan["blockers"][0].startswith("bare: no kproxy")
    assert [n["name"] for b in plan["batches"] for n in b["nodes"]] == ["n1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "ipvss"], "spec.targetMode: 'ipvss' is not a proxy mode"),
        (["--to", "ipvs", "--stages", "1,50%"], "the last stage must cover every selected"),
        (["--to", "ipvs", "--soak", "5"], "spec.soak: missing unit"),
        (["--to", "ipvs", "--selector", "pool"], "--selector: 'pool' is not key=value"),
        ([], "give --to MODE or -f FILE"),
    ],
)
def test_usage_errors_name_the_field_and_exit_2(
    api: tuple[KubeApiStore, Path], args: list[str], message: str
) -> None:
    _, kc = api
    code, out = kproxy(kc, "plan", *args)
    assert code == 2 and message in out and "Traceback" not in out


def test_start_refuses_a_stale_plan_and_creates_from_a_fresh_one(
    api: tuple[KubeApiStore, Path], tmp_path: Path
) -> None:
    store, kc = api
    with Agents(store, ["n1", "n2"]):
        _, out = kproxy(kc, "plan", "--to", "nftables", "--json", "--no-preflight")
        fingerprint = json.loads(out)["fingerprint"]
        store.apply(node("n3"))  # a node joined since
        code, out = kproxy(kc, "start", "--to", "nftables", "--plan", fingerprint)
        assert code == 1 and "the plan changed since you saw it" in out
        assert store.objects("ProxyRollout") == []
        manifest = tmp_path / "r.yaml"
        manifest.write_text(
            "apiVersion: proxy.kproxy.io/v1alpha1\nkind: ProxyRollout\n"
            "metadata: {name: from-file}\n"
            "spec: {targetMode: nftables, soak: 0s, stages: [{nodes: '100%'}]}\n"
        )
        code, out = kproxy(kc, "start", "-f", str(manifest))
    assert code == 0 and "proxyrollout from-file created: 3 node(s) to nftables" in out
    (created,) = store.objects("ProxyRollout")
    assert created["spec"]["targetMode"] == "nftables"
    assert created["metadata"]["annotations"][rollout_cli.PLAN_ANNOTATION]


def test_status_pause_resume_and_abort_through_the_controller(
    api: tuple[KubeApiStore, Path],
) -> None:
    store, kc = api
    settings = ClientSettings(kubeconfig=str(kc))
    with Agents(store, ["n1", "n2", "n3"]), running(settings):
        code, out = kproxy(
            kc, "start", "--to", "nftables", "--name", "r", "--soak", "1h", "--stages", "1,100%"
        )
        assert code == 0, out
        wait_for(lambda: phase(store, "r") == st.SOAKING)
        code, out = kproxy(kc, "status", "r")
        assert code == 0
        assert "ProxyRollout r: Soaking, stage 1 of 2, 1/3 nodes done, to nftables" in out
        assert "n1    1      iptables  nftables  Switched" in out
        code, out = kproxy(kc, "pause", "r")
        assert code == 0 and out.strip() == "paused"
        code, out = kproxy(kc, "resume", "r", "--json")
        assert code == 0
        assert json.loads(out) == {
            "rollout": "r",
            "request": "resume",
            "ok": True,
            "answer": "resumed",
        }
        code, out = kproxy(kc, "abort", "r", "--rollback", "all")
        assert code == 0 and "aborted (rollback: all)" in out
        wait_for(lambda: phase(store, "r") == st.FAILED)
        code, out = kproxy(kc, "status", "r", "--json")
    assert code == 1
    assert json.loads(out)["phase"] == st.FAILED


def test_requests_without_a_controller_say_so(api: tuple[KubeApiStore, Path]) -> None:
    store, kc = api
    store.create(
        {
            "apiVersion": "proxy.kproxy.io/v1alpha1",
            "kind": "ProxyRollout",
            "metadata": {"name": "r"},
            "spec": {"targetMode": "ipvs"},
        }
    )
    code, out = kproxy(kc, "status")
    assert code == 0 and "not planned yet (is the controller running?)" in out
    code, out = kproxy(kc, "pause", "r", "--timeout", "1")
    assert code == 1 and "the controller did not answer within 1 s" in out


def test_undo_waits_for_the_rollout_to_finish_then_sends_nodes_back(
    api: tuple[KubeApiStore, Path],
) -> None:
    store, kc = api
    settings = ClientSettings(kubeconfig=str(kc))
    with Agents(store, ["n1", "n2"]) as agents, running(settings):
        code, out = kproxy(
            kc, "start", "--to", "nftables", "--name", "r", "--soak", "1h", "--stages", "1,100%"
        )
        assert code == 0, out
        wait_for(lambda: phase(store, "r") == st.SOAKING)
        code, out = kproxy(kc, "undo", "r")
        assert code == 1 and "rollout r is Soaking: abort it first" in out
        code, out = kproxy(kc, "abort", "r", "--rollback", "none")
        assert code == 0
        wait_for(lambda: phase(store, "r") == st.FAILED)
        code, out = kproxy(kc, "undo", "r", "--soak", "0s")
        assert code == 0 and "proxyrollout r-undo created: 1 node(s) back (n1 -> iptables)" in out
        wait_for(lambda: phase(store, "r-undo") == st.SUCCEEDED)
    assert agents.sims["n1"].switches == ["nftables", "iptables"]
    assert agents.sims["n2"].switches == []
