"""The one entry point for kernel tests that need IPVS: tests/uml/* run inside User-Mode Linux.

At collection time a host-side `pytest --collect-only tests/uml` (with KPROXY_IN_UML=1)
lists the inner tests; each becomes one outer test `test_in_uml[<inner id>]`. The first of
them boots one guest (kproxy.lab.uml) that runs the whole inner suite and streams a JSON
line per test phase to the host; every outer test then reports its inner test's outcome:
a failure shows the inner traceback, an inner skip is an outer skip with the inner reason.

If the guest cannot boot or report, every outer test fails with the reason. Only a host
without the user-mode-linux package (or not root, see tests/conftest.py) skips.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kproxy.lab import uml, uml_kernel
from kproxy.lab.uml import (
    IN_UML_ENV,
    UmlError,
    UmlGuest,
    UmlResult,
    group_members,
    in_uml,
    uml_boots,
    uml_supported,
)

pytestmark = [
    pytest.mark.kernel,
    # Never boot a guest from inside a guest (someone ran the whole suite in UML).
    pytest.mark.skipif(in_uml(), reason="already inside a UML guest"),
]

REPO = Path(__file__).resolve().parents[1]
# Overridable only to check the harness itself against a scratch folder of known outcomes.
INNER_DIR = os.environ.get("KPROXY_UML_INNER_DIR", "tests/uml")
REPORT_ENV = "KPROXY_UML_REPORT"
PARALLEL_ENV = "KPROXY_UML_PARALLEL"
# The whole inner suite, boot to poweroff. Override for slow machines.
TIMEOUT = float(os.environ.get("KPROXY_UML_TIMEOUT", "900"))
COLLECT_TIMEOUT = 120.0
UML_OK, UML_SKIP_REASON = uml_supported()


def _boots() -> tuple[bool, str]:
    """UML installed and bootable on this host (one probe boot, only when guests are due)."""
    return uml_boots() if UML_OK else (UML_OK, UML_SKIP_REASON)


NOT_COLLECTED = "<not collected>"
COLLECTED: list[str] = []  # inner ids known at collection time, to spot ones that ran unseen


def _collect_inner() -> tuple[list[str], str | None]:
    """Inner test ids, from a host-side collection; or an error text if that failed."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        INNER_DIR,
    ]
    env = {**os.environ, IN_UML_ENV: "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop(REPORT_ENV, None)
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=COLLECT_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return [], f"collecting {INNER_DIR} took over {COLLECT_TIMEOUT:.0f} s"
    ids = [line for line in proc.stdout.splitlines() if line.startswith(f"{INNER_DIR}/")]
    if proc.returncode not in (0, 5) or not ids:
        return [], f"collecting {INNER_DIR} failed (exit {proc.returncode}):\n" + (
            proc.stdout + proc.stderr
        ).strip()[-6000:]
    return ids, None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "inner_id" not in metafunc.fixturenames:
        return
    markexpr = str(metafunc.config.getoption("markexpr", "") or "")
    if not UML_OK or "not kernel" in markexpr or not _boots()[0]:
        # Nothing will run: skip the collection subprocess (about 1 s).
        metafunc.parametrize("inner_id", [NOT_COLLECTED], ids=["uml"])
        return
    ids, error = _collect_inner()
    if error is not None:
        metafunc.parametrize("inner_id", [f"{NOT_COLLECTED}\n{error}"], ids=["collect-error"])
        return
    COLLECTED[:] = ids
    prefix = f"{INNER_DIR}/"
    metafunc.parametrize("inner_id", ids, ids=[i.removeprefix(prefix) for i in ids])


# -- the guest run ------------------------------------------------------------------------


@dataclass
class InnerTest:
    nodeid: str
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class InnerRun:
    result: UmlResult | None
    error: str | None  # the guest could not be started at all
    tests: dict[str, InnerTest]
    collect_errors: list[dict[str, Any]]

    def harness_failure(self) -> str | None:
        """Why no inner result can be trusted, or None if the inner session ran."""
        if self.error is not None:
            return self.error
        result = self.result
        assert result is not None
        # pytest exits 0 (all passed) or 1 (some failed); anything else means the session
        # itself broke (interrupted, internal error, usage, nothing collected).
        if result.returncode not in (0, 1):
            return result.describe_failure()
        return None

    def check(self, nodeid: str) -> None:
        test = self.tests.get(nodeid)
        if test is None or ("call" not in test.phases and not self._ended_early(test)):
            why = self.harness_failure() or "the inner session ended without running it"
            pytest.fail(f"{nodeid} did not run in UML: {why}", pytrace=False)
        for when in ("setup", "call", "teardown"):
            phase = test.phases.get(when)
            if phase is not None and phase["outcome"] == "failed":
                text = phase.get("longrepr", "") + "\n" + phase.get("sections", "")
                pytest.fail(f"inner {when} failed in UML:\n{text.strip()}", pytrace=False)
        for phase in test.phases.values():
            if phase["outcome"] == "skipped":
                if "xfail" in phase:
                    pytest.xfail(f"in UML: {phase['xfail']}")
                pytest.skip(f"in UML: {phase.get('reason', '')}")
        assert test.phases["call"]["outcome"] == "passed", test.phases

    @staticmethod
    def _ended_early(test: InnerTest) -> bool:
        setup = test.phases.get("setup")
        return setup is not None and setup["outcome"] != "passed"


def _parse_report(path: Path) -> tuple[dict[str, InnerTest], list[dict[str, Any]]]:
    tests: dict[str, InnerTest] = {}
    collect_errors: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed guest
        if record.get("when") == "collect":
            collect_errors.append(record)
            continue
        test = tests.setdefault(record["nodeid"], InnerTest(record["nodeid"]))
        test.phases[record["when"]] = record
    return tests, collect_errors


def _run_inner(selected: list[str], cancel: threading.Event | None = None) -> InnerRun:
    try:
        guest = UmlGuest(timeout=TIMEOUT)
    except Exception as exc:
        return InnerRun(None, f"cannot start UML: {exc}", {}, [])
    with guest:
        assert guest.run_dir is not None
        report = guest.run_dir / "report.jsonl"
        # Only what the outer run selected (-k, node ids): a quick loop for one inner test.
        targets = selected if selected and set(selected) != set(COLLECTED) else [INNER_DIR]
        argv = [
            sys.executable,
            "-m",
            "pytest",
            *targets,
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=-ra",
            f"--rootdir={REPO}",
        ]
        # The sources under test, not the venv's install (a worktree's own).
        env = {REPORT_ENV: str(report), "PYTHONPATH": str(REPO / "src")}
        result = guest.run(argv, cwd=REPO, env=env, cancel=cancel)
        tests, collect_errors = _parse_report(report)
    return InnerRun(result, None, tests, collect_errors)


def _selected(session: pytest.Session) -> list[str]:
    return [
        item.callspec.params["inner_id"]
        for item in session.items
        if isinstance(item, pytest.Function)
        and hasattr(item, "callspec")
        and item.callspec.params.get("inner_id") in COLLECTED
    ]


@dataclass
class _Background:
    """The guest run started at the end of collection, beside the host tests."""

    thread: threading.Thread
    cancel: threading.Event
    started: float
    run: InnerRun | None = None


_BACKGROUND: list[_Background] = []


def start_in_background(session: pytest.Session) -> None:
    """Boot the guest now (tests/conftest.py calls this once collection is done): the inner
    suite (~6 min, about one core) then runs beside the host tests instead of after them.
    KPROXY_UML_PARALLEL=0 runs it when its first outer test comes, as before."""
    if not UML_OK or os.environ.get(PARALLEL_ENV, "1") == "0" or _BACKGROUND:
        return
    if not _boots()[0]:
        return
    selected = _selected(session)
    if not selected:
        return
    cancel = threading.Event()

    def work() -> None:
        bg.run = _run_inner(selected, cancel)

    bg = _Background(threading.Thread(target=work, name="uml-guest"), cancel, time.perf_counter())
    _BACKGROUND.append(bg)
    bg.thread.start()


def stop_background() -> None:
    """At the end of the session: a guest still running (the session stopped early) dies."""
    for bg in _BACKGROUND:
        bg.cancel.set()
        bg.thread.join()
    _BACKGROUND.clear()


@pytest.fixture(scope="session")
def uml_run(request: pytest.FixtureRequest) -> Iterator[InnerRun]:
    ok, reason = _boots()
    if not ok:
        pytest.skip(reason)
    if _BACKGROUND:
        bg = _BACKGROUND[0]
        bg.thread.join()
        started, beside = bg.started, " (beside the host tests)"
        run = bg.run or InnerRun(None, "the background guest run ended without a result", {}, [])
    else:
        started, beside = time.perf_counter(), ""
        run = _run_inner(_selected(request.session))
    elapsed = time.perf_counter() - started
    yield run
    result = run.result
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or result is None:
        return
    fmt = "{:.1f} s".format
    with capture.global_and_fixture_disabled():
        reporter.write_line(
            f"\nUML: boot {fmt(result.boot_seconds or 0)}, modules "
            f"{fmt(result.module_seconds or 0)}, inner pytest {fmt(result.command_seconds or 0)}"
            f", guest wall {fmt(result.wall_seconds)}, total {fmt(elapsed)};"
            f" {len(run.tests)} inner tests{beside}"
        )


def test_in_uml(uml_run: InnerRun, inner_id: str) -> None:
    if inner_id == NOT_COLLECTED:
        pytest.skip("inner tests not collected: -m excludes kernel tests")
    if inner_id.startswith(NOT_COLLECTED):
        pytest.fail(inner_id.removeprefix(NOT_COLLECTED).strip(), pytrace=False)
    uml_run.check(inner_id)


def test_uml_inner_session_complete(uml_run: InnerRun) -> None:
    """The inner session itself ran cleanly: no collection errors, a normal pytest exit."""
    assert not uml_run.collect_errors, "\n".join(
        f"{e['nodeid']}:\n{e.get('longrepr', '')}" for e in uml_run.collect_errors
    )
    failure = uml_run.harness_failure()
    assert failure is None, failure
    # An inner test that exists only in the guest (parametrized on guest facts, say) would
    # otherwise pass unseen.
    unseen = sorted(set(uml_run.tests) - set(COLLECTED))
    assert not unseen, f"inner tests that ran in UML but were not collected on the host: {unseen}"


# -- the harness itself --------------------------------------------------------------------

needs_uml = pytest.mark.skipif(not UML_OK, reason=UML_SKIP_REASON)


@pytest.fixture
def booting() -> None:
    """For tests that boot a guest: skipped, with the reason, where none can boot."""
    ok, reason = _boots()
    if not ok:
        pytest.skip(reason)


@needs_uml
@pytest.mark.usefixtures("booting")
def test_guest_reports_exit_code_and_keeps_namespaces_off_the_host() -> None:
    name = f"kpuml{secrets.token_hex(4)}"
    with UmlGuest(timeout=120) as guest:
        run_dir = guest.run_dir
        assert run_dir is not None
        result = guest.run(["sh", "-c", f"ip netns add {name} && ip netns list; exit 3"])
    assert result.returncode == 3, result.describe_failure()
    assert name in result.output, result.output
    # G11: the guest's `ip netns add` went to its private /run, not the host's.
    assert not (Path("/run/netns") / name).exists()
    assert not run_dir.exists(), "run dir left behind"
    assert result.uml_pid is not None and not group_members(result.uml_pid)
    assert not result.missing_modules
    assert result.boot_seconds is not None and result.module_seconds is not None


@needs_uml
@pytest.mark.usefixtures("booting")
def test_guest_command_timeout_is_reported_with_output() -> None:
    with UmlGuest(timeout=60, command_timeout=2) as guest:
        result = guest.run(["sh", "-c", "echo started; exec sleep 300"])
    assert result.returncode == 124 and not result.timed_out, result.describe_failure()
    assert "started" in result.output
    assert "timed out inside the UML guest" in result.describe_failure()


@needs_uml
@pytest.mark.usefixtures("booting")
def test_guest_over_budget_is_killed_with_all_its_processes() -> None:
    with UmlGuest(timeout=5, command_timeout=300) as guest:
        result = guest.run(["sleep", "300"])
    assert result.timed_out and result.returncode is None
    assert result.uml_pid is not None and not group_members(result.uml_pid)
    assert "killed after" in result.describe_failure()
    assert result.wall_seconds < 5 + uml.KILL_GRACE


def test_missing_linux_uml_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uml.shutil, "which", lambda *_a, **_k: None)
    monkeypatch.setattr(uml_kernel, "kernel", lambda: None)  # none built on this machine
    with pytest.raises(uml.UmlUnavailable, match="user-mode-linux"):
        UmlGuest()


@needs_uml
def test_run_dir_under_a_guest_private_mount_is_refused() -> None:
    with pytest.raises(UmlError, match="mounts privately"):
        UmlGuest(runs_dir=Path("/tmp/kproxy-uml-runs")).open()


def test_a_guest_that_cannot_boot_here_says_why() -> None:
    """The known host incompatibility is named in the failure text (and makes uml_boots
    false), from the console line the guest kernel prints."""
    line = f"userspace - {uml.FPU_STATE_FAILURE}, errno = 14\nKernel panic - not syncing"
    result = uml.UmlResult(argv=("true",), returncode=None, output="", console=line, init_log="")
    assert uml.FPU_STATE_REASON in result.describe_failure()
    assert "AMX" in uml.FPU_STATE_REASON


def test_a_guest_process_the_host_refused_mappings_is_explained() -> None:
    # The guest prints this and kills the process; the command itself exits non-zero.
    console = (
        "syscall_stub_dump_error : stub syscall type 1 failed, return value = 0xfffffffffffffff4\n"
        f"{uml.HOST_MEMORY_FAILURE}! This can happen due to a memory limitation or "
        "vm.max_map_count has been reached.\n"
    )
    result = uml.UmlResult(argv=("bench",), returncode=1, output="", console=console, init_log="")
    text = result.describe_failure()
    assert "vm.max_map_count (" in text and "SIGSEGV" in text
    ok = uml.UmlResult(argv=("bench",), returncode=1, output="", console="", init_log="")
    assert "max_map_count" not in ok.describe_failure()
