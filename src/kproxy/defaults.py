"""Defaults shared by the daemon and the commands that talk to it."""

from pathlib import Path

# State of a running kproxy: status.json, the admin socket, kept failed restore inputs.
DEFAULT_STATE_DIR = Path("/var/run/kproxy")
