"""Wake the file source when something changes in the folders it reads (inotify).

Only directories are watched, never files: a directory watch reports writes, renames,
creations and deletions of its entries, which covers editors that replace a file, tools
that rewrite it in place and ConfigMap volumes that swap a `..data` symlink. The watch only
says "look again"; what changed is still decided by the source's stat-and-hash poll, so a
missed or coalesced event costs latency, never correctness (the source also rescans on a
timer, for filesystems that send no events, such as NFS).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
from collections.abc import Iterable

from inotify_simple import INotify
from inotify_simple import flags as f

logger = logging.getLogger("kproxy.sources.files")

_MASK = (
    f.CREATE
    | f.DELETE
    | f.MODIFY
    | f.CLOSE_WRITE
    | f.MOVED_FROM
    | f.MOVED_TO
    | f.ATTRIB
    | f.DELETE_SELF
    | f.MOVE_SELF
    | f.ONLYDIR
)


class DirWatch:
    """inotify watches on a set of directories, plus a pipe that wakes a waiting reader."""

    def __init__(self) -> None:
        self._inotify = INotify(nonblocking=True)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watches: dict[str, int] = {}
        # The directories the last watch() began to watch: what was written into them before
        # their watch existed sent no event (a folder created with files in it).
        self.added: set[str] = set()

    @classmethod
    def create(cls) -> DirWatch | None:
        """A watcher, or None when this kernel or process cannot have one (then poll)."""
        try:
            return cls()
        except OSError as e:
            logger.info("inotify unavailable (%s); watching by polling only", e.strerror or e)
            return None

    def watch(self, directories: Iterable[str]) -> bool:
        """Make the watched set exactly `directories`; False if the kernel refused some
        (e.g. fs.inotify.max_user_watches reached), in which case polling must take over."""
        wanted = set(directories)
        for gone in set(self._watches) - wanted:
            wd = self._watches.pop(gone)
            # OSError: the directory was removed, and its watch with it.
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(wd)
        complete = True
        self.added = set()
        for path in wanted - set(self._watches):
            try:
                self._watches[path] = self._inotify.add_watch(path, _MASK)
                self.added.add(path)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR):
                    continue  # gone since the scan; the next scan sees it
                logger.warning(
                    "cannot watch %s (%s); falling back to polling", path, e.strerror or e
                )
                complete = False
        return complete

    def wait(self, timeout: float) -> bool:
        """Block until an event, wake() or the timeout; True if there were events."""
        ready, _, _ = select.select([self._inotify.fileno(), self._wake_r], [], [], timeout)
        self._drain_wake()
        return self.drain() if self._inotify.fileno() in ready else False

    def drain(self) -> bool:
        """Consume pending events without waiting; True if there were any."""
        try:
            return bool(self._inotify.read(timeout=0))
        except BlockingIOError:
            return False

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # pipe full: a wake-up is already pending
            os.write(self._wake_w, b"x")

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._inotify.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
