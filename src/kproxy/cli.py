"""The `kproxy` command: run, render, cleanup, lab, demo.

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

if sys.argv[1:2] == ["run"]:
    # The daemon's resident memory: typer imports rich (7.5 MiB resident) only to colour
    # help and usage errors; without it `kproxy run` prints click's plain ones.
    sys.modules.setdefault("rich", None)  # type: ignore[assignment]

import typer

from kproxy import __version__
from kproxy.config import ConfigError, ProxyConfig, apply_flags, load_config
from kproxy.dataplane.base import DataplaneUnavailable, check_mode_available
from kproxy.dataplane.facts import NodeFacts
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.lab.cli import lab_app
from kproxy.model.objects import Snapshot
from kproxy.server.admin import AdminBindError, AdminTarget, parse_admin_address

app = typer.Typer(
    help="kproxy: a Kubernetes service proxy compatible with kube-proxy, with safe live "
    "proxy-mode switching.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(lab_app, name="lab", help="Build and tear down the network-namespace lab.")

log = logging.getLogger("kproxy")


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit code 2."""


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.secho(f"kproxy: error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING - 10 * verbosity if verbosity < 2 else logging.DEBUG
    logging.basicConfig(
        level=min(level, logging.INFO) if verbosity >= 0 else logging.WARNING,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        stream=sys.stderr,
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
HostOpt = Annotated[
    str | None,
    typer.Option("--hostname-override", help="The node name (default: this machine's hostname)."),
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
NodeIpOpt = Annotated[
    list[str] | None,
    typer.Option("--node-ip", help="The node's primary IP (repeatable); default: detected."),
]
VerboseOpt = Annotated[
    int, typer.Option("--verbose", "-v", count=True, help="More logging (-v info, -vv debug).")
]


def build_config(
    config_path: Path | None, flags: dict[str, object | None]
) -> tuple[ProxyConfig, list[str]]:
    """Config file + explicitly given flags, validated; user errors become UserError."""
    given = {k: _flag_text(v) for k, v in flags.items() if v is not None}
    try:
        config = load_config(config_path)
        config, ignored = apply_flags(config, given)
        check_mode_available(config.effective_mode)
    except (ConfigError, DataplaneUnavailable) as err:
        raise UserError(str(err)) from None
    except FileNotFoundError as err:
        raise UserError(f"config file not found: {err.filename}") from None
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


EXTRA_FLAGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def parse_extra_flags(args: list[str]) -> dict[str, str]:
    """The kube-proxy flags without a dedicated option here (e.g. --conntrack-max-per-core=0,
    --ipvs-scheduler rr, --v=2), so an existing DaemonSet's arguments work unchanged."""
    from kproxy.config import FLAG_NAMES

    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise UserError(f"unexpected argument {arg!r}")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        if name not in FLAG_NAMES and name not in ("v", "logtostderr", "alsologtostderr"):
            raise UserError(f"unknown flag --{name} (see kproxy run --help)")
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


@app.command(context_settings=EXTRA_FLAGS)
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
    except UserError as err:
        raise fail(str(err)) from None
    klog_v = extra.pop("v", None)
    for name in ("logtostderr", "alsologtostderr"):
        extra.pop(name, None)
    setup_logging(max(verbose, int(klog_v) if klog_v and klog_v.isdigit() else 0))
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
        config, _ = build_config(config_path, flags)  # config.py logs the flags it ignores
        from kproxy.daemon import Daemon
        from kproxy.sources.cluster import ClientConfigError, prepare_source

        if backend not in ("auto", "nft", "legacy"):
            raise UserError(f"--iptables-backend: {backend!r} is not auto, nft or legacy")
        admin_tcp = _admin_tcp(admin_address)
        try:
            # The file source, or the API server (whose Node may give node IPs and a mode).
            objects = prepare_source(
                source, master, config, _node_name(config), tuple(node_ip or ())
            )
        except ClientConfigError as err:
            raise UserError(str(err)) from None
        daemon = Daemon(
            objects.config,
            source=objects.source,
            iptables_backend=backend,
            node_ips=objects.node_ips,
            state_dir=state_dir,
            node_name=_node_name(config),
            config_path=config_path,
            admin_address=admin_tcp,
        )
        daemon.start()
        objects.started(daemon)
    except (UserError, DataplaneUnavailable, AdminBindError) as err:
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
        objects.stop()
        daemon.stop()
        log.info("stopped; the rules stay in place")


# --- render ---------------------------------------------------------------------------------------


@app.command()
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
    node_ip: NodeIpOpt = None,
    local_address: Annotated[
        list[str] | None,
        typer.Option(
            "--local-address",
            help="An address on the node's interfaces (repeatable); default: detected.",
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
        typer.Option("--nfacct-counter", help="An existing nfacct counter (repeatable)."),
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

    Node facts a live sync detects (node IPs, local addresses, --random-fully support, nfacct
    counters, tcp_be_liberal) can be given as options so the output is reproducible on any
    machine; those not given are detected on this machine. Jump rules from the built-in
    chains (added once, only when missing) are not part of the output, as upstream.
    """
    setup_logging(verbose)
    from kproxy.config import rule_options
    from kproxy.dataplane.iptables.render import render_full
    from kproxy.model.snapshot import snapshot_from_objects
    from kproxy.sources.files import load_path

    try:
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
            objects, problems = load_path(source)
        except FileNotFoundError:
            raise UserError(f"source not found: {source}") from None
        for p in problems:
            typer.secho(f"kproxy: warning: {p}", err=True, fg=typer.colors.YELLOW)
        snapshot = snapshot_from_objects(objects.values(), _node_name(config))
        for rej in snapshot.rejections:
            typer.secho(
                f"kproxy: warning: skipping invalid {rej}", err=True, fg=typer.colors.YELLOW
            )
        facts = _render_facts(node_ip, local_address, random_fully, nfacct, tcp_be_liberal)
        if config.effective_mode == "nftables":
            from kproxy.dataplane.nftables.render import render_full as render_nft

            sys.stdout.write(render_nft(snapshot, facts, rule_options(config)))
        elif config.effective_mode == "userspace":
            from kproxy.dataplane.userspace.proxier import saved_ports
            from kproxy.dataplane.userspace.render import parse_port_range, render_text

            text = render_text(
                snapshot,
                facts,
                rule_options(config),
                previous_ports=saved_ports(DEFAULT_STATE_DIR),
                port_range=parse_port_range(config.port_range),
            )
            sys.stdout.write(text)
        elif config.effective_mode == "ipvs":
            from kproxy.dataplane.ipvs.render import render_text as render_ipvs

            sys.stdout.write(render_ipvs(snapshot, facts, rule_options(config)))
        else:
            sys.stdout.write(render_full(snapshot, facts, rule_options(config)))
    except UserError as err:
        raise fail(str(err)) from None


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


@app.command()
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


# --- status --------------------------------------------------------------------------------------

StateDirOpt = Annotated[
    Path, typer.Option("--state-dir", help="The state dir of the kproxy to ask (as given to run).")
]


AdminAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--admin-address",
        help="Ask over the proxy's loopback TCP admin endpoint (IP:PORT, as given to run) "
        "instead of the state dir's unix socket.",
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--admin-token-file",
        help="The token for --admin-address (default: admin.token in --state-dir).",
    ),
]


def _admin_tcp(address: str | None) -> tuple[str, int] | None:
    if not address:
        return None
    try:
        return parse_admin_address(address)
    except ValueError as err:
        raise UserError(f"--admin-address: {err}") from None


def _admin_target(state_dir: Path, address: str | None, token_file: Path | None) -> AdminTarget:
    """The running proxy's admin endpoint; a usage error (exit 2) names what is wrong."""
    try:
        return AdminTarget.of(state_dir, address, token_file)
    except ValueError as err:
        raise fail(f"--admin-address: {err}") from None


def _age(ts: float | None) -> str:
    import time

    if not ts:
        return "never"
    return f"{time.time() - ts:.1f} s ago"


@app.command()
def status(
    state_dir: StateDirOpt = DEFAULT_STATE_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    admin_address: AdminAddressOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Mode, health, syncs and the last error of the running kproxy (over its admin socket)."""
    from kproxy.server.admin import AdminUnavailable, call

    target = _admin_target(state_dir, admin_address, token_file)
    try:
        st = call(target, {"op": "status"}, timeout=10)
        running = True
        if st.get("ok") is False:  # it answered, and refused (a wrong token, say)
            raise fail(f"kproxy refused the request: {st.get('error')}", code=1)
    except AdminUnavailable as err:
        saved = state_dir / "status.json"
        if not saved.exists():
            raise fail(str(err), code=1) from None
        st = json.loads(saved.read_text())
        running = False
        typer.secho(
            f"kproxy: {err}; showing the last saved status", err=True, fg=typer.colors.YELLOW
        )
    st["running"] = running
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        raise typer.Exit(0 if running else 1)
    res = st.get("last_result") or {}
    lines = [
        f"mode:            {st.get('mode')}  (node {st.get('node')}, pid {st.get('pid')}, "
        f"{'running' if running else 'NOT running'})",
        f"last sync:       {_age(st.get('last_sync'))}, took {st.get('last_duration') or 0:.3f} s "
        f"({'full' if res.get('full') else 'partial'}); "
        f"last full sync {_age(st.get('last_full_sync'))}",
        f"syncs:           {st.get('syncs')} ({st.get('full_syncs')} full), "
        f"failures {st.get('failures')}",
        f"service ports:   {st.get('services')}; rules owned {res.get('rules_total', {})}",
        f"pending changes: {'yes' if st.get('pending') else 'no'}",
        f"invalid objects: {st.get('invalid_objects')}",
    ]
    lines += [f"  - {r}" for r in st.get("rejections", [])[:20]]
    if st.get("last_error"):
        lines.append(f"last error:      {st['last_error']}")
    typer.echo("\n".join(lines))
    raise typer.Exit(0 if running else 1)


# --- switch --------------------------------------------------------------------------------------


@app.command()
def switch(
    to: Annotated[
        str, typer.Option("--to", help="The mode to switch to, or 'previous' to roll back.")
    ],
    timeout: Annotated[
        float, typer.Option("--timeout", help="Give up (and keep the old mode) after S s.")
    ] = 60.0,
    state_dir: StateDirOpt = DEFAULT_STATE_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Switch even if preflight blocks (logged, in the report)."),
    ] = False,
    config_path: Annotated[
        Path | None, typer.Option("--config", help="For preflight (default: the running one's).")
    ] = None,
    source: Annotated[
        Path | None, typer.Option("--source", help="For preflight (default: the running one's).")
    ] = None,
    admin_address: AdminAddressOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Switch the running kproxy to another proxy mode, live and make-before-break.

    First `kproxy preflight --to MODE` runs; a blocking finding refuses the switch (exit
    code 1, nothing changed) unless --force. The new mode is programmed beside the old one
    and verified (every service in the kernel, a self-probe of a sample of services); only
    then is the old mode taken out of the packet path in one step and its state removed. If
    anything fails before that, the old mode keeps serving untouched and the report says
    why. Exit code 0 on success.
    """
    from kproxy.ops.preflight.cli import UsageError, print_gate, switch_gate
    from kproxy.server.admin import AdminUnavailable, call

    target = _admin_target(state_dir, admin_address, token_file)
    try:
        gate = switch_gate(
            to,
            state_dir=state_dir,
            force=force,
            config_path=config_path,
            source=source,
            admin=target,
        )
    except UsageError as err:
        raise fail(str(err)) from None
    if gate is not None and not as_json:
        print_gate(gate)
    if gate is not None and gate.refused:
        refusal = gate.refusal()
        if as_json:
            typer.echo(json.dumps(refusal, indent=2))
            raise typer.Exit(1)
        raise fail(refusal["error"], code=1)
    try:
        request: dict[str, object] = {"op": "switch", "to": to, "timeout": timeout, "force": force}
        before = gate.backup_path() if gate is not None else None
        if before is not None:
            request["before"] = before
        report = call(target, request, timeout=timeout + 30)
    except AdminUnavailable as err:
        raise fail(str(err), code=1) from None
    if gate is not None:
        report = gate.annotate(report)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        raise typer.Exit(0 if report.get("ok") else 1)
    if "steps" not in report:
        raise fail(str(report.get("error")), code=1)
    for st in report["steps"]:
        typer.echo(f"  {st['name']:<15} {st['seconds']:8.3f} s  {st['detail']}")
    if report.get("ok"):
        typer.secho(
            f"switched {report['from_mode']} -> {report['to_mode']} in {report['duration']:.2f} s; "
            f"{report.get('removed_total', 0)} objects of {report['from_mode']} removed"
            + (" (FORCED past blocking preflight findings)" if report.get("forced") else ""),
            fg=typer.colors.GREEN,
        )
        if report.get("removed_file"):
            typer.echo(f"  the removed objects, one a line: {report['removed_file']}")
        raise typer.Exit(0)
    typer.secho(
        f"switch {report['from_mode']} -> {report['to_mode']} FAILED, "
        f"{report['from_mode']} is still serving: {report.get('error')}",
        fg=typer.colors.RED,
        err=True,
    )
    raise typer.Exit(1)


# --- preflight and doctor (bodies in kproxy.ops.preflight / kproxy.ops.doctor) -------------------

from kproxy.ops.doctor.cli import doctor_command  # noqa: E402
from kproxy.ops.preflight.cli import preflight_command  # noqa: E402

app.command("preflight")(preflight_command)
app.command("doctor")(doctor_command)


# --- list and trace ------------------------------------------------------------------------------

InspectModeOpt = Annotated[
    str | None,
    typer.Option(
        "--mode",
        help="Which dataplane to read when two are live (mid-switch): iptables, "
        "iptables-nft, iptables-legacy, nftables, userspace, userspace-nft or userspace-legacy.",
    ),
]
DriftSourceOpt = Annotated[
    Path | None,
    typer.Option("--source", help="Objects to compare the kernel with (reports drift)."),
]


def _drift_snapshot(source: Path | None, hostname: str | None) -> Snapshot | None:
    if source is None:
        return None
    import socket

    from kproxy.model.snapshot import snapshot_from_objects
    from kproxy.sources.files import load_path

    try:
        objects, _ = load_path(source)
    except FileNotFoundError:
        raise UserError(f"source not found: {source}") from None
    return snapshot_from_objects(objects.values(), (hostname or socket.gethostname()).lower())


@app.command("list")
def list_command(
    stats: Annotated[
        bool, typer.Option("--stats", help="Packet/byte counters per endpoint.")
    ] = False,
    rate: Annotated[
        bool, typer.Option("--rate", help="Per-second rates (two reads 1 s apart).")
    ] = False,
    sort: Annotated[
        bool, typer.Option("--sort", help="Sort by protocol, address and port.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    mode: InspectModeOpt = None,
    source: DriftSourceOpt = None,
    hostname: HostOpt = None,
) -> None:
    """The services the kernel programs now, in the `ipvsadm -Ln` layout: each virtual
    address with its scheduler and flags, each endpoint with ActiveConn / InActConn from
    conntrack (from the workers in userspace mode). Read from the kernel, so it shows what
    is really there."""
    from kproxy.ops.inspect import ModeSelectionError, list_services

    try:
        result = list_services(
            mode=mode, stats=stats, rate=rate, sort=sort, snapshot=_drift_snapshot(source, hostname)
        )
    except (ModeSelectionError, UserError) as err:
        raise fail(str(err)) from None
    typer.echo(result.to_json() if as_json else result.text())


@app.command("trace")
def trace_command(
    src: Annotated[str, typer.Option("--from", help="Source IP of the new connection.")],
    to: Annotated[str, typer.Option("--to", help="Destination IP:PORT.")],
    proto: Annotated[str, typer.Option("--proto", help="tcp or udp.")] = "tcp",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    mode: InspectModeOpt = None,
    from_node: Annotated[
        bool | None,
        typer.Option(
            "--from-node/--not-from-node", help="Default: decided from the node's addresses."
        ),
    ] = None,
    source: DriftSourceOpt = None,
    hostname: HostOpt = None,
) -> None:
    """Where a new connection goes and why: the chain and rule path (iptables), the
    map and chain path (nftables), the redirect rules to a worker's listener and its choice
    of endpoint (userspace), computed from what the kernel and the workers hold."""
    from kproxy.ops.inspect import ModeSelectionError, trace

    ip, sep, port_text = to.rpartition(":")
    if not sep or not port_text.isdigit():
        raise fail(f"--to: {to!r} is not IP:PORT")
    try:
        result = trace(
            src,
            ip,
            int(port_text),
            proto,
            mode=mode,
            from_node=from_node,
            snapshot=_drift_snapshot(source, hostname),
        )
    except (ModeSelectionError, ValueError, UserError) as err:
        raise fail(str(err)) from None
    typer.echo(result.to_json() if as_json else result.text())


# --- verify (body in kproxy.ops.verify) ----------------------------------------------------------

from kproxy.ops.verify import verify_command  # noqa: E402

app.command("verify")(verify_command)


# --- snapshot and diff ---------------------------------------------------------------------------


@app.command()
def snapshot(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here (default: stdout).")
    ] = None,
) -> None:
    """Record this node's dataplane (iptables of both backends, nftables, IPVS, ipsets,
    kube-ipvs0, conntrack usage) as one JSON document. Read only."""
    from kproxy.ops.snapshot import programmed_in, take
    from kproxy.ops.snapshot_file import write_node_snapshot

    if output is None:
        json.dump(take(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    write_node_snapshot(output)
    found = programmed_in(json.loads(output.read_text()))
    summary = ", ".join(f"{name}: {len(keys)} service destinations" for name, keys in found.items())
    typer.echo(f"wrote {output} ({summary or 'no kube-proxy dataplane found'})")


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="The earlier snapshot.")],
    b: Annotated[Path, typer.Argument(help="The later snapshot.")],
) -> None:
    """Compare two snapshots, mode-aware: which service destinations one programs and the
    other lacks, in which dataplane. Exit code 1 when B misses something A had."""
    from kproxy.ops.snapshot import FORMAT
    from kproxy.ops.snapshot import diff as compare

    docs = []
    for path in (a, b):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise fail(f"cannot read snapshot {path}: {err}") from None
        if doc.get("format") != FORMAT:
            raise fail(f"{path} is not a kproxy snapshot (format {doc.get('format')!r})")
        docs.append(doc)
    lines = compare(*docs)
    typer.echo("\n".join(lines))
    raise typer.Exit(1 if any(line.startswith("missing in B") for line in lines) else 0)


# --- demo and version -----------------------------------------------------------------------------


@app.command()
def demo(
    keep: Annotated[bool, typer.Option("--keep", help="Leave the lab running at the end.")] = False,
) -> None:
    """Build the lab, run kproxy on its node, send traffic, edit a service live, tear down."""
    from kproxy.demo import run_demo

    raise typer.Exit(run_demo(keep=keep))


@app.command()
def version() -> None:
    """Print the kproxy version."""
    typer.echo(f"kproxy {__version__}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
