"""The lab's traffic harness and proxy handle, as the soak bench uses them: the proxy's
/metrics fetched from inside its node namespace, and a long-lived connection cut by its pod
recorded with the pod it was on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kproxy.lab.load import LoadHarness
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from tests.support.api import wait_until
from tests.support.dataplane_env import POD_IPS
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel


def test_metrics_fetched_in_the_node_namespace_and_a_cut_stream_names_its_pod(
    lab: Lab, tmp_path: Path
) -> None:
    source = tmp_path / "objects"
    source.mkdir()
    write(source / "node.yaml", node())
    write(
        source / "web.yaml",
        service("web", "10.96.0.10", [port("http", 80, "http")]),
        endpoint_slice("web", [endpoint(POD_IPS[0])], [port("http", 8080)]),
    )
    config = tmp_path / "config.yaml"
    config.write_text(proxy_config("iptables"))
    proxy = ProxyProcess(
        lab, source, config=config, args=["--iptables-backend", "nft"], workdir=tmp_path / "kp"
    ).start()
    try:
        # The bench's process is in the host namespace, where 127.0.0.1:10249 is not kproxy.
        text = proxy.fetch("http://127.0.0.1:10249/metrics")
        assert "kubeproxy_sync_proxy_rules_duration_seconds_count" in text
        with pytest.raises(ValueError, match="not an http URL"):
            proxy.fetch("https://127.0.0.1:10249/metrics")

        load = LoadHarness(lab, tcp=("10.96.0.10", 80), streams=2, ping_interval=0.1).start()
        wait_until(lambda: load.result.pings_sent >= 4, 10)
        # The pod answers its streams' next segment with a reset, as a pod that went away.
        pod_ns = lab.pod_ns_of("pod1")
        lab.exec(
            pod_ns,
            ["iptables-nft", "-A", "INPUT", "-p", "tcp", "--dport", "8080", "-j", "REJECT",
             "--reject-with", "tcp-reset"],
        )  # fmt: skip
        wait_until(lambda: load.result.streams_dropped == 2, 10)
        result = load.stop()
    finally:
        proxy.stop()
    assert result.streams_opened == 2
    assert [(pod, error) for _t, pod, error in result.stream_failures] == [
        ("pod1", "reset"),
        ("pod1", "reset"),
    ]
