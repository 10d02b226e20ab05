"""The admin endpoint of a running proxy: a root-only unix socket speaking JSON lines.

One request per connection: {"op": "status"} or {"op": "switch", "to": "nftables",
"timeout": 30} and so on; one JSON answer back. Unix socket permissions (0600, owned by
root) are the authentication, as for other node daemons' admin sockets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("kproxy.admin")

SOCKET_NAME = "admin.sock"
MAX_REQUEST = 64 * 1024

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class AdminServer:
    def __init__(self, path: Path, handlers: dict[str, Handler]) -> None:
        self.path = path
        self.handlers = handlers
        self._server: socketserver.ThreadingUnixStreamServer | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale socket from a killed process
        handlers = self.handlers

        class Conn(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(MAX_REQUEST)
                try:
                    request = json.loads(line)
                    op = request.get("op")
                    handler = handlers.get(op)
                    if handler is None:
                        answer = {
                            "ok": False,
                            "error": f"unknown op {op!r}; known: {', '.join(sorted(handlers))}",
                        }
                    else:
                        answer = handler(request)
                except ValueError as err:
                    answer = {"ok": False, "error": f"bad request: {err}"}
                except Exception as err:  # report, never kill the server
                    log.exception("admin request failed")
                    answer = {"ok": False, "error": f"{type(err).__name__}: {err}"}
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        old_umask = os.umask(0o177)  # the socket is created 0600: root only
        try:
            server = socketserver.ThreadingUnixStreamServer(str(self.path), Conn)
        finally:
            os.umask(old_umask)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, name="admin", daemon=True).start()
        log.info("admin endpoint on %s", self.path)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with contextlib.suppress(OSError):
                self.path.unlink()


class AdminUnavailable(Exception):
    """No proxy answers on that socket."""


def call(path: Path, request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """Send one request to a running proxy and return its answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
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
            f"nothing listens on {path} (a stale socket: kproxy is not running)"
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
