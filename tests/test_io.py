"""Atomic writes and JSONL reading (``hieragent.io``): what a crash or a bad line leaves."""

import ast
import json
import os
import stat

import pytest

import hieragent.io as io_mod
from hieragent.io import (
    atomic_open, atomic_write_bytes, atomic_write_text, iter_jsonl, scratch_dir, write_jsonl,
)


def test_a_writer_that_raises_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_open(path) as f:
            f.write("new, half written")
            raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_the_target_is_untouched_until_the_block_ends(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")
    with atomic_open(path, binary=True) as f:
        f.write(b"new")
        f.flush()
        assert path.read_bytes() == b"old"  # the new bytes sit in a temporary beside it
        [tmp] = [p for p in tmp_path.iterdir() if p != path]
        assert tmp.name.startswith(".f.bin.") and tmp.read_bytes() == b"new"
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.bin"]


def test_the_file_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(io_mod.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(io_mod.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    atomic_write_text(tmp_path / "f.txt", "x")
    assert events == ["fsync", "replace"]


def test_a_failed_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    path.write_text("old")

    def replace(src, dst):
        raise OSError("disk vanished")

    monkeypatch.setattr(io_mod.os, "replace", replace)
    with pytest.raises(OSError, match="disk vanished"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_write_jsonl_counts_lines_and_creates_the_folder(tmp_path):
    path = tmp_path / "sub" / "rows.jsonl"
    rows = [{"id": 1, "text": "go to the red ball"}, {"id": 2, "text": "ünïcode"}]
    assert write_jsonl(iter(rows), path) == 2
    assert [obj for _, obj in iter_jsonl(path)] == rows


def test_iter_jsonl_numbers_lines_from_one_and_skips_blank_ones(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2}\n')
    assert list(iter_jsonl(path)) == [(1, {"a": 1}), (4, {"a": 2})]


@pytest.mark.parametrize(("line", "message"), [
    ('{"a": 1', r"rows.jsonl:2: not valid JSON"),
    ("[1, 2]", r"rows.jsonl:2: expected a JSON object, got list"),
])
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        list(iter_jsonl(path))
    assert str(path) in str(err.value)


def test_scratch_dir_is_beside_the_target_and_gone_afterwards(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with scratch_dir(target) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
            (tmp / "half").write_text("x")
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []
    with scratch_dir(target) as tmp:
        (tmp / "done").write_text("x")
        os.replace(tmp, target)
    assert os.listdir(tmp_path) == ["out"] and (target / "done").read_text() == "x"


def test_io_is_the_lowest_floor():
    tree = ast.parse(open(io_mod.__file__).read())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("hieragent")]


def test_an_atomic_write_gets_the_mode_a_plain_open_would_give(tmp_path):
    plain, atomic = tmp_path / "plain.txt", tmp_path / "atomic.txt"
    plain.write_text("x")
    atomic_write_text(atomic, "x")
    assert stat.S_IMODE(atomic.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
