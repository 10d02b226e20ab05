"""FileSource and load_path: parsing, folder rules, and live watching (no root needed)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kproxy.sources.base import ObjectEvent, ObjectKey
from kproxy.sources.files import FileSource, load_path

POLL = 0.05
DEADLINE = 3.0
LOGGER = "kproxy.sources.files"


def svc(name: str, port: int = 80, namespace: str | None = None) -> str:
    ns = f"\n  namespace: {namespace}" if namespace else ""
    return (
        f"apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}{ns}\n"
        f"spec:\n  ports:\n  - port: {port}\n"
    )


def skey(name: str, namespace: str = "default") -> ObjectKey:
    return ObjectKey("Service", namespace, name)


def write(path: Path, text: str) -> None:
    """Replace a file the way careful tools do (temp file + rename), so tests never race a
    half-written file unless they mean to."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Recorder:
    """A sink that keeps every batch and lets a test wait for one."""

    def __init__(self) -> None:
        self.batches: list[list[ObjectEvent]] = []
        self._cond = threading.Condition()

    def __call__(self, batch: Sequence[ObjectEvent]) -> None:
        with self._cond:
            self.batches.append(list(batch))
            self._cond.notify_all()

    def wait_batches(self, n: int, timeout: float = DEADLINE) -> list[list[ObjectEvent]]:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.batches) >= n, timeout)
        assert ok, f"expected {n} batches, got {self.batches}"
        return self.batches

    def quiet_for(self, seconds: float) -> None:
        """Assert that no further batch arrives for a while (several polls)."""
        before = len(self.batches)
        time.sleep(seconds)
        assert self.batches[before:] == []


def by_key(batch: Sequence[ObjectEvent]) -> dict[ObjectKey, dict[str, Any] | None]:
    keys = [e.key for e in batch]
    assert len(keys) == len(set(keys)), f"a key appears twice in one batch: {keys}"
    return {e.key: e.obj for e in batch}


def wait_until(cond: Callable[[], bool], timeout: float = DEADLINE) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached before the deadline"
        time.sleep(0.01)


@pytest.fixture
def started() -> Iterator[Callable[[Path], tuple[FileSource, Recorder]]]:
    sources: list[FileSource] = []

    def start(path: Path, poll: float = POLL) -> tuple[FileSource, Recorder]:
        src = FileSource(path, poll_interval=poll)
        rec = Recorder()
        src.start(rec)
        sources.append(src)
        return src, rec

    yield start
    for s in sources:
        s.stop()


# ---------------------------------------------------------------- one-shot loading


def test_single_file(tmp_path: Path) -> None:
    f = tmp_path / "web.yaml"
    write(f, svc("web", namespace="shop"))
    objects, errors = load_path(f)
    assert errors == []
    assert list(objects) == [skey("web", "shop")]
    assert objects[skey("web", "shop")]["spec"]["ports"][0]["port"] == 80


def test_folder_recursive_and_ignored_names(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", svc("a"))
    write(tmp_path / "sub" / "deeper" / "b.yml", svc("b"))
    (tmp_path / "c.json").write_text(
        json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    )
    for junk in ("a.yaml~", ".#a.yaml", ".a.yaml.swp", ".hidden.yaml", "notes.txt", "x.swp"):
        (tmp_path / junk).write_text(svc("junk"))
    write(tmp_path / ".git" / "x.yaml", svc("in-hidden-dir"))
    objects, errors = load_path(tmp_path)
    assert errors == []
    assert set(objects) == {skey("a"), skey("b"), ObjectKey("Node", "", "n1")}


def test_multi_document_and_empty_documents(tmp_path: Path) -> None:
    f = tmp_path / "all.yaml"
    write(f, "---\n# only a comment\n---\n" + svc("a") + "---\n" + svc("b") + "---\n")
    objects, errors = load_path(f)
    assert errors == []
    assert list(objects) == [skey("a"), skey("b")]


def test_list_yaml_and_typed_list_items_without_kind(tmp_path: Path) -> None:
    write(
        tmp_path / "list.yaml",
        "apiVersion: v1\nkind: List\nitems:\n"
        "- apiVersion: v1\n  kind: Service\n  metadata: {name: a}\n"
        "- apiVersion: v1\n  kind: Node\n  metadata: {name: n1, namespace: ignored}\n",
    )
    write(
        tmp_path / "svclist.yaml",
        "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: b, namespace: x}\n",
    )
    objects, errors = load_path(tmp_path)
    assert errors == []
    assert set(objects) == {skey("a"), skey("b", "x"), ObjectKey("Node", "", "n1")}
    assert objects[skey("b", "x")]["kind"] == "Service"
    assert objects[skey("b", "x")]["apiVersion"] == "v1"


def test_json_list_forms(tmp_path: Path) -> None:
    eps = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSliceList",
        "items": [{"metadata": {"name": "web-abc", "namespace": "shop"}, "endpoints": []}],
    }
    write(tmp_path / "eps.json", json.dumps(eps, indent=2))
    bare = [{"kind": "Service", "metadata": {"name": "x"}}, None]
    write(tmp_path / "bare.json", json.dumps(bare))
    objects, errors = load_path(tmp_path)
    assert errors == []
    key = ObjectKey("EndpointSlice", "shop", "web-abc")
    assert set(objects) == {key, skey("x")}
    assert objects[key]["apiVersion"] == "discovery.k8s.io/v1"


def test_other_kinds_are_ignored(tmp_path: Path) -> None:
    f = tmp_path / "mixed.yaml"
    write(
        f,
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n---\n"
        "kind: ConfigMapList\nitems:\n- metadata: {name: cm}\n---\n" + svc("a"),
    )
    objects, errors = load_path(f)
    assert errors == []
    assert list(objects) == [skey("a")]


def test_timestamps_stay_strings(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    write(f, "kind: Service\nmetadata:\n  name: a\n  creationTimestamp: 2024-05-01T10:00:00Z\n")
    objects, _ = load_path(f)
    assert objects[skey("a")]["metadata"]["creationTimestamp"] == "2024-05-01T10:00:00Z"


def test_missing_name_is_skipped_and_others_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "objs.yaml"
    write(f, svc("a") + "---\nkind: Service\nmetadata: {namespace: x}\n---\n" + svc("b"))
    objects, errors = load_path(f)
    assert set(objects) == {skey("a"), skey("b")}
    assert len(errors) == 1
    assert str(f) in errors[0] and "document 2" in errors[0] and "metadata.name" in errors[0]

    caplog.set_level(logging.WARNING, logger=LOGGER)
    src = FileSource(f, poll_interval=POLL)
    rec = Recorder()
    src.start(rec)
    src.stop()
    assert set(by_key(rec.batches[0])) == {skey("a"), skey("b")}
    assert any("document 2" in r.getMessage() and str(f) in r.getMessage() for r in caplog.records)


def test_parse_error_reports_file_and_line(tmp_path: Path) -> None:
    write(tmp_path / "good.yaml", svc("a"))
    write(tmp_path / "bad.yaml", "kind: Service\nmetadata:\n  name: b\n  labels: [unclosed\n")
    write(tmp_path / "bad.json", '{\n  "kind": "Service",\n  "metadata": {"name": "c"},,\n}\n')
    objects, errors = load_path(tmp_path)
    assert list(objects) == [skey("a")]
    assert len(errors) == 2
    json_err = next(e for e in errors if "bad.json" in e)
    yaml_err = next(e for e in errors if "bad.yaml" in e)
    assert f"{tmp_path / 'bad.json'}:3:" in json_err
    assert f"{tmp_path / 'bad.yaml'}:" in yaml_err and "invalid YAML" in yaml_err


def test_duplicate_key_last_path_wins(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", svc("web", 80))
    write(tmp_path / "b.yaml", svc("web", 81))
    objects, errors = load_path(tmp_path)
    assert objects[skey("web")]["spec"]["ports"][0]["port"] == 81
    assert len(errors) == 1 and "a.yaml" in errors[0] and "b.yaml" in errors[0]


def test_missing_path_raises(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_path(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        FileSource(missing).start(Recorder())


def test_empty_folder_is_fine(tmp_path: Path, started: Any) -> None:
    src, rec = started(tmp_path)
    assert src.synced
    assert rec.batches == [[]]


# ---------------------------------------------------------------- live watching


def test_initial_batch_then_synced(tmp_path: Path, started: Any) -> None:
    write(tmp_path / "a.yaml", svc("a") + "---\n" + svc("b"))
    src = FileSource(tmp_path, poll_interval=POLL)
    assert not src.synced
    rec = Recorder()
    src.start(rec)
    try:
        assert src.synced
        assert len(rec.batches) == 1
        first = by_key(rec.batches[0])
        assert set(first) == {skey("a"), skey("b")}
        assert all(obj is not None for obj in first.values())
        rec.quiet_for(4 * POLL)  # nothing changed, so nothing more is sent
    finally:
        src.stop()


def test_add_file_emits_upserts(tmp_path: Path, started: Any) -> None:
    write(tmp_path / "a.yaml", svc("a"))
    _, rec = started(tmp_path)
    write(tmp_path / "new" / "b.yaml", svc("b") + "---\n" + svc("c"))
    batch = by_key(rec.wait_batches(2)[1])
    assert set(batch) == {skey("b"), skey("c")}
    assert batch[skey("b")] is not None


def test_a_file_written_into_a_new_folder_before_its_watch_is_seen(
    tmp_path: Path, started: Any
) -> None:
    """The race behind a flaky run: the folder is scanned while still empty, the file lands
    before the folder's watch exists (no event will come): the source must look again soon,
    not at its 10 s safety rescan."""
    write(tmp_path / "a.yaml", svc("a"))
    src, rec = started(tmp_path)
    scan = src._scanner.scan

    def scan_then_write(*args: Any) -> Any:
        found, directories = scan(*args)
        new = tmp_path / "new"
        if str(new) in directories and not (new / "b.yaml").exists():
            write(new / "b.yaml", svc("b"))  # after the scan, before watch()
        return found, directories

    src._scanner.scan = scan_then_write
    (tmp_path / "new").mkdir()
    batch = by_key(rec.wait_batches(2)[1])
    assert set(batch) == {skey("b")}


def test_edit_one_object_in_multidoc_file(tmp_path: Path, started: Any) -> None:
    f = tmp_path / "all.yaml"
    write(f, svc("a", 80) + "---\n" + svc("b", 80) + "---\n" + svc("c", 80))
    _, rec = started(tmp_path)
    write(f, svc("a", 80) + "---\n" + svc("b", 8080) + "---\n" + svc("c", 80))
    batch = rec.wait_batches(2)[1]
    assert len(batch) == 1
    assert batch[0].key == skey("b")
    assert batch[0].obj is not None and batch[0].obj["spec"]["ports"][0]["port"] == 8080
    rec.quiet_for(4 * POLL)


def test_in_place_edit_with_same_size(tmp_path: Path, started: Any) -> None:
    # Same size and inode, likely within the same mtime tick: the content hash must tell.
    f = tmp_path / "a.yaml"
    f.write_text(svc("a", 80))
    _, rec = started(tmp_path)
    f.write_text(svc("a", 81))
    batch = rec.wait_batches(2)[1]
    assert batch[0].obj is not None and batch[0].obj["spec"]["ports"][0]["port"] == 81


def test_delete_file_emits_deletes(tmp_path: Path, started: Any) -> None:
    write(tmp_path / "keep.yaml", svc("keep"))
    write(tmp_path / "gone.yaml", svc("x") + "---\n" + svc("y"))
    _, rec = started(tmp_path)
    (tmp_path / "gone.yaml").unlink()
    batch = by_key(rec.wait_batches(2)[1])
    assert batch == {skey("x"): None, skey("y"): None}


def test_broken_edit_keeps_last_good_then_heals(
    tmp_path: Path, started: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    f = tmp_path / "svc.yaml"
    write(f, svc("a") + "---\n" + svc("b"))
    src, rec = started(tmp_path)
    assert src.parse_errors == 0 and src.last_error is None
    # Line 5 opens a flow sequence that never closes; PyYAML notices on line 6.
    broken = "kind: Service\nmetadata:\n  name: a\nspec:\n  ports: [\n  - port: 80\n"
    write(f, broken)
    wait_until(lambda: src.parse_errors == 1)
    rec.quiet_for(4 * POLL)
    assert len(rec.batches) == 1  # no deletes for the last good objects
    assert src.last_error is not None
    assert f"{f}:6:" in src.last_error
    assert src.current_errors == {f: src.last_error}
    assert any(f"{f}:6:" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    assert src.parse_errors == 1  # the same bad content is not counted again

    write(f, svc("a", 9090))  # fixed, and b is gone
    batch = by_key(rec.wait_batches(2)[1])
    assert set(batch) == {skey("a"), skey("b")}
    assert batch[skey("b")] is None
    assert batch[skey("a")] is not None and batch[skey("a")]["spec"]["ports"][0]["port"] == 9090
    assert src.current_errors == {}
    assert src.parse_errors == 1


def test_file_never_good_contributes_nothing(tmp_path: Path, started: Any) -> None:
    write(tmp_path / "bad.json", '{"kind": "Service",')
    src, rec = started(tmp_path)
    assert rec.batches == [[]]
    assert src.parse_errors == 1 and src.last_error is not None and "bad.json:1:" in src.last_error
    write(tmp_path / "bad.json", '{"kind": "Service", "metadata": {"name": "z"}}')
    assert set(by_key(rec.wait_batches(2)[1])) == {skey("z")}


def test_atomic_rename_replacement(tmp_path: Path, started: Any) -> None:
    f = tmp_path / "svc.yaml"
    write(f, svc("a", 80) + "---\n" + svc("b", 80))
    _, rec = started(tmp_path)
    # What editors do: write a new file beside the old one, then rename it over.
    tmp = tmp_path / "svc.yaml.new"
    tmp.write_text(svc("a", 80) + "---\n" + svc("b", 443))
    os.replace(tmp, f)
    batch = rec.wait_batches(2)[1]
    assert [e.key for e in batch] == [skey("b")]
    # Editors that move the old file away first leave a moment with no file at all.
    os.rename(f, tmp_path / "svc.yaml~")
    write(f, svc("a", 80) + "---\n" + svc("b", 444))
    batch = rec.wait_batches(3)[2]
    assert [(e.key, e.obj is not None) for e in batch] == [(skey("b"), True)]
    rec.quiet_for(4 * POLL)


def test_half_written_file_is_not_acted_on(tmp_path: Path) -> None:
    # Drives the polls by hand (the watcher is stopped) so the timing is exact.
    f = tmp_path / "svc.yaml"
    full = svc("a") + "---\n" + svc("b") + "---\n" + svc("c")
    write(f, full)
    src = FileSource(tmp_path, poll_interval=60)
    src.start(Recorder())
    src.stop()
    # A writer caught half way: what was written so far parses, and lacks c.
    f.write_text(full[: full.index("name: c")])
    assert src._poll() == []
    changed = full.replace("port: 80", "port: 81")
    f.write_text(changed)
    assert src._poll() == []  # new content, seen once
    assert {e.key for e in src._poll()} == {skey("a"), skey("b"), skey("c")}
    assert src._poll() == []
    # Content that stays put is taken as meant, even if it lost objects.
    f.write_text(svc("a", 81))
    assert src._poll() == []
    assert by_key(src._poll()) == {skey("b"): None, skey("c"): None}


def test_vanished_file_is_deleted_on_the_second_poll(tmp_path: Path) -> None:
    f = tmp_path / "svc.yaml"
    write(f, svc("a"))
    src = FileSource(tmp_path, poll_interval=60)
    src.start(Recorder())
    src.stop()
    aside = tmp_path / "svc.yaml~"
    os.rename(f, aside)  # an editor moving the old file away before writing the new one
    assert src._poll() == []
    os.rename(aside, f)
    assert src._poll() == []
    f.unlink()
    assert src._poll() == []
    assert by_key(src._poll()) == {skey("a"): None}


def test_symlink_loop_is_not_followed_forever(tmp_path: Path) -> None:
    write(tmp_path / "sub" / "a.yaml", svc("a"))
    (tmp_path / "sub" / "loop").symlink_to(tmp_path)
    objects, errors = load_path(tmp_path)
    assert errors == []
    assert list(objects) == [skey("a")]


def test_configmap_volume_swap(tmp_path: Path, started: Any) -> None:
    # The layout kubelet uses: visible names link into ..data, which is swapped atomically.
    write(tmp_path / "..v1" / "svc.yaml", svc("a", 80))
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "svc.yaml").symlink_to("..data/svc.yaml")
    src, rec = started(tmp_path)
    assert set(by_key(rec.batches[0])) == {skey("a")}
    write(tmp_path / "..v2" / "svc.yaml", svc("a", 81))
    (tmp_path / "..data_tmp").symlink_to("..v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    batch = rec.wait_batches(2)[1]
    assert batch[0].obj is not None and batch[0].obj["spec"]["ports"][0]["port"] == 81
    assert src.parse_errors == 0


def test_duplicate_key_across_files_and_takeover(
    tmp_path: Path, started: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    write(tmp_path / "a.yaml", svc("web", 80))
    write(tmp_path / "b.yaml", svc("web", 81))
    _, rec = started(tmp_path)
    first = by_key(rec.batches[0])
    assert first[skey("web")] is not None and first[skey("web")]["spec"]["ports"][0]["port"] == 81
    dup_warnings = [r.getMessage() for r in caplog.records if "several files" in r.getMessage()]
    assert len(dup_warnings) == 1
    assert "a.yaml" in dup_warnings[0] and "b.yaml" in dup_warnings[0]

    (tmp_path / "b.yaml").unlink()  # a.yaml takes over
    batch = rec.wait_batches(2)[1]
    assert len(batch) == 1 and batch[0].key == skey("web")
    assert batch[0].obj is not None and batch[0].obj["spec"]["ports"][0]["port"] == 80


def test_sink_exception_does_not_stop_watching(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    write(tmp_path / "a.yaml", svc("a"))
    rec = Recorder()
    calls = 0

    def flaky(batch: Sequence[ObjectEvent]) -> None:
        nonlocal calls
        calls += 1
        rec(batch)
        if calls == 2:
            raise RuntimeError("boom")

    src = FileSource(tmp_path, poll_interval=POLL)
    src.start(flaky)
    try:
        write(tmp_path / "b.yaml", svc("b"))
        rec.wait_batches(2)
        write(tmp_path / "c.yaml", svc("c"))
        assert set(by_key(rec.wait_batches(3)[2])) == {skey("c")}
        failures = [r for r in caplog.records if r.exc_info and "boom" in str(r.exc_info[1])]
        assert len(failures) == 1
    finally:
        src.stop()


def test_sink_cannot_corrupt_state_by_mutating(tmp_path: Path, started: Any) -> None:
    f = tmp_path / "a.yaml"
    write(f, svc("a", 80))

    def mutating(batch: Sequence[ObjectEvent]) -> None:
        for e in batch:
            if e.obj is not None:
                e.obj["spec"]["ports"][0]["port"] = 1
        rec(batch)

    rec = Recorder()
    src = FileSource(f, poll_interval=POLL)
    src.start(mutating)
    try:
        write(f, svc("a", 81))
        rec.wait_batches(2)
        write(f, svc("a", 1))  # equal to what the sink made of its copy, not to the file
        assert [e.key for e in rec.wait_batches(3)[2]] == [skey("a")]
    finally:
        src.stop()


def test_watch_single_file_deleted(tmp_path: Path, started: Any) -> None:
    f = tmp_path / "one.json"
    write(f, json.dumps({"kind": "Node", "metadata": {"name": "n1"}}))
    _, rec = started(f)
    f.unlink()
    assert by_key(rec.wait_batches(2)[1]) == {ObjectKey("Node", "", "n1"): None}


def test_stop_joins_quickly(tmp_path: Path) -> None:
    src = FileSource(tmp_path, poll_interval=5.0)
    src.start(Recorder())
    begin = time.monotonic()
    src.stop()
    assert time.monotonic() - begin < 1.0
    alive = [t for t in threading.enumerate() if t.name.startswith("file-source:")]
    assert alive == []


# ---------------------------------------------------------------- inotify wake-ups


def test_idle_source_sleeps_on_inotify_and_wakes_on_a_change(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", svc("a"))
    src = FileSource(tmp_path, poll_interval=POLL, rescan_interval=60)
    polls = 0
    real_poll = src._poll

    def counting_poll() -> list[ObjectEvent]:
        nonlocal polls
        polls += 1
        return real_poll()

    src._poll = counting_poll  # type: ignore[method-assign]
    rec = Recorder()
    src.start(rec)
    try:
        assert src.watching
        time.sleep(20 * POLL)
        assert polls <= 2  # the initial read, and nothing while idle (polling would be ~20)
        write(tmp_path / "sub" / "b.yaml", svc("b"))  # a new folder is watched too
        assert set(by_key(rec.wait_batches(2)[1])) == {skey("b")}
        (tmp_path / "sub" / "b.yaml").write_text(svc("b", 81))  # in place, no rename
        assert set(by_key(rec.wait_batches(3)[2])) == {skey("b")}
    finally:
        src.stop()


def test_without_inotify_the_source_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kproxy.sources import files

    monkeypatch.setattr(files.DirWatch, "create", classmethod(lambda cls: None))
    write(tmp_path / "a.yaml", svc("a"))
    src = FileSource(tmp_path, poll_interval=POLL, rescan_interval=60)
    rec = Recorder()
    src.start(rec)
    try:
        assert not src.watching
        write(tmp_path / "a.yaml", svc("a", 82))
        assert set(by_key(rec.wait_batches(2)[1])) == {skey("a")}
    finally:
        src.stop()


def test_shadowed_duplicate_comes_back_when_the_winner_goes(tmp_path: Path) -> None:
    # The source keeps digests, not objects: the older file is read again to re-deliver it.
    write(tmp_path / "a.yaml", svc("web", 80))
    write(tmp_path / "b.yaml", svc("web", 90))
    src = FileSource(tmp_path, poll_interval=60)
    rec = Recorder()
    src.start(rec)
    src.stop()
    assert rec.batches[0][0].obj is not None
    assert rec.batches[0][0].obj["spec"]["ports"][0]["port"] == 90
    (tmp_path / "b.yaml").unlink()
    assert src._poll() == []
    (event,) = src._poll()
    assert event.obj is not None and event.obj["spec"]["ports"][0]["port"] == 80


def test_large_initial_read_arrives_in_batches_before_start_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kproxy.sources.files.INITIAL_CHUNK_FILES", 4)
    for i in range(10):
        write(tmp_path / f"s{i:02}.yaml", svc(f"s{i}"))
    # The same key in the first and the last file: the last file's version must win.
    write(tmp_path / "a0.yaml", svc("s9", port=81))
    write(tmp_path / "z9.yaml", svc("s9", port=99))
    src = FileSource(tmp_path, poll_interval=POLL)
    rec = Recorder()
    src.start(rec)
    try:
        assert src.synced
        # 12 files in 3 batches; in the last one s09.yaml and z9.yaml give one event for s9.
        assert [len(b) for b in rec.batches] == [4, 4, 3]
        final: dict[ObjectKey, Any] = {}
        for batch in rec.batches:
            final.update(by_key(batch))
        assert set(final) == {skey(f"s{i}") for i in range(10)}
        assert final[skey("s9")]["spec"]["ports"][0]["port"] == 99
        rec.quiet_for(4 * POLL)
    finally:
        src.stop()
