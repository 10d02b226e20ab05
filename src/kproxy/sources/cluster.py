"""Running against a cluster: which source `kproxy run` uses, and what the Node object says
before the proxy is built (node IPs, a declared proxy mode).

kube-proxy's rules: an explicit kubeconfig or master URL means that API server; neither means
the pod's service account (in-cluster). kproxy adds --source (a file or folder) which, when
given, wins. Node IPs come from --node-ip, else a specific bindAddress, else the Node's
status.addresses (InternalIP before ExternalIP, as upstream's node-IP detection), else the
interfaces (the dataplane detects them).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kproxy.cluster.annotations import MODE_ANNOTATION, declared_mode
from kproxy.config import ProxyConfig
from kproxy.sources.clientsettings import ClientConfigError, ClientSettings, in_cluster_available

if TYPE_CHECKING:  # the API source loads the client library: only when it is used
    from kproxy.sources.api import ApiSource

log = logging.getLogger("kproxy.sources.cluster")

_UNSPECIFIED = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class SourceChoice:
    """What `kproxy run` reads objects from: a path (the file source) or the API server."""

    path: Path | None = None
    api: ClientSettings | None = None

    def describe(self) -> str:
        return (
            f"--source {self.path}"
            if self.path is not None
            else (self.api.description if self.api is not None else "nothing")
        )


def choose_source(source: Path | None, config: ProxyConfig, master: str | None) -> SourceChoice:
    """--source, else --kubeconfig/clientConnection.kubeconfig or --master, else in-cluster.
    Raises ClientConfigError when none of them applies."""
    kubeconfig = config.client_connection.kubeconfig
    if source is not None:
        if kubeconfig or master:
            log.warning("--source %s is given: the API server settings are not used", source)
        return SourceChoice(path=source)
    if kubeconfig or master:
        return SourceChoice(api=ClientSettings(kubeconfig=kubeconfig, master=master or ""))
    if in_cluster_available():
        log.info("neither kubeconfig nor master given: using the in-cluster configuration")
        return SourceChoice(api=ClientSettings())
    raise ClientConfigError(
        "no objects to proxy: give --source FILE, --kubeconfig FILE or --master URL "
        "(or run in a pod, where the service account is used)"
    )


def node_ips_of(node: dict[str, Any] | None) -> tuple[str, ...]:
    """IPv4 node IPs from status.addresses: InternalIP ones first, then ExternalIP."""
    if not isinstance(node, dict):
        return ()
    status = node.get("status")
    addresses = status.get("addresses") if isinstance(status, dict) else None
    if not isinstance(addresses, list):
        return ()
    out: list[str] = []
    for wanted in ("InternalIP", "ExternalIP"):
        for a in addresses:
            if not isinstance(a, dict) or a.get("type") != wanted:
                continue
            try:
                ip = ipaddress.ip_address(str(a.get("address", "")))
            except ValueError:
                continue
            if ip.version == 4 and str(ip) not in out:
                out.append(str(ip))
    return tuple(out)


@dataclass(frozen=True)
class StartFacts:
    config: ProxyConfig  # with the declared mode, when the Node declares a usable one
    node_ips: tuple[str, ...]
    node: dict[str, Any] | None
    configured_mode: str  # the config's own mode, where a removed annotation leads back


def start_facts(
    source: ApiSource, config: ProxyConfig, node_ips: tuple[str, ...], *, wait: float = 10.0
) -> StartFacts:
    """Read this node's Node once before the dataplane is built, as kube-proxy does."""
    from kproxy.dataplane.base import DataplaneUnavailable, check_mode_available

    node = source.fetch_node(wait=wait)
    configured = config.effective_mode
    if not node_ips:
        if config.bind_address not in _UNSPECIFIED:
            node_ips = (config.bind_address,)
        else:
            node_ips = node_ips_of(node)
            if node_ips:
                log.info("node IPs from Node %s: %s", source.node_name, ", ".join(node_ips))
    mode = declared_mode(node)
    if mode and mode != configured:
        try:
            check_mode_available(mode)
        except (DataplaneUnavailable, ValueError) as err:
            # Reported on the Node by the cluster agent; the configured mode serves meanwhile.
            log.error("Node %s declares mode %r, which cannot run: %s", source.node_name, mode, err)
        else:
            log.info(
                "Node %s declares mode %s (%s): it overrides the configured %s",
                source.node_name,
                mode,
                MODE_ANNOTATION,
                configured,
            )
            config = config.model_copy(update={"mode": mode})
    return StartFacts(config=config, node_ips=node_ips, node=node, configured_mode=configured)


@dataclass
class Prepared:
    """What `kproxy run` builds its Daemon from."""

    source: Path | ApiSource
    config: ProxyConfig
    node_ips: tuple[str, ...]
    facts: StartFacts | None = None

    @property
    def follow_node_from(self) -> str | None:
        """With the API source: the configured mode, where a removed declaration leads back
        (the daemon then follows the Node's declared mode); None with the file source."""
        return None if self.facts is None else self.facts.configured_mode


def prepare_source(
    source: Path | None,
    master: str | None,
    config: ProxyConfig,
    node_name: str,
    node_ips: tuple[str, ...],
) -> Prepared:
    """Pick the source; for the API server, connect and read the Node first (node IPs,
    declared mode). Raises ClientConfigError for unusable settings."""
    choice = choose_source(source, config, master)
    if choice.path is not None:
        return Prepared(source=choice.path, config=config, node_ips=node_ips)
    assert choice.api is not None
    from kproxy.sources.api import ApiSource

    api = ApiSource(node_name, choice.api)
    try:
        facts = start_facts(api, config, node_ips)
    except BaseException:
        api.stop()
        raise
    return Prepared(source=api, config=facts.config, node_ips=facts.node_ips, facts=facts)
