import logging

from hypothesis import given
from hypothesis import strategies as st

from kproxy.text import OneLineFormatter, one_line


def test_plain_text_is_unchanged() -> None:
    assert one_line("default/web:http") == "default/web:http"


def test_line_breaks_and_controls_are_escaped() -> None:
    assert one_line("a\nb\rc\x1b[31m\u2028d") == "a\\nb\\rc\\x1b[31m\\u2028d"


def test_a_backslash_cannot_forge_an_escape() -> None:
    assert one_line("a\\nb") == "a\\\\nb"


def test_limit_marks_the_cut() -> None:
    assert one_line("x" * 10, limit=4) == "xxxx...(6 more)"


@given(st.text())
def test_never_more_than_one_line(text: str) -> None:
    out = one_line(text)
    assert out.splitlines() in ([out], [])
    assert all(ch.isprintable() for ch in out)


def test_formatter_keeps_a_forged_line_in_its_own(caplog: object) -> None:
    record = logging.LogRecord("kproxy", logging.WARNING, "", 0, "bad %s", ("web\nE forged",), None)
    out = OneLineFormatter("%(levelname).1s %(message)s").format(record)
    assert out == "W bad web\\nE forged"


def test_log_to_stderr_keeps_every_record_on_one_line() -> None:
    import subprocess
    import sys

    probe = (
        "import logging; from kproxy.text import log_to_stderr; "
        "log_to_stderr(logging.INFO, '%(levelname).1s %(message)s'); "
        "logging.getLogger('kproxy').warning('skipping %s', 'web\\nE forged')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert proc.stderr == "W skipping web\\nE forged\n"
