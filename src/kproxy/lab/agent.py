"""Probe agent: a long-running traffic generator inside one lab namespace.

Run as `ip netns exec NS python -m kproxy.lab.agent`. It speaks JSON lines: every request on
stdin is `{"id": N, "op": ..., ...}` and gets exactly one answer on stdout,
`{"id": N, "result": ...}` or `{"id": N, "fail": "message"}` for a malformed request.
Requests run concurrently, so answers may come back out of order; the id pairs them up.
One process per namespace lets tests send thousands of probes without paying a process
start (about 50 ms of Python start-up) per probe.

Operations:
- request:      proto tcp|udp, dst, port, timeout, optional sport -> probe result
- request_many: the same plus count and concurrency -> list of probe results
- open_stream:  proto tcp, dst, port, timeout, optional sport -> {"stream": id} or a result
- stream_ping:  stream, timeout -> probe result (sends one line, reads the answer)
- close_stream: stream -> {}
- ping:         -> {"pong": true}

A probe result is {"ok", "pod", "peer", "error", "elapsed", "local_port"}; "pod" and "peer"
come from the pod server's "<pod> <peer ip>" reply. error is one of "refused", "timeout",
"unreachable", "reset", "closed", "bad reply: ..." or another short description.

The second half of this module is the client side (ProbeAgent, ProbeResult), which the lab
uses to drive an agent; both ends of the protocol live here so they change together.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

PAYLOAD = b"hello\n"
PING = b"ping\n"
MAX_LINE = 4096


def classify_error(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, 'errno')}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def result(
    ok: bool,
    started: float,
    pod: str | None = None,
    peer: str | None = None,
    error: str | None = None,
    local_port: int | None = None,
) -> dict[str, Any]:
    return {
        "ok": ok,
        "pod": pod,
        "peer": peer,
        "error": error,
        "elapsed": time.perf_counter() - started,
        "local_port": local_port,
    }


def parse_reply(line: bytes, started: float, local_port: int | None) -> dict[str, Any]:
    parts = line.decode(errors="replace").split()
    if len(parts) != 2:
        return result(False, started, error=f"bad reply: {line[:80]!r}", local_port=local_port)
    return result(True, started, pod=parts[0], peer=parts[1], local_port=local_port)


class LineSocket:
    """Buffered line reads on a non-blocking socket, without asyncio stream overhead."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self._recv: asyncio.Task[bytes] | None = None

    async def readline(self) -> bytes:
        loop = asyncio.get_running_loop()
        while b"\n" not in self.buf:
            if self._recv is None:
                self._recv = loop.create_task(loop.sock_recv(self.sock, MAX_LINE))
            # A timeout cancels this wait, never the receive: a cancelled sock_recv can drop
            # bytes it already took from the socket (the answer arrived as the timeout fired),
            # which would leave a stream one answer short forever. The next call takes them.
            chunk = await asyncio.shield(self._recv)
            self._recv = None
            if not chunk:
                line, self.buf = self.buf, b""
                return line
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise ValueError("reply line too long")
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"

    def close(self) -> None:
        """Stop a receive still pending, then close the socket."""
        if self._recv is not None:
            self._recv.cancel()
            self._recv = None
        self.sock.close()


def _new_socket(proto: str, sport: int | None) -> socket.socket:
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(socket.AF_INET, kind)
    sock.setblocking(False)
    if sport:
        # Fixed source ports are reused on purpose (conntrack tests); TIME_WAIT must not block.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", sport))
    return sock


async def request(
    proto: str, dst: str, port: int, timeout: float, sport: int | None = None
) -> dict[str, Any]:
    if proto not in ("tcp", "udp"):
        raise ValueError(f"unknown proto {proto!r}")
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    local_port: int | None = None
    lines: LineSocket | None = None
    try:
        sock = _new_socket(proto, sport)
    except OSError as exc:
        return result(False, started, error=classify_error(exc))
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    await loop.sock_connect(sock, (dst, port))
                    break
                except OSError as exc:
                    # The same fixed source port's last connection may still be closing
                    # (its four-tuple taken until the peer's FIN): wait for it.
                    if not sport or exc.errno != errno.EADDRNOTAVAIL:
                        raise
                    sock.close()
                    await asyncio.sleep(0.02)
                    sock = _new_socket(proto, sport)
            local_port = sock.getsockname()[1]
            await loop.sock_sendall(sock, PAYLOAD)
            if proto == "udp":
                line = await loop.sock_recv(sock, MAX_LINE)
            else:
                lines = LineSocket(sock)
                line = await lines.readline()
        if not line:
            return result(False, started, error="closed", local_port=local_port)
        return parse_reply(line, started, local_port)
    except (OSError, ValueError) as exc:
        return result(False, started, error=classify_error(exc), local_port=local_port)
    finally:
        if lines is not None:
            lines.close()
        else:
            sock.close()


async def request_many(
    proto: str,
    dst: str,
    port: int,
    timeout: float,
    count: int,
    concurrency: int = 1,
    sport: int | None = None,
) -> list[dict[str, Any]]:
    limit = asyncio.Semaphore(max(1, concurrency))

    async def one() -> dict[str, Any]:
        async with limit:
            return await request(proto, dst, port, timeout, sport)

    return list(await asyncio.gather(*(one() for _ in range(count))))


@dataclass
class Stream:
    sock: socket.socket
    lines: LineSocket
    local_port: int
    # Answers still in flight from pings that timed out; they are skipped, not mistaken for
    # the answer to a later ping.
    owed: int = 0
    dead: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Agent:
    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}
        self._ids = itertools.count(1)

    async def open_stream(
        self, dst: str, port: int, timeout: float, sport: int | None = None, proto: str = "tcp"
    ) -> dict[str, Any]:
        if proto != "tcp":
            raise ValueError("streams are TCP only")
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            sock = _new_socket("tcp", sport)
        except OSError as exc:
            return result(False, started, error=classify_error(exc))
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, (dst, port))
        except OSError as exc:
            sock.close()
            return result(False, started, error=classify_error(exc))
        stream_id = f"s{next(self._ids)}"
        self.streams[stream_id] = Stream(sock, LineSocket(sock), sock.getsockname()[1])
        return {"stream": stream_id, "local_port": sock.getsockname()[1]}

    async def stream_ping(self, stream: str, timeout: float) -> dict[str, Any]:
        started = time.perf_counter()
        st = self.streams.get(stream)
        if st is None:
            raise ValueError(f"unknown stream {stream!r}")
        async with st.lock:
            if st.dead:
                return result(False, started, error=st.dead, local_port=st.local_port)
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(timeout):
                    st.owed += 1
                    await loop.sock_sendall(st.sock, PING)
                    line = b""
                    while st.owed:
                        line = await st.lines.readline()
                        if not line:
                            st.dead = "closed"
                            return result(False, started, error="closed", local_port=st.local_port)
                        st.owed -= 1
            except (OSError, ValueError) as exc:
                error = classify_error(exc)
                if error != "timeout":
                    st.dead = error
                return result(False, started, error=error, local_port=st.local_port)
            return parse_reply(line, started, st.local_port)

    def close_stream(self, stream: str) -> dict[str, Any]:
        st = self.streams.pop(stream, None)
        if st is not None:
            st.lines.close()
        return {}

    def close_all(self) -> None:
        for stream_id in list(self.streams):
            self.close_stream(stream_id)

    async def dispatch(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        args = {k: v for k, v in msg.items() if k not in ("id", "op")}
        if op == "request":
            return await request(**args)
        if op == "request_many":
            return await request_many(**args)
        if op == "open_stream":
            return await self.open_stream(**args)
        if op == "stream_ping":
            return await self.stream_ping(**args)
        if op == "close_stream":
            return self.close_stream(**args)
        if op == "ping":
            return {"pong": True}
        raise ValueError(f"unknown op {op!r}")


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _handle(agent: Agent, raw: bytes) -> None:
    msg_id: Any = None
    try:
        msg = json.loads(raw)
        msg_id = msg.get("id")
        _emit({"id": msg_id, "result": await agent.dispatch(msg)})
    except Exception as exc:  # a bad request must not kill the agent
        _emit({"id": msg_id, "fail": f"{type(exc).__name__}: {exc}"})


async def serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    agent = Agent()
    tasks: set[asyncio.Task[None]] = set()
    _emit({"ready": True})
    while raw := await reader.readline():
        if not raw.strip():
            continue
        task = asyncio.create_task(_handle(agent, raw))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    # stdin closed: the controlling test is gone or done.
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)
    agent.close_all()


# --------------------------------------------------------------------------------------
# Client side: used by the lab (and tests) to drive an agent process.


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    pod: str | None
    peer: str | None
    error: str | None
    elapsed: float
    # The client-side port, so tests can look the connection up in conntrack.
    local_port: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(
            ok=bool(data["ok"]),
            pod=data.get("pod"),
            peer=data.get("peer"),
            error=data.get("error"),
            elapsed=float(data.get("elapsed", 0.0)),
            local_port=data.get("local_port"),
        )


class ProbeError(RuntimeError):
    """The agent refused a request, died, or a stream could not be opened."""

    def __init__(self, message: str, result: ProbeResult | None = None) -> None:
        super().__init__(message)
        self.result = result


# Slack on top of a probe's own timeout before the client gives up on the agent itself.
CALL_SLACK = 10.0


class ProbeAgent:
    """Thread-safe handle on one agent process; calls from several threads run concurrently."""

    def __init__(self, proc: subprocess.Popen[str], ns: str, start_timeout: float = 15.0) -> None:
        if proc.stdin is None or proc.stdout is None:
            raise ValueError("agent process needs stdin and stdout pipes")
        self.proc = proc
        self.ns = ns
        self._stdin = proc.stdin
        self._stdout = proc.stdout
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name=f"probe-{ns}", daemon=True)
        self._reader.start()
        if not self._ready.wait(start_timeout) or self._dead:
            self.close()
            raise ProbeError(f"agent in {ns} did not start: {self._dead or 'no ready line'}")

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    def _read_loop(self) -> None:
        try:
            for line in self._stdout:
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if msg.get("ready"):
                    self._ready.set()
                    continue
                with self._lock:
                    fut = self._pending.pop(msg.get("id"), None)
                if fut is None:
                    continue
                if "fail" in msg:
                    fut.set_exception(ProbeError(f"agent in {self.ns}: {msg['fail']}"))
                else:
                    fut.set_result(msg.get("result"))
        except (OSError, ValueError):
            pass
        with self._lock:
            self._dead = self._dead or f"agent exited (rc={self.proc.poll()})"
            pending, self._pending = self._pending, {}
        self._ready.set()
        for fut in pending.values():
            fut.set_exception(ProbeError(f"agent in {self.ns}: {self._dead}"))

    def _call(self, op: str, wait: float, **args: Any) -> Any:
        fut: Future[Any] = Future()
        with self._lock:
            if self._dead:
                raise ProbeError(f"agent in {self.ns}: {self._dead}")
            msg_id = next(self._ids)
            self._pending[msg_id] = fut
            try:
                self._stdin.write(json.dumps({"id": msg_id, "op": op, **args}) + "\n")
                self._stdin.flush()
            except (OSError, ValueError) as exc:
                self._pending.pop(msg_id, None)
                raise ProbeError(f"agent in {self.ns}: cannot send: {exc}") from exc
        try:
            return fut.result(timeout=wait)
        except FutureTimeout as exc:
            with self._lock:
                self._pending.pop(msg_id, None)
            raise ProbeError(f"agent in {self.ns}: no answer to {op} within {wait:.1f}s") from exc

    def ping(self) -> bool:
        return bool(self._call("ping", CALL_SLACK).get("pong"))

    def request(
        self, proto: str, dst: str, port: int, timeout: float = 1.0, sport: int | None = None
    ) -> ProbeResult:
        data = self._call(
            "request",
            timeout + CALL_SLACK,
            proto=proto,
            dst=dst,
            port=port,
            timeout=timeout,
            sport=sport,
        )
        return ProbeResult.from_dict(data)

    def request_many(
        self,
        proto: str,
        dst: str,
        port: int,
        count: int,
        concurrency: int = 1,
        timeout: float = 1.0,
        sport: int | None = None,
    ) -> list[ProbeResult]:
        rounds = -(-count // max(1, concurrency))
        data = self._call(
            "request_many",
            rounds * timeout + CALL_SLACK,
            proto=proto,
            dst=dst,
            port=port,
            timeout=timeout,
            count=count,
            concurrency=concurrency,
            sport=sport,
        )
        return [ProbeResult.from_dict(item) for item in data]

    def open_stream(
        self, dst: str, port: int, timeout: float = 1.0, sport: int | None = None
    ) -> str:
        data = self._call(
            "open_stream", timeout + CALL_SLACK, dst=dst, port=port, timeout=timeout, sport=sport
        )
        if "stream" not in data:
            res = ProbeResult.from_dict(data)
            raise ProbeError(f"open_stream to {dst}:{port} failed: {res.error}", res)
        return str(data["stream"])

    def stream_ping(self, stream_id: str, timeout: float = 1.0) -> ProbeResult:
        data = self._call("stream_ping", timeout + CALL_SLACK, stream=stream_id, timeout=timeout)
        return ProbeResult.from_dict(data)

    def close_stream(self, stream_id: str) -> None:
        self._call("close_stream", CALL_SLACK, stream=stream_id)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the agent: EOF on stdin first (clean exit), then SIGKILL by PID if needed."""
        with self._lock:
            self._dead = self._dead or "closed"
            with contextlib.suppress(OSError, ValueError):
                self._stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout)
        with contextlib.suppress(OSError, ValueError):
            self._stdout.close()


def main() -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
