"""ApiSource against the in-memory API server (kproxy.lab.kubeapi), over real HTTP on loopback.

Covers the Source contract (one initial batch once all three lists succeeded, then changes),
resourceVersion handling (bookmarks, resuming a cut watch, 410 Gone -> relist delivering only
the difference), outages (nothing delivered, nothing deleted, one log line per state change),
upstream's filters, paging, authentication from a kubeconfig and the in-cluster settings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.cluster.agent import ClusterAgent
from kproxy.cluster.annotations import (
    CURRENT_MODE,
    LAST_ERROR,
    MODE_ANNOTATION,
    OBSERVED,
    SWITCH_STATE,
    SWITCH_TARGET,
)
from kproxy.config import ProxyConfig, apply_flags, load_config
from kproxy.lab.kubeapi import KubeApiServer, KubeApiStore, write_kubeconfig
from kproxy.model.snapshot import ChangeTracker
from kproxy.sources.api import LABEL_SELECTOR, ApiSource, ClientConfigError, ClientSettings, Timing
from kproxy.sources.base import ObjectEvent, ObjectKey
from kproxy.sources.cluster import choose_source, node_ips_of, start_facts
from kproxy.sources.kubeclient import connect
from tests.support.api import FAST, FakeDaemon, Sink, node, wait_until
from tests.support.objects import endpoint, endpoint_slice, service


def svc_key(name: str, ns: str = "default") -> ObjectKey:
    return ObjectKey("Service", ns, name)


def slice_key(name: str, ns: str = "default") -> ObjectKey:
    return ObjectKey("EndpointSlice", ns, name)


NODE_KEY = ObjectKey("Node", "", "n1")


def svc(name: str, ip: str, **labels: str) -> dict[str, Any]:
    obj = service(name, ip, ports=[{"name": "http", "port": 80, "targetPort": 8080}])
    if labels:
        obj["metadata"]["labels"] = labels
    return obj


def eps(name: str, service_name: str, *ips: str, address_type: str = "IPv4") -> dict[str, Any]:
    obj = endpoint_slice(
        service_name,
        [endpoint(ip, "n1") for ip in ips],
        [{"name": "http", "port": 8080}],
        name=name,
    )
    obj["addressType"] = address_type
    return obj


def changed(events: list[ObjectEvent], key: ObjectKey) -> bool:
    return any(e.key == key and e.obj is not None for e in events)


def deleted(events: list[ObjectEvent], key: ObjectKey) -> bool:
    return any(e.key == key and e.obj is None for e in events)


@pytest.fixture
def store() -> KubeApiStore:
    st = KubeApiStore(bookmark_interval=0.2)
    st.apply(node())
    return st


@pytest.fixture
def server(store: KubeApiStore) -> Iterator[KubeApiServer]:
    with KubeApiServer(store) as srv:
        yield srv


@pytest.fixture
def kubeconfig(server: KubeApiServer, tmp_path: Path) -> Path:
    return server.kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def make_source(kubeconfig: Path) -> Iterator[Callable[..., ApiSource]]:
    made: list[ApiSource] = []

    def make(node_name: str = "n1", timing: Timing = FAST, **settings: Any) -> ApiSource:
        settings.setdefault("kubeconfig", str(kubeconfig))
        src = ApiSource(node_name, ClientSettings(**settings), timing=timing)
        made.append(src)
        return src

    yield make
    for src in made:
        src.stop()


def started(make_source: Callable[..., ApiSource], **kw: Any) -> tuple[ApiSource, Sink]:
    sink = Sink()
    src = make_source(**kw)
    src.start(sink)
    return src, sink


def wait_watches(store: KubeApiStore, path: str, count: int, timeout: float = 5.0) -> None:
    """Until `count` watch requests for `path` have reached the server."""
    deadline = time.monotonic() + timeout
    while len([r for r in store.recorded("GET", path) if r.query.get("watch")]) < count:
        assert time.monotonic() < deadline, f"fewer than {count} watches of {path}"
        time.sleep(0.01)


# --- initial sync and filters -------------------------------------------------------------------


def test_initial_sync_is_one_batch_of_plain_objects_with_upstream_filters(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    store.apply(svc("web", "10.96.0.10"))
    store.apply(svc("other", "10.96.0.11", **{"service.kubernetes.io/service-proxy-name": "x"}))
    store.apply(svc("hl", "10.96.0.12", **{"service.kubernetes.io/headless": ""}))
    store.apply(eps("web-1", "web", "10.244.0.2"))
    store.apply(eps("web-v6", "web", "fd00::2", address_type="IPv6"))
    headless_slice = eps("hl-1", "hl", "10.244.0.3")
    headless_slice["metadata"]["labels"]["service.kubernetes.io/headless"] = ""
    store.apply(headless_slice)
    store.apply(node("n2"))

    src, sink = started(make_source)

    assert src.synced
    assert len(sink.batches) == 1
    keys = {e.key for e in sink.batches[0]}
    assert keys == {svc_key("web"), slice_key("web-1"), NODE_KEY}
    by_key = {e.key: e.obj for e in sink.batches[0]}
    # Complete plain dicts, like the file source gives: kind and apiVersion included.
    assert by_key[svc_key("web")]["kind"] == "Service"
    assert by_key[slice_key("web-1")]["apiVersion"] == "discovery.k8s.io/v1"
    assert by_key[NODE_KEY]["metadata"]["annotations"] == {}
    lists = [r for r in store.requests if r.method == "GET" and "watch" not in r.query]
    by_path = {r.path: r.query for r in lists}
    assert by_path["/api/v1/services"]["labelSelector"] == LABEL_SELECTOR
    assert by_path["/apis/discovery.k8s.io/v1/endpointslices"]["labelSelector"] == LABEL_SELECTOR
    assert by_path["/api/v1/nodes"]["fieldSelector"] == "metadata.name=n1"
    # The objects feed the change tracker as they are.
    tracker = ChangeTracker("n1")
    tracker.apply(sink.batches[0])
    snap = tracker.snapshot()
    assert [str(sp.name) for sp in snap.sorted_ports()] == ["default/web:http"]
    assert [ep.addr for ep in snap.sorted_ports()[0].endpoints] == ["10.244.0.2:8080"]
    assert snap.node.zone == "z1"


def test_upstream_label_selector_is_the_one_kube_proxy_uses() -> None:
    # kube-proxy's informers: labels.NewSelector() with DoesNotExist requirements on
    # service-proxy-name and headless, printed sorted by key.
    assert LABEL_SELECTOR == (
        "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
    )


def test_first_batch_waits_until_every_list_succeeded(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    store.apply(svc("web", "10.96.0.10"))
    store.apply(eps("web-1", "web", "10.244.0.2"))
    store.fail("/endpointslices", 500, times=4)

    src, sink = started(make_source)

    assert src.synced
    assert len(sink.batches) == 1  # nothing before: no partial view ever went out
    assert {e.key for e in sink.batches[0]} == {svc_key("web"), slice_key("web-1"), NODE_KEY}
    failed = [
        r for r in store.requests if r.path.endswith("/endpointslices") and "watch" not in r.query
    ]
    assert len(failed) == 5


def test_paged_lists_deliver_everything(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    for i in range(7):
        store.apply(svc(f"s{i}", f"10.96.0.{10 + i}"))
    from dataclasses import replace

    src, sink = started(make_source, timing=replace(FAST, page_size=3))

    assert {e.key for e in sink.batches[0]} == {svc_key(f"s{i}") for i in range(7)} | {NODE_KEY}
    pages = [r for r in store.requests if r.path == "/api/v1/services" and "watch" not in r.query]
    assert len(pages) == 3
    assert "continue" in pages[1].query and "resourceVersion" not in pages[1].query


# --- watching -------------------------------------------------------------------------------------


def test_add_modify_delete_arrive_as_events(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    store.apply(svc("web", "10.96.0.10"))
    src, sink = started(make_source)
    n = len(sink.events)

    store.apply(svc("api", "10.96.0.20"))
    store.apply(eps("api-1", "api", "10.244.0.3"))
    sink.wait(lambda ev: changed(ev[n:], svc_key("api")) and changed(ev[n:], slice_key("api-1")))
    modified = svc("web", "10.96.0.10")
    modified["spec"]["ports"][0]["port"] = 81
    store.apply(modified)
    sink.wait(lambda ev: any(e.key == svc_key("web") for e in ev[n:]))
    store.delete("Service", "default", "api")
    sink.wait(lambda ev: deleted(ev[n:], svc_key("api")))

    later = sink.since(n)
    # Each resource is its own watch: order holds within a kind, not across kinds.
    services = [(e.key.name, e.obj) for e in later if e.key.kind == "Service"]
    assert [(name, obj is None) for name, obj in services] == [
        ("api", False),
        ("web", False),
        ("api", True),
    ]
    assert services[1][1] is not None and services[1][1]["spec"]["ports"][0]["port"] == 81
    assert [e.key for e in later if e.key.kind == "EndpointSlice"] == [slice_key("api-1")]


def test_objects_leaving_and_entering_the_selector(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    store.apply(svc("web", "10.96.0.10"))
    src, sink = started(make_source)
    n = len(sink.events)

    store.apply(svc("web", "10.96.0.10", **{"service.kubernetes.io/service-proxy-name": "x"}))
    sink.wait(lambda ev: deleted(ev[n:], svc_key("web")))
    store.apply(svc("web", "10.96.0.10"))
    sink.wait(lambda ev: changed(ev[n + 1 :], svc_key("web")))
    # An IPv6 slice is never delivered, not even as a change.
    store.apply(eps("v6", "web", "fd00::5", address_type="IPv6"))
    store.apply(svc("marker", "10.96.0.99"))
    sink.wait(lambda ev: changed(ev, svc_key("marker")))
    assert not any(e.key == slice_key("v6") for e in sink.events)


def test_node_changes_reach_listeners_other_nodes_do_not(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    src = make_source()
    seen: list[dict[str, Any] | None] = []
    src.node_listeners.append(seen.append)
    sink = Sink()
    src.start(sink)
    assert seen and seen[0] is not None and seen[0]["metadata"]["name"] == "n1"

    store.apply(node("n2"))
    store.patch("Node", "", "n1", {"metadata": {"annotations": {"proxy.kproxy.io/mode": "ipvs"}}})
    sink.wait(lambda ev: len([e for e in ev if e.key == NODE_KEY]) == 2)
    assert not any(e.key.name == "n2" for e in sink.events)
    assert seen[-1] is not None
    assert seen[-1]["metadata"]["annotations"] == {"proxy.kproxy.io/mode": "ipvs"}
    assert src.node == seen[-1]
    assert src.fetch_node(wait=1)["metadata"]["annotations"]["proxy.kproxy.io/mode"] == "ipvs"


def test_fetch_node_gives_up_when_the_node_does_not_exist(
    make_source: Callable[..., ApiSource],
) -> None:
    src = make_source("missing")
    t0 = time.monotonic()
    assert src.fetch_node(wait=0.5) is None
    assert time.monotonic() - t0 < 3


def test_bookmarks_move_the_resource_version(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    src, sink = started(make_source)
    before = int(src.state()["services"]["resource_version"])  # type: ignore[index]
    for i in range(3):
        store.apply(node(f"other{i}"))  # changes no service: only a bookmark can tell
    target = int(store.resource_version)
    deadline = time.monotonic() + 5
    while int(src.state()["services"]["resource_version"]) < target:  # type: ignore[index]
        assert time.monotonic() < deadline, "no bookmark moved the services' version"
        time.sleep(0.05)
    assert target > before
    watches = [r for r in store.requests if r.query.get("watch") == "true"]
    assert watches and all(r.query.get("allowWatchBookmarks") == "true" for r in watches)


def test_cut_watch_resumes_from_the_last_version_without_losing_events(
    store: KubeApiStore, server: KubeApiServer, make_source: Callable[..., ApiSource]
) -> None:
    src, sink = started(make_source)
    n = len(sink.events)
    for round_ in range(3):
        wait_watches(store, "/api/v1/services", round_ + 1)
        time.sleep(0.05)  # the stream is open
        server.drop_connections()
        # Changes made while the watch is being re-established must still arrive.
        for i in range(5):
            store.apply(svc(f"r{round_}-{i}", f"10.96.{round_}.{i + 1}"))
    expected = [svc_key(f"r{r}-{i}") for r in range(3) for i in range(5)]
    sink.wait(lambda ev: all(changed(ev[n:], k) for k in expected))
    time.sleep(0.3)
    later = sink.since(n)
    assert [e.key for e in later] == expected  # in order, none twice, nothing else
    assert src.state()["services"]["lists"] == 1  # type: ignore[index]
    resumed = [r for r in store.requests if r.path == "/api/v1/services" and r.query.get("watch")]
    assert len(resumed) >= 4 and all(r.query["resourceVersion"] != "0" for r in resumed)


# --- 410 Gone -------------------------------------------------------------------------------------


def test_gone_relists_and_delivers_only_the_difference(
    store: KubeApiStore, server: KubeApiServer, make_source: Callable[..., ApiSource]
) -> None:
    for name in ("keep", "change", "remove"):
        store.apply(svc(name, "10.96.0.10" if name == "keep" else "10.96.0.20"))
    src, sink = started(make_source)
    n = len(sink.events)

    server.stop()  # changes happen while kproxy cannot watch, then history is compacted
    store.apply(svc("change", "10.96.0.21"))
    store.delete("Service", "default", "remove")
    store.apply(svc("new", "10.96.0.30"))
    store.compact()
    server.start()

    sink.wait(lambda ev: deleted(ev[n:], svc_key("remove")) and changed(ev[n:], svc_key("new")))
    time.sleep(0.3)
    later = sink.since(n)
    assert sorted((str(e.key), e.obj is None) for e in later) == [
        ("Service default/change", False),
        ("Service default/new", False),
        ("Service default/remove", True),
    ]
    assert src.state()["services"]["lists"] == 2  # type: ignore[index]
    watch_410 = [
        r
        for r in store.requests
        if r.path == "/api/v1/services" and "watch" not in r.query and r is not None
    ]
    # The relist asked for "not older than" the version it had, as client-go does.
    assert watch_410[-1].query.get("resourceVersion") not in (None, "", "0")


def test_gone_on_an_open_watch_with_nothing_changed_delivers_nothing(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    store.apply(svc("web", "10.96.0.10"))
    src, sink = started(make_source)
    n = len(sink.events)
    wait_watches(store, "/api/v1/services", 1)
    time.sleep(0.05)
    store.expire_watches()
    deadline = time.monotonic() + 5
    while src.state()["services"]["lists"] < 2:  # type: ignore[index]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    store.apply(svc("marker", "10.96.0.99"))
    sink.wait(lambda ev: changed(ev[n:], svc_key("marker")))
    assert [e.key for e in sink.since(n)] == [svc_key("marker")]


def test_failed_relist_deletes_nothing_until_a_list_succeeds(
    store: KubeApiStore, server: KubeApiServer, make_source: Callable[..., ApiSource]
) -> None:
    store.apply(svc("a", "10.96.0.1"))
    store.apply(svc("b", "10.96.0.2"))
    src, sink = started(make_source)
    n = len(sink.events)
    server.stop()
    store.delete("Service", "default", "b")
    store.compact()
    store.fail("/api/v1/services", 503, times=6)  # the relist fails for a while
    server.start()
    deadline = time.monotonic() + 5
    while not deleted(sink.since(n), svc_key("b")):
        assert time.monotonic() < deadline, "the relist never succeeded"
        # Until the list succeeds, nothing at all was delivered for services.
        assert not any(e.key.kind == "Service" for e in sink.since(n))
        time.sleep(0.02)
    assert [(e.key, e.obj) for e in sink.since(n)] == [(svc_key("b"), None)]


# --- outages and slow servers ---------------------------------------------------------------------


def test_outage_delivers_nothing_and_logs_once_per_state_change(
    store: KubeApiStore,
    server: KubeApiServer,
    make_source: Callable[..., ApiSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store.apply(svc("web", "10.96.0.10"))
    src, sink = started(make_source)
    n = len(sink.events)
    caplog.set_level(logging.INFO, logger="kproxy.sources.api")

    server.stop()
    time.sleep(1.0)  # several backoff rounds (20 ms doubling to 200 ms)
    assert sink.since(n) == []
    state = src.state()
    assert all(s["error"] for s in state.values()), state  # type: ignore[index]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, [r.getMessage() for r in warnings]  # one per resource
    assert {r.getMessage().split(":")[0] for r in warnings} == {
        "services list/watch",
        "endpointslices list/watch",
        "nodes list/watch",
    }

    store.apply(svc("after", "10.96.0.11"))
    server.start()
    sink.wait(lambda ev: changed(ev[n:], svc_key("after")))
    assert [e.key for e in sink.since(n)] == [svc_key("after")]
    deadline = time.monotonic() + 5
    while any(s["error"] for s in src.state().values()):  # type: ignore[index]
        assert time.monotonic() < deadline, src.state()
        time.sleep(0.02)
    recovered = [r for r in caplog.records if "working again" in r.getMessage()]
    assert len(recovered) == 3


def test_slow_server_is_waited_for(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    from dataclasses import replace

    store.apply(svc("web", "10.96.0.10"))
    store.delay = 0.3
    src = make_source(timing=replace(FAST, list_timeout=0.2))
    sink = Sink()
    t = threading.Thread(target=src.start, args=(sink,))
    t.start()
    time.sleep(1.0)
    assert not src.synced and sink.batches == []  # lists time out and are retried
    store.delay = 0.1
    t.join(10)
    assert src.synced
    assert {e.key for e in sink.batches[0]} == {svc_key("web"), NODE_KEY}


def test_stop_ends_a_start_that_waits_for_an_unreachable_server(tmp_path: Path) -> None:
    kc = write_kubeconfig(tmp_path / "kc", "http://127.0.0.1:9")  # discard port: refused
    src = ApiSource("n1", ClientSettings(kubeconfig=str(kc)), timing=FAST)
    sink = Sink()
    t = threading.Thread(target=src.start, args=(sink,))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not src.synced
    src.stop()
    t.join(5)
    assert not t.is_alive()
    assert sink.batches == []


# --- connection settings ------------------------------------------------------------------------


def test_kubeconfig_token_is_sent(
    store: KubeApiStore, server: KubeApiServer, tmp_path: Path
) -> None:
    store.token = "s3cret"
    good = server.kubeconfig(tmp_path / "good", token="s3cret")
    src = ApiSource("n1", ClientSettings(kubeconfig=str(good)), timing=FAST)
    try:
        sink = Sink()
        src.start(sink)
        assert NODE_KEY in {e.key for e in sink.batches[0]}
    finally:
        src.stop()

    bad = write_kubeconfig(tmp_path / "bad", server.url, token="wrong")
    src = ApiSource("n1", ClientSettings(kubeconfig=str(bad)), timing=FAST)
    sink = Sink()
    t = threading.Thread(target=src.start, args=(sink,))
    t.start()
    try:
        time.sleep(0.5)
        assert not src.synced
        errors = [s["error"] for s in src.state().values()]  # type: ignore[index]
        assert all(e and "401" in e for e in errors), errors
    finally:
        src.stop()
        t.join(5)


def test_master_overrides_the_kubeconfig_server(server: KubeApiServer, tmp_path: Path) -> None:
    kc = write_kubeconfig(tmp_path / "kc", "http://127.0.0.1:9")
    src = ApiSource("n1", ClientSettings(kubeconfig=str(kc), master=server.url), timing=FAST)
    try:
        src.start(Sink())
        assert src.synced
    finally:
        src.stop()
    alone = ApiSource("n1", ClientSettings(master=server.url), timing=FAST)
    try:
        alone.start(Sink())
        assert alone.synced
    finally:
        alone.stop()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (ClientSettings(kubeconfig="/nonexistent/kc"), "does not exist"),
        (ClientSettings(master="127.0.0.1:6443"), "must start with http"),
    ],
)
def test_unusable_settings_are_one_line_errors(settings: ClientSettings, message: str) -> None:
    src = ApiSource("n1", settings, timing=FAST)
    try:
        with pytest.raises(ClientConfigError, match=message):
            src.open()
    finally:
        src.stop()


def test_broken_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    kc = tmp_path / "kc"
    kc.write_text("apiVersion: v1\nkind: Config\ncurrent-context: nowhere\ncontexts: []\n")
    src = ApiSource("n1", ClientSettings(kubeconfig=str(kc)), timing=FAST)
    try:
        with pytest.raises(ClientConfigError, match=str(kc)):
            src.open()
    finally:
        src.stop()


def test_in_cluster_needs_the_service_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import asyncio

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ClientConfigError, match="KUBERNETES_SERVICE_HOST"):
        asyncio.run(connect(ClientSettings()))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    missing = ClientSettings(token_file=str(tmp_path / "token"), ca_file=str(tmp_path / "ca"))
    with pytest.raises(ClientConfigError, match="token"):
        asyncio.run(connect(missing))


# --- choosing the source, and what the Node says before the proxy is built -------------------


def _config(**flags: str) -> ProxyConfig:
    return apply_flags(load_config(None), flags)[0]


def test_source_choice_follows_kube_proxy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with_kc = _config(kubeconfig="/etc/kc")
    assert choose_source(tmp_path, with_kc, None).path == tmp_path  # --source wins
    api = choose_source(None, with_kc, "https://10.0.0.1:6443").api
    assert api == ClientSettings(kubeconfig="/etc/kc", master="https://10.0.0.1:6443")
    assert choose_source(None, _config(), "http://127.0.0.1:8080").api == ClientSettings(
        master="http://127.0.0.1:8080"
    )
    with pytest.raises(ClientConfigError, match="--kubeconfig"):
        choose_source(None, _config(), None)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert choose_source(None, _config(), None).api == ClientSettings()  # in-cluster


def test_node_ips_prefer_internal_addresses() -> None:
    obj = node()
    obj["status"]["addresses"] = [
        {"type": "Hostname", "address": "n1"},
        {"type": "ExternalIP", "address": "203.0.113.5"},
        {"type": "InternalIP", "address": "fd00::1"},
        {"type": "InternalIP", "address": "10.0.0.7"},
    ]
    assert node_ips_of(obj) == ("10.0.0.7", "203.0.113.5")
    assert node_ips_of(None) == ()


def test_start_facts_take_node_ips_and_declared_mode_from_the_node(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    store.patch("Node", "", "n1", {"metadata": {"annotations": {MODE_ANNOTATION: "NFTables"}}})
    src = make_source()
    facts = start_facts(src, _config(), ())
    assert facts.node_ips == ("10.100.0.1",)
    assert facts.config.effective_mode == "nftables"
    assert facts.configured_mode == "iptables"
    # Explicit node IPs and a specific bindAddress win over the Node's addresses.
    assert start_facts(src, _config(), ("10.1.1.1",)).node_ips == ("10.1.1.1",)
    assert start_facts(src, _config(**{"bind-address": "10.2.2.2"}), ()).node_ips == ("10.2.2.2",)
    # A mode that cannot run is not taken (the configured one serves; the agent reports it).
    store.patch("Node", "", "n1", {"metadata": {"annotations": {MODE_ANNOTATION: "bpf"}}})
    assert start_facts(src, _config(), ()).config.effective_mode == "iptables"


def test_start_facts_without_a_node(make_source: Callable[..., ApiSource]) -> None:
    src = make_source("absent")
    facts = start_facts(src, _config(), (), wait=0.3)
    assert facts.node is None and facts.node_ips == ()
    assert facts.config.effective_mode == "iptables"


# --- the cluster agent: declared mode and status on the Node -----------------------------------


def annotate(store: KubeApiStore, value: str | None) -> None:
    store.patch("Node", "", "n1", {"metadata": {"annotations": {MODE_ANNOTATION: value}}})


def node_annotations(store: KubeApiStore) -> dict[str, str]:
    obj = store.get("Node", "", "n1")
    assert obj is not None
    return dict(obj["metadata"].get("annotations") or {})


def event_reasons(store: KubeApiStore) -> list[str]:
    return [str(r.body["reason"]) for r in store.recorded("POST", "/events")]


@pytest.fixture
def agent_for(
    make_source: Callable[..., ApiSource],
) -> Iterator[Callable[[FakeDaemon], ClusterAgent]]:
    agents: list[ClusterAgent] = []

    def make(daemon: FakeDaemon) -> ClusterAgent:
        src, _ = started(make_source)
        agent = ClusterAgent(daemon, src, configured_mode="iptables", interval=0.05)
        agent.start()
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.stop()


def test_declared_mode_switches_and_is_reported_on_the_node(
    store: KubeApiStore, agent_for: Callable[[FakeDaemon], ClusterAgent]
) -> None:
    daemon = FakeDaemon()
    agent_for(daemon)
    wait_until(lambda: node_annotations(store).get(CURRENT_MODE) == "iptables")
    assert node_annotations(store)[SWITCH_STATE] == "idle"
    assert daemon.switches == []

    annotate(store, "nftables")
    wait_until(lambda: node_annotations(store).get(SWITCH_STATE) == "succeeded")
    ann = node_annotations(store)
    assert daemon.switches == ["nftables"]
    assert ann[CURRENT_MODE] == "nftables" and ann[SWITCH_TARGET] == "nftables"
    assert ann[OBSERVED] == "nftables" and LAST_ERROR not in ann
    wait_until(lambda: len(event_reasons(store)) == 2)
    assert event_reasons(store) == ["ProxyModeSwitching", "ProxyModeSwitched"]
    ev = store.recorded("POST", "/events")[-1]
    assert ev.path == "/api/v1/namespaces/default/events"
    assert ev.body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "n1",
        "uid": "n1",
    }
    assert ev.body["type"] == "Normal" and "iptables to nftables" in ev.body["message"]
    patches = store.recorded("PATCH", "/api/v1/nodes/n1")
    assert patches and all(p.content_type == "application/merge-patch+json" for p in patches)
    # The switching state was reported before the switch ran.
    states = [p.body["metadata"]["annotations"].get(SWITCH_STATE) for p in patches]
    assert states.index("switching") < states.index("succeeded")

    annotate(store, None)  # removed: back to the configured mode
    wait_until(lambda: node_annotations(store).get(CURRENT_MODE) == "iptables")
    assert daemon.switches == ["nftables", "iptables"]
    assert node_annotations(store)[OBSERVED] == ""


def test_declared_mode_removed_before_the_agent_starts_leads_back(
    store: KubeApiStore, agent_for: Callable[[FakeDaemon], ClusterAgent]
) -> None:
    # The daemon came up in the declared nftables; the annotation was removed between its
    # first sync and the agent's start, so the agent's first look sees no annotation.
    daemon = FakeDaemon(mode="nftables")
    agent_for(daemon)
    wait_until(lambda: node_annotations(store).get(SWITCH_STATE) == "succeeded")
    assert daemon.switches == ["iptables"]
    assert node_annotations(store)[CURRENT_MODE] == "iptables"
    assert node_annotations(store)[OBSERVED] == ""


def test_failed_switch_is_reported_and_not_retried(
    store: KubeApiStore, agent_for: Callable[[FakeDaemon], ClusterAgent]
) -> None:
    daemon = FakeDaemon(fail_with="verify: 10.96.0.10:80 not programmed")
    agent_for(daemon)
    annotate(store, "ipvs")
    wait_until(lambda: node_annotations(store).get(SWITCH_STATE) == "failed")
    ann = node_annotations(store)
    assert ann[CURRENT_MODE] == "iptables" and ann[SWITCH_TARGET] == "ipvs"
    assert "not programmed" in ann[LAST_ERROR]
    wait_until(lambda: "ProxyModeSwitchFailed" in event_reasons(store))
    warning = store.recorded("POST", "/events")[-1].body
    assert warning["type"] == "Warning" and "iptables keeps serving" in warning["message"]
    time.sleep(0.3)
    assert daemon.switches == ["ipvs"]  # edge-triggered: no retry loop

    daemon.fail_with = ""
    annotate(store, "nftables")
    wait_until(lambda: node_annotations(store).get(SWITCH_STATE) == "succeeded")
    assert LAST_ERROR not in node_annotations(store)


def test_unknown_declared_mode_is_refused_without_switching(
    store: KubeApiStore, agent_for: Callable[[FakeDaemon], ClusterAgent]
) -> None:
    daemon = FakeDaemon()
    agent_for(daemon)
    annotate(store, "ebpf")
    wait_until(lambda: node_annotations(store).get(SWITCH_STATE) == "failed")
    assert "'ebpf' is not a proxy mode" in node_annotations(store)[LAST_ERROR]
    assert daemon.switches == []


def test_a_declared_mode_with_line_breaks_is_echoed_on_one_line(
    store: KubeApiStore, agent_for: Callable[[FakeDaemon], ClusterAgent]
) -> None:
    daemon = FakeDaemon()
    agent_for(daemon)
    annotate(store, "ipvs\nWarning ProxyModeSwitched forged\r\x1b[2J" + "x" * 300)
    wait_until(lambda: node_annotations(store).get(SWITCH_STATE) == "failed")
    ann = node_annotations(store)
    for key in (OBSERVED, SWITCH_TARGET, LAST_ERROR):
        assert ann[key].isprintable() and "\\n" in ann[key], (key, ann[key])
    assert ann[OBSERVED].startswith("ipvs\\nwarning proxymodeswitched forged\\r\\x1b[2j")
    assert len(ann[OBSERVED]) < 100  # cut, saying so
    wait_until(lambda: "ProxyModeSwitchFailed" in event_reasons(store))
    message = store.recorded("POST", "/events")[-1].body["message"]
    assert message.isprintable() and "forged" in message
    assert daemon.switches == []


def test_switches_made_elsewhere_are_reported(
    store: KubeApiStore, agent_for: Callable[[FakeDaemon], ClusterAgent]
) -> None:
    daemon = FakeDaemon()
    agent_for(daemon)
    wait_until(lambda: node_annotations(store).get(CURRENT_MODE) == "iptables")
    daemon.switch("userspace")  # e.g. `kproxy switch` or the config file
    wait_until(lambda: node_annotations(store).get(CURRENT_MODE) == "userspace")
    assert node_annotations(store)[SWITCH_STATE] == "succeeded"
    assert node_annotations(store)[OBSERVED] == ""


def test_status_waits_out_an_outage(
    store: KubeApiStore,
    server: KubeApiServer,
    agent_for: Callable[[FakeDaemon], ClusterAgent],
) -> None:
    daemon = FakeDaemon()
    agent = agent_for(daemon)
    wait_until(lambda: node_annotations(store).get(CURRENT_MODE) == "iptables")
    server.stop()
    daemon.switch("nftables")
    time.sleep(0.3)
    assert node_annotations(store)[CURRENT_MODE] == "iptables"
    agent._retry_at = 0.0  # no need to wait out the backoff in a test
    server.start()
    wait_until(lambda: node_annotations(store).get(CURRENT_MODE) == "nftables", timeout=8)
    wait_until(lambda: "ProxyModeSwitched" in event_reasons(store))


def test_kubeconfig_token_file_is_read_again_when_rotated(
    store: KubeApiStore, server: KubeApiServer, tmp_path: Path
) -> None:
    import json

    (tmp_path / "token").write_text("first\n")
    kc = tmp_path / "kubeconfig.conf"
    kc.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server.url}}],
                # kubeadm's kube-proxy kubeconfig: the service-account token by file.
                "users": [{"name": "u", "user": {"tokenFile": "token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    store.token = "first"
    src = ApiSource("n1", ClientSettings(kubeconfig=str(kc)), timing=FAST)
    try:
        src.start(Sink())
        (tmp_path / "token").write_text("second\n")  # the kubelet rotated it
        store.token = "second"
        node_obj = src.fetch_node(wait=0.5)
        # The old token would get 401 until fetch_node gives up (None).
        assert node_obj is not None and node_obj["metadata"]["name"] == "n1"
    finally:
        src.stop()


def test_expired_continue_token_restarts_the_list(
    store: KubeApiStore, make_source: Callable[..., ApiSource]
) -> None:
    from dataclasses import replace

    for i in range(5):
        store.apply(svc(f"s{i}", f"10.96.0.{10 + i}"))
    store.fail("/api/v1/services", 410, times=1, query="continue")
    src, sink = started(make_source, timing=replace(FAST, page_size=2))
    assert {e.key for e in sink.batches[0]} == {svc_key(f"s{i}") for i in range(5)} | {NODE_KEY}
    pages = [r for r in store.recorded("GET", "/api/v1/services") if not r.query.get("watch")]
    # page 1, page 2 (410: its continue token expired), then a fresh list of 3 pages
    assert len(pages) == 5
    assert pages[0].query.get("resourceVersion") == "0" and "continue" in pages[1].query
    assert "resourceVersion" not in pages[2].query and "continue" not in pages[2].query


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    import subprocess

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    argv += ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=api"]
    argv += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        argv,
        check=True,
        capture_output=True,
    )
    return cert, key


def test_in_cluster_service_account_over_tls(
    store: KubeApiStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = _self_signed(tmp_path)
    store.token = "sa-token"
    (tmp_path / "token").write_text("sa-token")
    with KubeApiServer(store, tls=(cert, key)) as server:
        # What the kubelet gives every pod: the service's address and the mounted account.
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
        settings = ClientSettings(token_file=str(tmp_path / "token"), ca_file=str(cert))
        assert choose_source(None, _config(), None).api == ClientSettings()
        src = ApiSource("n1", settings, timing=FAST)
        try:
            sink = Sink()
            src.start(sink)
            assert NODE_KEY in {e.key for e in sink.batches[0]}
            assert src.connection.host == f"https://127.0.0.1:{server.port}"
        finally:
            src.stop()
        # A CA that did not sign the server's certificate: nothing is trusted.
        (tmp_path / "other").mkdir()
        other, _ = _self_signed(tmp_path / "other")
        bad = ApiSource(
            "n1", ClientSettings(token_file=settings.token_file, ca_file=str(other)), timing=FAST
        )
        t = threading.Thread(target=bad.start, args=(Sink(),))
        t.start()
        try:
            time.sleep(0.5)
            assert not bad.synced
            errors = [s["error"] for s in bad.state().values()]  # type: ignore[index]
            assert all(e and "certificate" in e.lower() for e in errors), errors
        finally:
            bad.stop()
            t.join(5)
