"""The admin endpoint of a running proxy: a root-only unix socket speaking JSON lines.

One request per connection: {"op": "status"} or {"op": "switch", "to": "nftables",
"timeout": 30} and so on; one JSON answer back. Unix socket permissions (0600, owned by
root) are the authentication, as for other node daemons' admin sockets.

Optionally (`kproxy run --admin-address 127.0.0.1:PORT`) the same requests are served on a
loopback TCP port, for tools that cannot reach the socket (a sidecar sharing the node's
network namespace, say). TCP has no file permission to lean on, so every request there
carries a token: a random secret the proxy writes at start to admin.token in its state
dir (0600, root only), handed to whoever may switch the node's mode. Only loopback
addresses are accepted: the endpoint never listens where another machine can reach it.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kproxy.admin")

SOCKET_NAME = "admin.sock"
TOKEN_NAME = "admin.token"
MAX_REQUEST = 64 * 1024

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def parse_admin_address(text: str) -> tuple[str, int]:
    """`--admin-address`: a loopback IP and a port ("127.0.0.1:10259", "[::1]:10259").
    ValueError naming what is wrong."""
    host, sep, port_text = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host:
        raise ValueError(f"{text!r} is not IP:PORT (e.g. 127.0.0.1:10259)")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (e.g. 127.0.0.1:10259)") from None
    if not ip.is_loopback:
        raise ValueError(
            f"{host} is not a loopback address: the admin endpoint switches the node's "
            "dataplane and only listens where no other machine can reach it"
        )
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"{port_text!r} is not a port (1-65535)")
    return str(ip), port


def _handler_class(handlers: dict[str, Handler], token: str | None) -> type:
    """One request per connection; with a token, only requests that carry it."""

    class Conn(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline(MAX_REQUEST)
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("a request is a JSON object")
                given = request.pop("token", None)
                if token is not None and not (
                    isinstance(given, str) and hmac.compare_digest(given, token)
                ):
                    answer = {
                        "ok": False,
                        "error": f"unauthorized: the TCP admin endpoint needs the token in "
                        f"the state dir's {TOKEN_NAME}",
                    }
                else:
                    answer = _answer(handlers, request)
            except ValueError as err:
                answer = {"ok": False, "error": f"bad request: {err}"}
            self.wfile.write(json.dumps(answer).encode() + b"\n")

    return Conn


def _answer(handlers: dict[str, Handler], request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    handler = handlers.get(op) if isinstance(op, str) else None
    if handler is None:
        return {"ok": False, "error": f"unknown op {op!r}; known: {', '.join(sorted(handlers))}"}
    try:
        return handler(request)
    except ValueError as err:
        return {"ok": False, "error": f"bad request: {err}"}
    except Exception as err:  # report, never kill the server
        log.exception("admin request failed")
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}


class _LoopbackServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class _Loopback6Server(_LoopbackServer):
    address_family = socket.AF_INET6


class AdminServer:
    def __init__(
        self,
        path: Path,
        handlers: dict[str, Handler],
        tcp_address: tuple[str, int] | None = None,
    ) -> None:
        self.path = path
        self.handlers = handlers
        self.tcp_address = tcp_address
        self._servers: list[socketserver.BaseServer] = []

    @property
    def token_path(self) -> Path:
        return self.path.parent / TOKEN_NAME

    @property
    def tcp_bound(self) -> tuple[str, int] | None:
        """The TCP address listened on (its port, when port 0 was asked for), once started."""
        for srv in self._servers:
            if isinstance(srv, socketserver.TCPServer):
                host, port = srv.server_address[:2]
                return str(host), int(port)
        return None

    def start(self) -> None:
        """Raises AdminBindError when the TCP address cannot be listened on."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.tcp_address is not None:
            # A new secret every start: a token handed out before goes stale with it.
            token = secrets.token_hex(32)
            cls = _Loopback6Server if ":" in self.tcp_address[0] else _LoopbackServer
            try:
                self._servers.append(cls(self.tcp_address, _handler_class(self.handlers, token)))
            except OSError as err:
                host, port = self.tcp_address
                raise AdminBindError(
                    f"--admin-address {host}:{port}: cannot listen there: {err.strerror or err}"
                ) from None
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale socket from a killed process
        old_umask = os.umask(0o177)  # the socket and the token are created 0600: root only
        try:
            unix = socketserver.ThreadingUnixStreamServer(
                str(self.path), _handler_class(self.handlers, None)
            )
            if self.tcp_address is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.token_path.unlink()
                fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(token + "\n")
        finally:
            os.umask(old_umask)
        unix.daemon_threads = True
        self._servers.append(unix)
        for srv in self._servers:
            threading.Thread(target=srv.serve_forever, name="admin", daemon=True).start()
        log.info(
            "admin endpoint on %s%s",
            self.path,
            f" and tcp {self.tcp_address[0]}:{self.tcp_address[1]} (token in {self.token_path})"
            if self.tcp_address
            else "",
        )

    def stop(self) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        self._servers.clear()
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self.tcp_address is not None:
            with contextlib.suppress(OSError):
                self.token_path.unlink()


class AdminBindError(RuntimeError):
    """The TCP admin address cannot be listened on (taken, or not an address of this node)."""


class AdminUnavailable(Exception):
    """No proxy answers on that socket."""


@dataclass(frozen=True)
class AdminTarget:
    """Where a running proxy answers: its unix socket, or its loopback TCP port and token."""

    socket: Path | None = None
    address: tuple[str, int] | None = None
    token: str | None = None

    @classmethod
    def of(
        cls, state_dir: Path, address: str | None = None, token_file: Path | None = None
    ) -> AdminTarget:
        """The state dir's socket; with `address`, TCP with the token from token_file (default:
        the state dir's admin.token). ValueError naming the bad address or unreadable token."""
        if not address:
            return cls(socket=state_dir / SOCKET_NAME)
        where = parse_admin_address(address)
        path = token_file or state_dir / TOKEN_NAME
        try:
            token = path.read_text().strip()
        except OSError as err:
            raise ValueError(
                f"cannot read the admin token {path}: {err.strerror or err} (kproxy run writes "
                "it when started with --admin-address; give --admin-token-file)"
            ) from None
        return cls(address=where, token=token)

    def describe(self) -> str:
        if self.address is not None:
            return f"tcp {self.address[0]}:{self.address[1]}"
        return str(self.socket)


def _connect(target: AdminTarget, timeout: float) -> socket.socket:
    if target.address is not None:
        return socket.create_connection(target.address, timeout=timeout)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(str(target.socket))
    except BaseException:
        s.close()
        raise
    return s


def call(
    target: Path | AdminTarget, request: dict[str, Any], timeout: float = 120.0
) -> dict[str, Any]:
    """Send one request to a running proxy and return its answer (target: its unix socket's
    path, or an AdminTarget)."""
    if isinstance(target, Path):
        target = AdminTarget(socket=target)
    path = target.describe()
    if target.token is not None:
        request = {**request, "token": target.token}
    try:
        with _connect(target, timeout) as s:
            s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except FileNotFoundError:
        raise AdminUnavailable(
            f"no kproxy admin socket at {path} (is kproxy running with this --state-dir?)"
        ) from None
    except ConnectionRefusedError:
        raise AdminUnavailable(
            f"nothing listens on {path}"
            + ("" if target.address else " (a stale socket: kproxy is not running)")
        ) from None
    except PermissionError:
        raise AdminUnavailable(
            f"permission denied on {path}: the admin socket is root-only"
        ) from None
    except TimeoutError:
        raise AdminUnavailable(f"kproxy did not answer on {path} within {timeout:.0f} s") from None
    if not data:
        raise AdminUnavailable(f"kproxy closed {path} without answering")
    return json.loads(data)
