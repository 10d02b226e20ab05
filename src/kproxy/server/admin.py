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
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kproxy.text import one_line

log = logging.getLogger("kproxy.admin")

SOCKET_NAME = "admin.sock"
TOKEN_NAME = "admin.token"
MAX_REQUEST = 64 * 1024  # bytes of one request line
READ_TIMEOUT = 10.0  # seconds a client has to send its whole request line
WRITE_TIMEOUT = 10.0  # seconds an answer may take to be taken
DRAIN_TIMEOUT = 1.0  # seconds a client has to close its side after the answer
BUSY_DRAIN = 0.2  # the same for a client refused as "busy"
MAX_CONNECTIONS = 32  # connections served at once, per server
MAX_ANSWER = 64 * 1024 * 1024  # bytes a client reads of an answer (a status is ~100 KiB)

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


class BadRequest(ValueError):
    """A request that cannot be read or is not one JSON object; answered, never raised on."""


def read_request(sock: socket.socket, deadline: float) -> bytes:
    """The request line's bytes (without its newline), read until the newline or until the
    client closes its side; BadRequest when it is longer than MAX_REQUEST or not complete by
    `deadline` (time.monotonic()), so a slow or silent client cannot hold its thread."""
    data = bytearray()
    while True:
        end = data.find(b"\n")
        if end >= 0:
            data = data[:end]
            break
        if len(data) > MAX_REQUEST:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BadRequest(f"no complete request line within {READ_TIMEOUT:.0f} s")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(MAX_REQUEST + 1 - len(data))
        except TimeoutError:
            raise BadRequest(f"no complete request line within {READ_TIMEOUT:.0f} s") from None
        if not chunk:
            break  # the client closed its side: what it sent is the request
        data += chunk
    if len(data) > MAX_REQUEST:
        raise BadRequest(f"longer than {MAX_REQUEST} bytes")
    return bytes(data)


def decode_request(data: bytes) -> dict[str, Any]:
    """One JSON object from the request's bytes; BadRequest saying what is wrong."""
    if not data.strip():
        raise BadRequest("empty request; send one JSON object on one line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"not UTF-8 (byte {err.start})") from None
    try:
        request = json.loads(text)
    except RecursionError:
        raise BadRequest("JSON nested too deeply") from None
    except ValueError as err:
        raise BadRequest(f"not JSON: {err}") from None
    if not isinstance(request, dict):
        raise BadRequest("a request is a JSON object")
    return request


def token_matches(given: object, token: bytes) -> bool:
    """Whether a request's token is the secret, compared in constant time on bytes (any
    text, also non-ASCII or a lone surrogate, is compared, never raised on)."""
    candidate = given.encode("utf-8", "surrogatepass") if isinstance(given, str) else b""
    return hmac.compare_digest(candidate, token)


def _handler_class(handlers: dict[str, Handler], token: str | None) -> type:
    """One request per connection; with a token, only requests that carry it."""
    secret = token.encode() if token is not None else None

    class Conn(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            try:
                request = decode_request(
                    read_request(self.request, time.monotonic() + READ_TIMEOUT)
                )
                given = request.pop("token", None)
                if secret is not None and not token_matches(given, secret):
                    answer = {
                        "ok": False,
                        "error": f"unauthorized: the TCP admin endpoint needs the token in "
                        f"the state dir's {TOKEN_NAME}",
                    }
                else:
                    answer = _answer(handlers, request)
            except BadRequest as err:
                answer = {"ok": False, "error": f"bad request: {err}"}
            except OSError as err:  # the client went away: nobody to answer
                log.debug("admin request not read: %s", err)
                return
            try:
                self.request.settimeout(WRITE_TIMEOUT)
                self.request.sendall(json.dumps(answer).encode() + b"\n")
                _drain(self.request, DRAIN_TIMEOUT)
            except OSError as err:
                log.debug("admin answer not delivered: %s", err)

    return Conn


def _drain(sock: socket.socket, timeout: float) -> None:
    """End our side, then read (bounded) what the client still sends: closing a socket with
    unread input resets the connection, and a reset can lose the answer on its way."""
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(timeout)
    left = MAX_REQUEST * 16
    while left > 0 and (chunk := sock.recv(65536)):
        left -= len(chunk)


def _answer(handlers: dict[str, Handler], request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    handler = handlers.get(op) if isinstance(op, str) else None
    if handler is None:
        shown = repr(op)[:80]  # repr: printable, one line
        return {"ok": False, "error": f"unknown op {shown}; known: {', '.join(sorted(handlers))}"}
    try:
        return handler(request)
    except ValueError as err:
        return {"ok": False, "error": f"bad request: {one_line(err, limit=500)}"}
    except Exception as err:  # a bug in a handler: reported, and the server keeps serving
        log.exception("admin request %s failed", op)
        return {"ok": False, "error": f"{type(err).__name__}: {one_line(err, limit=500)}"}


class _Served:
    """What both admin servers share: a bounded number of connections at once (a further
    one is answered "busy" at once), and a failed connection logged in one line, not as
    socketserver's traceback on stderr."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            # Answered here, in the accepting thread: no thread for it, and a flood of
            # connections is slowed to BUSY_DRAIN each.
            with contextlib.suppress(OSError):
                request.settimeout(BUSY_DRAIN)
                request.sendall(_BUSY)
                _drain(request, BUSY_DRAIN)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        super().process_request(request, client_address)  # type: ignore[misc]

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        log.warning("admin connection failed: %s", one_line(f"{type(err).__name__}: {err}"))


_BUSY = (
    json.dumps({"ok": False, "error": "busy: too many admin connections at once; try again"}) + "\n"
).encode()


class _LoopbackServer(_Served, socketserver.ThreadingTCPServer):
    allow_reuse_address = True


class _Loopback6Server(_LoopbackServer):
    address_family = socket.AF_INET6


class _UnixServer(_Served, socketserver.ThreadingUnixStreamServer):
    pass


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
            unix = _UnixServer(str(self.path), _handler_class(self.handlers, None))
            if self.tcp_address is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.token_path.unlink()
                fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(token + "\n")
        finally:
            os.umask(old_umask)
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
            token = path.read_bytes().decode("ascii").strip()
        except UnicodeDecodeError:
            raise ValueError(
                f"the admin token {path} is not the token kproxy run wrote (not ASCII text)"
            ) from None
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
            # It may answer (and close) before reading, e.g. "busy": read that answer.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n") and len(data) <= MAX_ANSWER:
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
    except OSError as err:  # reset, unreachable, ...
        raise AdminUnavailable(f"cannot ask kproxy on {path}: {err.strerror or err}") from None
    if not data:
        raise AdminUnavailable(f"kproxy closed {path} without answering")
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        shown = one_line(data[:200].decode("utf-8", "replace"))
        raise AdminUnavailable(f"{path} answered something that is not kproxy's: {shown!r}")
    return answer
