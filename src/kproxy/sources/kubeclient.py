"""Connect to the Kubernetes API server with kubernetes_asyncio, the way kube-proxy does.

Which server and credentials: --kubeconfig FILE (its current context), optionally with
--master overriding the server URL (kube-proxy's precedence), --master alone (no
credentials, e.g. a local insecure port or `kubectl proxy`), or the pod's service account
when neither is given (KUBERNETES_SERVICE_HOST/PORT plus the mounted token and CA). The
client library does TLS, client certificates, bearer tokens, exec plugins and token-file
rotation; kproxy only asks it for raw JSON (no model classes), so objects reach the tracker
as the same plain dicts the file source gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.config import kube_config
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.incluster_config import load_incluster_config

from kproxy.sources.clientsettings import (
    SERVICE_HOST_ENV_NAME,
    ClientConfigError,
    ClientSettings,
    in_cluster_available,
)


def _token_file_hook(token_file: Path) -> Callable[[k8s.Configuration], None]:
    seen: list[int] = [-1]

    def refresh(cfg: k8s.Configuration) -> None:
        try:
            mtime = token_file.stat().st_mtime_ns
            if mtime == seen[0]:
                return
            token = token_file.read_text().strip()
        except OSError:
            return  # keep the token we have; the request tells if it is no longer good
        if token:
            cfg.api_key["BearerToken"] = f"Bearer {token}"
            seen[0] = mtime

    return refresh


@dataclass
class Connection:
    api: k8s.ApiClient
    host: str
    # Background tasks keeping credentials fresh (exec plugins), cancelled on close.
    refreshers: list[asyncio.Task[None]]

    async def close(self) -> None:
        for task in self.refreshers:
            task.cancel()
        for task in self.refreshers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.api.close()


async def connect(settings: ClientSettings) -> Connection:
    """An API client for the settings; raises ClientConfigError naming what is wrong."""
    cfg = k8s.Configuration()
    refreshers: list[asyncio.Task[None]] = []
    if settings.kubeconfig:
        path = Path(settings.kubeconfig)
        if not path.is_file():
            raise ClientConfigError(f"kubeconfig {path} does not exist or is not a file")
        try:
            loader = await kube_config.load_kube_config(
                config_file=str(path), client_configuration=cfg, persist_config=False
            )
        except ConfigException as err:
            raise ClientConfigError(f"kubeconfig {path}: {err}") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ClientConfigError(f"kubeconfig {path} is not usable: {err}") from None
        user = getattr(loader, "_user", None) or {}
        if "exec" in user or getattr(loader, "provider", "") == "gcp":
            refreshers.append(asyncio.create_task(kube_config.refresh_token(loader, cfg)))
        elif "tokenFile" in user and "token" not in user:
            # kubeadm's kube-proxy kubeconfig names the pod's service-account token file,
            # which the kubelet rotates: read it again when it changes, not once.
            token_file = Path(str(user["tokenFile"]))
            if not token_file.is_absolute():
                token_file = path.parent / token_file
            cfg.refresh_api_key_hook = _token_file_hook(token_file)
        if settings.master:
            cfg.host = settings.master.rstrip("/")
    elif settings.master:
        cfg.host = settings.master.rstrip("/")
    else:
        if not in_cluster_available():
            raise ClientConfigError(
                "no API server: give --kubeconfig or --master, or run in a pod "
                f"({SERVICE_HOST_ENV_NAME} is not set)"
            )
        try:
            load_incluster_config(
                client_configuration=cfg,
                token_filename=settings.token_file,
                cert_filename=settings.ca_file,
            )
        except ConfigException as err:
            raise ClientConfigError(f"in-cluster configuration: {err}") from None
    if not cfg.host.startswith(("http://", "https://")):
        raise ClientConfigError(f"API server URL {cfg.host!r} must start with http:// or https://")
    try:
        api = k8s.ApiClient(configuration=cfg)
    except (OSError, ValueError) as err:  # e.g. an unreadable CA or client certificate
        for task in refreshers:
            task.cancel()
        raise ClientConfigError(f"{settings.description}: {err}") from None
    api.user_agent = "kproxy"
    return Connection(api=api, host=cfg.host, refreshers=refreshers)


class ApiError(Exception):
    """The API server answered with an error Status (or something that is not JSON)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {code} {reason}: {message}" if message else f"HTTP {code} {reason}")
        self.code = code
        self.reason = reason
        self.message = message


GONE = 410


def status_error(code: int, body: bytes | dict[str, object]) -> ApiError:
    """The ApiError for an error response body (a metav1.Status, usually)."""
    data: object = body
    if isinstance(body, bytes):
        try:
            data = json.loads(body)
        except ValueError:
            text = body.decode("utf-8", "replace").strip()
            return ApiError(code, "", text[:200])
    if isinstance(data, dict):
        reason = str(data.get("reason") or "")
        message = str(data.get("message") or "")
        status_code = data.get("code")
        if isinstance(status_code, int) and status_code:
            code = status_code
        return ApiError(code, reason, message[:500])
    return ApiError(code, "", "")


async def request(
    conn: Connection,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: object = None,
    content_type: str = "application/json",
    timeout: aiohttp.ClientTimeout | None = None,
) -> aiohttp.ClientResponse:
    """One raw request through the client (auth, TLS, token refresh); the caller reads the
    response and must release it. Non-2xx responses are returned, not raised."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    response: aiohttp.ClientResponse = await conn.api.call_api(
        path,
        method,
        query_params=list(query),
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=timeout or aiohttp.ClientTimeout(total=30, sock_connect=10),
    )
    return response


async def json_request(
    conn: Connection,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: object = None,
    content_type: str = "application/json",
    timeout: aiohttp.ClientTimeout | None = None,
) -> dict[str, Any]:
    """A request whose 2xx answer is a JSON object; ApiError otherwise."""
    resp = await request(
        conn, method, path, query=query, body=body, content_type=content_type, timeout=timeout
    )
    try:
        data = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status <= 299:
        raise status_error(resp.status, data)
    try:
        out = json.loads(data)
    except ValueError:
        raise ApiError(resp.status, "", "the answer is not JSON") from None
    if not isinstance(out, dict):
        raise ApiError(resp.status, "", "the answer is not a JSON object")
    return out
