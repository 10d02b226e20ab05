"""The rollout controller against the lab's API server: ProxyRollouts with their status
subresource, Node annotations, Events and the Lease, with simulated node agents (the kernel
tests run real kproxies)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.cluster.annotations import CURRENT_MODE
from kproxy.cluster.rollout import status as st
from kproxy.cluster.rollout.controller import LEASE_NAME, REQUEST_ANNOTATION
from kproxy.lab.kubeapi import KubeApiServer, KubeApiStore
from kproxy.sources.clientsettings import ClientSettings
from tests.support.rollout import Agents, phase, rollout, running, wait_for


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[KubeApiStore, ClientSettings]]:
    store = KubeApiStore()
    with KubeApiServer(store) as server:
        yield store, ClientSettings(kubeconfig=str(server.kubeconfig(tmp_path / "kc")))


def test_a_rollout_runs_to_the_end_through_the_api(
    api: tuple[KubeApiStore, ClientSettings],
) -> None:
    store, settings = api
    with Agents(store, ["n1", "n2", "n3", "n4"]) as agents, running(settings):
        store.create(rollout())
        wait_for(lambda: phase(store) == st.SUCCEEDED)
    for n in store.objects("Node"):
        assert n["metadata"]["annotations"][CURRENT_MODE] == "nftables"
    assert all(s.switches == ["nftables"] for s in agents.sims.values())
    status = store.get("ProxyRollout", "", "to-nft")["status"]  # type: ignore[index]
    assert status["nodesDone"] == 4 and status["nodesTotal"] == 4
    # the status went through the subresource, the spec was never rewritten
    assert store.recorded("PUT", "/proxyrollouts/to-nft/status")
    assert not store.recorded("PUT", "/proxyrollouts/to-nft") or all(
        r.path.endswith("/status") for r in store.recorded("PUT", "/proxyrollouts/to-nft")
    )
    reasons = {(e["involvedObject"]["kind"], e["reason"]) for e in store.objects("Event")}
    assert ("ProxyRollout", "Finished") in reasons and ("Node", "NodeSwitched") in reasons
    lease = store.get("Lease", "default", LEASE_NAME)
    assert lease is not None and lease["spec"]["holderIdentity"] == ""  # released at exit


def test_an_invalid_spec_fails_naming_the_field(api: tuple[KubeApiStore, ClientSettings]) -> None:
    store, settings = api
    with Agents(store, ["n1"]), running(settings):
        store.create(rollout(stages=[{"nodes": "50%"}]))
        wait_for(lambda: phase(store) == st.FAILED)
    status = store.get("ProxyRollout", "", "to-nft")["status"]  # type: ignore[index]
    assert "spec.stages: the last stage must cover every selected node" in status["message"]


def test_one_controller_acts_and_a_successor_goes_on_after_a_kill(
    api: tuple[KubeApiStore, ClientSettings],
) -> None:
    store, settings = api
    slow = {"soak": "1s", "stages": [{"nodes": "1"}, {"nodes": "100%"}]}
    with Agents(store, ["n1", "n2", "n3"]) as agents:
        store.create(rollout(**slow))
        fast = {"lease_duration": 1.0}
        with (
            running(settings, identity="a", kill=True, **fast),
            running(settings, identity="b", **fast),
        ):
            wait_for(lambda: phase(store) == st.SOAKING)
            holder = store.get("Lease", "default", LEASE_NAME)["spec"]["holderIdentity"]  # type: ignore[index]
            assert holder in ("a", "b")
        # both gone; "a" was killed and never released: a third instance waits it out
        store.patch("Lease", "default", LEASE_NAME, {"spec": {"holderIdentity": "a"}})
        with running(settings, identity="c", **fast):
            wait_for(lambda: phase(store) == st.SUCCEEDED, timeout=40)
    assert all(s.switches == ["nftables"] for s in agents.sims.values())
    assert store.get("Lease", "default", LEASE_NAME)["spec"]["leaseTransitions"] >= 1  # type: ignore[index]


def test_operator_requests_arrive_as_an_annotation(
    api: tuple[KubeApiStore, ClientSettings],
) -> None:
    store, settings = api
    with Agents(store, ["n1", "n2"]), running(settings):
        store.create(rollout(soak="30s", stages=[{"nodes": "1"}, {"nodes": "100%"}]))
        wait_for(lambda: phase(store) == st.SOAKING)
        store.patch(
            "ProxyRollout",
            "",
            "to-nft",
            {"metadata": {"annotations": {REQUEST_ANNOTATION: "1 abort:all"}}},
        )
        wait_for(lambda: phase(store) == st.FAILED)
    status = store.get("ProxyRollout", "", "to-nft")["status"]  # type: ignore[index]
    assert status["handledRequest"] == "1 abort:all"
    assert {n["metadata"]["annotations"][CURRENT_MODE] for n in store.objects("Node")} == {
        "iptables"
    }
