"""deploy/: every manifest against the Kubernetes OpenAPI schemas (kubernetes-validate, offline),
the pieces consistent with each other and with kproxy, and RBAC exactly what kproxy uses.

The RBAC check is measured, not listed by hand: kproxy's API source and cluster agent run
against the test API server, every request they make is mapped to (API group, resource,
verb), and the ClusterRole must allow each one and grant nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kproxy.cluster.agent import ClusterAgent
from kproxy.cluster.annotations import MODE_ANNOTATION
from kproxy.config import load_config
from kproxy.lab.kubeapi import KubeApiServer, KubeApiStore, Request
from kproxy.sources.api import ApiSource, ClientSettings
from tests.support.api import FAST, FakeDaemon, Sink, node, wait_until

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
# The oldest Kubernetes kproxy supports (ValidatingAdmissionPolicy v1 is GA there) and the
# newest schema kubernetes-validate ships.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def by_kind(kind: str, name: str = "kproxy") -> dict[str, Any]:
    """The one manifest of `kind` named `name` (the node proxy's pieces are "kproxy")."""
    found = [
        d
        for p in MANIFESTS
        for d in documents(p)
        if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"expected one {kind} {name} in deploy/"
    return found[0]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_matches_the_kubernetes_schema(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs
    for doc in docs:
        # strict: unknown fields are errors too (a typo would otherwise pass silently)
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    ds = by_kind("DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[0], strict=True)


def test_kustomization_lists_every_top_level_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    top = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == top


def test_configmap_is_a_config_kproxy_loads(tmp_path: Path) -> None:
    data = by_kind("ConfigMap")["data"]
    conf = tmp_path / "config.conf"
    conf.write_text(data["config.conf"])
    config = load_config(conf)  # raises ConfigError naming the field if anything is off
    assert config.effective_mode == "iptables"
    ds = by_kind("DaemonSet")
    mount = next(
        m["mountPath"]
        for m in ds["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        if m["name"] == "config"
    )
    assert config.client_connection.kubeconfig == f"{mount}/kubeconfig.conf"
    kubeconfig = yaml.safe_load(data["kubeconfig.conf"])
    user = kubeconfig["users"][0]["user"]
    assert user == {"tokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token"}
    cluster = kubeconfig["clusters"][0]["cluster"]
    assert cluster["server"].startswith("https://")
    assert cluster["certificate-authority"].startswith("/var/run/secrets/kubernetes.io/")


def test_daemonset_pieces_fit_together() -> None:
    ds = by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["serviceAccountName"] == by_kind("ServiceAccount")["metadata"]["name"]
    binding = by_kind("ClusterRoleBinding")
    sa = by_kind("ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    ]
    assert binding["roleRef"]["name"] == by_kind("ClusterRole")["metadata"]["name"]
    assert pod["hostNetwork"] is True and container["securityContext"]["privileged"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert set(mounts) == set(volumes)
    assert mounts["xtables-lock"] == "/run/xtables.lock"  # shared with every iptables user
    assert mounts["state"] == "/var/run/kproxy"  # DEFAULT_STATE_DIR: status and admin socket
    command = container["command"]
    assert command[:2] == ["kproxy", "run"]
    assert f"--config={mounts['config']}/config.conf" in command
    assert "--hostname-override=$(NODE_NAME)" in command
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    health = load_config_text(by_kind("ConfigMap")["data"]["config.conf"]).healthz_bind_address
    assert container["livenessProbe"]["httpGet"]["port"] == int(health.rsplit(":", 1)[1])


def load_config_text(text: str) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "config.conf"
        p.write_text(text)
        return load_config(p)


def test_containerfile_has_what_the_dataplanes_call() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    for package in ("iptables", "nftables", "ipset", "ipvsadm", "conntrack", "iproute2", "kmod"):
        assert f" {package}" in text, package
    assert "pip install" in text and '"kproxy", "run"' in text


# --- RBAC: measured against what kproxy does ----------------------------------------------------


def _verb(r: Request) -> str:
    parts = r.path.strip("/").split("/")
    # /api/v1/<res>[/name], /api/v1/namespaces/<ns>/<res>[/name], /apis/<g>/<v>/...
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    item = len(rest) > 1
    if r.method == "GET":
        return "get" if item else ("watch" if r.query.get("watch") == "true" else "list")
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[r.method]


def _resource(r: Request) -> tuple[str, str]:
    parts = r.path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    return group, "/".join(rest[:1] + rest[2:3])  # "proxyrollouts/status" for a subresource


@pytest.fixture
def kproxy_requests(tmp_path: Path) -> Iterator[list[Request]]:
    """Everything kproxy asks of an API server: sync, watch, a declared switch, status."""
    store = KubeApiStore(bookmark_interval=0.2)
    store.apply(node())
    with KubeApiServer(store) as server:
        kc = server.kubeconfig(tmp_path / "kc")
        src = ApiSource("n1", ClientSettings(kubeconfig=str(kc)), timing=FAST)
        agent = None
        try:
            src.fetch_node(wait=1)
            src.start(Sink())
            agent = ClusterAgent(FakeDaemon(), src, configured_mode="iptables", interval=0.05)
            agent.start()
            store.patch("Node", "", "n1", {"metadata": {"annotations": {MODE_ANNOTATION: "ipvs"}}})
            wait_until(lambda: len(store.recorded("POST", "/events")) >= 2)
            time.sleep(0.2)
        finally:
            if agent is not None:
                agent.stop()
            src.stop()
        yield list(store.requests)


def granted_by(*roles: dict[str, Any]) -> set[tuple[str, str, str]]:
    granted = {
        (group, resource, verb)
        for role in roles
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert not any("*" in g or "*" in r or "*" in v for g, r, v in granted)
    return granted


def assert_exactly_used(granted: set[tuple[str, str, str]], requests: list[Request]) -> None:
    used = {(*_resource(r), _verb(r)) for r in requests}
    assert used <= granted, f"it needs more than RBAC grants: {sorted(used - granted)}"
    assert granted == used, f"RBAC grants what it never uses: {sorted(granted - used)}"


def test_rbac_allows_exactly_what_kproxy_does(kproxy_requests: list[Request]) -> None:
    assert_exactly_used(granted_by(by_kind("ClusterRole")), kproxy_requests)


def test_rbac_allows_exactly_what_the_rollout_controller_does(tmp_path: Path) -> None:
    from kproxy.cluster.rollout import status as st
    from tests.support.rollout import Agents, phase, rollout, running, wait_for

    store = KubeApiStore()
    with KubeApiServer(store) as server:
        settings = ClientSettings(kubeconfig=str(server.kubeconfig(tmp_path / "kc")))
        with Agents(store, ["n1", "n2"]):
            store.create(rollout())
            with running(settings, lease_namespace="kube-system"):
                wait_for(lambda: phase(store) == st.SUCCEEDED)
    lease_role = by_kind("Role", "kproxy-rollout-lease")
    assert lease_role["metadata"]["namespace"] == "kube-system"
    granted = granted_by(by_kind("ClusterRole", "kproxy-rollout"), lease_role)
    assert_exactly_used(granted, list(store.requests))


def test_the_rollout_controller_runs_as_its_service_account() -> None:
    deployment = by_kind("Deployment", "kproxy-rollout")
    pod = deployment["spec"]["template"]["spec"]
    assert (
        pod["serviceAccountName"] == by_kind("ServiceAccount", "kproxy-rollout")["metadata"]["name"]
    )
    assert pod["containers"][0]["command"][:3] == ["kproxy", "rollout", "run"]
    for binding in (
        by_kind("ClusterRoleBinding", "kproxy-rollout"),
        by_kind("RoleBinding", "kproxy-rollout-lease"),
    ):
        assert binding["subjects"][0]["name"] == "kproxy-rollout"


def test_the_admission_policy_allows_exactly_the_keys_the_agent_writes() -> None:
    from kproxy.cluster.annotations import AGENT_ANNOTATIONS

    policy = by_kind("ValidatingAdmissionPolicy", "kproxy-node-status-only")
    (ours,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == "ours"]
    assert sorted(yaml.safe_load(ours)) == sorted(AGENT_ANNOTATIONS)
