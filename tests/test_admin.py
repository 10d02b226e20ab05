"""The admin endpoint without a kernel: the unix socket, and the optional loopback TCP
endpoint whose requests must carry the token the proxy wrote to its state dir."""

from __future__ import annotations

import json
import socket
import stat
import threading
import time
import types
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.daemon import Daemon
from kproxy.server import admin
from kproxy.server.admin import (
    SOCKET_NAME,
    TOKEN_NAME,
    AdminBindError,
    AdminServer,
    AdminTarget,
    AdminUnavailable,
    call,
    parse_admin_address,
    token_matches,
)


def handlers(seen: list[dict[str, Any]]) -> dict[str, Any]:
    def status(request: dict[str, Any]) -> dict[str, Any]:
        seen.append(request)
        return {"ok": True, "mode": "iptables"}

    def broken(_: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("boom")

    return {"status": status, "broken": broken}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[AdminServer, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    srv = AdminServer(tmp_path / SOCKET_NAME, handlers(seen), tcp_address=("127.0.0.1", 0))
    srv.start()
    try:
        yield srv, seen
    finally:
        srv.stop()


def tcp_target(srv: AdminServer, token: str | None) -> AdminTarget:
    assert srv.tcp_bound is not None
    return AdminTarget(address=srv.tcp_bound, token=token)


def test_the_unix_socket_needs_no_token_and_reports_handler_failures(
    server: tuple[AdminServer, list[dict[str, Any]]],
) -> None:
    srv, _ = server
    assert call(srv.path, {"op": "status"}) == {"ok": True, "mode": "iptables"}
    assert stat.S_IMODE(srv.path.stat().st_mode) == 0o600
    broken = call(srv.path, {"op": "broken"})
    assert broken == {"ok": False, "error": "RuntimeError: boom"}
    unknown = call(srv.path, {"op": "nope"})
    assert not unknown["ok"] and "known: broken, status" in unknown["error"]


def test_tcp_requests_need_the_token_from_the_state_dir(
    server: tuple[AdminServer, list[dict[str, Any]]],
) -> None:
    srv, seen = server
    token_file = srv.path.parent / TOKEN_NAME
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) == 64
    for wrong in (None, "", "x" * 64):
        answer = call(tcp_target(srv, wrong), {"op": "status"})
        assert not answer["ok"] and answer["error"].startswith("unauthorized"), wrong
    assert seen == []  # refused before any handler ran
    host, port = srv.tcp_bound  # type: ignore[misc]
    target = AdminTarget.of(srv.path.parent, f"{host}:{port}")
    assert target.token == token
    assert call(target, {"op": "status"}) == {"ok": True, "mode": "iptables"}
    assert seen == [{"op": "status"}]  # the token is not handed on


def test_a_request_that_is_no_json_object_is_a_bad_request(
    server: tuple[AdminServer, list[dict[str, Any]]],
) -> None:
    srv, _ = server
    with socket.create_connection(srv.tcp_bound) as s:  # type: ignore[arg-type]
        s.sendall(b"[1, 2]\n")
        answer = json.loads(s.makefile().readline())
    assert answer == {"ok": False, "error": "bad request: a request is a JSON object"}


def exchange(address: Any, data: bytes, *, close: bool = True, timeout: float = 5.0) -> Any:
    """Send `data` (then close our side unless told not to) and read the answer to its end."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(address)
        try:
            s.sendall(data)
            if close:
                s.shutdown(socket.SHUT_WR)
        except BrokenPipeError:
            pass  # answered before it read (busy): the answer is there to read
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.endswith(b"\n") and answer.count(b"\n") == 1, answer
    return json.loads(answer)


def status_token(srv: AdminServer) -> str:
    return (srv.path.parent / TOKEN_NAME).read_text().strip()


@pytest.mark.parametrize(
    "token",
    ["é" * 64, "\u2028", "\ud800", "x\x00y", 17, None, ["a"], {"t": 1}],
    ids=["non-ascii", "line-separator", "lone-surrogate", "nul", "int", "null", "list", "dict"],
)
def test_any_token_that_is_not_the_secret_is_answered_unauthorized(
    server: tuple[AdminServer, list[dict[str, Any]]], token: object
) -> None:
    srv, seen = server
    request = json.dumps({"op": "status", "token": token}).encode() + b"\n"
    answer = exchange(srv.tcp_bound, request)
    assert answer["ok"] is False and answer["error"].startswith("unauthorized"), answer
    assert seen == []
    # The server keeps serving.
    assert call(tcp_target(srv, status_token(srv)), {"op": "status"})["ok"] is True


def test_tokens_are_compared_as_bytes() -> None:
    secret = b"s3cret"
    assert token_matches("s3cret", secret)
    for other in ("s3cre", "s3creté", "\ud800", "", None, 5, b"s3cret"):
        assert not token_matches(other, secret), other


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\n", "bad request: empty request"),
        (b"", "bad request: empty request"),
        (b'{"op": "status", "x": "\xff\xfe"}\n', "bad request: not UTF-8 (byte 23)"),
        (b"[" * 50_000 + b"\n", "bad request: JSON nested too deeply"),
        (b"{" + b" " * (70 * 1024) + b"}\n", "bad request: longer than 65536 bytes"),
        (b'{"op": "status"', "bad request: not JSON: Expecting ',' delimiter"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad request: not JSON: Expecting value"),
        (b'"status"\n', "bad request: a request is a JSON object"),
        (b'{"op": 5}\n', "unknown op 5; known: broken, status"),
        (b'{"op": "nope\\n2026 E forged"}\n', "unknown op 'nope\\n2026 E forged'"),
        (b'{"op": ["status"]}\n', "unknown op ['status']"),
    ],
    ids=[
        "blank", "nothing", "invalid-utf8", "deep-nesting", "huge", "half", "http",
        "not-an-object", "op-not-text", "op-with-newline", "op-a-list",
    ],
)  # fmt: skip
def test_bad_requests_get_a_json_answer_saying_why(
    server: tuple[AdminServer, list[dict[str, Any]]], data: bytes, why: str
) -> None:
    srv, _ = server
    for address in (str(srv.path), srv.tcp_bound):
        answer = exchange(address, data)
        assert answer["ok"] is False
        if address == str(srv.path) or why.startswith("bad request"):
            assert answer["error"].startswith(why), answer
        else:  # over TCP a parsable request without the token is refused first
            assert answer["error"].startswith("unauthorized"), answer
    assert call(srv.path, {"op": "status"})["ok"] is True


def test_a_silent_client_is_answered_after_the_read_timeout_and_blocks_no_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin, "READ_TIMEOUT", 1.0)
    srv = AdminServer(tmp_path / SOCKET_NAME, handlers([]))
    srv.start()
    try:
        answers: list[Any] = []
        slow = threading.Thread(
            target=lambda: answers.append(exchange(str(srv.path), b'{"op": "st', close=False))
        )
        start = time.monotonic()
        slow.start()
        time.sleep(0.2)  # the slow client is connected and waiting now
        assert call(srv.path, {"op": "status"}, timeout=5)["ok"] is True
        assert time.monotonic() - start < 1.0  # answered while the slow one still waits
        slow.join(10)
        assert answers == [
            {"ok": False, "error": "bad request: no complete request line within 1 s"}
        ]
    finally:
        srv.stop()


def test_connections_beyond_the_limit_are_answered_busy_and_the_server_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(admin, "READ_TIMEOUT", 3.0)
    srv = AdminServer(tmp_path / SOCKET_NAME, handlers([]))
    srv.start()
    held = []
    try:
        for _ in range(2):  # two clients that send nothing hold both slots
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(srv.path))
            held.append(s)
        time.sleep(0.3)
        busy = exchange(str(srv.path), b'{"op": "status"}\n')
        assert busy["ok"] is False and busy["error"].startswith("busy"), busy
        for s in held:
            s.close()
        deadline = time.monotonic() + 10
        while (answer := call(srv.path, {"op": "status"}))["ok"] is not True:
            assert time.monotonic() < deadline, answer
            time.sleep(0.1)
    finally:
        for s in held:
            s.close()
        srv.stop()


def test_switch_fields_of_the_wrong_type_are_bad_requests(tmp_path: Path) -> None:
    # Everything below is refused before the daemon's state is touched.
    daemon: Any = types.SimpleNamespace()
    srv = AdminServer(tmp_path / SOCKET_NAME, {"switch": partial(Daemon._switch_request, daemon)})
    srv.start()
    try:
        for request, why in [
            ({"to": 5}, "switch needs 'to'"),
            ({"to": "nftables", "timeout": "60"}, "bad request: 'timeout' must be a number"),
            ({"to": "nftables", "timeout": True}, "bad request: 'timeout' must be a number"),
            ({"to": "nftables", "timeout": -1}, "bad request: 'timeout' must be more than 0"),
            ({"to": "nftables", "timeout": float("nan")}, "bad request: 'timeout' must be more"),
            ({"to": "nftables", "timeout": 1e400}, "bad request: 'timeout' must be more than 0"),
            ({"to": "nftables", "before": ["x"]}, "bad request: 'before' must be the path"),
        ]:
            answer = call(srv.path, {"op": "switch", **request})
            assert answer["ok"] is False and answer["error"].startswith(why), (request, answer)
    finally:
        srv.stop()


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
_REQUESTS = st.one_of(
    st.binary(max_size=3000),
    st.dictionaries(
        st.sampled_from(["op", "token", "to", "timeout", "before", "force"]) | st.text(),
        st.sampled_from(["status", "switch", "broken"]) | _JSON_VALUES,
    ).map(lambda d: json.dumps(d).encode() + b"\n"),
)


def test_any_bytes_to_the_admin_endpoint_get_one_json_answer(tmp_path: Path) -> None:
    daemon: Any = types.SimpleNamespace(first_sync_done=threading.Event())
    ops = {
        **handlers([]),
        "switch": lambda r: Daemon._switch_request(daemon, {**r, "timeout": 0.01}),
    }
    srv = AdminServer(tmp_path / SOCKET_NAME, ops, tcp_address=("127.0.0.1", 0))
    srv.start()
    try:

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(data=_REQUESTS)
        def check(data: bytes) -> None:
            for address in (srv.tcp_bound, str(srv.path)):
                answer = exchange(address, data)
                assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool)
                if answer["ok"] is False:
                    assert isinstance(answer["error"], str) and "\n" not in answer["error"]

        check()
        assert call(srv.path, {"op": "status"})["ok"] is True
    finally:
        srv.stop()


def test_the_client_reports_an_answer_that_is_not_kproxys(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer_garbage() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1000)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n\n")

        threading.Thread(target=answer_garbage, daemon=True).start()
        target = AdminTarget(address=listener.getsockname(), token="t")
        with pytest.raises(AdminUnavailable, match="answered something that is not kproxy's"):
            call(target, {"op": "status"}, timeout=5)


def test_a_new_start_writes_a_new_token_and_stop_removes_it(tmp_path: Path) -> None:
    tokens = []
    for _ in range(2):
        srv = AdminServer(tmp_path / SOCKET_NAME, {}, tcp_address=("127.0.0.1", 0))
        srv.start()
        tokens.append((tmp_path / TOKEN_NAME).read_text())
        srv.stop()
        assert not (tmp_path / TOKEN_NAME).exists() and not (tmp_path / SOCKET_NAME).exists()
    assert tokens[0] != tokens[1]


def test_a_taken_tcp_port_is_a_clear_start_error(
    server: tuple[AdminServer, list[dict[str, Any]]], tmp_path: Path
) -> None:
    srv, _ = server
    other = AdminServer(tmp_path / "b" / SOCKET_NAME, {}, tcp_address=srv.tcp_bound)
    with pytest.raises(AdminBindError, match=r"--admin-address 127\.0\.0\.1:\d+: cannot listen"):
        other.start()
    assert not (tmp_path / "b" / SOCKET_NAME).exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:10259", ("127.0.0.1", 10259)), ("[::1]:10259", ("::1", 10259))],
)
def test_admin_addresses_are_loopback_ip_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_admin_address(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0.0.0.0:10259", "not a loopback address"),
        ("10.100.0.1:10259", "not a loopback address"),
        ("localhost:10259", "not an IP address"),
        ("127.0.0.1", "not IP:PORT"),
        ("127.0.0.1:0", "not a port"),
        ("127.0.0.1:http", "not a port"),
    ],
)
def test_other_admin_addresses_are_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_admin_address(text)


def test_a_missing_token_file_and_a_silent_port_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read the admin token .*admin\.token"):
        AdminTarget.of(tmp_path, "127.0.0.1:10259")
    (tmp_path / "t").write_text("secret\n")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = AdminTarget.of(tmp_path, f"127.0.0.1:{port}", tmp_path / "t")
    assert target.token == "secret"
    with pytest.raises(AdminUnavailable, match=f"nothing listens on tcp 127.0.0.1:{port}$"):
        call(target, {"op": "status"})
