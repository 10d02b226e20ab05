"""Which API server to use and with what credentials: the settings alone.

Kept apart from kubeclient, which imports the client library (kubernetes_asyncio and
aiohttp: about 900 modules and 50 MB of a daemon's RSS), so a proxy reading files never
loads it. The in-cluster paths and variable are the ones kube-proxy and the client library
use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SERVICE_HOST_ENV_NAME = "KUBERNETES_SERVICE_HOST"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SERVICE_TOKEN_FILENAME = f"{SERVICE_ACCOUNT_DIR}/token"
SERVICE_CERT_FILENAME = f"{SERVICE_ACCOUNT_DIR}/ca.crt"


class ClientConfigError(Exception):
    """The connection settings are unusable (a user mistake: printed as one line)."""


@dataclass(frozen=True)
class ClientSettings:
    kubeconfig: str = ""
    master: str = ""
    # Where in-cluster credentials live (tests point these at a temporary folder).
    token_file: str = SERVICE_TOKEN_FILENAME
    ca_file: str = SERVICE_CERT_FILENAME

    @property
    def description(self) -> str:
        if self.kubeconfig:
            return f"kubeconfig {self.kubeconfig}" + (
                f" (server {self.master})" if self.master else ""
            )
        if self.master:
            return f"master {self.master}"
        return "in-cluster service account"


def in_cluster_available() -> bool:
    """Whether this process runs in a pod with a service account (what kube-proxy checks)."""
    return bool(os.environ.get(SERVICE_HOST_ENV_NAME))
