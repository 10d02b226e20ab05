"""A small Kubernetes API server for tests and the lab: the real list/watch protocol, in memory.

It serves Services, EndpointSlices, Nodes, Events, Leases and kproxy's ProxyRollouts (with
their status subresource) the way kube-apiserver does for the calls kproxy and the tests
make: lists with metadata.resourceVersion and paging (limit/continue), watches as a chunked
stream of JSON lines from a resourceVersion with bookmarks and timeoutSeconds, label and
field selectors (an object leaving a watch's selector is sent as DELETED, one entering it as
ADDED), 410 Gone for a version older than the kept history (an ERROR event with a Status, as
the real server sends), create/update (409 Conflict for a stale resourceVersion)/delete,
merge patches, and Events. For faults it can drop every connection mid-stream, stop and
restart its listener (an outage), slow down every answer and fail chosen requests.

State lives in a KubeApiStore; any number of KubeApiServer front ends serve one store, each
on 127.0.0.1 of a chosen network namespace (a lab node's loopback, or the caller's), so a
test can keep talking to the store while kproxy's front end is down.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import json
import re
import socket
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kproxy.host.netns import socket_in_netns

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    plural: str
    kind: str
    api_version: str
    group_path: str  # "/api/v1" or "/apis/GROUP/VERSION"
    namespaced: bool
    # Has a status subresource: writes to the object keep its status, writes to /status
    # change only the status (as for custom resources that declare one).
    status_subresource: bool = False


KINDS = {
    k.plural: k
    for k in (
        Kind("services", "Service", "v1", "/api/v1", True),
        Kind(
            "endpointslices",
            "EndpointSlice",
            "discovery.k8s.io/v1",
            "/apis/discovery.k8s.io/v1",
            True,
        ),
        Kind("nodes", "Node", "v1", "/api/v1", False),
        Kind("events", "Event", "v1", "/api/v1", True),
        Kind(
            "proxyrollouts",
            "ProxyRollout",
            "proxy.kproxy.io/v1alpha1",
            "/apis/proxy.kproxy.io/v1alpha1",
            False,
            status_subresource=True,
        ),
        Kind("leases", "Lease", "coordination.k8s.io/v1", "/apis/coordination.k8s.io/v1", True),
    )
}
BY_KIND = {k.kind: k for k in KINDS.values()}

_PATH = re.compile(
    r"^(?P<group>/api/v1|/apis/[a-z0-9.-]+/v1[a-z0-9]*)"
    r"(?:/namespaces/(?P<ns>[a-z0-9-]+))?/(?P<plural>[a-z]+)"
    r"(?:/(?P<name>[A-Za-z0-9.-]+)(?P<status>/status)?)?$"
)


class ApiStatus(Exception):
    """Answered as a metav1.Status."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


# --- selectors --------------------------------------------------------------------------------


def label_matches(selector: str, labels: dict[str, str]) -> bool:
    """The label selector forms kube-proxy and kubectl use: k, !k, k=v, k==v, k!=v."""
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_matches(selector: str, obj: Obj) -> bool:
    """Field selectors as dotted paths (metadata.name, involvedObject.name, reason, ...)."""
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        neg = "!=" in term
        k, v = term.split("!=" if neg else "=", 1)
        path = k.strip()
        if not re.fullmatch(r"[A-Za-z]+(\.[A-Za-z]+)*", path):
            raise ApiStatus(400, "BadRequest", f'field label not supported: "{path}"')
        value: Any = obj
        for part in path.split("."):
            value = value.get(part, "") if isinstance(value, dict) else ""
        if (str(value) == v.strip().lstrip("=")) == neg:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (null removes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# --- the store -------------------------------------------------------------------------------


@dataclass
class _Change:
    rv: int
    plural: str
    type: str  # ADDED, MODIFIED, DELETED
    old: Obj | None
    new: Obj | None


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any = None
    content_type: str = ""


@dataclass
class _Fault:
    match: str
    code: int
    times: int
    query: str = ""  # only requests with this query parameter


@dataclass
class KubeApiStore:
    """Objects, their history for watches, and the faults to inject."""

    history: int = 10_000  # changes kept for watches; older versions get 410 Gone
    bookmark_interval: float = 1.0
    token: str = ""  # if set, requests need "Authorization: Bearer TOKEN"
    delay: float = 0.0  # seconds before every answer (a slow server)
    requests: list[Request] = field(default_factory=list)
    _objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)
    _changes: deque[_Change] = field(default_factory=deque)
    _rv: int = 1
    _oldest: int = 1  # a watch from rv >= this can be served
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _faults: list[_Fault] = field(default_factory=list)
    _expire: int = 0  # bumped to send 410 to the watches open now

    # -- reading --

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        k = BY_KIND[kind]
        with self._cond:
            obj = self._objects.get((k.plural, namespace if k.namespaced else "", name))
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str) -> list[Obj]:
        plural = BY_KIND[kind].plural
        with self._cond:
            return [
                copy.deepcopy(o) for (p, _, _), o in sorted(self._objects.items()) if p == plural
            ]

    def recorded(self, method: str, fragment: str = "") -> list[Request]:
        return [r for r in list(self.requests) if r.method == method and fragment in r.path]

    # -- writing (also used directly by tests) --

    def apply(self, obj: Obj, *, subresource: str = "") -> Obj:
        """Create the object or replace it (kind, metadata.name, metadata.namespace). A
        metadata.resourceVersion in `obj` must be the current one (409 Conflict otherwise),
        as for an update of the real server."""
        k = BY_KIND[obj["kind"]]
        meta = obj.get("metadata") or {}
        ns = (meta.get("namespace") or "default") if k.namespaced else ""
        with self._cond:
            current = self._objects.get((k.plural, ns, meta["name"]))
            wanted = meta.get("resourceVersion")
            if current is not None and wanted and wanted != current["metadata"]["resourceVersion"]:
                raise ApiStatus(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {k.plural} "{meta["name"]}": the object '
                    "has been modified; please apply your changes to the latest version",
                )
            if current is not None:
                obj = _with_subresource(k, current, obj, subresource)
        return self._write(k, ns, meta["name"], obj, "MODIFIED" if current else "ADDED")

    def create(self, obj: Obj) -> Obj:
        k = BY_KIND[obj["kind"]]
        if k.kind == "Service":
            self._allocate_cluster_ip(obj)
        meta = obj.get("metadata") or {}
        ns = (meta.get("namespace") or "default") if k.namespaced else ""
        if "name" not in meta and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            obj["metadata"] = meta
        with self._cond:
            if (k.plural, ns, meta.get("name", "")) in self._objects:
                raise ApiStatus(
                    409, "AlreadyExists", f'{k.plural} "{meta.get("name")}" already exists'
                )
        return self._write(k, ns, meta["name"], obj, "ADDED")

    def _allocate_cluster_ip(self, obj: Obj) -> None:
        """As the real server: a Service without spec.clusterIP gets one (10.96.0.0/16)."""
        spec = obj.setdefault("spec", {})
        if spec.get("clusterIP") or spec.get("type") == "ExternalName":
            return
        with self._cond:
            used = {
                o.get("spec", {}).get("clusterIP")
                for (p, _, _), o in self._objects.items()
                if p == "services"
            }
        for n in range(100, 65000):
            ip = f"10.96.{n // 256}.{n % 256}"
            if ip not in used:
                spec["clusterIP"] = ip
                spec["clusterIPs"] = [ip]
                return

    def delete(self, kind: str, namespace: str, name: str) -> Obj:
        k = BY_KIND[kind]
        return self._write(k, namespace if k.namespaced else "", name, None, "DELETED")

    def patch(
        self, kind: str, namespace: str, name: str, patch: Obj, *, subresource: str = ""
    ) -> Obj:
        k = BY_KIND[kind]
        ns = namespace if k.namespaced else ""
        with self._cond:
            current = self._objects.get((k.plural, ns, name))
            if current is None:
                raise ApiStatus(404, "NotFound", f'{k.plural} "{name}" not found')
            new = _with_subresource(k, current, merge_patch(current, patch), subresource)
        return self._write(k, ns, name, new, "MODIFIED")

    def _write(self, k: Kind, ns: str, name: str, obj: Obj | None, type_: str) -> Obj:
        with self._cond:
            key = (k.plural, ns, name)
            old = self._objects.get(key)
            if type_ != "ADDED" and old is None:
                raise ApiStatus(404, "NotFound", f'{k.plural} "{name}" not found')
            self._rv += 1
            if obj is None:
                assert old is not None
                gone = copy.deepcopy(old)
                gone["metadata"]["resourceVersion"] = str(self._rv)
                del self._objects[key]
                self._record(_Change(self._rv, k.plural, "DELETED", old, None))
                return gone
            new = copy.deepcopy(obj)
            new["kind"], new["apiVersion"] = k.kind, k.api_version
            meta = new.setdefault("metadata", {})
            meta["name"] = name
            if k.namespaced:
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            meta["resourceVersion"] = str(self._rv)
            meta["uid"] = (old or {}).get("metadata", {}).get("uid") or str(uuid.uuid4())
            if k.status_subresource:  # as for custom resources: spec changes count
                before = (old or {}).get("metadata", {}).get("generation", 0)
                changed = old is None or old.get("spec") != new.get("spec")
                meta["generation"] = before + 1 if changed else before
            meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            self._objects[key] = new
            self._record(_Change(self._rv, k.plural, type_, old, new))
            return copy.deepcopy(new)

    def _record(self, change: _Change) -> None:
        self._changes.append(change)
        while len(self._changes) > self.history:
            self._oldest = self._changes.popleft().rv
        self._cond.notify_all()

    # -- faults --

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        with self._cond:
            self._changes.clear()
            self._oldest = self._rv
            self._cond.notify_all()

    def expire_watches(self) -> None:
        """Send 410 Gone to every open watch (the server's watch cache fell behind)."""
        with self._cond:
            self.compact()
            self._expire += 1
            self._cond.notify_all()

    def fail(self, fragment: str, code: int = 500, times: int = 1, *, query: str = "") -> None:
        """Answer the next `times` requests whose path contains `fragment` (and that carry
        the query parameter `query`, if given) with `code`."""
        with self._cond:
            self._faults.append(_Fault(fragment, code, times, query))

    def _fault_for(self, path: str, query: dict[str, str]) -> int:
        with self._cond:
            for f in self._faults:
                if f.match in path and f.times > 0 and (not f.query or f.query in query):
                    f.times -= 1
                    return f.code
        return 0

    # -- lists and watches --

    def list(self, plural: str, ns: str, query: dict[str, str]) -> Obj:
        k = KINDS[plural]
        labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
        limit = int(query.get("limit") or 0)
        cont = query.get("continue", "")
        with self._cond:
            rv, after = self._rv, ""
            if cont:
                try:
                    token = json.loads(base64.urlsafe_b64decode(cont))
                    rv, after = int(token["rv"]), str(token["after"])
                except (ValueError, KeyError, TypeError):
                    raise ApiStatus(400, "BadRequest", "invalid continue token") from None
                if rv < self._oldest:
                    raise ApiStatus(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent"
                        " list result. You can start a new list without the continue parameter.",
                    )
            selected = (
                o
                for (p, ons, name), o in sorted(self._objects.items())
                if p == plural
                and (not ns or ons == ns)
                and f"{ons}/{name}" > after
                and self._matches(o, labels, fields)
            )
            # Only the page (and one more, to know whether there are more) is matched and
            # copied: a list of 10,000 objects in pages of 500 would otherwise copy every
            # later page's objects too, once per page.
            matched = list(itertools.islice(selected, limit + 1) if limit else selected)
            more = bool(limit) and len(matched) > limit
            items = [copy.deepcopy(o) for o in (matched[:limit] if more else matched)]
        meta: Obj = {"resourceVersion": str(rv)}
        if more:
            last = items[-1]["metadata"]
            after = f"{last.get('namespace', '')}/{last['name']}"
            token = json.dumps({"rv": rv, "after": after}).encode()
            meta["continue"] = base64.urlsafe_b64encode(token).decode()
        for item in items:  # list items carry no kind/apiVersion, as the real server's
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{k.kind}List",
            "apiVersion": k.api_version,
            "metadata": meta,
            "items": items,
        }

    @staticmethod
    def _matches(obj: Obj | None, labels: str, fields: str) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        return label_matches(labels, meta.get("labels") or {}) and field_matches(fields, obj)

    def watch(
        self, plural: str, ns: str, query: dict[str, str], stop: threading.Event
    ) -> Iterator[Obj]:
        """The watch events for a request, until timeoutSeconds, stop, or a 410."""
        k = KINDS[plural]
        labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        rv_text = query.get("resourceVersion", "")

        def visible(o: Obj | None) -> bool:
            if o is None:
                return False
            return (not ns or o["metadata"].get("namespace") == ns) and self._matches(
                o, labels, fields
            )

        with self._cond:
            expire = self._expire
            too_old = False
            if rv_text in ("", "0"):
                # No version: the current state as ADDED events, then the changes.
                sent = self._rv
                initial = [
                    copy.deepcopy(o)
                    for (p, _, _), o in sorted(self._objects.items())
                    if p == plural and visible(o)
                ]
            else:
                try:
                    sent = int(rv_text)
                except ValueError:
                    raise ApiStatus(
                        400, "BadRequest", f"invalid resourceVersion {rv_text!r}"
                    ) from None
                initial = []
                too_old = sent < self._oldest
            oldest = self._oldest
        if too_old:
            yield _gone(sent, oldest)
            return
        for o in initial:
            yield {"type": "ADDED", "object": o}
        next_bookmark = time.monotonic() + self.bookmark_interval
        while not stop.is_set():
            now = time.monotonic()
            if now >= deadline:
                return
            with self._cond:
                pending = [c for c in self._changes if c.rv > sent]
                if not pending and self._expire == expire and sent >= self._oldest:
                    wait = min(deadline, next_bookmark if bookmarks else deadline) - now
                    self._cond.wait(max(0.0, min(wait, 0.2)))
                    pending = [c for c in self._changes if c.rv > sent]
                # Lost history, or told to expire: the client must list again.
                too_old = self._expire != expire or (not pending and sent < self._oldest)
                oldest, current = self._oldest, self._rv
            if too_old:
                yield _gone(sent, oldest)
                return
            for c in pending:
                sent = c.rv
                if c.plural != plural:
                    continue
                event = _event_for(c, visible(c.old), visible(c.new))
                if event is not None:
                    yield event
            if bookmarks and time.monotonic() >= next_bookmark:
                next_bookmark = time.monotonic() + self.bookmark_interval
                sent = max(sent, current)
                yield {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": k.kind,
                        "apiVersion": k.api_version,
                        "metadata": {"resourceVersion": str(sent)},
                    },
                }


def _with_subresource(k: Kind, current: Obj, new: Obj, subresource: str) -> Obj:
    """What a write leaves of `new`: with a status subresource, a write to the object keeps
    the current status and a write to /status changes nothing but the status."""
    if not k.status_subresource:
        if subresource:
            raise ApiStatus(404, "NotFound", f"{k.plural} have no {subresource} subresource")
        return new
    if subresource == "status":
        kept = copy.deepcopy(current)
        if "status" in new:
            kept["status"] = new["status"]
        else:
            kept.pop("status", None)
        return kept
    new = dict(new)
    if "status" in current:
        new["status"] = current["status"]
    else:
        new.pop("status", None)
    return new


def _gone(rv: int, oldest: int) -> Obj:
    return {
        "type": "ERROR",
        "object": ApiStatus(410, "Expired", f"too old resource version: {rv} ({oldest})").status(),
    }


def _event_for(c: _Change, was: bool, now: bool) -> Obj | None:
    """A change as a selective watch sees it: leaving the selector is a deletion."""
    if was and now:
        return {"type": "MODIFIED", "object": copy.deepcopy(c.new)}
    if now:
        return {"type": "ADDED", "object": copy.deepcopy(c.new)}
    if was:
        gone = copy.deepcopy(c.new if c.new is not None else c.old)
        assert gone is not None
        gone["metadata"]["resourceVersion"] = str(c.rv)
        return {"type": "DELETED", "object": gone}
    return None


# --- the HTTP front end ------------------------------------------------------------------------


def _socket_in_netns(netns: str | None, port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 of a network namespace (None: the caller's)."""
    sock = socket_in_netns(netns, socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    return sock


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    api: KubeApiServer


class KubeApiServer:
    """One HTTP front end of a store, on 127.0.0.1 (of `netns`, if given)."""

    def __init__(
        self,
        store: KubeApiStore,
        *,
        netns: str | None = None,
        port: int = 0,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.store = store
        self.netns = netns
        self.port = port
        self.tls = tls  # (certificate, key): serve HTTPS, as a real API server does
        self._server: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._watches: set[threading.Event] = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> KubeApiServer:
        """Listen (again on the same port after a stop: an outage that ends)."""
        if self._server is not None:
            return self
        sock = _socket_in_netns(self.netns, self.port)
        self.port = sock.getsockname()[1]
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(self.tls[0]), str(self.tls[1]))
            sock = ctx.wrap_socket(sock, server_side=True)
        server = _HTTPServer(("127.0.0.1", self.port), _Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.api = self
        self.stopping = threading.Event()
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            daemon=True,
            name=f"kubeapi:{self.port}",
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection (clients see a dead server)."""
        server = self._server
        if server is None:
            return
        self._server = None
        self.stopping.set()
        server.shutdown()
        server.server_close()
        self.drop_connections()
        if self._thread is not None:
            self._thread.join(5)

    def drop_connections(self) -> None:
        """Cut every open connection abruptly (watch streams end without their last chunk)."""
        with self._lock:
            conns = list(self._conns)
            for ended in self._watches:
                ended.set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def __enter__(self) -> KubeApiServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def kubeconfig(self, path: Path, *, token: str = "") -> Path:
        """Write a kubeconfig pointing at this front end."""
        return write_kubeconfig(path, self.url, token=token or self.store.token)


def write_kubeconfig(path: Path, server: str, *, token: str = "") -> Path:
    user: Obj = {"token": token} if token else {}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests assert on store.requests instead

    def setup(self) -> None:
        super().setup()
        self.server.api._track(self.connection, True)

    def finish(self) -> None:
        self.server.api._track(self.connection, False)
        with contextlib.suppress(OSError):
            super().finish()

    # -- plumbing --

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiStatus(400, "BadRequest", "the body is not JSON") from None

    def _send(self, code: int, obj: Obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        api = self.server.api
        store = api.store
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        try:
            body = self._body() if method in ("POST", "PUT", "PATCH") else None
            store.requests.append(
                Request(method, url.path, query, body, self.headers.get("Content-Type", ""))
            )
            if store.delay:
                time.sleep(store.delay)
            if store.token and self.headers.get("Authorization") != f"Bearer {store.token}":
                raise ApiStatus(401, "Unauthorized", "Unauthorized")
            code = store._fault_for(url.path, query)
            if code == 410:
                raise ApiStatus(410, "Expired", "injected: the resource version is too old")
            if code:
                raise ApiStatus(code, "InternalError" if code >= 500 else "Injected", "injected")
            if url.path in ("/version", "/healthz", "/readyz"):
                self._send(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-kproxy-test"})
                return
            m = _PATH.match(url.path)
            if m is None or m["plural"] not in KINDS:
                raise ApiStatus(404, "NotFound", f"the server could not find {url.path}")
            k = KINDS[m["plural"]]
            if m["group"] != k.group_path:
                raise ApiStatus(404, "NotFound", f"the server could not find {url.path}")
            ns, name = m["ns"] or "", m["name"]
            self._dispatch(method, k, ns, name, query, body, "status" if m["status"] else "")
        except ApiStatus as err:
            self._send(err.code, err.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _dispatch(
        self,
        method: str,
        k: Kind,
        ns: str,
        name: str | None,
        query: dict[str, str],
        body: Any,
        subresource: str = "",
    ) -> None:
        store = self.server.api.store
        if name is None:
            if method == "GET":
                if query.get("watch") in ("true", "1"):
                    self._watch(k, ns, query)
                else:
                    self._send(200, store.list(k.plural, ns, query))
                return
            if method == "POST":
                obj = self._object(k, ns, body)
                self._send(201, store.create(obj))
                return
        else:
            ns_for = ns if k.namespaced else ""
            if method == "GET":
                obj = store.get(k.kind, ns_for, name)
                if obj is None:
                    raise ApiStatus(404, "NotFound", f'{k.plural} "{name}" not found')
                self._send(200, obj)
                return
            if method == "PUT":
                obj = self._object(k, ns, body)
                if store.get(k.kind, ns_for, name) is None:
                    raise ApiStatus(404, "NotFound", f'{k.plural} "{name}" not found')
                self._send(200, store.apply(obj, subresource=subresource))
                return
            if method == "PATCH":
                ctype = self.headers.get("Content-Type", "")
                if ctype not in (
                    "application/merge-patch+json",
                    "application/strategic-merge-patch+json",
                ):
                    raise ApiStatus(415, "UnsupportedMediaType", f"unsupported patch type {ctype}")
                if not isinstance(body, dict):
                    raise ApiStatus(400, "BadRequest", "a merge patch must be an object")
                self._send(200, store.patch(k.kind, ns_for, name, body, subresource=subresource))
                return
            if method == "DELETE":
                self._send(200, store.delete(k.kind, ns_for, name))
                return
        raise ApiStatus(405, "MethodNotAllowed", f"{method} is not allowed here")

    @staticmethod
    def _object(k: Kind, ns: str, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise ApiStatus(400, "BadRequest", "the body must be an object")
        obj = dict(body)
        obj["kind"] = obj.get("kind") or k.kind
        meta = dict(obj.get("metadata") or {})
        if k.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise ApiStatus(400, "BadRequest", "the namespace of the object does not match")
            meta["namespace"] = ns or meta.get("namespace") or "default"
        if not meta.get("name") and not meta.get("generateName"):
            raise ApiStatus(422, "Invalid", "metadata.name: Required value")
        obj["metadata"] = meta
        return obj

    def _watch(self, k: Kind, ns: str, query: dict[str, str]) -> None:
        api = self.server.api
        # Bad parameters are answered before the stream starts, as a plain error.
        rv = query.get("resourceVersion", "")
        if rv and not rv.isdigit():
            raise ApiStatus(400, "BadRequest", f"invalid resourceVersion {rv!r}")
        field_matches(query.get("fieldSelector", ""), {"metadata": {}})
        ended = threading.Event()
        with api._lock:
            api._watches.add(ended)
        try:
            self._stream(api.store.watch(k.plural, ns, query, ended), ended)
        finally:
            with api._lock:
                api._watches.discard(ended)

    def _stream(self, events: Iterator[Obj], ended: threading.Event) -> None:
        api = self.server.api
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for event in events:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            if api.stopping.is_set() or ended.is_set():
                self.close_connection = True  # cut: no last chunk
            else:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")
