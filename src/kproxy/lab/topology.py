"""The network-namespace lab: one node (the proxy host), client namespaces and pod namespaces.

```
c1 10.100.0.2 ─┐                          ┌─ veth-p1 ── p1 eth0 10.244.0.2/32
c2 10.100.0.3 ─┴─ br-ext 10.100.0.1 [node]┼─ veth-p2 ── p2 eth0 10.244.0.3/32
                                          └─ veth-p3 ── p3 eth0 10.244.0.4/32
```

- Clients sit on a bridge with the node IP; their default route is the node, so external
  and LoadBalancer IPs (for example 10.99.0.10) are routed to the node.
- Pods are routed, Calico-style, not bridged: each pod has a /32 and a default route via
  the link-local gateway 169.254.1.1, which the node's veth answers by proxy ARP. Every
  pod-to-anything packet is therefore forwarded by the node's IP stack and passes its
  netfilter hooks (no br_netfilter needed).
- The node has no address in the pod CIDR. Packets the node sends to pods, and packets it
  masquerades towards pods, carry the node IP 10.100.0.1 (br-ext is the first interface
  with an address, which is what MASQUERADE falls back to for an address-less veth).
- Unused pod-CIDR addresses are blackholed on the node, like Calico's block route, so
  they are silent (probes time out), e.g. `Lab.silent_ip`.
- The node's default route points at 10.100.0.254, which does not exist; it only has to
  exist so that node-originated ClusterIP traffic gets past the route lookup (G4).

With nodes=N (N > 1) the lab is a small cluster: node 1 keeps the layout above and br-ext,
and nodes 2..N hang off br-ext too (node i at 10.100.0.(240+i), its eth0 on the bridge), each
with its own pod CIDR 10.244.(i-1).0/24 and routes to the other nodes' pod CIDRs via their
node IPs. Pods are spread over the nodes in turn; every node's veths, proxy ARP and pod
routes are built as node 1's.

```
c1 ─┐              ┌─ pods of node 1 (10.244.0.x)
    ├─ br-ext [node]┤
n2 ─┤ 10.100.0.242  └─ ...          [node2] ── pods of node 2 (10.244.1.x)
n3 ─┘ 10.100.0.243                  [node3] ── pods of node 3 (10.244.2.x)
```

Every veth is created inside a node namespace with its peer moved straight into the other
namespace, so nothing is ever created in the host's root namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kproxy
from kproxy.host.netns import NETNS_DIR
from kproxy.lab.agent import ProbeAgent, ProbeError, ProbeResult

__all__ = [
    "CLUSTER_CIDR",
    "NODE_IP",
    "POD_CIDR",
    "STATE_DIR",
    "Lab",
    "LabCommandError",
    "LabError",
    "PodSpec",
    "ProbeAgent",
    "ProbeError",
    "ProbeResult",
]

STATE_DIR = Path("/run/kproxy-lab")

NODE_IP = "10.100.0.1"
EXTERNAL_PREFIX_LEN = 24
NODE_GATEWAY = "10.100.0.254"  # nothing answers here; see the module docstring
POD_GATEWAY = "169.254.1.1"
POD_CIDR = "10.244.0.0/24"
CLUSTER_CIDR = "10.244.0.0/16"
SILENT_IP = "10.244.0.254"
MAX_PODS = 250
MAX_CLIENTS = 250
MAX_NODES = 9
MAX_CLIENTS_MULTI_NODE = 200  # node i > 1 sits at 10.100.0.(240+i)

READY_TIMEOUT = 20.0
TERM_GRACE = 2.0


class LabError(RuntimeError):
    pass


class LabCommandError(subprocess.CalledProcessError):
    """CalledProcessError whose message includes stderr, which is where ip/sysctl explain."""

    def __str__(self) -> str:
        detail = (self.stderr or "").strip()
        return f"{super().__str__()}: {detail}" if detail else super().__str__()


def find_tool(name: str) -> str:
    # Root's PATH normally has /usr/sbin, but pytest may run with a trimmed environment.
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if not found:
        raise LabError(f"required tool {name!r} not found")
    return found


def lab_supported() -> tuple[bool, str]:
    """Whether this process can build a lab; the reason is meant for pytest skip messages."""
    if os.geteuid() != 0:
        return False, "kernel tests need root (network namespaces)"
    for tool in ("ip", "sysctl"):
        try:
            find_tool(tool)
        except LabError as exc:
            return False, str(exc)
    return True, ""


def _src_root() -> str:
    return str(Path(kproxy.__file__).resolve().parent.parent)


def _proc_starttime(pid: int) -> int | None:
    """Start time in clock ticks: with the PID it identifies a process across PID reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


@dataclass(frozen=True)
class LabNode:
    """One node of the lab: its namespace, IP on br-ext's segment and pod CIDR."""

    name: str  # "node1", "node2", ...: its Node object's name in a cluster lab
    ns: str
    ip: str
    pod_cidr: str
    uplink: str  # the node's interface on br-ext's segment


@dataclass(frozen=True)
class PodSpec:
    name: str
    tcp_ports: tuple[int, ...] = (8080, 9090)
    udp_ports: tuple[int, ...] = (8080,)


@dataclass
class _Proc:
    pid: int
    starttime: int | None
    ns: str
    argv: list[str]
    role: str
    popen: subprocess.Popen[Any] | None = field(default=None, repr=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.starttime is not None and _proc_starttime(self.pid) == self.starttime

    def signal(self, sig: int) -> None:
        # Only signal the process we started: the recorded start time guards against a
        # recycled PID when the lab was loaded from its state file.
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.send_signal(sig)
        elif self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "starttime": self.starttime,
            "ns": self.ns,
            "argv": self.argv,
            "role": self.role,
        }


_LIVE_LABS: weakref.WeakSet[Lab] = weakref.WeakSet()


@atexit.register
def _down_leftover_labs() -> None:
    for lab in list(_LIVE_LABS):
        with contextlib.suppress(Exception):
            lab.down()


class Lab:
    """A lab instance. Use as a context manager, or call up() and down() (idempotent)."""

    def __init__(
        self,
        pods: int | Sequence[PodSpec] = 3,
        clients: int = 2,
        prefix: str = "kp",
        python: str = sys.executable,
        no_time_wait: bool = True,
        *,
        lab_id: str | None = None,
        nodes: int = 1,
    ) -> None:
        if not (prefix.isascii() and prefix.isalnum() and 0 < len(prefix) <= 6):
            raise ValueError("prefix must be 1-6 ASCII letters/digits")
        specs = (
            [PodSpec(f"pod{i}") for i in range(1, pods + 1)]
            if isinstance(pods, int)
            else (list(pods))
        )
        if not 0 < len(specs) <= MAX_PODS or not 0 <= clients <= MAX_CLIENTS:
            raise ValueError(f"need 1..{MAX_PODS} pods and 0..{MAX_CLIENTS} clients")
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("pod names must be unique")
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"need 1..{MAX_NODES} nodes")
        if nodes > 1 and clients > MAX_CLIENTS_MULTI_NODE:
            raise ValueError(
                f"a lab of several nodes has room for {MAX_CLIENTS_MULTI_NODE} clients"
            )
        self.prefix = prefix
        self.python = python
        self.no_time_wait = no_time_wait
        self.pods: tuple[PodSpec, ...] = tuple(specs)
        self.id = lab_id or self._new_id(prefix)

        self.node_ns = f"{self.id}-node"
        self.client_ns = [f"{self.id}-c{i}" for i in range(1, clients + 1)]
        self.pod_ns = [f"{self.id}-p{i}" for i in range(1, len(specs) + 1)]
        self.node_ip = NODE_IP
        self.node_gateway = NODE_GATEWAY
        self.client_ips = [f"10.100.0.{1 + i}" for i in range(1, clients + 1)]
        self.nodes = [
            LabNode("node1", self.node_ns, NODE_IP, POD_CIDR, "br-ext"),
            *(
                LabNode(
                    f"node{i}",
                    f"{self.id}-node{i}",
                    f"10.100.0.{240 + i}",
                    f"10.244.{i - 1}.0/24",
                    "eth0",
                )
                for i in range(2, nodes + 1)
            ),
        ]
        # Pods in turn over the nodes; the k-th pod of a node at .(1+k) of its pod CIDR.
        self.pod_nodes = {spec.name: self.nodes[i % nodes] for i, spec in enumerate(specs)}
        self.pod_ips = {
            spec.name: f"{self.pod_nodes[spec.name].pod_cidr.rsplit('.', 1)[0]}.{1 + k}"
            for i, spec in enumerate(specs)
            for k in [1 + i // nodes]
        }
        self.pod_cidr = POD_CIDR
        self.cluster_cidr = CLUSTER_CIDR
        self.silent_ip = SILENT_IP

        self.up_seconds: float | None = None
        self.down_seconds: float | None = None
        self._ip = find_tool("ip")
        self._procs: list[_Proc] = []
        self._agents: dict[str, ProbeAgent] = {}
        self._state = "new"  # new -> up -> down
        self._owner: dict[str, Any] = {}  # only set for labs loaded from a state file
        self.created = time.time()

    # -- naming -----------------------------------------------------------------------

    @staticmethod
    def _new_id(prefix: str) -> str:
        existing = _existing_netns()
        for _ in range(100):
            candidate = f"{prefix}{secrets.token_hex(3)}"
            taken = any(ns.startswith(f"{candidate}-") for ns in existing)
            if not taken and not (STATE_DIR / f"{candidate}.json").exists():
                return candidate
        raise LabError("could not find a free lab id")

    @property
    def namespaces(self) -> list[str]:
        return [*(n.ns for n in self.nodes), *self.client_ns, *self.pod_ns]

    def node(self, name: str) -> LabNode:
        for n in self.nodes:
            if name in (n.name, n.ns):
                return n
        raise KeyError(name)

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.id}.json"

    @property
    def log_dir(self) -> Path:
        return STATE_DIR / self.id

    def pod_ns_of(self, pod: str) -> str:
        for spec, ns in zip(self.pods, self.pod_ns, strict=True):
            if spec.name == pod:
                return ns
        raise KeyError(pod)

    def is_running(self) -> bool:
        return self._state == "up" and (NETNS_DIR / self.node_ns).exists()

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Lab:
        if self._state != "new":
            raise LabError(f"lab {self.id} is already {self._state}")
        started = time.perf_counter()
        self._state = "up"
        _LIVE_LABS.add(self)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # Written before anything exists, so a crash mid-way still leaves a trail for
            # `kproxy lab down`.
            self._write_state()
            self._create_namespaces()
            self._configure()
            self._start_pod_servers()
        except BaseException as exc:
            try:
                self.down()
            except Exception as cleanup:
                # The build failure is the news; a failed cleanup is attached, not swapped in.
                exc.add_note(f"lab cleanup also failed: {cleanup}")
            raise
        self.up_seconds = time.perf_counter() - started
        return self

    def down(self) -> None:
        """Stop every process this lab started (by PID) and delete its namespaces."""
        if self._state == "down":
            return
        started = time.perf_counter()
        self._state = "down"
        _LIVE_LABS.discard(self)
        # Every step runs even if an earlier one failed: leaking namespaces is the worst outcome.
        errors: list[Exception] = []
        for step in (self._close_agents, self._stop_processes, self._delete_namespaces):
            try:
                step()
            except Exception as exc:
                errors.append(exc)
        if any(ns in _existing_netns() for ns in self.namespaces):
            # Keep the state file so that `kproxy lab down ID` can retry later.
            self._write_state()
        else:
            with contextlib.suppress(OSError):
                self.state_file.unlink()
            shutil.rmtree(self.log_dir, ignore_errors=True)
        self.down_seconds = time.perf_counter() - started
        if errors:
            raise errors[0]

    def _close_agents(self) -> None:
        agents, self._agents = list(self._agents.values()), {}
        for agent in agents:
            with contextlib.suppress(Exception):
                agent.close(timeout=0.5)

    def detach(self) -> None:
        """Leave the lab running after this process exits (the CLI's `up`)."""
        _LIVE_LABS.discard(self)
        for proc in self._procs:
            proc.popen = None

    # -- commands in namespaces -------------------------------------------------------

    def _check_ns(self, ns: str) -> None:
        # Guards the host: commands only ever run in namespaces this lab owns.
        if ns not in self.namespaces:
            raise ValueError(f"{ns!r} is not a namespace of lab {self.id}")

    def exec(
        self,
        ns: str,
        argv: Sequence[str],
        check: bool = True,
        input: str | None = None,
        timeout: float = 30,
    ) -> subprocess.CompletedProcess[str]:
        self._check_ns(ns)
        cmd = [self._ip, "netns", "exec", ns, *argv]
        proc = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise LabCommandError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def spawn(self, ns: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start a long-running process in ns; down() stops it by PID."""
        return self._spawn(ns, argv, Path(argv[0]).name if argv else "?", **popen_kwargs)

    def _spawn(
        self, ns: str, argv: Sequence[str], role: str, log: str | None = None, **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        self._check_ns(ns)
        if self._state != "up":
            raise LabError(f"lab {self.id} is not up")
        popen_kwargs.setdefault("env", self.process_env())
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        # Own session: a Ctrl-C in the terminal must not kill lab processes behind down()'s
        # back, and CLI-started labs must survive the CLI exiting.
        popen_kwargs.setdefault("start_new_session", True)
        # `ip netns exec` execs the command in place, so this PID is the command itself.
        cmd = [self._ip, "netns", "exec", ns, *argv]
        if log is None:
            popen = subprocess.Popen(cmd, **popen_kwargs)
        else:
            with (self.log_dir / f"{log}.log").open("ab") as stderr:
                popen = subprocess.Popen(cmd, stderr=stderr, **popen_kwargs)
        starttime = _proc_starttime(popen.pid)
        self._procs.append(_Proc(popen.pid, starttime, ns, list(argv), role, popen))
        self._write_state()
        return popen

    def agent(self, ns: str) -> ProbeAgent:
        """The probe agent of ns: started on first use, restarted if it died."""
        cached = self._agents.get(ns)
        if cached is not None and cached.alive:
            return cached
        popen = self._spawn(
            ns,
            [self.python, "-m", "kproxy.lab.agent"],
            "agent",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            log=f"agent-{ns}",
            text=True,
            bufsize=1,
        )
        agent = ProbeAgent(popen, ns)
        self._agents[ns] = agent
        return agent

    # -- building ---------------------------------------------------------------------

    def process_env(self) -> dict[str, str]:
        """The environment of the processes the lab starts (kproxy's sources importable)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_src_root(), env.get("PYTHONPATH", "")) if p
        )
        return env

    def _ip_batch(
        self, lines: Iterable[str], ns: str | None = None, force: bool = False
    ) -> subprocess.Popen[str]:
        cmd = [self._ip, *(["-n", ns] if ns else []), *(["-force"] if force else []), "-batch", "-"]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin is not None
        proc.stdin.write("\n".join(lines) + "\n")
        proc.stdin.close()
        # Tell communicate() there is nothing left to send; the batch now runs in parallel
        # with whatever the caller starts next.
        proc.stdin = None
        return proc

    @staticmethod
    def _wait_all(procs: Iterable[subprocess.Popen[str]]) -> None:
        failures = []
        for proc in procs:
            _, err = proc.communicate(timeout=30)
            if proc.returncode != 0:
                failures.append(LabCommandError(proc.returncode, proc.args, None, err))
        if failures:
            raise failures[0]

    def _sysctl(self, ns: str, settings: dict[str, str | int]) -> subprocess.Popen[str]:
        argv = [find_tool("sysctl"), "-q", "-w", *(f"{k}={v}" for k, v in settings.items())]
        return subprocess.Popen(
            [self._ip, "netns", "exec", ns, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _create_namespaces(self) -> None:
        existing = _existing_netns()
        clash = [ns for ns in self.namespaces if ns in existing]
        if clash:
            raise LabError(f"namespaces already exist: {clash}")
        self._wait_all([self._ip_batch(f"netns add {ns}" for ns in self.namespaces)])

    def _configure(self) -> None:
        # Before any interface exists, so every interface inherits rp_filter=0 from
        # "default" (new namespaces copy the host's all/default values).
        self._wait_all(
            [
                self._sysctl(
                    node.ns,
                    {
                        "net.ipv4.ip_forward": 1,
                        "net.ipv4.conf.all.rp_filter": 0,
                        "net.ipv4.conf.default.rp_filter": 0,
                        # The kernel rate-limits ICMP errors per client (a burst, then
                        # 1/s): a REJECTed service would look like a timeout to many probes.
                        "net.ipv4.icmp_ratelimit": 0,
                    },
                )
                for node in self.nodes
            ]
        )

        hub = self.nodes[0]
        lines = [
            "link set lo up",
            "link add br-ext type bridge",
            f"addr add {NODE_IP}/{EXTERNAL_PREFIX_LEN} dev br-ext",
            "link set br-ext up",
        ]
        for i, ns in enumerate(self.client_ns, 1):
            lines += [
                f"link add veth-c{i} type veth peer name eth0 netns {ns}",
                f"link set veth-c{i} master br-ext up",
            ]
        for i, node in enumerate(self.nodes[1:], 2):
            lines += [
                f"link add veth-n{i} type veth peer name {node.uplink} netns {node.ns}",
                f"link set veth-n{i} master br-ext up",
            ]
        per_node: dict[str, list[str]] = {node.ns: [] for node in self.nodes}
        per_node[hub.ns] = lines
        for node in self.nodes[1:]:
            per_node[node.ns] += [
                "link set lo up",
                f"addr add {node.ip}/{EXTERNAL_PREFIX_LEN} dev {node.uplink}",
                f"link set {node.uplink} up",
            ]
        for i, (spec, ns) in enumerate(zip(self.pods, self.pod_ns, strict=True), 1):
            node, ip = self.pod_nodes[spec.name], self.pod_ips[spec.name]
            per_node[node.ns] += [
                f"link add veth-p{i} type veth peer name eth0 netns {ns}",
                f"link set veth-p{i} up",
                f"route add {ip}/32 dev veth-p{i} src {node.ip}",
            ]
        for node in self.nodes:
            per_node[node.ns] += [
                f"route add default via {NODE_GATEWAY} dev {node.uplink}",
                f"route add blackhole {node.pod_cidr}",
                *(
                    f"route add {other.pod_cidr} via {other.ip} dev {node.uplink}"
                    for other in self.nodes
                    if other is not node
                ),
            ]
        self._wait_all([self._ip_batch(per_node[hub.ns], hub.ns)])
        self._wait_all([self._ip_batch(per_node[node.ns], node.ns) for node in self.nodes[1:]])

        batches: list[subprocess.Popen[str]] = []
        veth_settings: dict[str, dict[str, str | int]] = {node.ns: {} for node in self.nodes}
        for i, spec in enumerate(self.pods, 1):
            # proxy_delay=0: the default answers proxy ARP only after a random delay of up
            # to 0.8 s, which would stall every pod's first packet.
            settings = veth_settings[self.pod_nodes[spec.name].ns]
            settings[f"net.ipv4.conf.veth-p{i}.proxy_arp"] = 1
            settings[f"net.ipv4.neigh.veth-p{i}.proxy_delay"] = 0
        batches += [self._sysctl(ns, s) for ns, s in veth_settings.items() if s]
        for ns, ip in zip(self.pod_ns, self.pod_ips.values(), strict=True):
            batches.append(
                self._ip_batch(
                    [
                        "link set lo up",
                        f"addr add {ip}/32 dev eth0",
                        "link set eth0 up",
                        f"route add {POD_GATEWAY} dev eth0 scope link",
                        f"route add default via {POD_GATEWAY} dev eth0",
                    ],
                    ns,
                )
            )
        for ns, ip in zip(self.client_ns, self.client_ips, strict=True):
            batches.append(
                self._ip_batch(
                    [
                        "link set lo up",
                        f"addr add {ip}/{EXTERNAL_PREFIX_LEN} dev eth0",
                        "link set eth0 up",
                        f"route add default via {NODE_IP}",
                    ],
                    ns,
                )
            )
        if self.no_time_wait:
            # G5: TIME_WAIT sockets in pods/clients distort sequential-connection benchmarks.
            batches += [
                self._sysctl(ns, {"net.ipv4.tcp_max_tw_buckets": 0})
                for ns in [*self.client_ns, *self.pod_ns]
            ]
        self._wait_all(batches)

    def _start_server(
        self, ns: str, name: str, tcp_ports: Sequence[int], udp_ports: Sequence[int], log: str
    ) -> subprocess.Popen[Any]:
        argv = [
            self.python,
            "-m",
            "kproxy.lab.podserver",
            "--name",
            name,
            "--tcp",
            ",".join(map(str, tcp_ports)),
            "--udp",
            ",".join(map(str, udp_ports)),
        ]
        return self._spawn(ns, argv, "podserver", log=log, stdout=subprocess.PIPE)

    def _start_pod_servers(self) -> None:
        starting = []
        for spec, ns in zip(self.pods, self.pod_ns, strict=True):
            popen = self._start_server(ns, spec.name, spec.tcp_ports, spec.udp_ports, spec.name)
            starting.append((spec.name, popen))
        self._wait_ready(starting)

    def serve(
        self,
        ns: str,
        name: str,
        tcp_ports: Sequence[int] = (8080,),
        udp_ports: Sequence[int] = (),
    ) -> subprocess.Popen[Any]:
        """Run a pod server in any lab namespace and wait until it listens.

        For endpoints that are not pods: a hostNetwork endpoint on the node, or an external
        server in a client namespace. down() stops it; so does terminate() on the result.
        """
        self._check_ns(ns)
        log = f"server-{ns}-{name}"
        popen = self._start_server(ns, name, tcp_ports, udp_ports, log)
        self._wait_ready([(log, popen)])
        return popen

    def _wait_ready(self, starting: list[tuple[str, subprocess.Popen[Any]]]) -> None:
        """Block until every server printed "ready"; `starting` pairs log names and processes."""
        deadline = time.monotonic() + READY_TIMEOUT
        waiting = {p.stdout.fileno(): (log, p) for log, p in starting if p.stdout is not None}
        output: dict[int, bytes] = dict.fromkeys(waiting, b"")
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                names = [log for log, _ in waiting.values()]
                raise LabError(f"servers not ready after {READY_TIMEOUT}s: {names}")
            readable, _, _ = select.select(list(waiting), [], [], left)
            for fd in readable:
                log, _popen = waiting[fd]
                chunk = os.read(fd, 4096)
                output[fd] += chunk
                if b"ready\n" in output[fd]:
                    del waiting[fd]
                elif not chunk:
                    text = (self.log_dir / f"{log}.log").read_text(errors="replace")
                    raise LabError(f"server {log} exited: {text.strip()[-2000:]}")
        for _, popen in starting:
            # The server never writes again; closing our end just frees the descriptor.
            if popen.stdout is not None:
                popen.stdout.close()

    # -- teardown ---------------------------------------------------------------------

    def _stop_processes(self) -> None:
        live = [p for p in self._procs if p.alive()]
        for proc in live:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE
        while time.monotonic() < deadline and any(p.alive() for p in live):
            time.sleep(0.01)
        for proc in live:
            if proc.alive():
                proc.signal(signal.SIGKILL)
        for proc in live:
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(TERM_GRACE)
                for stream in (proc.popen.stdin, proc.popen.stdout, proc.popen.stderr):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()

    def _delete_namespaces(self) -> None:
        mine = [ns for ns in self.namespaces if ns in _existing_netns()]
        for _attempt in range(2):
            if not mine:
                return
            # -force: keep deleting the rest when one fails; a retry covers transient EBUSY.
            proc = self._ip_batch((f"netns del {ns}" for ns in mine), force=True)
            _, err = proc.communicate(timeout=30)
            mine = [ns for ns in mine if ns in _existing_netns()]
        if mine:
            raise LabError(f"could not delete namespaces {mine}: {err.strip()}")

    # -- state file -------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Namespaces, addresses and processes as plain data (state file, CLI output)."""
        return {
            "id": self.id,
            "prefix": self.prefix,
            "python": self.python,
            "node": {"ns": self.node_ns, "ip": self.node_ip, "gateway": self.node_gateway},
            "nodes": [
                {"name": n.name, "ns": n.ns, "ip": n.ip, "pod_cidr": n.pod_cidr} for n in self.nodes
            ],
            "clients": [
                {"ns": ns, "ip": ip} for ns, ip in zip(self.client_ns, self.client_ips, strict=True)
            ],
            "pods": [
                {
                    "name": spec.name,
                    "ns": ns,
                    "ip": self.pod_ips[spec.name],
                    "tcp_ports": list(spec.tcp_ports),
                    "udp_ports": list(spec.udp_ports),
                }
                for spec, ns in zip(self.pods, self.pod_ns, strict=True)
            ],
            "pod_cidr": self.pod_cidr,
            "cluster_cidr": self.cluster_cidr,
            "silent_ip": self.silent_ip,
            "processes": [p.to_json() for p in self._procs],
        }

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        owner = self._owner or {"pid": os.getpid(), "starttime": _proc_starttime(os.getpid())}
        state = {**self.describe(), "created": self.created, "owner": owner}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, lab_id: str) -> Lab:
        """A handle on a lab started by another process (for example `kproxy lab up`)."""
        path = STATE_DIR / f"{lab_id}.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LabError(f"no lab {lab_id!r}: {exc}") from exc
        specs = [
            PodSpec(p["name"], tuple(p["tcp_ports"]), tuple(p["udp_ports"])) for p in state["pods"]
        ]
        lab = cls(
            pods=specs,
            clients=len(state["clients"]),
            prefix=state["prefix"],
            python=state.get("python", sys.executable),
            lab_id=state["id"],
            nodes=len(state.get("nodes") or [1]),
        )
        lab._procs = [
            _Proc(p["pid"], p["starttime"], p["ns"], p["argv"], p["role"])
            for p in state["processes"]
        ]
        lab._state = "up"
        lab._owner = state.get("owner", {})
        lab.created = state.get("created", lab.created)
        return lab

    def owner_alive(self) -> bool:
        """For loaded labs: whether the process that created it still runs (pytest, ...)."""
        owner = self._owner
        if not owner:
            return True
        return owner.get("starttime") is not None and (
            _proc_starttime(owner["pid"]) == owner["starttime"]
        )

    @classmethod
    def list_running(cls) -> list[Lab]:
        labs = []
        for path in sorted(STATE_DIR.glob("*.json")):
            with contextlib.suppress(LabError, KeyError, ValueError):
                labs.append(cls.load(path.stem))
        return labs


def _existing_netns() -> set[str]:
    try:
        return {entry.name for entry in NETNS_DIR.iterdir()}
    except FileNotFoundError:
        return set()
