"""`kproxy rollout`: plan, start, watch and steer a cluster rollout of a proxy mode.

Every verb talks to the API server only (a kubeconfig, like kubectl); the controller
(`kproxy rollout run`, or the Deployment in deploy/rollout/) does the work.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from kproxy.cli_common import checked

rollout_app = typer.Typer(
    no_args_is_help=True,
    help="Roll a proxy-mode switch out across a cluster: canary, batches, soak, breakers, "
    "automatic rollback. The verbs act through the API server only.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(rollout_app, name="rollout")


T = TypeVar("T")
EXIT_FAILED = 1
EXIT_USAGE = 2
PLAN_ANNOTATION = "proxy.kproxy.io/plan"
# Spelled here so that registering the commands loads nothing of the rollout's modules
# (`kproxy run` imports this file): checked against spec.KIND by the tests.
KIND = "ProxyRollout"

Kubeconfig = Annotated[
    Path | None,
    typer.Option(
        "--kubeconfig",
        help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, else in-cluster).",
    ),
]
Master = Annotated[str | None, typer.Option("--master", help="API server URL (overrides).")]
JsonOut = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
To = Annotated[
    str | None, typer.Option("--to", help="Target mode: iptables, nftables, ipvs or userspace.")
]
Selector = Annotated[
    str | None,
    typer.Option("--selector", "-l", help="Nodes to move, by label: key=value[,key=value]."),
]
Stages = Annotated[
    str,
    typer.Option(
        "--stages",
        help="Cumulative node counts or percentages of the nodes to move, the last 100%.",
    ),
]
MaxParallel = Annotated[
    str, typer.Option("--max-parallel", help="Nodes switching at once in each stage (N or N%).")
]
Soak = Annotated[str, typer.Option("--soak", help="Watch time after each stage (Go duration).")]
FromFile = Annotated[
    Path | None, typer.Option("-f", "--filename", help="A ProxyRollout manifest (YAML or JSON).")
]


def _seconds(value: float) -> float:
    from kproxy.config.durations import check_seconds

    return check_seconds(value)


def _object_name(text: str) -> str:
    from kproxy.model.parse import is_dns_subdomain

    if not is_dns_subdomain(text):
        raise ValueError(f"{text!r} is not an object name (lowercase RFC 1123, e.g. to-nft)")
    return text


def _namespace(text: str) -> str:
    from kproxy.model.parse import is_dns_label

    if not is_dns_label(text):
        raise ValueError(f"{text!r} is not a namespace name (lowercase RFC 1123 label)")
    return text


def _listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT to serve metrics on; an empty HOST is 127.0.0.1."""
    from kproxy.config.addresses import parse_ip, parse_port, split_host_port

    parts = split_host_port(text)
    if parts is None:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9090)")
    return (parse_ip(parts[0]) if parts[0] else "127.0.0.1"), parse_port(parts[1])


class RolloutUsageError(Exception):
    """A mistake in the command's arguments or manifest: one line, exit code 2."""


def _fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    typer.secho(f"kproxy: error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


def _settings(kubeconfig: Path | None, master: str | None) -> Any:
    from kproxy.sources.clientsettings import ClientSettings, in_cluster_available

    path = kubeconfig or (Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else None)
    if path is None:
        home = Path.home() / ".kube" / "config"
        if home.is_file() or not in_cluster_available():
            path = home
    return ClientSettings(kubeconfig=str(path) if path else "", master=master or "")


def _api(kubeconfig: Path | None, master: str | None, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run `work(connection)` against the API server; errors end the command in one line."""
    from kproxy.sources.clientsettings import ClientConfigError
    from kproxy.sources.kubeclient import ApiError, connect

    async def main() -> T:
        conn = await connect(_settings(kubeconfig, master))
        try:
            return await work(conn)
        finally:
            await conn.close()

    try:
        return asyncio.run(main())
    except ClientConfigError as err:
        raise _fail(str(err), EXIT_USAGE) from None
    except ApiError as err:
        raise _fail(f"API server: {err}") from None
    except OSError as err:
        raise _fail(f"API server unreachable: {err}") from None


def spec_from_options(
    to: str | None,
    selector: str | None,
    stages: str,
    max_parallel: str,
    soak: str,
    filename: Path | None,
) -> tuple[dict[str, Any], str | None]:
    """The spec (as written in a manifest) and the manifest's name, from -f or the flags."""
    if filename is not None:
        import yaml

        try:
            doc = yaml.safe_load(filename.read_text())
        except (OSError, yaml.YAMLError) as err:
            raise RolloutUsageError(f"{filename}: {err}") from None
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            raise RolloutUsageError(f"{filename}: not a {KIND} manifest")
        return doc.get("spec") or {}, (doc.get("metadata") or {}).get("name")
    if not to:
        raise RolloutUsageError("give --to MODE or -f FILE")
    spec: dict[str, Any] = {
        "targetMode": to,
        "soak": soak,
        "stages": [
            {"nodes": s.strip(), "maxParallel": max_parallel}
            for s in stages.split(",")
            if s.strip()
        ],
    }
    if selector:
        labels = {}
        for part in selector.split(","):
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                raise RolloutUsageError(f"--selector: {part!r} is not key=value")
            labels[key.strip()] = value.strip()
        spec["nodeSelector"] = {"matchLabels": labels}
    return spec, None


def spec_or_exit(
    *options: Any, extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str | None, Any]:
    """spec_from_options' raw spec (plus `extra` fields), its manifest name and the parsed
    spec; a mistake ends the command with exit code 2, naming the field."""
    from kproxy.cluster.rollout.spec import RolloutSpecError, parse_spec

    try:
        raw, name = spec_from_options(*options)
        raw.update(extra or {})
        return raw, name, parse_spec(raw)
    except (RolloutUsageError, RolloutSpecError) as err:
        raise _fail(str(err), EXIT_USAGE) from None


async def create_rollout(
    conn: Any, name: str, raw: dict[str, Any], fingerprint: str
) -> dict[str, Any]:
    """POST the ProxyRollout, remembering the plan it was created from."""
    from kproxy.cluster.rollout.controller import ROLLOUTS
    from kproxy.cluster.rollout.spec import API_VERSION
    from kproxy.sources.kubeclient import json_request

    body = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "annotations": {PLAN_ANNOTATION: fingerprint}},
        "spec": raw,
    }
    return await json_request(conn, "POST", ROLLOUTS, body=body)


async def _nodes(conn: Any) -> list[dict[str, Any]]:
    from kproxy.sources.kubeclient import json_request

    return (await json_request(conn, "GET", "/api/v1/nodes")).get("items") or []


async def ask_preflight(
    conn: Any, spec: Any, nodes: list[dict[str, Any]], timeout: float, tag: str
) -> dict[str, Any]:
    """Ask each node to move to preflight its switch (through its annotation); wait for the
    answers up to `timeout`. Nodes that do not answer are left out of the result."""
    from kproxy.cluster.annotations import PREFLIGHT_REQUEST, PREFLIGHT_RESULT
    from kproxy.cluster.rollout.plan import NodeInfo, PreflightAnswer
    from kproxy.sources.kubeclient import json_request

    asked: dict[str, str] = {}
    for n in map(NodeInfo.of, nodes):
        if not spec.node_selector.matches(n.labels) or n.mode in (None, spec.target_mode):
            continue
        ident = f"{tag}.{n.name}"
        request = json.dumps({"id": ident, "mode": spec.target_mode}, sort_keys=True)
        await json_request(
            conn,
            "PATCH",
            f"/api/v1/nodes/{n.name}",
            body={"metadata": {"annotations": {PREFLIGHT_REQUEST: request}}},
            content_type="application/merge-patch+json",
        )
        asked[n.name] = ident
    answers: dict[str, PreflightAnswer] = {}
    deadline = time.monotonic() + timeout
    while asked.keys() - answers.keys() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        for n in map(NodeInfo.of, await _nodes(conn)):
            if n.name not in asked or n.name in answers:
                continue
            try:
                got = json.loads(n.annotations.get(PREFLIGHT_RESULT, "") or "{}")
            except ValueError:
                continue
            if isinstance(got, dict) and got.get("id") == asked[n.name]:
                answers[n.name] = PreflightAnswer(
                    bool(got.get("ok")),
                    tuple(str(b) for b in got.get("blocks") or ()),
                    tuple(str(w) for w in got.get("warnings") or ()),
                )
    for name in asked:
        await json_request(
            conn,
            "PATCH",
            f"/api/v1/nodes/{name}",
            body={"metadata": {"annotations": {PREFLIGHT_REQUEST: None}}},
            content_type="application/merge-patch+json",
        )
    missing = sorted(asked.keys() - answers.keys())
    if missing:
        typer.secho(
            f"kproxy: warning: no preflight answer within {timeout:.0f} s from: "
            + ", ".join(missing),
            err=True,
            fg=typer.colors.YELLOW,
        )
    return answers


@rollout_app.command("plan")
def plan_command(
    to: To = None,
    selector: Selector = None,
    stages: Stages = "1,100%",
    max_parallel: MaxParallel = "1",
    soak: Soak = "15m",
    filename: FromFile = None,
    preflight: Annotated[
        bool, typer.Option(help="Ask each node to preflight its switch (through the API).")
    ] = True,
    preflight_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds to wait for the nodes' preflight answers.", callback=checked(_seconds)
        ),
    ] = 60.0,
    json_out: JsonOut = False,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """A dry run: the batches in order (spread across zones), each node's preflight, the
    estimated duration and what blocks the rollout. Changes nothing but the nodes'
    preflight-request annotations. Exit 1 when something blocks."""
    from kproxy.cluster.rollout.plan import make_plan
    from kproxy.cluster.rollout.view import plan_text

    _, _, spec = spec_or_exit(to, selector, stages, max_parallel, soak, filename)

    async def work(conn: Any) -> Any:
        nodes = await _nodes(conn)
        answers = {}
        if preflight:
            tag = f"plan-{uuid.uuid4().hex[:8]}"
            answers = await ask_preflight(conn, spec, nodes, preflight_timeout, tag)
        return make_plan(spec, nodes, preflight=answers)

    plan = _api(kubeconfig, master, work)
    typer.echo(json.dumps(plan.to_json(), indent=2) if json_out else plan_text(plan))
    if plan.blockers:
        raise typer.Exit(EXIT_FAILED)


@rollout_app.command("start")
def start_command(
    to: To = None,
    selector: Selector = None,
    stages: Stages = "1,100%",
    max_parallel: MaxParallel = "1",
    soak: Soak = "15m",
    filename: FromFile = None,
    name: Annotated[
        str | None,
        typer.Option("--name", help="The ProxyRollout's name.", callback=checked(_object_name)),
    ] = None,
    plan_id: Annotated[
        str | None,
        typer.Option("--plan", help="The plan fingerprint you approved (`rollout plan`)."),
    ] = None,
    json_out: JsonOut = False,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """Create the ProxyRollout. With --plan, refuses when the plan changed since it was
    shown (nodes, their modes, zones or readiness, or the spec); always refuses a plan
    with blockers."""
    from kproxy.cluster.rollout.plan import make_plan

    raw, manifest_name, spec = spec_or_exit(to, selector, stages, max_parallel, soak, filename)
    chosen = name or manifest_name or f"to-{spec.target_mode}-{time.strftime('%Y%m%d-%H%M%S')}"

    async def work(conn: Any) -> tuple[Any, dict[str, Any] | None]:
        plan = make_plan(spec, await _nodes(conn))
        if plan.blockers or (plan_id and plan_id != plan.fingerprint):
            return plan, None
        return plan, await create_rollout(conn, chosen, raw, plan.fingerprint)

    plan, created = _api(kubeconfig, master, work)
    if plan.blockers:
        raise _fail("the plan has blockers: " + "; ".join(plan.blockers))
    if created is None:
        raise _fail(
            f"the plan changed since you saw it (now {plan.fingerprint}, you approved "
            f"{plan_id}): run `kproxy rollout plan` again"
        )
    if json_out:
        typer.echo(json.dumps(created, indent=2))
    else:
        typer.echo(f"proxyrollout {chosen} created: {plan.node_count} node(s) to {plan.target}")


async def _get(conn: Any, name: str | None) -> dict[str, Any]:
    from kproxy.cluster.rollout.controller import ROLLOUTS
    from kproxy.sources.kubeclient import json_request

    if name:
        return await json_request(conn, "GET", f"{ROLLOUTS}/{name}")
    items = (await json_request(conn, "GET", ROLLOUTS)).get("items") or []
    if not items:
        raise RolloutUsageError("no ProxyRollout exists")
    return max(items, key=lambda o: o["metadata"].get("creationTimestamp", ""))


NameArg = Annotated[str | None, typer.Argument(help="The rollout (default: the most recent one).")]


@rollout_app.command("status")
def status_command(
    name: NameArg = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Follow until it ends.")] = False,
    json_out: JsonOut = False,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """Phase, stage, each node (stage, previous -> target, state, verify, last error) and
    the breakers' readings. Exit 1 when the rollout failed."""
    from kproxy.cluster.rollout import status as st
    from kproxy.cluster.rollout.view import status_text

    async def work(conn: Any) -> dict[str, Any]:
        shown = ""
        while True:
            obj = await _get(conn, name)
            text = (
                json.dumps({"name": obj["metadata"]["name"], **(obj.get("status") or {})})
                if json_out
                else status_text(obj)
            )
            if text != shown:
                typer.echo(text if not watch or json_out else f"{text}\n")
                shown = text
            phase = (obj.get("status") or {}).get("phase")
            if not watch or phase in st.TERMINAL:
                return obj
            await asyncio.sleep(2.0)

    try:
        obj = _api(kubeconfig, master, work)
    except RolloutUsageError as err:
        raise _fail(str(err)) from None
    if (obj.get("status") or {}).get("phase") == "Failed":
        raise typer.Exit(EXIT_FAILED)


def _request(
    name: str, verb: str, kubeconfig: Path | None, master: str | None, timeout: float = 30.0
) -> str:
    """Send an operator's request to the controller and wait for its answer."""
    from kproxy.cluster.rollout.controller import REQUEST_ANNOTATION, ROLLOUTS
    from kproxy.sources.kubeclient import json_request

    request = f"{uuid.uuid4().hex[:12]} {verb}"

    async def work(conn: Any) -> str:
        await json_request(
            conn,
            "PATCH",
            f"{ROLLOUTS}/{name}",
            body={"metadata": {"annotations": {REQUEST_ANNOTATION: request}}},
            content_type="application/merge-patch+json",
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = (await json_request(conn, "GET", f"{ROLLOUTS}/{name}")).get("status") or {}
            if status.get("handledRequest") == request:
                return str(status.get("message") or "done")
            await asyncio.sleep(0.5)
        raise RolloutUsageError(
            f"the controller did not answer within {timeout:.0f} s (is `kproxy rollout run` "
            "or the controller Deployment running?); the request stays on the object"
        )

    try:
        return _api(kubeconfig, master, work)
    except RolloutUsageError as err:
        raise _fail(str(err)) from None


NameRequired = Annotated[str, typer.Argument(help="The rollout.", callback=checked(_object_name))]


def _answer(name: str, verb: str, answer: str, json_out: bool, *, ok: bool = True) -> None:
    """The controller's answer to a request, as text or JSON."""
    if json_out:
        typer.echo(json.dumps({"rollout": name, "request": verb, "ok": ok, "answer": answer}))
    else:
        typer.echo(answer)


Timeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds to wait for the controller's answer.",
        callback=checked(_seconds),
    ),
]


@rollout_app.command("pause")
def pause_command(
    name: NameRequired,
    timeout: Timeout = 30.0,
    json_out: JsonOut = False,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """Stop starting new node switches; switches under way finish."""
    _answer(name, "pause", _request(name, "pause", kubeconfig, master, timeout), json_out)


@rollout_app.command("resume")
def resume_command(
    name: NameRequired,
    timeout: Timeout = 30.0,
    json_out: JsonOut = False,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """Go on after a pause or a trip. The controller reads the cluster breakers again first
    and refuses while one still trips. Exit 1 when refused."""
    answer = _request(name, "resume", kubeconfig, master, timeout)
    refused = answer.startswith("resume refused") or "not Paused" in answer
    _answer(name, "resume", answer, json_out, ok=not refused)
    if refused:
        raise typer.Exit(EXIT_FAILED)


@rollout_app.command("abort")
def abort_command(
    name: NameRequired,
    rollback: Annotated[
        str,
        typer.Option(
            "--rollback",
            help="none: leave every node as it is; batch: send the current batch back; "
            "all: send every node this rollout moved back.",
        ),
    ] = "batch",
    timeout: Timeout = 30.0,
    json_out: JsonOut = False,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """End the rollout (phase Failed), rolling back as asked; switches under way finish."""
    if rollback not in ("none", "batch", "all"):
        raise _fail(f"--rollback {rollback!r}: use none, batch or all", EXIT_USAGE)
    verb = f"abort:{rollback}"
    _answer(name, verb, _request(name, verb, kubeconfig, master, timeout), json_out)


@rollout_app.command("undo")
def undo_command(
    name: NameRequired,
    stages: Stages = "1,100%",
    max_parallel: MaxParallel = "1",
    soak: Soak = "15m",
    new_name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="The undo's name (default: NAME-undo).",
            callback=checked(_object_name),
        ),
    ] = None,
    json_out: JsonOut = False,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """Send every node the rollout NAME moved back to the mode it served before, as a
    rollout of its own (with its own stages, soak and breakers). NAME must have finished:
    abort it first (`--rollback none` leaves the rest to the undo)."""
    from kproxy.cluster.rollout import status as st
    from kproxy.cluster.rollout.plan import make_undo_plan
    from kproxy.cluster.rollout.spec import PREVIOUS

    raw, _, spec = spec_or_exit(
        PREVIOUS, None, stages, max_parallel, soak, None, extra={"undoOf": name}
    )
    chosen = new_name or f"{name}-undo"

    async def work(conn: Any) -> tuple[Any, dict[str, Any] | None]:
        undone = await _get(conn, name)
        status = st.RolloutStatus.of(undone)
        if status is None or status.phase not in st.TERMINAL:
            phase = status.phase if status else "not planned"
            raise RolloutUsageError(
                f"rollout {name} is {phase}: abort it first "
                f"(kproxy rollout abort {name} --rollback none)"
            )
        plan = make_undo_plan(spec, status, await _nodes(conn))
        if plan.blockers:
            return plan, None
        return plan, await create_rollout(conn, chosen, raw, plan.fingerprint)

    try:
        plan, created = _api(kubeconfig, master, work)
    except RolloutUsageError as err:
        raise _fail(str(err)) from None
    if created is None:
        raise _fail("the undo has blockers: " + "; ".join(plan.blockers))
    if json_out:
        typer.echo(json.dumps(created, indent=2))
    else:
        back = ", ".join(f"{n} -> {m}" for n, m in sorted(plan.targets.items()))
        typer.echo(f"proxyrollout {chosen} created: {plan.node_count} node(s) back ({back})")


@rollout_app.command("run")
def run_command(
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Steer only this rollout (default: all).",
            callback=checked(_object_name),
        ),
    ] = None,
    lease_namespace: Annotated[
        str,
        typer.Option(
            help="Namespace of the Lease that keeps one controller active.",
            callback=checked(_namespace),
        ),
    ] = "kube-system",
    interval: Annotated[
        float, typer.Option(help="Seconds between steps.", callback=checked(_seconds))
    ] = 2.0,
    lease_duration: Annotated[
        float,
        typer.Option(
            help="Seconds a stopped controller's Lease holds off its successor.",
            callback=checked(_seconds),
        ),
    ] = 15.0,
    metrics_address: Annotated[
        str | None,
        typer.Option(
            help="Serve kproxy_rollout_* metrics on HOST:PORT (default: off).",
            callback=checked(_listen_address),
        ),
    ] = None,
    kubeconfig: Kubeconfig = None,
    master: Master = None,
) -> None:
    """Run the rollout controller in the foreground until interrupted (Ctrl-C)."""
    import logging
    import signal

    from kproxy.cluster.rollout.controller import RolloutController
    from kproxy.cluster.rollout.metrics import RolloutMetrics
    from kproxy.sources.clientsettings import ClientConfigError
    from kproxy.text import log_to_stderr

    log_to_stderr(logging.INFO, "%(asctime)s %(name)s %(message)s")
    metrics = RolloutMetrics()
    if metrics_address:
        from prometheus_client import start_http_server

        host, port = _listen_address(metrics_address)
        try:
            start_http_server(port, addr=host, registry=metrics.registry)
        except OSError as err:
            raise _fail(
                f"--metrics-address {metrics_address}: {err.strerror or err}", EXIT_USAGE
            ) from None
    controller = RolloutController(
        _settings(kubeconfig, master),
        lease_namespace=lease_namespace,
        lease_duration=lease_duration,
        interval=interval,
        only=name,
        metrics=metrics,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await controller.run(stop)

    try:
        asyncio.run(main())
    except ClientConfigError as err:
        raise _fail(str(err), EXIT_USAGE) from None
