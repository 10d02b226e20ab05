"""Objects from a YAML/JSON file or a folder of them, watched with inotify and polls.

What changed is always decided by a poll (stat signature plus content hash), which works the
same on every filesystem, including bind mounts and ConfigMap volumes whose files are
swapped through symlinks. inotify watches on the folders only decide when to poll, so an
idle daemon reading 10,000 files costs next to nothing; without inotify it polls on a timer.

While watching, a change is acted on only once it has been seen on two consecutive polls (the
same new content, or the file still gone), so a write or an editor's save caught half way
never turns into deleted objects. That costs one poll of latency.

Bad input is contained where it is: a file that cannot be read or parsed (not YAML, beyond
the loader's limits, too big, not a regular file) is reported with its line and keeps its
last good objects, as an informer keeps the last object it could decode, while every other
file goes on; a document in a readable file that is not an object is skipped and reported,
and the file's other objects go on. Only a file that is gone (on two polls) takes its
objects away. Nothing in a file's content can stop the watch or the daemon's start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kproxy.sources.base import KINDS, NODE, EventSink, ObjectEvent, ObjectKey
from kproxy.sources.dirwatch import DirWatch
from kproxy.sources.yamlload import LimitExceeded, check_depth, load_documents

logger = logging.getLogger("kproxy.sources.files")

SUFFIXES = (".yaml", ".yml", ".json")

# A file modified this recently may be modified again without its stat signature changing
# (coarse mtime granularity, same size), so it is re-hashed until it has been quiet this long.
_RACY_NS = 2_000_000_000

# Files read per batch of the initial delivery (see FileSource._initial_batches).
INITIAL_CHUNK_FILES = 256

# How long stop() waits for the watcher; a sink blocked forever must not hang shutdown.
_JOIN_TIMEOUT = 10.0

# Larger files are refused unread: ten thousand Services with their EndpointSlices in one
# file take about 12 MiB of YAML, and reading is all in memory.
MAX_FILE_BYTES = 64 << 20

_Objects = dict[ObjectKey, dict[str, Any]]


@dataclass(frozen=True)
class FileProblem:
    """Something wrong in one file: the whole file (unreadable, unparsable) or one document
    of it (skipped). The path and error hold outside text: through kproxy.text.one_line
    wherever they are shown as a line."""

    path: str
    line: int | None
    error: str

    def __str__(self) -> str:
        where = self.path + (f":{self.line}" if self.line is not None else "")
        return f"{where}: {self.error}"

    def to_dict(self) -> dict[str, object]:
        return {"file": self.path, "line": self.line, "error": self.error}


class _FileError(Exception):
    """A whole file could not be read or parsed; str() names the file and line."""

    def __init__(self, path: Path | str, line: int | None, error: str) -> None:
        self.problem = FileProblem(str(path), line, error[:300])
        super().__init__(str(self.problem))


@dataclass
class _ParsedFile:
    objects: _Objects
    problems: list[FileProblem]  # documents that were skipped, with the reason


def _is_candidate(name: str) -> bool:
    """Whether a file name found in a folder is one of ours (not hidden, not an editor temp)."""
    if name.startswith((".", "#")) or name.endswith(("~", ".swp", ".swx", "#")):
        return False
    return name.lower().endswith(SUFFIXES)


def _path_order(path: str) -> list[str]:
    """Sort key giving the order of pathlib's comparison (by path component)."""
    return path.split(os.sep)


@dataclass
class _Listing:
    sig: tuple[int, int]  # the directory's (mtime_ns, inode) when listed
    listed_ns: int
    files: list[str]
    subdirs: list[str]


class _Scanner:
    """The files to read under a root, re-listing only directories that changed.

    A directory's entries change only together with its mtime, so an unchanged directory's
    listing is reused; one modified within the last two seconds is listed again every time
    (a second change could share the first one's mtime).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._listings: dict[str, _Listing] = {}
        self._last: tuple[list[str], list[str]] | None = None

    def scan(self) -> tuple[list[str], list[str]]:
        """(files in duplicate-resolution order, directories read)."""
        try:
            st = os.stat(self.root)
        except OSError:
            return [], []
        if not stat.S_ISDIR(st.st_mode):
            # Watch the folder of the path and of its target: editing either is a change.
            folders = {os.path.dirname(os.path.abspath(p)) for p in (self.root,)}
            folders.add(os.path.dirname(os.path.realpath(self.root)))
            return [self.root], sorted(folders)
        files: list[str] = []
        dirs: list[str] = []
        seen: set[tuple[int, int]] = set()
        relisted = False
        stack = [self.root]
        while stack:
            d = stack.pop()
            try:
                st = os.stat(d)
            except OSError:
                continue
            # Symlinked folders are followed (ConfigMap-style layouts), with a loop guard.
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            dirs.append(d)
            listing = self._listings.get(d)
            sig = (st.st_mtime_ns, st.st_ino)
            if listing is None or listing.sig != sig or listing.listed_ns <= sig[0] + _RACY_NS:
                listing = self._listings[d] = self._list(d, sig)
                relisted = True
            files.extend(os.path.join(d, name) for name in listing.files)
            stack.extend(os.path.join(d, name) for name in listing.subdirs)
        if not relisted and self._last is not None and self._last[1] == dirs:
            return self._last
        for gone in set(self._listings) - set(dirs):
            del self._listings[gone]
        files.sort(key=_path_order)
        self._last = (files, dirs)
        return self._last

    @staticmethod
    def _list(directory: str, sig: tuple[int, int]) -> _Listing:
        listed_ns = time.time_ns()
        files: list[str] = []
        subdirs: list[str] = []
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    if is_dir:
                        if not entry.name.startswith("."):
                            subdirs.append(entry.name)
                    elif _is_candidate(entry.name):
                        files.append(entry.name)
        except OSError:
            pass  # vanished or unreadable: no entries, listed again once it changes
        return _Listing(sig, listed_ns, files, subdirs)


def discover(root: Path) -> list[Path]:
    """The files to read under root, in the order that decides which duplicate wins."""
    return [Path(p) for p in _Scanner(str(root)).scan()[0]]


def _line_of(err: yaml.YAMLError) -> int | None:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return None if mark is None else mark.line + 1


def _load_documents(text: str, path: Path) -> list[tuple[int, Any]]:
    """(line, document) for every document of the file's text; _FileError naming the line."""
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise _FileError(path, e.lineno, f"invalid JSON: {e.msg}") from e
        except RecursionError:  # deeper than Python's JSON parser goes
            raise _FileError(path, None, "invalid JSON: nested too deep") from None
        try:
            check_depth(doc)
        except ValueError as e:
            raise _FileError(path, None, f"invalid JSON: {e}") from None
        return [(1, doc)]
    try:
        return load_documents(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        what = "refused" if isinstance(e, LimitExceeded) else "invalid YAML"
        raise _FileError(path, _line_of(e), f"{what}: {problem}") from e


def _expand(doc: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Flatten Lists (kind List, ServiceList, a bare sequence) into single objects."""
    if isinstance(doc, list):
        for i, item in enumerate(doc):
            yield from _expand(item, f"{where}, item {i}")
        return
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if not (isinstance(kind, str) and kind.endswith("List")):
        yield where, doc
        return
    if not isinstance(doc.get("items"), list):
        items = doc.get("items")
        if items is not None:  # an empty List may print `items: null`
            yield where, f"{kind}: items is {type(items).__name__}, not a list"
        return
    # `kubectl get -o yaml` of one kind prints a typed list whose items may omit kind and
    # apiVersion; the list's own values are what they would have been.
    item_kind = kind[: -len("List")]
    for i, item in enumerate(doc["items"]):
        if isinstance(item, dict) and item_kind and "kind" not in item:
            item = {"kind": item_kind, **item}
            if "apiVersion" in doc and "apiVersion" not in item:
                item = {"apiVersion": doc["apiVersion"], **item}
        yield from _expand(item, f"{where}, items[{i}]")


def _key_of(obj: dict[str, Any]) -> ObjectKey | str:
    """The object's key, or why it has none."""
    kind = obj["kind"]
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return f"{kind} has no metadata"
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return f"{kind} has no metadata.name"
    if kind == NODE:  # cluster-scoped: a stray namespace must not split its identity
        return ObjectKey(kind, "", name)
    namespace = meta.get("namespace") or "default"
    if not isinstance(namespace, str):
        return f"{kind} {name}: metadata.namespace is not a string"
    return ObjectKey(kind, namespace, name)


def _parse_text(text: str, path: Path) -> _ParsedFile:
    """Objects in one file's text; raises _FileError when the file as a whole is unreadable.
    Each document (each item of a List) is taken or skipped on its own."""
    objects: _Objects = {}
    problems: list[FileProblem] = []

    def skip(line: int, where: str, why: str) -> None:
        problems.append(FileProblem(str(path), line, f"{where}: skipped: {why}"))

    for n, (line, doc) in enumerate(_load_documents(text, path), start=1):
        for where, obj in _expand(doc, f"document {n}"):
            if obj is None:
                continue
            if isinstance(obj, str):  # _expand's reason why a List gives no objects
                skip(line, where, obj)
                continue
            if not isinstance(obj, dict):
                skip(line, where, f"not an object but a {type(obj).__name__}")
                continue
            kind = obj.get("kind")
            if not isinstance(kind, str) or not kind:
                skip(line, where, "no kind")
                continue
            if kind not in KINDS:
                logger.debug("%s (%s): ignoring kind %s", path, where, kind)
                continue
            key = _key_of(obj)
            if isinstance(key, str):
                skip(line, where, key)
                continue
            if key in objects:
                problems.append(
                    FileProblem(
                        str(path), line, f"{where}: {key} appears again; the later one wins"
                    )
                )
            objects[key] = obj
    return _ParsedFile(objects, problems)


def _read(path: str | Path) -> bytes:
    """A file's bytes; FileNotFoundError if it is gone, _FileError if it cannot be read."""
    try:
        # Non-blocking: opening a FIFO for reading would otherwise wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):  # a FIFO would block the watcher for good
                raise _FileError(path, None, "not a regular file")
            if st.st_size > MAX_FILE_BYTES:
                raise _FileError(path, None, _too_big(st.st_size))
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _FileError(path, None, f"cannot read: {e.strerror or e}") from e
    if len(data) > MAX_FILE_BYTES:  # grew while being read
        raise _FileError(path, None, _too_big(len(data)))
    return data


def _too_big(size: int) -> str:
    return f"{size} bytes: larger than the {MAX_FILE_BYTES >> 20} MiB kproxy reads in one file"


def _parse_file(path: Path) -> _ParsedFile:
    return _parse_bytes(_read(path), path)


def _parse_bytes(data: bytes, path: Path) -> _ParsedFile:
    """The file's objects, or _FileError: whatever the bytes, never another exception."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _FileError(path, None, f"not UTF-8 text (byte {e.start})") from e
    try:
        return _parse_text(text, path)
    except _FileError:
        raise
    except Exception as e:
        # Nothing known gets here (the loader's limits hold); should anything, it is this
        # file's problem alone.
        raise _FileError(path, None, f"cannot be read: {type(e).__name__}: {e}") from e


def _merge(
    per_file: list[tuple[Path, _Objects]],
) -> tuple[_Objects, dict[ObjectKey, tuple[Path, ...]]]:
    """Union of all files, later paths winning; also every key defined by more than one file."""
    merged: _Objects = {}
    owners: dict[ObjectKey, list[Path]] = {}
    for path, objects in sorted(per_file, key=lambda pf: pf[0]):
        for key, obj in objects.items():
            merged[key] = obj
            owners.setdefault(key, []).append(path)
    dups = {key: tuple(paths) for key, paths in owners.items() if len(paths) > 1}
    return merged, dups


def _duplicate_message(key: ObjectKey, paths: tuple[Path, ...]) -> str:
    names = ", ".join(str(p) for p in paths)
    return f"{key} is defined in several files ({names}); using {paths[-1]}"


def _require(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"object path {str(path)!r} does not exist (file or folder)")


def load_path(path: str | Path) -> tuple[dict[ObjectKey, dict[str, Any]], list[str]]:
    """Read a file or folder once: the objects and every problem found (files that failed to
    parse, skipped documents, duplicate keys). Raises FileNotFoundError if path is missing."""
    loaded = read_path(path)
    return loaded.objects, [str(p) for p in loaded.failed + loaded.skipped] + loaded.duplicates


@dataclass
class Loaded:
    """A file or folder read once (see read_path)."""

    objects: _Objects
    failed: list[FileProblem]  # files that could not be read or parsed: none of their objects
    skipped: list[FileProblem]  # documents skipped in files that were read
    duplicates: list[str]  # keys defined in several files, and which file wins


def read_path(path: str | Path) -> Loaded:
    """Read a file or folder once, each file on its own. Raises FileNotFoundError if path is
    missing."""
    root = Path(path)
    _require(root)
    per_file: list[tuple[Path, _Objects]] = []
    failed: list[FileProblem] = []
    skipped: list[FileProblem] = []
    for p in discover(root):
        try:
            result = _parse_file(p)
        except FileNotFoundError:
            continue  # removed while we were listing
        except _FileError as e:
            failed.append(e.problem)
            continue
        skipped.extend(result.problems)
        per_file.append((p, result.objects))
    merged, dups = _merge(per_file)
    return Loaded(merged, failed, skipped, [_duplicate_message(k, ps) for k, ps in dups.items()])


@dataclass
class _FileState:
    sig: tuple[int, int, int, int] | None = None  # (mtime_ns, ctime_ns, size, inode)
    checked_ns: int = 0  # wall time of the read that produced digest
    digest: bytes | None = None  # of the content objects/error came from
    pending: bytes | None = None  # new content seen once, applied if seen again unchanged
    # Last good content, as one digest per object: the objects themselves go to the sink
    # and are not kept here (at 10,000 services that is most of the daemon's memory).
    objects: dict[ObjectKey, bytes] = field(default_factory=dict)
    error: FileProblem | None = None
    skipped: list[FileProblem] = field(default_factory=list)  # of the last good content
    missing: bool = False


def _object_digest(obj: dict[str, Any]) -> bytes:
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    except TypeError:  # keys of mixed types cannot be sorted; any stable text will do
        text = repr(obj)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class FileSource:
    """A Source over a YAML/JSON file or a folder of them (recursive).

    start() delivers every object (in batches of INITIAL_CHUNK_FILES files, all before it
    returns); then a daemon thread delivers one batch of
    differences per change. It sleeps on inotify watches of the folders it reads and, after
    an event, polls every poll_interval seconds until the change has settled; without
    inotify, or every rescan_interval seconds as a safety net for filesystems that send no
    events, it polls anyway. A file that stops parsing keeps its last good objects (counted
    in parse_errors / last_error and listed by problems()); a removed file's objects are
    deleted; a key defined in several files comes from the last one in path order.
    """

    def __init__(
        self, path: str | Path, poll_interval: float = 0.25, rescan_interval: float = 10.0
    ) -> None:
        self.path = Path(path)
        self.poll_interval = poll_interval
        self.rescan_interval = rescan_interval
        self.parse_errors = 0
        self.last_error: str | None = None
        self._states: dict[str, _FileState] = {}
        # key -> (file it comes from, digest of what the sink was last given)
        self._view: dict[ObjectKey, tuple[str, bytes]] = {}
        self._dups: dict[ObjectKey, tuple[str, ...]] = {}
        # Objects parsed during the current poll, handed to the sink and then dropped.
        self._fresh: dict[str, _Objects] = {}
        self._scanner = _Scanner(str(self.path))
        self._watch: DirWatch | None = None
        self._sink: EventSink | None = None
        self._synced = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def watching(self) -> bool:
        """True while inotify drives the watch (False: polling every poll_interval)."""
        return self._watch is not None

    @property
    def current_errors(self) -> dict[Path, str]:
        """Files failing right now (their last good objects are still served)."""
        # list() first: the watcher thread may be adding or removing files meanwhile.
        return {Path(p): str(s.error) for p, s in list(self._states.items()) if s.error}

    def problems(self) -> tuple[list[FileProblem], list[FileProblem]]:
        """(files failing right now, documents skipped in the files as last read), in path
        order; an entry goes once its file is fixed or gone."""
        states = sorted(list(self._states.items()), key=lambda ps: _path_order(ps[0]))
        failed = [s.error for _, s in states if s.error is not None]
        return failed, [p for _, s in states for p in s.skipped]

    def state(self) -> dict[str, object]:
        """What the status shows of this source: the files failing now and the documents
        skipped, with file, line and error."""
        failed, skipped = self.problems()
        return {
            "path": str(self.path),
            "files": len(self._states),
            "parse_errors": self.parse_errors,
            "failing_files": [p.to_dict() for p in failed],
            "skipped_documents": [p.to_dict() for p in skipped],
        }

    def start(self, sink: EventSink) -> None:
        if self._thread is not None:
            raise RuntimeError("FileSource already started")
        _require(self.path)
        self._sink = sink
        self._watch = DirWatch.create()
        for batch in self._initial_batches():
            self._deliver(batch)
        self._synced = True
        self._thread = threading.Thread(
            target=self._run, name=f"file-source:{self.path}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if self._watch is not None:
            self._watch.wake()
        if thread is None or thread is threading.current_thread():
            return
        thread.join(_JOIN_TIMEOUT)
        if thread.is_alive():
            logger.warning(
                "file watcher for %s did not stop within %.0fs", self.path, _JOIN_TIMEOUT
            )

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wait()
                if self._stop.is_set():
                    break
                try:
                    batch = self._poll()
                except Exception:
                    logger.exception("watching %s failed; retrying", self.path)
                    continue
                if batch:
                    self._deliver(batch)
        finally:
            if self._watch is not None:
                self._watch.close()
                self._watch = None

    def _wait(self) -> None:
        """Until the next poll is due: an inotify event (or the safety rescan) when all is
        settled, else one poll_interval (a change seen once is confirmed on the next poll)."""
        watch = self._watch
        if watch is not None and not self._unsettled():
            watch.wait(self.rescan_interval)
            return
        self._stop.wait(self.poll_interval)
        if watch is not None:
            watch.drain()  # the poll about to run covers whatever those events announced

    def _unsettled(self) -> bool:
        # A folder watched only since the last poll may have got files before its watch
        # existed: look once more instead of waiting for an event that will not come.
        new_folders = self._watch is not None and bool(self._watch.added)
        return new_folders or any(s.pending is not None or s.missing for s in self._states.values())

    def _deliver(self, batch: list[ObjectEvent]) -> None:
        assert self._sink is not None
        try:
            self._sink(batch)
        except Exception:
            # The view has already moved on: re-sending the same batch would most likely fail
            # the same way, and a stuck source is worse than one lost update.
            logger.exception(
                "object sink failed on a batch of %d events from %s", len(batch), self.path
            )

    def _initial_batches(self) -> Iterator[list[ObjectEvent]]:
        """The first read, as one batch per INITIAL_CHUNK_FILES files. Every file's objects
        are dicts until the sink has parsed them; reading 10,000 files before handing any
        over held all of them at once and left the heap fragmented after they were freed.
        A key defined in several files may arrive more than once; the last one wins, as in
        a single batch, and no sink acts on objects before start() returns."""
        found, directories = self._scanner.scan()
        if self._watch is not None and not self._watch.watch(directories):
            self._watch.close()
            self._watch = None
        delivered = False
        for i in range(0, len(found), INITIAL_CHUNK_FILES):
            chunk = found[i : i + INITIAL_CHUNK_FILES]
            for p in chunk:
                self._refresh(p)
            try:
                batch = self._first_read_events(chunk)
            finally:
                self._fresh.clear()
            if batch:
                delivered = True
                yield batch
        self._resolve()  # duplicates are reported once, over all files
        if not delivered:
            yield []  # the sink learns that the source is empty

    def _poll(self) -> list[ObjectEvent]:
        """Re-read what changed on disk; the events turning the old view into the new one."""
        found, directories = self._scanner.scan()
        if self._watch is not None and not self._watch.watch(directories):
            self._watch.close()
            self._watch = None
        changed = False
        for p in set(self._states) - set(found):
            changed |= self._gone(p)
        for p in found:
            changed |= self._refresh(p)
        try:
            return self._events() if changed else []
        finally:
            self._fresh.clear()

    def _resolve(self) -> dict[ObjectKey, tuple[str, bytes]]:
        """key -> (the file it comes from now, its digest): the last file in path order
        that defines it. Logs each new duplicate once."""
        new_view: dict[ObjectKey, tuple[str, bytes]] = {}
        owners: dict[ObjectKey, list[str]] = {}
        for path in sorted(self._states, key=_path_order):
            for key, digest in self._states[path].objects.items():
                new_view[key] = (path, digest)
                owners.setdefault(key, []).append(path)
        dups = {key: tuple(paths) for key, paths in owners.items() if len(paths) > 1}
        for key, paths in dups.items():
            if self._dups.get(key) != paths:
                logger.warning("%s", _duplicate_message(key, tuple(Path(p) for p in paths)))
        self._dups = dups
        return new_view

    def _first_read_events(self, paths: list[str]) -> list[ObjectEvent]:
        """Events for files read for the first time, each later in path order than every
        file read before it (so it wins any key they share)."""
        events: dict[ObjectKey, ObjectEvent] = {}
        for path in paths:
            state = self._states.get(path)
            for key, digest in state.objects.items() if state is not None else ():
                old = self._view.get(key)
                if old is None or old[1] != digest:
                    obj = self._object(path, key, digest)
                    if obj is None:
                        continue
                    events[key] = ObjectEvent(key, obj)
                self._view[key] = (path, digest)
        return list(events.values())

    def _events(self) -> list[ObjectEvent]:
        new_view = self._resolve()
        events: list[ObjectEvent] = []
        for key, (path, digest) in new_view.items():
            old = self._view.get(key)
            if old is not None and old[1] == digest:
                if old[0] != path:
                    self._view[key] = (path, digest)
                continue
            obj = self._object(path, key, digest)
            if obj is None:
                continue  # re-read next poll; the sink keeps what it had
            events.append(ObjectEvent(key, obj))
            self._view[key] = (path, digest)
        for key in [k for k in self._view if k not in new_view]:
            events.append(ObjectEvent(key, None))
            del self._view[key]
        return events

    def _object(self, path: str, key: ObjectKey, digest: bytes) -> dict[str, Any] | None:
        """The object as the sink must now get it. Usually it was just parsed; only when a
        duplicate's winning file goes away does the older file have to be read again."""
        fresh = self._fresh.get(path)
        if fresh is not None:
            # Parsed in this poll from the content its digests were taken of: they match.
            obj = fresh.get(key)
            if obj is not None:
                return obj
        else:
            try:
                fresh = self._fresh[path] = _parse_file(Path(path)).objects
            except (OSError, _FileError):  # _parse_file raises nothing else
                fresh = self._fresh[path] = {}
            obj = fresh.get(key)
            if obj is not None and _object_digest(obj) == digest:
                return obj
        # The file changed since its last good read: let its next refresh settle it.
        self._states[path].sig = None
        return None

    def _gone(self, path: str) -> bool:
        """A file vanished. Its objects are dropped only if it is still gone on the next poll,
        because some editors move the old file away before writing the new one."""
        state = self._states[path]
        if not state.missing:
            state.missing = True
            return False
        del self._states[path]
        return bool(state.objects)

    def _refresh(self, path: str) -> bool:
        """Bring one file's state up to date; True if its objects changed."""
        state = self._states.get(path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self._gone(path) if state is not None else False
        except OSError as e:
            state = self._states.setdefault(path, _FileState())
            state.missing, state.sig, state.digest, state.pending = False, None, None, None
            problem = FileProblem(path, None, f"cannot stat: {e.strerror or e}")
            # Nothing like a signature to tell a new failure from the same one: compare text.
            return False if state.error == problem else self._failed(state, problem)
        if state is None:
            state = self._states[path] = _FileState()
        state.missing = False
        sig = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        quiet = st.st_mtime_ns + _RACY_NS < state.checked_ns
        if state.pending is None and state.sig == sig and quiet:
            return False
        now = time.time_ns()
        try:
            data = _read(path)
        except FileNotFoundError:
            return self._gone(path)
        except _FileError as e:
            # Forget the digest so that the same good content, once readable, clears the error.
            state.sig, state.checked_ns, state.digest, state.pending = sig, now, None, None
            if state.error == e.problem:
                return False
            return self._failed(state, e.problem)
        state.sig, state.checked_ns = sig, now
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if digest == state.digest:
            state.pending = None
            return False
        if self._synced and digest != state.pending:
            # A writer that truncates and rewrites in place can be caught half way, and half a
            # YAML file often still parses, minus the objects after the cut: deleting those
            # would be an outage. So content is used only once it is the same on two polls.
            state.pending = digest
            return False
        state.digest, state.pending = digest, None
        try:
            result = _parse_bytes(data, Path(path))
        except _FileError as e:
            return self._failed(state, e.problem)
        for problem in result.problems:
            logger.warning("%s", problem)
        if state.error is not None:
            logger.info("%s is valid again", path)
        state.error = None
        state.skipped = result.problems
        digests = {key: _object_digest(obj) for key, obj in result.objects.items()}
        self._fresh[path] = result.objects
        if digests == state.objects:
            return False
        state.objects = digests
        return True

    def _failed(self, state: _FileState, problem: FileProblem) -> bool:
        """Record a new failure of a file; its last good objects stay in force."""
        message = str(problem)
        self.parse_errors += 1
        self.last_error = message
        state.error = problem
        if state.objects:
            kept = f"keeping its last good {len(state.objects)} object(s)"
        else:
            kept = "it contributes no objects"
        logger.warning("%s (%s)", message, kept)
        return False
