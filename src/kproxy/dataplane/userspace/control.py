"""How the controller hands the listener table to the workers, and finds them again.

Everything lives in one folder, ``<state dir>/userspace``:

* ``table.json`` - the listener table with a generation number, replaced atomically
  (write + rename). The controller sends SIGHUP after writing it; workers also poll its
  mtime, so a lost signal only costs a poll interval.
* ``worker-<i>.json`` - written by worker i: its PID and start time (which identify it
  across PID reuse), the table generation it has applied, its counters and bind errors.
* ``report-<i>.json`` - written by worker i when sent REPORT_SIGNAL (`kproxy list`
  and `kproxy trace` ask): open connections per listener and endpoint, affinity entries.
  Only on request, so the periodic status stays small at 10,000 listeners.
* ``ports.json`` - the proxy-port allocation, so a restarted controller keeps every port.
* ``controller.lock`` - flock()ed by the running controller; never inherited by workers.

Workers run in their own session, so neither a kill -9 of the controller nor a signal to
its process group reaches them. A restarted controller adopts each worker whose status file
names a live process that is really a worker of this folder (checked in /proc), and starts
only the missing ones. Workers stop when told (SIGTERM), when the table says so, when the
folder disappears, or when the named network namespace they run in is deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kproxy

log = logging.getLogger("kproxy.userspace")

SUBDIR = "userspace"
TABLE_FILE = "table.json"
PORTS_FILE = "ports.json"
LOCK_FILE = "controller.lock"
WORKER_MODULE = "kproxy.dataplane.userspace.worker"
STOP_GRACE = 3.0
# A new worker is a Python interpreter importing kproxy: ~1 s on a quiet node, but 10 s
# were exceeded inside User-Mode Linux during a slow hour of this machine (a switch test).
WORKER_START_TIMEOUT = 30.0
# Asks a worker for a fresh report file. Only sent to workers whose status says they handle
# it ("reports": 1): to an older worker, SIGUSR1's default action would kill it.
REPORT_SIGNAL = signal.SIGUSR1


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    tmp.replace(path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def proc_starttime(pid: int) -> int | None:
    """Start time in clock ticks (None if gone or a zombie): PID + start time = identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def proc_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def worker_argv(state_dir: Path, index: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", WORKER_MODULE, "--state-dir", str(state_dir), "--index", str(index)]


def is_worker_of(pid: int, state_dir: Path) -> bool:
    argv = proc_cmdline(pid)
    if WORKER_MODULE not in argv:
        return False
    try:
        return Path(argv[argv.index("--state-dir") + 1]) == state_dir
    except (ValueError, IndexError):
        return False


@dataclass
class WorkerInfo:
    index: int
    pid: int
    starttime: int
    status: dict[str, Any]

    @property
    def generation(self) -> int:
        return int(self.status.get("generation", -1))

    def alive(self) -> bool:
        return proc_starttime(self.pid) == self.starttime


class ControlError(Exception):
    pass


class WorkerSet:
    """The controller's handle on the workers of one state folder."""

    def __init__(
        self,
        state_dir: Path,
        *,
        count: int,
        netns: str | None = None,
        python: str = sys.executable,
        worker_args: Sequence[str] = (),
    ) -> None:
        # Absolute (not resolved: /var/run stays /var/run), so a worker's command line names
        # the same folder whatever the controller's working directory was.
        self.dir = Path(os.path.abspath(state_dir)) / SUBDIR
        self.count = count
        self.netns = netns
        self.python = python
        self.worker_args = list(worker_args)
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._lock_fd: int | None = None
        self._generation: int | None = None

    # --- files ------------------------------------------------------------------------------

    @property
    def table_path(self) -> Path:
        return self.dir / TABLE_FILE

    def status_path(self, index: int) -> Path:
        return self.dir / f"worker-{index}.json"

    def log_path(self, index: int) -> Path:
        return self.dir / f"worker-{index}.log"

    def report_path(self, index: int) -> Path:
        return self.dir / f"report-{index}.json"

    def read_table(self) -> dict[str, Any] | None:
        data = read_json(self.table_path)
        return data if isinstance(data, dict) else None

    def acquire(self, timeout: float = 10.0) -> None:
        """Become the one controller of this folder (waits for a stopping predecessor)."""
        if self._lock_fd is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ControlError(
                        f"another kproxy controller is running on {self.dir}"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def write_table(self, table: dict[str, Any]) -> int:
        """Publish a table (a new generation) and poke the workers; returns the generation."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._generation is None:
            old = self.read_table() or {}
            self._generation = int(old.get("generation", 0))
        self._generation += 1
        data = {**table, "generation": self._generation, "workers": self.count}
        write_json_atomic(self.table_path, data)
        self.notify()
        return self._generation

    # --- workers ----------------------------------------------------------------------------

    def workers(self) -> dict[int, WorkerInfo]:
        """Live workers of this folder, by index (verified against /proc)."""
        self._reap()
        out: dict[int, WorkerInfo] = {}
        if not self.dir.is_dir():
            return out
        for path in self.dir.glob("worker-*.json"):
            status = read_json(path)
            if not isinstance(status, dict):
                continue
            try:
                info = WorkerInfo(
                    int(status["index"]), int(status["pid"]), int(status["starttime"]), status
                )
            except (KeyError, TypeError, ValueError):
                continue
            if info.alive() and is_worker_of(info.pid, self.dir.parent):
                out[info.index] = info
        return out

    def _reap(self) -> None:
        for pid, popen in list(self._children.items()):
            if popen.poll() is not None:
                del self._children[pid]

    def spawn(self, index: int) -> subprocess.Popen[bytes]:
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = worker_argv(self.dir.parent, index, self.python) + self.worker_args
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        env = dict(os.environ)
        src = str(Path(kproxy.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        with self.log_path(index).open("ab") as logf:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                close_fds=True,
                # Their own session: the controller's death (or a signal to its process
                # group) must not reach the workers.
                start_new_session=True,
            )
        self._children[popen.pid] = popen
        log.info("started userspace worker %d (pid %d)", index, popen.pid)
        return popen

    def ensure(self, timeout: float = WORKER_START_TIMEOUT) -> tuple[list[int], list[int]]:
        """Adopt the running workers, start the missing ones, stop surplus ones.

        Returns (adopted indices, started indices); waits until started ones report."""
        live = self.workers()
        started = []
        for index in range(self.count):
            if index not in live:
                self.spawn(index)
                started.append(index)
        for index, info in live.items():
            if index >= self.count:
                self._signal(info, signal.SIGTERM)
        if started:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                live = self.workers()
                if all(i in live for i in started):
                    break
                for pid, popen in list(self._children.items()):
                    if popen.poll() is not None and popen.returncode not in (0, None):
                        del self._children[pid]
                        raise ControlError(
                            f"userspace worker exited with {popen.returncode}: "
                            f"{self._log_tail(started[0])}"
                        )
                time.sleep(0.02)
            else:
                raise ControlError(
                    f"userspace workers {started} did not start within {timeout:.0f} s: "
                    f"{self._log_tail(started[0])}"
                )
        adopted = [i for i in live if i < self.count and i not in started]
        return adopted, started

    def _log_tail(self, index: int) -> str:
        try:
            return self.log_path(index).read_text(errors="replace")[-1500:].strip()
        except OSError:
            return "(no log)"

    def _signal(self, info: WorkerInfo, sig: int) -> None:
        # Only a process verified to be our worker (start time and command line).
        if info.alive() and is_worker_of(info.pid, self.dir.parent):
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, sig)

    def request_reports(self, timeout: float = 1.0) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """Fresh reports of the live workers that can give one: (reports by index, indices
        that cannot report or did not answer within `timeout`)."""
        live = self.workers()
        asked = {i: w for i, w in live.items() if w.status.get("reports") == 1}
        started = time.time()
        for info in asked.values():
            self._signal(info, REPORT_SIGNAL)
        reports: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while True:
            for index, info in asked.items():
                if index in reports:
                    continue
                data = read_json(self.report_path(index))
                if (
                    isinstance(data, dict)
                    and data.get("pid") == info.pid
                    and float(data.get("time", 0)) >= started
                ):
                    reports[index] = data
            if len(reports) == len(asked) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return reports, sorted(set(live) - set(reports))

    def notify(self) -> None:
        for info in self.workers().values():
            self._signal(info, signal.SIGHUP)

    def wait_applied(self, generation: int, timeout: float = 5.0) -> dict[int, WorkerInfo]:
        """Wait until every live worker has applied `generation`; returns their state.

        Raises ControlError when no worker applied it at all."""
        deadline = time.monotonic() + timeout
        live = self.workers()
        while time.monotonic() < deadline:
            live = self.workers()
            if live and all(w.generation >= generation for w in live.values()):
                return live
            time.sleep(0.005)
        done = {i: w for i, w in live.items() if w.generation >= generation}
        if not done:
            raise ControlError(
                f"no userspace worker applied table generation {generation} within "
                f"{timeout:.0f} s (live workers: {sorted(live)})"
            )
        log.warning(
            "userspace workers %s did not apply table generation %d in time",
            sorted(set(live) - set(done)),
            generation,
        )
        return done

    def stop_all(self, timeout: float = STOP_GRACE) -> list[int]:
        """SIGTERM every worker of this folder, SIGKILL the ones still there; their PIDs."""
        live = list(self.workers().values())
        for info in live:
            self._signal(info, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(w.alive() for w in live):
            self._reap()
            time.sleep(0.02)
        for info in live:
            if info.alive():
                self._signal(info, signal.SIGKILL)
        for popen in self._children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout)
        self._children.clear()
        for info in live:
            for path in (self.status_path(info.index), self.report_path(info.index)):
                with contextlib.suppress(OSError):
                    path.unlink()
        return [w.pid for w in live]
