"""Shared fixtures. The lab fixtures build real network namespaces (see kproxy.lab.topology)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest

from kproxy.lab.topology import Lab
from kproxy.lab.uml import in_uml
from tests.support.lab import LAB_SKIP_REASON, LAB_SUPPORTED

# tests/uml needs a kernel with ip_vs: on the host it runs only through tests/test_uml.py,
# which boots User-Mode Linux and runs it there (with KPROXY_IN_UML=1).
collect_ignore = [] if in_uml() else ["uml"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Kernel tests need root and iproute2; elsewhere they are skipped with the reason shown.
    if LAB_SUPPORTED:
        return
    skip = pytest.mark.skip(reason=f"kernel test: {LAB_SKIP_REASON}")
    for item in items:
        if "kernel" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The UML guest boots now and runs its inner suite beside the host tests (test_uml.py).
    uml_tests = sys.modules.get("tests.test_uml")
    if LAB_SUPPORTED and uml_tests is not None and not session.config.option.collectonly:
        uml_tests.start_in_background(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    uml_tests = sys.modules.get("tests.test_uml")
    if uml_tests is not None:
        uml_tests.stop_background()


def _lab() -> Iterator[Lab]:
    if not LAB_SUPPORTED:
        pytest.skip(f"lab unavailable: {LAB_SKIP_REASON}")
    with Lab(pods=3) as lab:
        yield lab


@pytest.fixture
def lab() -> Iterator[Lab]:
    """A fresh lab (3 pods, 2 clients) per test, torn down afterwards even on failure."""
    yield from _lab()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A fresh event loop that the test drives itself (the userspace engines' tests)."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


@pytest.fixture(scope="module")
def lab_module() -> Iterator[Lab]:
    """One lab shared by a test module; tests must not leave dataplane state behind."""
    yield from _lab()
