"""Bad input in the sources: every file, document and object on its own, whatever its bytes.

A hostile or broken file never holds up another file (in the same poll, or at start), a bad
document never holds up the other documents of its file, a bad watch event never ends the
watch of other objects; each is reported with file and line (or kind and name), escaped
onto one line. (No root needed.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.model import snapshot as snapshot_module
from kproxy.model.snapshot import ChangeTracker
from kproxy.ops.control import _source_problem_lines
from kproxy.server.metrics import ProxyMetrics
from kproxy.sources import files
from kproxy.sources.base import ObjectEvent, ObjectKey
from kproxy.sources.files import FileSource, _FileError, _parse_bytes, load_path, read_path
from kproxy.sources.reflector import SERVICES, Reflector, _decode
from kproxy.sources.yamlload import MAX_DEPTH
from kproxy.text import OneLineFormatter

LOGGER = "kproxy.sources.files"


def svc(name: str, port: int = 80) -> str:
    return (
        f"apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n"
        f"spec:\n  ports:\n  - port: {port}\n"
    )


def skey(name: str) -> ObjectKey:
    return ObjectKey("Service", "default", name)


def laughs(levels: int = 9) -> str:
    lines = ["kind: Service", "metadata: {name: lol}", "spec:", "  a0: &a0 [x,x,x,x,x,x,x,x,x,x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


# Files that parse as YAML (or not) but cannot become objects; each must stay its own problem.
HOSTILE: dict[str, bytes] = {
    "mixed-keys.yaml": b"kind: Service\nmetadata: {name: mixed}\nspec: {1: a, b: c}\n",
    "recursive.yaml": b"kind: Service\nmetadata: {name: rec}\nspec: &a\n  x: *a\n",
    "deep.yaml": b"kind: Service\nmetadata: {name: deep}\nspec: " + b"[" * 100_000 + b"]" * 100_000,
    "deep-block.yaml": b"a:\n" + b"- " * 50_000 + b"x\n",
    "laughs.yaml": laughs().encode(),
    "garbage.yaml": bytes(range(256)) * 8,
    "latin1.yaml": "kind: Service\nmetadata: {name: caf\xe9}\n".encode("latin-1"),
    "empty.yaml": b"",
    "comment.yaml": b"# nothing here\n",
    "deep.json": b"[" * 100_000 + b"]" * 100_000,
    "list-of-lists.yaml": b"- - - kind: Service\n",
    "scalar.yaml": b"just a string\n",
    "metadata-list.yaml": b"kind: Service\nmetadata: [name, x]\n",
    "name-int.yaml": b"kind: Service\nmetadata: {name: 5}\n",
    "kind-map.yaml": b"kind: {a: 1}\nmetadata: {name: k}\n",
    "items-map.yaml": b"kind: ServiceList\nitems: {a: 1}\n",
    "unknown-kind.yaml": b"kind: Deployment\nmetadata: {name: d}\n",
    "tags.yaml": b"kind: Service\nmetadata: {name: t}\nspec: !!python/object:os.system {}\n",
    "broken.yaml": b"kind: Service\nmetadata:\n  name: b\n  labels: [unclosed\n",
    "broken.json": b'{"kind": "Service",',
    "namespace-list.yaml": b"kind: Service\nmetadata: {name: n, namespace: [a]}\n",
}


def hostile_folder(tmp_path: Path) -> Path:
    for name, data in HOSTILE.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "zz-good.yaml").write_text(svc("good"))
    return tmp_path


def test_hostile_files_neither_raise_nor_hold_up_a_valid_file(tmp_path: Path) -> None:
    folder = hostile_folder(tmp_path)
    loaded = read_path(folder)
    assert set(loaded.objects) == {skey("good"), skey("mixed")}
    failed = {Path(p.path).name for p in loaded.failed}
    assert {
        "recursive.yaml",
        "deep.yaml",
        "deep-block.yaml",
        "laughs.yaml",
        "garbage.yaml",
    } <= failed
    assert {"latin1.yaml", "deep.json", "tags.yaml", "broken.yaml", "broken.json"} <= failed
    # Readable files whose documents are not objects: skipped one by one, with their line.
    skipped = {Path(p.path).name for p in loaded.skipped}
    assert {"scalar.yaml", "metadata-list.yaml", "name-int.yaml", "kind-map.yaml"} <= skipped
    assert {"items-map.yaml", "list-of-lists.yaml", "namespace-list.yaml"} <= skipped
    assert all(p.line is not None for p in loaded.skipped)
    for p in loaded.failed + loaded.skipped:
        assert str(p).startswith(str(folder))
    by_name = {Path(p.path).name: p for p in loaded.failed}
    assert by_name["laughs.yaml"].line is not None and "nodes" in by_name["laughs.yaml"].error
    assert by_name["deep.yaml"].line == 3 and f"{MAX_DEPTH} levels" in by_name["deep.yaml"].error
    assert "recursive alias" in by_name["recursive.yaml"].error


def test_keys_of_mixed_types_are_an_object_like_any_other(tmp_path: Path) -> None:
    # Sorting such a mapping for the object's digest raised TypeError, which failed the
    # whole poll and kept `kproxy run` from starting.
    (tmp_path / "m.yaml").write_bytes(HOSTILE["mixed-keys.yaml"])
    src = FileSource(tmp_path, poll_interval=60)
    batches: list[list[ObjectEvent]] = []
    src.start(batches.append)
    src.stop()
    assert [e.key.name for e in batches[0]] == ["mixed"]


def test_start_with_hostile_files_present_delivers_the_valid_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    folder = hostile_folder(tmp_path)
    src = FileSource(folder, poll_interval=60)
    batches: list[list[ObjectEvent]] = []
    src.start(batches.append)
    src.stop()
    keys = {e.key for b in batches for e in b}
    assert skey("good") in keys and skey("mixed") in keys
    failed, skipped = src.problems()
    assert {Path(p.path).name for p in failed} == {p.name for p in map(Path, src.current_errors)}
    assert "laughs.yaml" in {Path(p.path).name for p in failed}
    assert "scalar.yaml" in {Path(p.path).name for p in skipped}
    state = src.state()
    assert state["failing_files"] and all("line" in f for f in state["failing_files"])  # type: ignore[union-attr]
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"


def poll_twice(src: FileSource) -> list[ObjectEvent]:
    """A change is acted on once seen on two polls."""
    first = src._poll()
    return first + src._poll()


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
def test_a_hostile_file_added_in_the_same_poll_as_a_valid_change(
    tmp_path: Path, hostile: str
) -> None:
    (tmp_path / "good.yaml").write_text(svc("good", 80))
    src = FileSource(tmp_path, poll_interval=60)
    src.start(lambda _: None)
    src.stop()  # polls driven by hand
    (tmp_path / hostile).write_bytes(HOSTILE[hostile])
    (tmp_path / "good.yaml").write_text(svc("good", 81))
    events = {e.key: e.obj for e in poll_twice(src)}
    assert events[skey("good")]["spec"]["ports"][0]["port"] == 81  # type: ignore[index]


def test_a_file_that_turns_hostile_keeps_its_last_good_objects_and_heals(tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text(svc("a") + "---\n" + svc("b"))
    src = FileSource(tmp_path, poll_interval=60)
    src.start(lambda _: None)
    src.stop()
    f.write_text(laughs())
    assert poll_twice(src) == []  # nothing deleted: the last good objects stay
    assert "nodes" in src.current_errors[f]
    assert src.problems()[0][0].line is not None
    f.write_text(svc("a", 8080))
    events = {e.key: e.obj for e in poll_twice(src)}
    assert events[skey("b")] is None and events[skey("a")] is not None
    assert src.current_errors == {} and src.problems() == ([], [])
    # The one rule: a file that is gone (on two polls) takes its objects away.
    f.unlink()
    assert {e.key: e.obj for e in poll_twice(src)} == {skey("a"): None}


def test_a_bad_document_does_not_hold_up_the_others_of_its_file(tmp_path: Path) -> None:
    f = tmp_path / "multi.yaml"
    f.write_text(
        svc("a") + "---\n- 1\n- [2]\n---\nkind: Service\nmetadata: {name: [x]}\n---\n" + svc("b")
    )
    objects, problems = load_path(f)
    assert set(objects) == {skey("a"), skey("b")}
    assert len(problems) == 3
    assert any(f"{f}:12: document 3: skipped: Service has no metadata.name" in p for p in problems)
    assert any(f"{f}:9: document 2, item 1, item 0: skipped: not an object" in p for p in problems)


def test_files_that_are_too_big_or_not_regular_are_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 1000)
    (tmp_path / "big.yaml").write_text(svc("big") + "#" * 2000 + "\n")
    os.mkfifo(tmp_path / "fifo.yaml")  # opening it for reading would block the watcher
    (tmp_path / "good.yaml").write_text(svc("good"))
    loaded = read_path(tmp_path)
    assert list(loaded.objects) == [skey("good")]
    errors = {Path(p.path).name: p.error for p in loaded.failed}
    assert "larger than" in errors["big.yaml"] and "not a regular file" in errors["fifo.yaml"]


def test_a_newline_in_a_name_reaches_logs_and_status_as_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    forged = "a\\nE0101 forged line"
    (tmp_path / "a.yaml").write_text(
        f'kind: Service\nmetadata: {{name: "{forged}", namespace: [x]}}\n---\n'
        f'kind: Service\nmetadata: {{name: "{forged}"}}\nspec: {{clusterIP: "bad\\nip"}}\n'
    )
    (tmp_path / "b.yaml").write_text(f'kind: Service\nmetadata: {{name: "{forged}"}}\n')
    src = FileSource(tmp_path, poll_interval=60)
    tracker = ChangeTracker("n1")
    src.start(tracker.apply)
    src.stop()
    (rejection,) = tracker.rejections()
    assert rejection.name == "a\nE0101 forged line"
    # The log setup of every command (kproxy.text) and the status text keep each on one line.
    formatter = OneLineFormatter("%(message)s")
    logged = [formatter.format(r) for r in caplog.records]
    assert any("a\\nE0101 forged line" in line for line in logged)
    assert all("\n" not in line for line in logged)
    status_text = _source_problem_lines(src.state())
    assert any("a\\nE0101" in line for line in status_text)
    assert all("\n" not in line for line in status_text)


# --- any bytes at all ---------------------------------------------------------------------

YAMLISH = st.lists(
    st.sampled_from(
        [
            "kind: Service",
            "metadata:",
            "  name: a",
            "- ",
            "[",
            "]",
            "{",
            "}",
            "&a ",
            "*a",
            "<<: ",
            "!!binary ",
            "? ",
            ": ",
            "---",
            "...",
            "'",
            '"',
            "\t",
            "\n",
            "  ",
            "1",
            "x",
            "\\",
            "#",
            "%YAML 1.1",
            "!",
            "|",
            ">",
            ",",
            "\x00",
            "\ufeff",
            "\x85",
        ]
    ),
    max_size=60,
).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.one_of(st.binary(max_size=400), YAMLISH.map(str.encode)),
    suffix=st.sampled_from([".yaml", ".json"]),
)
def test_any_bytes_in_a_file_give_objects_or_a_file_error(data: bytes, suffix: str) -> None:
    try:
        parsed = _parse_bytes(data, Path("/src/f" + suffix))
    except _FileError as e:
        assert str(e).startswith("/src/f") and e.problem.path == "/src/f" + suffix
        return
    assert all(p.path == "/src/f" + suffix for p in parsed.problems)


# --- the tracker: an object that cannot be read is that object's problem alone ------------


def test_a_parser_failure_rejects_only_that_object(monkeypatch: pytest.MonkeyPatch) -> None:
    real = snapshot_module.parse_service

    def fragile(obj: dict[str, Any]) -> Any:
        if obj["metadata"]["name"] == "odd":
            raise TypeError("unforeseen shape")
        return real(obj)

    monkeypatch.setattr(snapshot_module, "parse_service", fragile)
    tracker = ChangeTracker("n1")
    objs = {
        name: {
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]},
        }
        for name in ("odd", "fine")
    }
    assert tracker.apply([ObjectEvent(skey(n), o) for n, o in objs.items()])
    (rej,) = tracker.rejections()
    assert rej.name == "odd" and "TypeError" in rej.reason
    assert [str(sp.name) for sp in tracker.snapshot().services.values()] == ["default/fine"]


def test_rejections_are_known_before_any_snapshot() -> None:
    tracker = ChangeTracker("n1")
    bad = {"kind": "Service", "metadata": {"name": "x"}, "spec": {"clusterIP": "10.0.0.300"}}
    assert tracker.apply([ObjectEvent(skey("x"), bad)]) is False  # nothing to sync
    assert [r.field for r in tracker.rejections()] == ["spec.clusterIP"]
    metrics = ProxyMetrics("iptables")
    metrics.follow_inputs(invalid_objects=lambda: tracker.rejected_total, failing_files=lambda: 2)
    assert metrics.registry.get_sample_value("kproxy_invalid_objects") == 1.0
    assert metrics.registry.get_sample_value("kproxy_source_failing_files") == 2.0
    tracker.apply([ObjectEvent(skey("x"), None)])
    assert tracker.rejections() == ()
    assert metrics.registry.get_sample_value("kproxy_invalid_objects") == 0.0


# --- the API source's watch: a bad event is skipped, the watch goes on --------------------


def test_watch_events_of_the_wrong_shape_are_skipped_and_the_next_ones_delivered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    delivered: list[ObjectEvent] = []
    r = Reflector(SERVICES, conn=None, deliver=delivered.extend)  # type: ignore[arg-type]
    bad: Sequence[Any] = [
        [1, 2],
        "text",
        {"type": "ADDED"},
        {"type": "ADDED", "object": [1]},
        {"type": "MODIFIED", "object": "x"},
        {"type": "ADDED", "object": {"metadata": ["no"]}},
        {"type": "ADDED", "object": {"metadata": {"name": 7}}},
        {"type": ["x"], "object": {"metadata": {"name": "y"}}},
    ]
    caplog.set_level(logging.WARNING, logger="kproxy.sources.api")
    for ev in bad:
        r._event(ev)
    assert delivered == [] and r.skipped == 7
    assert r.state()["skipped"] == 7 and r.state()["last_skipped"]
    good = {"type": "ADDED", "object": {"metadata": {"name": "a\nb", "resourceVersion": "9"}}}
    assert r._event(good) == 1
    assert [e.key.name for e in delivered] == ["a\nb"] and r.resource_version == "9"
    assert all("\n" not in rec.getMessage() for rec in caplog.records)


def test_a_watch_line_that_is_not_json_ends_only_this_watch() -> None:
    # As client-go's: the watch ends and resumes from the last version seen (a ValueError is
    # one of the failures a retry can cure), never a crash of the watch task.
    for line in (b"{not json", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(ValueError):
            _decode(line)


# --- the status text ----------------------------------------------------------------------


def test_status_text_lists_failing_files_and_skipped_documents() -> None:
    source = {
        "failing_files": [{"file": "/s/bad.yaml", "line": 4, "error": "invalid YAML: x"}],
        "skipped_documents": [{"file": "/s/a.yaml", "line": None, "error": "document 2: no kind"}],
    }
    lines = _source_problem_lines(source)
    assert lines[0].startswith("failing files:   1")
    assert "  - /s/bad.yaml:4: invalid YAML: x" in lines
    assert "  - /s/a.yaml: document 2: no kind" in lines
    assert _source_problem_lines({"services": {}}) == []  # the API source's state
