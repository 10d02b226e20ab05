"""The bounded-frequency runner that drives every mode's sync, after upstream's pkg/proxy/runner.

Guarantees (the same three as upstream's 1.33+ BoundedFrequencyRunner):

1. At least `min_interval` passes between the *end* of one run and the *start* of the next.
   Requests made meanwhile are coalesced into one run, started once the interval is over.
2. `fn` runs at least every `max_interval` (measured from the end of the last run), even
   without requests, so state drifting behind kproxy's back is repaired.
3. A failed run (exception or a False return) is retried `retry_interval` after it ended,
   unless a request or the max interval triggers a run sooner; a success cancels the retry.

Differences from upstream, both deliberate: a `run()` before `start()` is remembered and
served by the first loop iteration (upstream drops it, which can lose the initial sync), and
an exception in `fn` is logged and treated as a failure instead of crashing the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kproxy.runner")


class BoundedFrequencyRunner:
    """Runs `fn` on its own thread, on request, bounded by min/max intervals; see module doc."""

    def __init__(
        self,
        name: str,
        fn: Callable[[], bool | None],
        min_interval: float,
        max_interval: float,
        retry_interval: float,
    ) -> None:
        if min(min_interval, max_interval, retry_interval) < 0:
            raise ValueError(f"{name}: intervals must not be negative")
        if max_interval < min_interval:
            raise ValueError(
                f"{name}: max_interval ({max_interval}) must be >= min_interval ({min_interval})"
            )
        self.name = name
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.retry_interval = retry_interval
        self._fn = fn
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending = False
        self._running = False
        self._runs = 0
        # Monotonic deadlines that drive the loop; set when the loop starts and after each run.
        self._not_before = 0.0
        self._max_due = 0.0
        self._retry_due: float | None = None
        # Wall-clock times (time.time()) for health and metrics reporting.
        self.last_run_started: float | None = None
        self.last_run_finished: float | None = None
        self.last_error: BaseException | None = None
        self.last_succeeded: bool | None = None

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        """Start the loop thread. A runner starts once; create a new one to start again."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError(f"runner {self.name!r} already started")
            self._max_due = time.monotonic() + self.max_interval
            self._thread = threading.Thread(
                target=self._loop, name=f"kproxy-runner-{self.name}", daemon=True
            )
            self._thread.start()
        log.debug(
            "runner %s started (min %.3fs, max %.3fs, retry %.3fs)",
            self.name,
            self.min_interval,
            self.max_interval,
            self.retry_interval,
        )

    def run(self) -> None:
        """Request a run as soon as min_interval allows; requests before it starts coalesce."""
        with self._cond:
            if self._stopping:
                return
            self._pending = True
            self._cond.notify_all()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the loop: no new runs start; waits (up to `timeout`) for a running fn.

        Returns True when the loop thread has ended. Safe to call from inside fn (then it
        only asks the loop to stop after fn returns) and more than once.
        """
        with self._cond:
            self._stopping = True
            self._pending = False
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def pending(self) -> bool:
        """True when a requested run has not started yet."""
        with self._cond:
            return self._pending

    @property
    def running(self) -> bool:
        """True while fn is executing."""
        with self._cond:
            return self._running

    @property
    def runs(self) -> int:
        """How many runs have completed (successful or not)."""
        with self._cond:
            return self._runs

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        while True:
            with self._cond:
                reason = self._wait_for_turn()
                if reason is None:
                    log.debug("runner %s stopped", self.name)
                    return
                self._pending = False
                self._running = True
                self.last_run_started = time.time()
            log.debug("runner %s: running (%s)", self.name, reason)
            ok, error = self._call()
            with self._cond:
                ended = time.monotonic()
                self._running = False
                self._runs += 1
                self.last_run_finished = time.time()
                self.last_error = error
                self.last_succeeded = ok
                self._not_before = ended + self.min_interval
                self._max_due = ended + self.max_interval
                self._retry_due = None if ok else ended + self.retry_interval
                self._cond.notify_all()
            if not ok:
                log.info("runner %s: run failed, retrying in %.3fs", self.name, self.retry_interval)

    def _wait_for_turn(self) -> str | None:
        """Block (lock held) until a run is due; the reason, or None when stopping."""
        while not self._stopping:
            now = time.monotonic()
            if now < self._not_before:
                # Cooldown after a run: nothing starts, requests only accumulate.
                self._cond.wait(self._not_before - now)
                continue
            if self._pending:
                return "requested"
            due = self._max_due if self._retry_due is None else min(self._max_due, self._retry_due)
            if now >= due:
                return "retry" if due == self._retry_due else "max interval"
            self._cond.wait(due - now)
        return None

    def _call(self) -> tuple[bool, BaseException | None]:
        try:
            result = self._fn()
        except Exception as err:
            # One broken sync must not end syncing: log it with its traceback and retry.
            log.exception("runner %s: run raised %s", self.name, type(err).__name__)
            return False, err
        return result is not False, None
