"""Text that came from outside (object names, file contents, request bytes) made safe to put
into one line of a log, a warning, an Event, an annotation, a status or a rule comment: it
can neither start a new line nor carry terminal control sequences."""

from __future__ import annotations

import logging
import sys

# Characters that end a line or move the cursor, escaped the way Python's repr() does.
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def one_line(value: object, limit: int = 0) -> str:
    """`value` as text on one line: control and line-breaking characters (C0, DEL, C1,
    U+2028/U+2029) as escapes, a backslash doubled so an escape cannot be forged; cut to
    `limit` characters (0: no limit) with a marker saying so."""
    text = value if isinstance(value, str) else str(value)
    clean = text.isprintable() and "\\" not in text
    out = text if clean else "".join(_escape(ch) for ch in text)
    if limit and len(out) > limit:
        return out[:limit] + f"...({len(out) - limit} more)"
    return out


def _escape(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    if ch.isprintable() or ch == " ":
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class OneLineFormatter(logging.Formatter):
    """A log formatter whose message part stays on one line whatever the arguments hold (a
    traceback, added after the message by the logging module itself, still spans lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


def log_to_stderr(level: int, fmt: str) -> None:
    """logging.basicConfig on stderr with a OneLineFormatter: what every kproxy process (the
    proxy, a userspace worker, the rollout controller) logs through."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
