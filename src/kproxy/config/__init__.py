"""KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1): loading, defaults, flags, validation.

kproxy reads the same configuration file and the same command-line flags as upstream
kube-proxy, and a file that upstream accepts means the same thing here. Behaviour that was
checked against upstream (pkg/proxy/apis/config/{v1alpha1,validation}, cmd/kube-proxy/app):

* **Defaulting is Go's zero-value defaulting.** Upstream fills a field when it holds its Go
  zero value, so an explicit zero is the same as leaving the field out for: ``bindAddress``,
  ``healthzBindAddress``/``metricsBindAddress`` (also: a bare IP gets the default port),
  ``iptables``/``nftables`` ``syncPeriod`` and ``minSyncPeriod`` (``minSyncPeriod: 0s`` becomes
  ``1s``!), ``ipvs.syncPeriod``, ``configSyncPeriod`` and ``clientConnection``
  ``contentType``/``qps``/``burst``. ``ipvs.minSyncPeriod: 0s`` stays 0, and pointer fields
  (``oomScoreAdj``, ``masqueradeBit``, ``localhostNodePorts``, conntrack ``maxPerCore``,
  ``min``, TCP timeouts) keep an explicit 0. ``null`` means "unset" everywhere.
* **Flags vs. --config** (options.go ``Complete``): when a config file is given, the file
  replaces the flag-parsed configuration wholesale; only ``--hostname-override`` (trimmed
  and lowercased) and logging flags still apply. Every other flag is silently ignored
  upstream; kproxy logs a warning and `apply_flags` returns the ignored names.
* Without a file, flags apply to the defaults. ``--iptables-sync-period`` and
  ``--iptables-min-sync-period`` apply unless the mode is ipvs (so they feed nftables too);
  ``--ipvs-sync-period``/``--ipvs-min-sync-period`` apply only in ipvs mode; both are
  reported as ignored otherwise. ``--masquerade-all`` sets the single internal field, so it
  applies to the iptables and nftables sections alike. A bare IP in
  ``--healthz-bind-address``/``--metrics-bind-address`` gets the default port (or the one
  from the deprecated ``--healthz-port``/``--metrics-port``; port 0 disables the server).
* **Effective per-mode values** (1.31+ internal config): sync periods come from the section
  of the mode (ipvs -> ``ipvs``, nftables -> ``nftables``, else ``iptables``); masqueradeAll
  and masqueradeBit come from ``nftables`` in nftables mode and from ``iptables`` otherwise
  (the v1alpha1 ipvs section has no masquerade fields; upstream's ipvs proxier uses iptables').
* Empty ``healthzBindAddress``/``metricsBindAddress`` mean "server disabled" (upstream's
  servers skip an empty address); a file cannot produce them because "" is defaulted.

Deliberate differences, all in the direction of failing loud: unknown fields are an error
(upstream retries a lenient decode and only logs), duplicate keys are an error, every section
is validated whatever the mode (upstream checks only the active mode's ipvs/nftables
section), and the mode must be one of kproxy's four (upstream: iptables, ipvs, nftables).
Feature-gate names and ``showHiddenMetricsForVersion`` beyond its "X.Y" form are not checked,

The package, one module per decision: durations.py (Go's duration syntax), schema.py (the
names, field types and models), defaulting.py (Go's zero-value defaulting), structure.py
(type errors in the file's terms), validation.py (the semantic checks), loading.py (files
and strict YAML), flags.py (the flag mapping), rule_options.py (what the dataplanes read),
problems.py and addresses.py (shared message and address helpers).
"""

import importlib
from typing import TYPE_CHECKING

# Each name's module, imported when the name is first asked for: a command that needs one
# small piece (`kproxy status` checks a duration) loads neither the models nor pydantic,
# which would add a second to every start (more in a UML guest).
_HOMES: dict[str, str] = {
    "format_duration": "kproxy.config.durations",
    "format_duration_ns": "kproxy.config.durations",
    "parse_duration": "kproxy.config.durations",
    "parse_duration_ns": "kproxy.config.durations",
    "FLAG_NAMES": "kproxy.config.flags",
    "apply_flags": "kproxy.config.flags",
    "load_config": "kproxy.config.loading",
    "parse_config": "kproxy.config.loading",
    "ConfigError": "kproxy.config.problems",
    "rule_options": "kproxy.config.rule_options",
    "API_VERSION": "kproxy.config.schema",
    "IPVS_SCHEDULERS": "kproxy.config.schema",
    "KIND": "kproxy.config.schema",
    "ClientConnectionConfig": "kproxy.config.schema",
    "ConntrackConfig": "kproxy.config.schema",
    "DetectLocalConfig": "kproxy.config.schema",
    "IPTablesConfig": "kproxy.config.schema",
    "IPVSConfig": "kproxy.config.schema",
    "NFTablesConfig": "kproxy.config.schema",
    "ProxyConfig": "kproxy.config.schema",
    "validate_config": "kproxy.config.validation",
    "DETECT_LOCAL_MODES": "kproxy.dataplane.nodepolicy",
    "MODES": "kproxy.modes",
}

if TYPE_CHECKING:
    from kproxy.config.durations import (
        format_duration,
        format_duration_ns,
        parse_duration,
        parse_duration_ns,
    )
    from kproxy.config.flags import FLAG_NAMES, apply_flags
    from kproxy.config.loading import load_config, parse_config
    from kproxy.config.problems import ConfigError
    from kproxy.config.rule_options import rule_options
    from kproxy.config.schema import (
        API_VERSION,
        IPVS_SCHEDULERS,
        KIND,
        ClientConnectionConfig,
        ConntrackConfig,
        DetectLocalConfig,
        IPTablesConfig,
        IPVSConfig,
        NFTablesConfig,
        ProxyConfig,
    )
    from kproxy.config.validation import validate_config
    from kproxy.dataplane.nodepolicy import DETECT_LOCAL_MODES
    from kproxy.modes import MODES


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = [
    "API_VERSION",
    "DETECT_LOCAL_MODES",
    "FLAG_NAMES",
    "IPVS_SCHEDULERS",
    "KIND",
    "MODES",
    "ClientConnectionConfig",
    "ConfigError",
    "ConntrackConfig",
    "DetectLocalConfig",
    "IPTablesConfig",
    "IPVSConfig",
    "NFTablesConfig",
    "ProxyConfig",
    "apply_flags",
    "format_duration",
    "format_duration_ns",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_duration_ns",
    "rule_options",
    "validate_config",
]
