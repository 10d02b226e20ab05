"""`kproxy run`, `kproxy render` and `kproxy cleanup`: the proxy on this node, what it would
program, and the removal of what it (or upstream kube-proxy) left in the kernel.

Flags keep kube-proxy's names so an existing DaemonSet's arguments work unchanged. User
mistakes (bad config, bad mode, missing files) end with a one-line error and exit code 2,
never a traceback.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer

from kproxy.cli_common import HostOpt, UsageError, checked, fail
from kproxy.config import FLAG_NAMES, ConfigError, ProxyConfig, apply_flags, load_config
from kproxy.config.addresses import parse_ip
from kproxy.dataplane.base import DataplaneUnavailable, check_mode_available
from kproxy.dataplane.facts import NodeFacts
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.host.commands import DEFAULT_TOOL_TIMEOUT, set_tool_timeout
from kproxy.server.admin import AdminBindError, parse_admin_address
from kproxy.text import log_to_stderr, one_line

log = logging.getLogger("kproxy")

# run takes every kube-proxy flag, also those without an option of their own here.
EXTRA_FLAGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def register(app: typer.Typer) -> None:
    app.command("run", context_settings=EXTRA_FLAGS)(run)
    app.command("render")(render)
    app.command("cleanup")(cleanup)


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING - 10 * verbosity if verbosity < 2 else logging.DEBUG
    log_to_stderr(
        min(level, logging.INFO) if verbosity >= 0 else logging.WARNING,
        "%(asctime)s %(levelname).1s %(name)s: %(message)s",
    )


# --- options shared by run and render -----------------------------------------------------------

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", help="KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1)."
    ),
]
ModeOpt = Annotated[
    str | None,
    typer.Option(
        "--proxy-mode",
        help="iptables, nftables, ipvs or userspace (default iptables). Never falls back.",
    ),
]
SourceOpt = Annotated[
    Path,
    typer.Option(
        "--source",
        help="A YAML/JSON file or folder of Services, EndpointSlices and Nodes; watched.",
    ),
]
CidrOpt = Annotated[
    str | None, typer.Option("--cluster-cidr", help="The pods' CIDR (local-traffic detection).")
]
MasqOpt = Annotated[
    bool | None,
    typer.Option("--masquerade-all/--no-masquerade-all", help="SNAT all traffic to services."),
]
SyncOpt = Annotated[
    str | None, typer.Option("--iptables-sync-period", help="Max time between syncs, e.g. 30s.")
]
MinSyncOpt = Annotated[
    str | None, typer.Option("--iptables-min-sync-period", help="Min time between syncs, e.g. 1s.")
]
MarkOpt = Annotated[
    int | None, typer.Option("--iptables-masquerade-bit", help="fwmark bit for SNAT (0-31).")
]
LocalhostOpt = Annotated[
    bool | None,
    typer.Option(
        "--iptables-localhost-nodeports/--no-iptables-localhost-nodeports",
        help="Serve NodePorts on 127.0.0.1 (sets route_localnet).",
    ),
]
NodePortAddrOpt = Annotated[
    str | None,
    typer.Option(
        "--nodeport-addresses", help="Comma-separated CIDRs NodePorts answer on, or 'primary'."
    ),
]
DetectOpt = Annotated[
    str | None,
    typer.Option(
        "--detect-local-mode", help="ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix."
    ),
]
BridgeOpt = Annotated[
    str | None,
    typer.Option("--pod-bridge-interface", help="For --detect-local-mode BridgeInterface."),
]
PrefixOpt = Annotated[
    str | None,
    typer.Option(
        "--pod-interface-name-prefix", help="For --detect-local-mode InterfaceNamePrefix."
    ),
]
MetricsOpt = Annotated[
    str | None, typer.Option("--metrics-bind-address", help="ip:port of /metrics.")
]
HealthOpt = Annotated[
    str | None, typer.Option("--healthz-bind-address", help="ip:port of /healthz and /livez.")
]
BackendOpt = Annotated[
    str,
    typer.Option("--iptables-backend", help="auto (detect like upstream), nft or legacy."),
]
LayoutOpt = Annotated[
    str,
    typer.Option(
        "--nftables-layout",
        help="nftables mode's table layout: upstream (kube-proxy's `table ip kube-proxy`, the "
        "default) or compact (kproxy's `table ip kproxy-compact`: shared chains and maps, "
        "whose commit cost does not grow with the number of services). kproxy's own "
        "setting, outside KubeProxyConfiguration, so the same config stays valid for "
        "upstream kube-proxy.",
    ),
]
NodeIpOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--node-ip",
        help="The node's primary IP (repeatable); default: detected.",
        callback=checked(parse_ip),
    ),
]
VerboseOpt = Annotated[
    int, typer.Option("--verbose", "-v", count=True, help="More logging (-v info, -vv debug).")
]


def build_config(
    config_path: Path | None, flags: dict[str, object | None]
) -> tuple[ProxyConfig, list[str]]:
    """Config file + explicitly given flags, validated; user errors become UsageError."""
    given = {k: _flag_text(v) for k, v in flags.items() if v is not None}
    try:
        config = load_config(config_path)
        config, ignored = apply_flags(config, given)
        check_mode_available(config.effective_mode)
    except (ConfigError, DataplaneUnavailable) as err:
        raise UsageError(str(err)) from None
    except FileNotFoundError as err:
        raise UsageError(f"config file not found: {err.filename}") from None
    return config, ignored


def _flag_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _node_name(config: ProxyConfig) -> str:
    import socket

    return (config.hostname_override or socket.gethostname()).strip().lower()


def _iptables_flags(
    mode: str | None,
    hostname: str | None,
    cluster_cidr: str | None,
    masquerade_all: bool | None,
    sync_period: str | None,
    min_sync_period: str | None,
    masquerade_bit: int | None,
    localhost_nodeports: bool | None,
    nodeport_addresses: str | None,
    detect_local_mode: str | None,
    bridge: str | None,
    prefix: str | None,
) -> dict[str, object | None]:
    return {
        "proxy-mode": mode,
        "hostname-override": hostname,
        "cluster-cidr": cluster_cidr,
        "masquerade-all": masquerade_all,
        "iptables-sync-period": sync_period,
        "iptables-min-sync-period": min_sync_period,
        "iptables-masquerade-bit": masquerade_bit,
        "iptables-localhost-nodeports": localhost_nodeports,
        "nodeport-addresses": nodeport_addresses,
        "detect-local-mode": detect_local_mode,
        "pod-bridge-interface": bridge,
        "pod-interface-name-prefix": prefix,
    }


# --- run ------------------------------------------------------------------------------------------


def parse_extra_flags(args: list[str]) -> dict[str, str]:
    """The kube-proxy flags without a dedicated option here (e.g. --conntrack-max-per-core=0,
    --ipvs-scheduler rr, --v=2), so an existing DaemonSet's arguments work unchanged."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise UsageError(f"unexpected argument {arg!r}")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        if name not in FLAG_NAMES and name not in ("v", "logtostderr", "alsologtostderr"):
            raise UsageError(f"unknown flag --{name} (see kproxy run --help)")
        out[name] = value
        i += 1
    return out


RunSourceOpt = Annotated[
    Path | None,
    typer.Option(
        "--source",
        help="A YAML/JSON file or folder of Services, EndpointSlices and Nodes; watched. "
        "Without it: the API server (--kubeconfig, --master, or in-cluster).",
    ),
]
KubeconfigOpt = Annotated[
    str | None,
    typer.Option("--kubeconfig", help="kubeconfig of the API server to list and watch."),
]
MasterOpt = Annotated[
    str | None,
    typer.Option("--master", help="API server URL (overrides the kubeconfig's server)."),
]


def run(
    ctx: typer.Context,
    source: RunSourceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    master: MasterOpt = None,
    config_path: ConfigOpt = None,
    mode: ModeOpt = None,
    hostname: HostOpt = None,
    cluster_cidr: CidrOpt = None,
    masquerade_all: MasqOpt = None,
    sync_period: SyncOpt = None,
    min_sync_period: MinSyncOpt = None,
    masquerade_bit: MarkOpt = None,
    localhost_nodeports: LocalhostOpt = None,
    nodeport_addresses: NodePortAddrOpt = None,
    detect_local_mode: DetectOpt = None,
    bridge: BridgeOpt = None,
    prefix: PrefixOpt = None,
    metrics_bind: MetricsOpt = None,
    healthz_bind: HealthOpt = None,
    backend: BackendOpt = "auto",
    nftables_layout: LayoutOpt = "upstream",
    node_ip: NodeIpOpt = None,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="Where failed restore inputs and state are kept.")
    ] = DEFAULT_STATE_DIR,
    admin_address: Annotated[
        str | None,
        typer.Option(
            "--admin-address",
            help="Also serve the admin endpoint (status, switch) on this loopback IP:PORT, "
            "e.g. 127.0.0.1:10259; requests there carry the token written to the state dir's "
            "admin.token (default: the unix socket only).",
        ),
    ] = None,
    tool_timeout: Annotated[
        float,
        typer.Option(
            "--tool-timeout",
            help="Seconds an external tool (iptables-restore, nft, ipset, conntrack, ...) may "
            "run before it is killed and the sync counts as failed (retried after syncPeriod).",
        ),
    ] = DEFAULT_TOOL_TIMEOUT,
    verbose: VerboseOpt = 1,
) -> None:
    """Run the proxy in the current network namespace (use `ip netns exec` for a lab node).

    Programs the node's dataplane from --source (or the API server) and keeps it in sync
    until stopped. On exit the rules stay in place: the dataplane outlives the process, and
    the next start adopts it.
    Every other kube-proxy flag is accepted in its usual form (--name=value), e.g.
    --conntrack-max-per-core=0, --oom-score-adj=-999, --config-sync-period=15m.
    """
    try:
        extra = parse_extra_flags(list(ctx.args))
    except UsageError as err:
        raise fail(str(err)) from None
    klog_v = extra.pop("v", "0")
    for name in ("logtostderr", "alsologtostderr"):
        extra.pop(name, None)
    if not (klog_v.isascii() and klog_v.isdigit()):
        raise fail(f"--v: {klog_v!r} is not a log level (0, 1, 2, ...)")
    setup_logging(max(verbose, int(klog_v)))
    if not tool_timeout > 0:
        raise fail(f"--tool-timeout: {tool_timeout:g} is not a positive number of seconds")
    set_tool_timeout(tool_timeout)
    from kproxy.memory import use_single_arena

    use_single_arena()  # before any thread starts (see kproxy.memory)
    try:
        flags = _iptables_flags(
            mode,
            hostname,
            cluster_cidr,
            masquerade_all,
            sync_period,
            min_sync_period,
            masquerade_bit,
            localhost_nodeports,
            nodeport_addresses,
            detect_local_mode,
            bridge,
            prefix,
        )
        flags["metrics-bind-address"] = metrics_bind
        flags["healthz-bind-address"] = healthz_bind
        flags["kubeconfig"] = kubeconfig
        flags.update(extra)
        config, _ = build_config(config_path, flags)  # kproxy.config logs the flags it ignores
        from kproxy.daemon import Daemon
        from kproxy.sources.cluster import ClientConfigError, prepare_source

        if backend not in ("auto", "nft", "legacy"):
            raise UsageError(f"--iptables-backend: {backend!r} is not auto, nft or legacy")
        _check_layout(nftables_layout)
        admin_tcp = _admin_tcp(admin_address)
        _make_state_dir(state_dir)
        try:
            # The file source, or the API server (whose Node may give node IPs and a mode).
            objects = prepare_source(
                source, master, config, _node_name(config), tuple(node_ip or ())
            )
        except ClientConfigError as err:
            raise UsageError(str(err)) from None
        daemon = Daemon(
            objects.config,
            source=objects.source,
            iptables_backend=backend,
            node_ips=objects.node_ips,
            state_dir=state_dir,
            node_name=_node_name(config),
            config_path=config_path,
            admin_address=admin_tcp,
            follow_node_from=objects.follow_node_from,
            nftables_layout=nftables_layout,
        )
        daemon.start()
    except (UsageError, DataplaneUnavailable, AdminBindError) as err:
        # DataplaneUnavailable: the mode cannot run on this node (e.g. ipvs without ip_vs).
        raise fail(str(err)) from None
    except FileNotFoundError as err:
        raise fail(f"source not found: {err.filename or err}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        daemon.stop()
        log.info("stopped; the rules stay in place")


# --- render ---------------------------------------------------------------------------------------


def render(
    source: SourceOpt,
    config_path: ConfigOpt = None,
    mode: ModeOpt = None,
    hostname: HostOpt = None,
    cluster_cidr: CidrOpt = None,
    masquerade_all: MasqOpt = None,
    masquerade_bit: MarkOpt = None,
    localhost_nodeports: LocalhostOpt = None,
    nodeport_addresses: NodePortAddrOpt = None,
    detect_local_mode: DetectOpt = None,
    bridge: BridgeOpt = None,
    prefix: PrefixOpt = None,
    nftables_layout: LayoutOpt = "upstream",
    node_ip: NodeIpOpt = None,
    local_address: Annotated[
        list[str] | None,
        typer.Option(
            "--local-address",
            help="An address on the node's interfaces (repeatable); default: detected.",
            callback=checked(parse_ip),
        ),
    ] = None,
    random_fully: Annotated[
        bool | None,
        typer.Option(
            "--random-fully/--no-random-fully",
            help="Whether MASQUERADE --random-fully is supported.",
        ),
    ] = None,
    nfacct: Annotated[
        list[str] | None,
        typer.Option(
            "--nfacct-counter",
            help="An existing nfacct counter (repeatable).",
            callback=checked(_nfacct_name),
        ),
    ] = None,
    tcp_be_liberal: Annotated[
        bool | None,
        typer.Option(
            "--tcp-be-liberal/--no-tcp-be-liberal",
            help="Whether nf_conntrack_tcp_be_liberal is set.",
        ),
    ] = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Print what a full sync would apply: iptables-restore input (iptables mode), an
    `nft -f` transaction, one command per line (nftables mode), or the virtual servers in
    `ipvsadm -S -n` form, the ipsets and the iptables rules (ipvs mode). Needs no root and
    no kernel.

    A file of the source that cannot be read or parsed is an error (exit code 2, naming the
    file and line, nothing printed); an invalid object in a readable file is skipped with a
    warning naming its field, as `kproxy run` skips it.

    Node facts a live sync detects (node IPs, local addresses, --random-fully support, nfacct
    counters, tcp_be_liberal) can be given as options so the output is reproducible on any
    machine; those not given are detected on this machine. Jump rules from the built-in
    chains (added once, only when missing) are not part of the output, as upstream.
    """
    setup_logging(verbose)
    from kproxy.config import rule_options
    from kproxy.dataplane.registry import RenderArgs, mode_spec
    from kproxy.model.snapshot import snapshot_from_objects
    from kproxy.sources.files import read_path

    try:
        _check_layout(nftables_layout)
        config, _ = build_config(
            config_path,
            _iptables_flags(
                mode,
                hostname,
                cluster_cidr,
                masquerade_all,
                None,
                None,
                masquerade_bit,
                localhost_nodeports,
                nodeport_addresses,
                detect_local_mode,
                bridge,
                prefix,
            ),
        )
        try:
            loaded = read_path(source)
        except FileNotFoundError:
            raise UsageError(f"source not found: {source}") from None
        if loaded.failed:
            # Rules without a whole file's objects would look complete and be wrong.
            for problem in loaded.failed[1:]:
                typer.secho(f"kproxy: error: {one_line(problem)}", err=True, fg=typer.colors.RED)
            raise UsageError(
                f"{one_line(loaded.failed[0])}"
                + (f" (and {len(loaded.failed) - 1} more files)" if len(loaded.failed) > 1 else "")
                + "; nothing rendered"
            )
        for p in [*loaded.skipped, *loaded.duplicates]:
            typer.secho(f"kproxy: warning: {one_line(p)}", err=True, fg=typer.colors.YELLOW)
        snapshot = snapshot_from_objects(loaded.objects.values(), _node_name(config))
        del loaded  # the raw objects are not needed past the model: gone before the render
        for rej in snapshot.rejections:
            typer.secho(
                f"kproxy: warning: skipping invalid {one_line(rej)}",
                err=True,
                fg=typer.colors.YELLOW,
            )
        facts = _render_facts(node_ip, local_address, random_fully, nfacct, tcp_be_liberal)
        given = RenderArgs(
            snapshot,
            facts,
            rule_options(config),
            DEFAULT_STATE_DIR,
            config.port_range,
            nftables_layout,
        )
        sys.stdout.write(mode_spec(config.effective_mode).render(given))
    except UsageError as err:
        raise fail(str(err)) from None


def _check_layout(layout: str) -> None:
    from kproxy.dataplane.nftables.layouts import LAYOUTS

    if layout not in LAYOUTS:
        raise UsageError(f"--nftables-layout: {layout!r} is not {' or '.join(LAYOUTS)}")


def _render_facts(
    node_ip: list[str] | None,
    local_address: list[str] | None,
    random_fully: bool | None,
    nfacct: list[str] | None,
    tcp_be_liberal: bool | None,
) -> NodeFacts:
    """Given facts win; the rest is detected here (best effort, no root needed)."""
    need_detect = None in (random_fully, tcp_be_liberal) or not node_ip or local_address is None
    detected = NodeFacts()
    if need_detect:
        try:
            from kproxy.dataplane.nodefacts import detect_node_facts

            detected = detect_node_facts(node_ips=tuple(node_ip or ()))
        except Exception as err:  # detection is optional for a render
            log.info("could not detect node facts (%s); using defaults", err)
    return NodeFacts(
        node_ips=tuple(node_ip) if node_ip else detected.node_ips,
        local_addresses=tuple(local_address)
        if local_address is not None
        else detected.local_addresses,
        random_fully=detected.random_fully if random_fully is None else random_fully,
        nfacct_counters=frozenset(nfacct) if nfacct is not None else detected.nfacct_counters,
        tcp_be_liberal=detected.tcp_be_liberal if tcp_be_liberal is None else tcp_be_liberal,
    )


# --- cleanup --------------------------------------------------------------------------------------


def cleanup(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what would be removed, and why.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Remove the dataplane state of kproxy and upstream kube-proxy, every mode, only that.

    iptables chains of every kube-proxy mode in both backends (and the rules elsewhere that
    jump into them), the kube-proxy nftables tables, kube-ipvs0 and the ipvs ipsets.
    kubelet's chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY) and other software's state are
    never touched. Works in the current network namespace.
    """
    setup_logging(verbose)
    from kproxy.leftovers import clean_leftovers

    removed = clean_leftovers(None, dry_run=dry_run)
    if as_json:
        typer.echo(
            json.dumps({"dry_run": dry_run, "removed": [o.__dict__ for o in removed]}, indent=2)
        )
        return
    verb = "would remove" if dry_run else "removed"
    if not removed:
        typer.echo("nothing to remove: no kproxy or kube-proxy dataplane state here")
    for obj in removed:
        typer.echo(f"{verb} {obj}")


def _make_state_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--state-dir {path}: cannot create it: {err.strerror or err}") from None
    if not path.is_dir():
        raise UsageError(f"--state-dir {path}: not a directory")


def _nfacct_name(name: str) -> str:
    # The kernel's limit (NFACCT_NAME_MAX) and what nft/iptables rules can name.
    if not (0 < len(name) < 32 and name.isascii() and name.isprintable()) or " " in name:
        raise ValueError(f"{name!r} is not an nfacct counter name (1-31 characters, no spaces)")
    return name


def _admin_tcp(address: str | None) -> tuple[str, int] | None:
    if not address:
        return None
    try:
        return parse_admin_address(address)
    except ValueError as err:
        raise UsageError(f"--admin-address: {err}") from None
