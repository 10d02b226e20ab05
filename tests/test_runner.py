"""BoundedFrequencyRunner: coalescing, min/max/retry intervals, failures, stop.

Real time with small intervals; assertions are on counts and ordering, and on lower bounds
of gaps (which the runner guarantees), never on exact timings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kproxy.runner import BoundedFrequencyRunner


class Recorder:
    """A fn that records monotonic start/end times and can block or fail on demand."""

    def __init__(self, results: list[bool | None | Exception] | None = None) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.results = list(results or [])
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self) -> bool | None:
        self.starts.append(time.monotonic())
        self.entered.set()
        self.gate.wait(5)
        try:
            result = self.results.pop(0) if self.results else None
            if isinstance(result, Exception):
                raise result
            return result
        finally:
            self.ends.append(time.monotonic())


def wait_until(predicate: Callable[[], bool], timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def runners() -> Iterator[list[BoundedFrequencyRunner]]:
    made: list[BoundedFrequencyRunner] = []
    yield made
    for r in made:
        assert r.stop(timeout=2), f"runner {r.name} did not stop"


def make(
    runners: list[BoundedFrequencyRunner],
    fn: Callable[[], bool | None],
    min_interval: float = 0.0,
    max_interval: float = 60.0,
    retry_interval: float = 60.0,
) -> BoundedFrequencyRunner:
    r = BoundedFrequencyRunner("test", fn, min_interval, max_interval, retry_interval)
    runners.append(r)
    return r


def test_requests_while_running_coalesce_into_one_run(
    runners: list[BoundedFrequencyRunner],
) -> None:
    rec = Recorder()
    rec.gate.clear()
    r = make(runners, rec, min_interval=0.02)
    r.start()
    r.run()
    assert rec.entered.wait(2)
    for _ in range(20):
        r.run()
    assert r.pending and r.running
    rec.gate.set()
    assert wait_until(lambda: r.runs == 2)
    time.sleep(0.1)  # room for a wrongly queued third run to show up
    assert r.runs == 2
    assert not r.pending


def test_requests_before_start_are_kept_and_coalesced(
    runners: list[BoundedFrequencyRunner],
) -> None:
    rec = Recorder()
    r = make(runners, rec)
    for _ in range(5):
        r.run()
    assert r.pending
    time.sleep(0.05)
    assert rec.starts == []  # nothing runs before start()
    r.start()
    assert wait_until(lambda: r.runs == 1)
    time.sleep(0.05)
    assert r.runs == 1
    assert not r.pending


def test_min_interval_separates_end_of_run_from_next_start(
    runners: list[BoundedFrequencyRunner],
) -> None:
    rec = Recorder()
    r = make(runners, rec, min_interval=0.25)
    r.start()
    r.run()
    assert wait_until(lambda: r.runs == 1)
    r.run()
    r.run()
    assert r.pending
    assert wait_until(lambda: r.runs == 2)
    assert rec.starts[1] - rec.ends[0] >= 0.25
    assert r.runs == 2


def test_first_request_runs_without_waiting_for_min_interval(
    runners: list[BoundedFrequencyRunner],
) -> None:
    rec = Recorder()
    r = make(runners, rec, min_interval=30.0)
    r.start()
    r.run()
    assert wait_until(lambda: r.runs == 1, timeout=1.0)


def test_runs_every_max_interval_without_requests(runners: list[BoundedFrequencyRunner]) -> None:
    rec = Recorder()
    r = make(runners, rec, min_interval=0.0, max_interval=0.1)
    r.start()
    time.sleep(0.05)
    assert r.runs == 0  # the first periodic run is one max_interval after start
    assert wait_until(lambda: r.runs >= 3, timeout=2.0)
    gaps = [b - a for a, b in zip(rec.ends, rec.starts[1:], strict=False)]
    assert all(g >= 0.1 for g in gaps)


def test_exception_is_logged_with_traceback_and_retried(
    runners: list[BoundedFrequencyRunner], caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder([RuntimeError("boom"), None])
    r = make(runners, rec, retry_interval=0.1)
    with caplog.at_level(logging.ERROR, logger="kproxy.runner"):
        r.start()
        r.run()
        assert wait_until(lambda: r.runs == 1)
        assert isinstance(r.last_error, RuntimeError)
        assert r.last_succeeded is False
        assert wait_until(lambda: r.runs == 2)  # the retry, without any request
    assert rec.starts[1] - rec.ends[0] >= 0.1
    assert r.last_error is None
    assert r.last_succeeded is True
    errors = [rec_ for rec_ in caplog.records if rec_.levelno == logging.ERROR]
    assert errors and errors[0].exc_info is not None
    assert "boom" in caplog.text
    # The thread survived the exception and still serves requests.
    r.run()
    assert wait_until(lambda: r.runs == 3)


def test_false_return_means_failure_and_is_retried(runners: list[BoundedFrequencyRunner]) -> None:
    rec = Recorder([False, False, True])
    r = make(runners, rec, retry_interval=0.05)
    r.start()
    r.run()
    assert wait_until(lambda: r.runs == 3)
    assert r.last_succeeded is True
    time.sleep(0.15)
    assert r.runs == 3  # success cancelled the retry; max_interval is far away


def test_request_sooner_than_retry_wins(runners: list[BoundedFrequencyRunner]) -> None:
    rec = Recorder([False, None])
    r = make(runners, rec, min_interval=0.05, retry_interval=30.0)
    r.start()
    r.run()
    assert wait_until(lambda: r.runs == 1)
    r.run()
    assert wait_until(lambda: r.runs == 2, timeout=1.0)
    assert rec.starts[1] - rec.ends[0] >= 0.05
    assert r.last_succeeded is True


def test_retry_still_respects_min_interval(runners: list[BoundedFrequencyRunner]) -> None:
    rec = Recorder([False, None])
    r = make(runners, rec, min_interval=0.2, retry_interval=0.0)
    r.start()
    r.run()
    assert wait_until(lambda: r.runs == 2)
    assert rec.starts[1] - rec.ends[0] >= 0.2


def test_stop_waits_for_running_fn_and_starts_nothing_new(
    runners: list[BoundedFrequencyRunner],
) -> None:
    rec = Recorder()
    rec.gate.clear()
    r = make(runners, rec, max_interval=0.05)
    r.start()
    r.run()
    assert rec.entered.wait(2)
    r.run()
    threading.Timer(0.1, rec.gate.set).start()
    assert r.stop(timeout=2)
    assert len(rec.ends) == 1  # stop returned only after the running fn finished
    r.run()  # ignored after stop
    time.sleep(0.1)  # longer than max_interval: no periodic run either
    assert r.runs == 1
    assert not r.pending


def test_stop_from_inside_fn_does_not_deadlock(runners: list[BoundedFrequencyRunner]) -> None:
    holder: list[BoundedFrequencyRunner] = []
    done = threading.Event()

    def fn() -> None:
        assert holder[0].stop() is False  # cannot join itself
        done.set()

    r = make(runners, fn, max_interval=0.05)
    holder.append(r)
    r.start()
    r.run()
    assert done.wait(2)
    assert r.stop(timeout=2)
    assert r.runs == 1


def test_timestamps_are_wall_clock(runners: list[BoundedFrequencyRunner]) -> None:
    r = make(runners, Recorder())
    assert r.last_run_started is None and r.last_run_finished is None
    before = time.time()
    r.start()
    r.run()
    assert wait_until(lambda: r.runs == 1)
    assert r.last_run_started is not None and r.last_run_finished is not None
    assert before <= r.last_run_started <= r.last_run_finished <= time.time()


def test_start_twice_is_an_error(runners: list[BoundedFrequencyRunner]) -> None:
    r = make(runners, Recorder())
    r.start()
    with pytest.raises(RuntimeError, match="already started"):
        r.start()


@pytest.mark.parametrize(
    ("min_i", "max_i", "retry"),
    [(2.0, 1.0, 1.0), (-1.0, 1.0, 1.0), (0.0, 1.0, -0.5)],
)
def test_invalid_intervals_rejected(min_i: float, max_i: float, retry: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        BoundedFrequencyRunner("bad", lambda: None, min_i, max_i, retry)


def test_stop_without_start_is_fine() -> None:
    r = BoundedFrequencyRunner("idle", lambda: None, 0.0, 1.0, 1.0)
    assert r.stop() is True
