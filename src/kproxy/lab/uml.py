"""Run a command inside User-Mode Linux: a real IPVS kernel on a host whose kernel has none.

The guest boots Debian's `user-mode-linux` kernel with the host filesystem as its root
(hostfs), so the host's venv, repo and tools run unchanged inside it. Everything the guest
could leak onto the host is made private first:

- /run and /tmp are fresh tmpfs mounts (G11): `ip netns add` writes /run/netns, the lab
  writes /run/kproxy-lab, iptables-legacy locks /run/xtables.lock.
- /dev is the guest's own devtmpfs (the kernel mounts it), plus /dev/shm and /dev/pts.
- The only host path the guest writes on purpose is the run directory made here (init
  script, logs, the command's output and exit code); it sits outside /tmp and /run so it
  stays visible in the guest, and it is removed afterwards unless the caller keeps it.
- PYTHONDONTWRITEBYTECODE keeps guest pythons from writing __pycache__ into the repo.

Results come back through the run directory: the init writes them, syncs, and powers off;
the host reads them after `linux.uml` exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import kproxy
from kproxy.lab.topology import _proc_starttime

__all__ = [
    "GUEST_MODULES",
    "IN_UML_ENV",
    "NFTABLES_GUEST_MODULES",
    "UmlError",
    "UmlGuest",
    "UmlResult",
    "UmlUnavailable",
    "find_linux_uml",
    "group_members",
    "in_uml",
    "run_in_uml",
    "uml_boots",
    "uml_supported",
]

UML_PACKAGE = "user-mode-linux"
IN_UML_ENV = "KPROXY_IN_UML"
RUN_DIR_ENV = "KPROXY_UML_RUN_DIR"
RUNS_DIR_ENV = "KPROXY_UML_RUNS"
DEFAULT_MEM = "1G"
DEFAULT_TIMEOUT = 600.0
# Boot, module loading and poweroff take ~5 s; the command's own guest-side timeout is the
# wall budget minus this, so a hung command still ends with its output synced to the host.
GUEST_OVERHEAD = 30.0
KILL_GRACE = 10.0
OWNER_FILE = "owner"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Guest-private mounts: a run directory under one of these would be invisible to the host.
PRIVATE_DIRS = ("/run", "/tmp", "/dev", "/proc", "/sys", "/var/run", "/var/lock")

# nftables mode (and iptables-nft): only kproxy's own UML kernel (uml_kernel) has them all;
# Debian's have nf_tables without the ip family.
NFTABLES_GUEST_MODULES: tuple[str, ...] = (
    "nf_tables",
    *(f"nft_{x}" for x in ("chain_nat", "ct", "nat", "masq", "numgen", "fib_ipv4", "compat")),
    "nft_reject_ipv4",
)
# What kube-proxy's ipvs mode (and the iptables mode used for comparison) needs, loaded at
# boot so tests see a node where the modules are present. Missing ones are recorded, not
# fatal: a test that needs one fails with the module named.
GUEST_MODULES: tuple[str, ...] = (
    "ip_vs",
    *(f"ip_vs_{s}" for s in ("rr", "wrr", "lc", "wlc", "sh", "dh", "sed", "nq", "mh")),
    "nf_conntrack",
    "nf_conntrack_netlink",
    "nf_nat",
    "iptable_nat",
    "iptable_filter",
    "iptable_mangle",
    "ipt_REJECT",
    *(
        f"xt_{m}"
        for m in (
            "MASQUERADE",
            "mark",
            "comment",
            "addrtype",
            "set",
            "conntrack",
            "physdev",
            "ipvs",
            "tcpudp",
            "nat",
            "multiport",
            "statistic",
        )
    ),
    "ip_set",
    *(
        f"ip_set_{t}"
        for t in ("hash_ip", "hash_ipport", "hash_ipportip", "hash_ipportnet", "hash_net")
    ),
    "ip_set_bitmap_port",
    "veth",
    "bridge",
    "dummy",
    *NFTABLES_GUEST_MODULES,
)


class UmlError(RuntimeError):
    """The guest did not boot or did not report back."""


class UmlUnavailable(UmlError):
    """This host cannot run UML guests (package missing)."""


# What the guest kernel prints when it cannot hand a process's FPU state back to the host:
# ptrace(PTRACE_SETREGSET, NT_X86_XSTATE) must carry the host's whole XSAVE area, and
# bookworm's UML 6.1 has a fixed buffer smaller than it is on a CPU with AMX (11 KB). Its
# init dies at the first context switch; nothing the guest runs can work around it.
FPU_STATE_FAILURE = "ptrace set fp regs failed"
FPU_STATE_REASON = (
    "this host's CPU has a larger FPU state (AVX-512/AMX XSAVE area) than the UML kernel "
    f"of the {UML_PACKAGE} package can pass through ptrace (its init dies with "
    f'"{FPU_STATE_FAILURE}, errno = 14"); UML guests cannot run on this host. Debian\'s '
    "newer UML kernels (7.x) boot here but are built without iptables and nf_tables for "
    "IPv4: build one for the lab with `kproxy lab uml-kernel` (`make test` does)"
)

# What the guest kernel prints when the host refuses a guest process another memory mapping.
# UML maps each page of a guest process into that process's host stub on its own (the
# guest's free pages are scattered), so the host's vm.max_map_count (65,530 by default)
# caps a guest process near 256 MiB resident; past it the process dies with SIGSEGV. Seen
# with the kproxy daemon switching ipvs -> nftables at 10,000 services: a limit of the lab,
# not of the proxy (on the host that daemon peaks at ~384 MiB during the switch).
HOST_MEMORY_FAILURE = "UML ran out of memory on the host side"


def host_memory_reason() -> str:
    try:
        limit = Path("/proc/sys/vm/max_map_count").read_text().strip()
    except OSError:
        limit = "?"
    return (
        f"a guest process needed more host memory mappings than vm.max_map_count ({limit}) "
        "allows: UML maps a guest process's pages one by one, which caps each process near "
        "max_map_count x 4 KiB resident; the process was killed (SIGSEGV). Run it with fewer "
        "services, or on a host whose vm.max_map_count is higher"
    )


def in_uml() -> bool:
    """Whether this process runs inside a guest started by this module."""
    return os.environ.get(IN_UML_ENV) == "1"


DEBIAN_MODULES = Path("/usr/lib/uml/modules")


def guest_kernel() -> tuple[str, Path]:
    """The guest kernel and the directory its modules' <release>/ lies below: the kernel
    built for this machine (uml_kernel), else Debian's."""
    from kproxy.lab import uml_kernel

    built = uml_kernel.kernel()
    if built is not None:
        return str(built), uml_kernel.module_dir()
    return find_debian_uml(), DEBIAN_MODULES


def find_linux_uml() -> str:
    return guest_kernel()[0]


def find_debian_uml() -> str:
    """Debian's linux.uml; UmlUnavailable naming the package when it is missing."""
    found = shutil.which("linux.uml") or shutil.which("linux.uml", path="/usr/bin:/bin")
    if not found:
        raise UmlUnavailable(
            f"linux.uml not found: install the Debian package {UML_PACKAGE} "
            f"(apt-get install {UML_PACKAGE}, or `make tools`)"
        )
    return found


def uml_supported() -> tuple[bool, str]:
    """Whether UML is installed here (cheap); the reason is meant for pytest skip messages.
    uml_boots() also boots a guest once, for the host incompatibilities only a boot shows."""
    try:
        find_linux_uml()
    except UmlUnavailable as exc:
        return False, str(exc)
    return True, ""


@functools.cache
def uml_boots() -> tuple[bool, str]:
    """uml_supported(), plus one probe boot (about 1.5 s, cached for the process) that
    fails only for a known host incompatibility (FPU_STATE_REASON). Any other failure of
    the probe counts as bootable, so that the runs after it fail and show the real error."""
    ok, reason = uml_supported()
    if not ok:
        return ok, reason
    with UmlGuest(timeout=60.0, modules=()) as guest:
        probe = guest.run(["true"])
    if not probe.ok and FPU_STATE_FAILURE in probe.console:
        return False, FPU_STATE_REASON
    return True, ""


def default_runs_dir() -> Path:
    """Where run directories go: the checkout's ignored .uml-runs/, else /var/tmp."""
    override = os.environ.get(RUNS_DIR_ENV)
    if override:
        return Path(override)
    checkout = Path(kproxy.__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and os.access(checkout, os.W_OK):
        return checkout / ".uml-runs"
    return Path("/var/tmp/kproxy-uml")


def _check_visible(path: Path) -> None:
    resolved = str(path.resolve())
    for private in PRIVATE_DIRS:
        if resolved == private or resolved.startswith(private + "/"):
            raise UmlError(
                f"UML run directory {resolved} is under {private}, which the guest mounts "
                f"privately; set {RUNS_DIR_ENV} to a path outside {', '.join(PRIVATE_DIRS)}"
            )


@dataclass(frozen=True)
class UmlResult:
    """What one guest run produced. Times are host wall-clock seconds."""

    argv: tuple[str, ...]
    returncode: int | None  # the command's exit code; None if it never finished
    output: str  # the command's stdout and stderr, interleaved
    console: str  # kernel console (boot messages, panics)
    init_log: str  # the init script's own log (mounts, modprobe errors)
    modules: dict[str, str] = field(default_factory=dict)  # module -> loaded|builtin|missing
    timed_out: bool = False  # the host killed the guest after the wall budget
    boot_seconds: float | None = None  # linux.uml start -> init running
    module_seconds: float | None = None  # init start -> modules loaded
    command_seconds: float | None = None
    wall_seconds: float = 0.0
    uml_exit: int | None = None
    uml_pid: int | None = None  # linux.uml's PID, also its process group

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def missing_modules(self) -> list[str]:
        return [m for m, state in self.modules.items() if state == "missing"]

    def describe_failure(self) -> str:
        """A human-readable account of why the run did not succeed, with log tails."""
        if self.timed_out:
            head = f"UML guest killed after {self.wall_seconds:.0f} s wall-clock budget"
        elif self.returncode is None:
            head = f"UML guest exited ({self.uml_exit}) before the command finished"
        elif self.returncode == 124:
            head = "command timed out inside the UML guest (exit 124)"
        else:
            head = f"command exited {self.returncode} inside the UML guest"
        parts = [f"{head}: {shlex.join(self.argv)}"]
        if self.returncode is None and FPU_STATE_FAILURE in self.console:
            parts.append(FPU_STATE_REASON)
        if HOST_MEMORY_FAILURE in self.console:
            parts.append(host_memory_reason())
        for name, text in (("output", self.output), ("init", self.init_log)):
            if text.strip():
                parts.append(f"--- {name} (tail) ---\n{text.strip()[-3000:]}")
        if self.returncode is None and self.console.strip():
            parts.append(f"--- console (tail) ---\n{self.console.strip()[-3000:]}")
        return "\n".join(parts)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _stamp(path: Path) -> float | None:
    text = _read(path).strip()
    try:
        return float(text) if text else None
    except ValueError:
        return None


class UmlGuest:
    """One run directory and one guest boot per run(); a context manager removes the dir.

    `run_dir` exists from __enter__ on, so callers can point the command at files in it
    (for example a report path) before booting.
    """

    def __init__(
        self,
        *,
        mem: str = DEFAULT_MEM,
        timeout: float = DEFAULT_TIMEOUT,
        command_timeout: float | None = None,
        runs_dir: Path | None = None,
        keep: bool = False,
        modules: Sequence[str] = GUEST_MODULES,
    ) -> None:
        """timeout: host wall-clock budget for boot to poweroff, after which the guest is
        killed; command_timeout: the command's own limit inside the guest (default: the
        budget minus GUEST_OVERHEAD), so a hung command still reports its output."""
        if command_timeout is None:
            command_timeout = timeout - GUEST_OVERHEAD
        if timeout <= 0 or command_timeout <= 0:
            raise ValueError(
                f"timeout ({timeout} s) must leave {GUEST_OVERHEAD:.0f} s for boot and poweroff"
            )
        self.linux, self.module_dir = guest_kernel()
        self.mem = mem
        self.timeout = timeout
        self.command_timeout = command_timeout
        self.keep = keep
        self.modules = tuple(modules)
        self.runs_dir = runs_dir or default_runs_dir()
        self.run_dir: Path | None = None

    def __enter__(self) -> UmlGuest:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> Path:
        if self.run_dir is None:
            _check_visible(self.runs_dir)
            self.runs_dir.mkdir(parents=True, exist_ok=True)
            _prune_orphans(self.runs_dir)
            for _ in range(100):
                candidate = self.runs_dir / f"run-{secrets.token_hex(4)}"
                # FileNotFoundError: another run's close() just removed the empty runs_dir.
                with contextlib.suppress(FileExistsError, FileNotFoundError):
                    self.runs_dir.mkdir(parents=True, exist_ok=True)
                    candidate.mkdir(mode=0o700)
                    self.run_dir = candidate
                    break
            else:
                raise UmlError(f"could not create a run directory in {self.runs_dir}")
            me = os.getpid()
            (self.run_dir / OWNER_FILE).write_text(f"{me} {_proc_starttime(me)}\n")
        return self.run_dir

    def close(self) -> None:
        if self.run_dir is not None and not self.keep:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.runs_dir.rmdir()  # only if no other run is using it
        self.run_dir = None

    # -- the guest's init ------------------------------------------------------------

    def _init_script(
        self, run_dir: Path, argv: Sequence[str], cwd: Path, env: Mapping[str, str]
    ) -> str:
        r = shlex.quote(str(run_dir))
        guest_timeout = max(1, round(self.command_timeout))
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        modules = " ".join(self.modules)
        mods = shlex.quote(str(self.module_dir))
        return f"""#!/bin/sh
# Generated by kproxy.lab.uml: PID 1 of a UML guest whose root is the host filesystem.
R={r}
export PATH={GUEST_PATH}
date +%s.%N > "$R/t-init"
exec > "$R/init.log" 2>&1 </dev/null
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# Private /run and /tmp before anything creates a namespace or a temp file (G11).
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/shm /dev/pts /run/lock /run/netns
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t devpts -o ptmxmode=0666 devpts /dev/pts
# devtmpfs lacks the links udev makes; `conntrack -R -` opens /dev/stdin.
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin
[ -e /dev/stdout ] || ln -s /proc/self/fd/1 /dev/stdout
[ -e /dev/stderr ] || ln -s /proc/self/fd/2 /dev/stderr
# The kernel's modules are under {mods} (Debian's package, or the kernel built by
# kproxy.lab.uml_kernel); if /lib/modules lacks them, point modprobe there:
# MODPROBE_OPTIONS for commands, kernel.modprobe for the kernel's own requests (ipvsadm,
# iptables extensions).
KVER=$(uname -r)
if [ ! -e "/lib/modules/$KVER/modules.dep" ]; then
  M=/run/kproxy-uml/modroot
  mkdir -p "$M/lib/modules" /run/kproxy-uml/bin
  ln -s "{mods}/$KVER" "$M/lib/modules/$KVER"
  export MODPROBE_OPTIONS="-d $M"
  printf '#!/bin/sh\\nexec /sbin/modprobe -d %s "$@"\\n' "$M" > /run/kproxy-uml/bin/modprobe
  chmod 755 /run/kproxy-uml/bin/modprobe
  echo /run/kproxy-uml/bin/modprobe > /proc/sys/kernel/modprobe
fi
modprobe -a {modules}
: > "$R/modules.txt"
for m in {modules}; do
  if [ -e "/sys/module/$m" ]; then echo "$m loaded"
  elif grep -q "/$m.ko" "{mods}/$KVER/modules.builtin" 2>/dev/null; then
    echo "$m builtin"
  else echo "$m missing"
  fi >> "$R/modules.txt"
done
ip link set lo up
date +%s.%N > "$R/t-modules"
{exports}
cd {shlex.quote(str(cwd))} && timeout -k 10 {guest_timeout} {shlex.join(argv)} \\
  > "$R/output.txt" 2>&1 </dev/null
echo $? > "$R/rc.tmp"
date +%s.%N > "$R/t-done"
sync
mv "$R/rc.tmp" "$R/rc"
sync
poweroff -f
"""

    def _guest_env(self, run_dir: Path, env: Mapping[str, str] | None) -> dict[str, str]:
        base = {
            # The host interpreter's bin first: `python`, `kproxy`, `pytest` are the venv's.
            "PATH": f"{Path(sys.executable).parent}:{GUEST_PATH}",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            IN_UML_ENV: "1",
            RUN_DIR_ENV: str(run_dir),
        }
        return {**base, **(env or {})}

    # -- running ---------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        cancel: threading.Event | None = None,
    ) -> UmlResult:
        """Boot, run argv (as guest root, in cwd), power off; never raises for a failing argv.
        Setting cancel (from another thread) kills the guest as a timeout would."""
        if not argv:
            raise ValueError("argv must not be empty")
        run_dir = self.open()
        for stale in ("rc", "rc.tmp", "output.txt", "modules.txt", "t-init", "t-modules", "t-done"):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / stale).unlink()
        init = run_dir / "init.sh"
        init.write_text(
            self._init_script(run_dir, argv, cwd or Path.cwd(), self._guest_env(run_dir, env))
        )
        init.chmod(0o755)
        cmd = [
            self.linux,
            f"mem={self.mem}",
            "root=/dev/root",
            "rootfstype=hostfs",
            "rootflags=/",
            "rw",
            f"init={init}",
            "con=null",
            "con0=fd:0,fd:1",
            # UML's pid file and mconsole socket go into the run dir, not ~/.uml.
            f"uml_dir={run_dir}",
            f"umid=kproxy-{run_dir.name}",
        ]
        started = time.time()
        timed_out = False
        with (run_dir / "console.log").open("wb") as console:
            # Own session: its PID is the process group of every UML helper process, so a
            # timeout kills exactly the processes started here.
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                timed_out = not _wait(proc, started + self.timeout, cancel)
            finally:
                # Also on KeyboardInterrupt: never leave a guest running.
                _kill_group(proc)
        wall = time.time() - started
        result = self._collect(run_dir, argv, started, wall, timed_out, proc.returncode)
        return dataclasses.replace(result, uml_pid=proc.pid)

    def _collect(
        self,
        run_dir: Path,
        argv: Sequence[str],
        started: float,
        wall: float,
        timed_out: bool,
        uml_exit: int | None,
    ) -> UmlResult:
        rc_text = _read(run_dir / "rc").strip()
        modules: dict[str, str] = {}
        for line in _read(run_dir / "modules.txt").splitlines():
            name, _, state = line.partition(" ")
            if name:
                modules[name] = state
        t_init, t_mod, t_done = (_stamp(run_dir / n) for n in ("t-init", "t-modules", "t-done"))
        return UmlResult(
            argv=tuple(argv),
            returncode=int(rc_text) if rc_text.lstrip("-").isdigit() else None,
            output=_read(run_dir / "output.txt"),
            console=_read(run_dir / "console.log"),
            init_log=_read(run_dir / "init.log"),
            modules=modules,
            timed_out=timed_out,
            boot_seconds=None if t_init is None else t_init - started,
            module_seconds=None if t_init is None or t_mod is None else t_mod - t_init,
            command_seconds=None if t_mod is None or t_done is None else t_done - t_mod,
            wall_seconds=wall,
            uml_exit=uml_exit,
        )


def _wait(proc: subprocess.Popen[bytes], deadline: float, cancel: threading.Event | None) -> bool:
    """Wait for proc until the wall-clock deadline or cancel; True if it exited."""
    while True:
        left = deadline - time.time()
        if left <= 0 or (cancel is not None and cancel.is_set()):
            return proc.poll() is not None
        try:
            proc.wait(timeout=min(left, 0.5) if cancel is not None else left)
            return True
        except subprocess.TimeoutExpired:
            continue


def group_members(pgid: int) -> list[int]:
    """PIDs whose process group is pgid (zombies excluded)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill what is left of the guest: its process group is the session linux.uml leads."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_GRACE)
    # UML's helper processes (one per guest process tracer) share the group. After a clean
    # poweroff they are gone; after a kill they may take a moment. The group id cannot be
    # reused while any member lives, so signalling it never hits a stranger.
    deadline = time.monotonic() + KILL_GRACE
    while group_members(proc.pid) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.05)


def _prune_orphans(runs_dir: Path) -> None:
    """Remove run dirs whose owning process died without cleaning up (kill -9, crash)."""
    for run_dir in runs_dir.glob("run-*"):
        try:
            pid_text, start_text = (run_dir / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue  # being created right now, or not ours
        if str(_proc_starttime(int(pid_text))) != start_text:
            shutil.rmtree(run_dir, ignore_errors=True)


def run_in_uml(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    mem: str = DEFAULT_MEM,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> UmlResult:
    """Boot a guest, run argv inside it and return what happened; the run dir is removed."""
    with UmlGuest(mem=mem, timeout=timeout) as guest:
        return guest.run(argv, cwd=cwd, env=env)
