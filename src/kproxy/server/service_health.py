"""Health-check NodePorts of externalTrafficPolicy: Local LoadBalancer services.

A cloud load balancer probes `http://<node>:<healthCheckNodePort>/` on every node and sends
traffic only to the nodes that answer 200, so that Local services keep client source IPs
without black-holing traffic on nodes with no endpoint. As upstream: one listener per
service (on every address, or on the nodePortAddresses' node IPs), 200 while the node has
at least one local *ready* endpoint (terminating ones fail the check so the LB drains the
node) and the proxy itself is healthy, else 503; the JSON body names the service and the
count of distinct local endpoint IPs.

It observes the sync loop: the listeners and counts follow the snapshot that was just
programmed, so the LB never sees "healthy" for endpoints the dataplane does not have yet.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler

from kproxy.dataplane.base import SyncResult
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeCounts
from kproxy.server.http import QuietHTTPServer, RequestHandler

log = logging.getLogger("kproxy.server.service_health")

ServiceKey = tuple[str, str]  # (namespace, name)


def wanted_health_checks(snapshot: Snapshot) -> dict[ServiceKey, int]:
    """The health-check NodePort of each service that has one (set only for LoadBalancer
    services with externalTrafficPolicy Local; the model drops it otherwise)."""
    out: dict[ServiceKey, int] = {}
    for name, sp in snapshot.services.items():
        if sp.health_check_node_port:
            out[(name.namespace, name.name)] = sp.health_check_node_port
    return out


def local_ready_endpoints(snapshot: Snapshot) -> dict[ServiceKey, int]:
    """Distinct local ready endpoint IPs per service, over all its ports (upstream counts
    10.0.0.1:80 and 10.0.0.1:443 as one endpoint)."""
    ips: dict[ServiceKey, set[str]] = {}
    for name, sp in snapshot.services.items():
        for ep in sp.endpoints:
            if ep.is_local and ep.ready:
                ips.setdefault((name.namespace, name.name), set()).add(ep.ip)
    return {key: len(v) for key, v in ips.items()}


class _Instance:
    """The listeners of one service's health-check port."""

    def __init__(self, key: ServiceKey, port: int) -> None:
        self.key = key
        self.port = port
        self.endpoints = 0
        self.servers: list[QuietHTTPServer] = []

    def close(self) -> None:
        for httpd in self.servers:
            httpd.shutdown()
            httpd.server_close()
        self.servers.clear()


class ServiceHealthServer:
    """Opens, answers and closes health-check NodePorts (a sync.SyncObserver)."""

    def __init__(
        self,
        proxy_healthy: Callable[[], bool],
        addresses: Callable[[], Iterable[str] | None] = lambda: None,
    ) -> None:
        self.proxy_healthy = proxy_healthy
        # None: every address (0.0.0.0); else the node IPs nodePortAddresses selects.
        self.addresses = addresses
        self._services: dict[ServiceKey, _Instance] = {}
        self._lock = threading.Lock()
        self.open_errors: dict[ServiceKey, str] = {}  # ports that could not be opened

    # --- sync observer -------------------------------------------------------------------

    def queued(self, when: float, pending_services: int, pending_endpoints: int) -> None:
        pass

    def synced(
        self, snapshot: Snapshot, result: SyncResult, seconds: float, counts: ChangeCounts
    ) -> None:
        self.sync_services(wanted_health_checks(snapshot))
        self.sync_endpoints(local_ready_endpoints(snapshot))

    def failed(self, full: bool) -> None:
        pass

    def conntrack_cleaned(self, deleted: int, error: str | None = None) -> None:
        pass

    # --- the two upstream operations -----------------------------------------------------

    def sync_services(self, wanted: dict[ServiceKey, int]) -> None:
        with self._lock:
            for key, inst in list(self._services.items()):
                if wanted.get(key) != inst.port:
                    log.info("closing health check of %s/%s on port %d", *key, inst.port)
                    inst.close()
                    del self._services[key]
            for key, port in wanted.items():
                if key in self._services:
                    continue
                inst = _Instance(key, port)
                try:
                    self._listen(inst)
                except OSError as err:
                    inst.close()
                    message = f"cannot open health check port {port}: {err.strerror or err}"
                    if self.open_errors.get(key) != message:
                        log.error("service %s/%s: %s", *key, message)
                    self.open_errors[key] = message
                    continue  # retried on the next sync, as upstream does
                self.open_errors.pop(key, None)
                log.info("health check of %s/%s listening on port %d", *key, port)
                self._services[key] = inst
            for key in [k for k in self.open_errors if k not in wanted]:
                del self.open_errors[key]

    def sync_endpoints(self, counts: dict[ServiceKey, int]) -> None:
        with self._lock:
            for key, inst in self._services.items():
                inst.endpoints = counts.get(key, 0)

    def ports(self) -> dict[ServiceKey, int]:
        with self._lock:
            return {k: i.port for k, i in self._services.items()}

    def stop(self) -> None:
        with self._lock:
            for inst in self._services.values():
                inst.close()
            self._services.clear()

    # --- serving ---------------------------------------------------------------------------

    def _listen(self, inst: _Instance) -> None:
        addresses = self.addresses()
        for host in ["0.0.0.0"] if addresses is None else list(addresses):
            httpd = QuietHTTPServer((host, inst.port), self._handler(inst.key))
            inst.servers.append(httpd)
            threading.Thread(
                target=httpd.serve_forever, name=f"hc-{inst.key[1]}:{inst.port}", daemon=True
            ).start()

    def _answer(self, key: ServiceKey) -> tuple[int, bytes] | None:
        with self._lock:
            inst = self._services.get(key)
            count = inst.endpoints if inst is not None else None
        if count is None:
            return None  # closed meanwhile: upstream answers nothing either
        healthy = self.proxy_healthy()
        body = {
            "service": {"namespace": key[0], "name": key[1]},
            "localEndpoints": count,
            "serviceProxyHealthy": healthy,
        }
        code = 200 if count and healthy else 503
        return code, json.dumps(body, indent=2).encode()

    def _handler(self, key: ServiceKey) -> type[BaseHTTPRequestHandler]:
        answer = self._answer

        class Handler(RequestHandler):
            def do_GET(self) -> None:  # any path, as upstream's handler
                reply = answer(key)
                if reply is None:
                    self.close_connection = True
                    return
                code, body = reply
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler
