"""The admin endpoint without a kernel: the unix socket, and the optional loopback TCP
endpoint whose requests must carry the token the proxy wrote to its state dir."""

from __future__ import annotations

import json
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.server.admin import (
    SOCKET_NAME,
    TOKEN_NAME,
    AdminBindError,
    AdminServer,
    AdminTarget,
    AdminUnavailable,
    call,
    parse_admin_address,
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
