"""How long a test module took, printed in pytest's output (even with capture on)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest


def module_timer(request: pytest.FixtureRequest) -> Iterator[None]:
    """The body of a module-scoped fixture: prints "<module>: N.N s" when the module ends."""
    started = time.monotonic()
    yield
    line = f"\n{request.module.__name__}: {time.monotonic() - started:.1f} s"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)
