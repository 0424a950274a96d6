"""Files written atomically, and JSONL read with errors that name the file and line.

The lowest floor: it imports nothing from hieragent, so every stage may use it.

A file is written to a temporary file beside it (same folder, so the rename cannot cross a
file system), flushed and fsynced, and only then renamed over the target with
``os.replace``. A reader therefore sees the old file or the new one, never half of one; a
writer that fails leaves the old file as it was and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_DEFAULT_MODE = 0o666 & ~_umask()  # what a plain open() would have created


def cache_dir() -> Path:
    """Where converted models and measurements live: ``$HIERAGENT_CACHE`` or ``~/.cache/hieragent``."""
    return Path(os.environ.get("HIERAGENT_CACHE", Path.home() / ".cache" / "hieragent"))


def write_synced(path: str | os.PathLike, write: Callable[[IO], Any], binary: bool = False) -> None:
    """Open ``path``, call ``write(f)`` and fsync, so that a rename after it cannot publish an
    empty or torn file. Not atomic by itself: use it inside a folder that is renamed into
    place, or use ``atomic_open``."""
    with open(path, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, binary: bool = False) -> Iterator[IO]:
    """``with atomic_open(path) as f: f.write(...)``: ``path`` changes only if the block ends
    without an exception, and then all at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _DEFAULT_MODE)  # mkstemp's 0600 would make every written file private
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, binary=True) as f:
        f.write(data)


@contextlib.contextmanager
def scratch_dir(path: str | os.PathLike, prefix: str | None = None) -> Iterator[Path]:
    """A new temporary folder beside ``path``, removed on exit with whatever is still in it.

    For outputs of several files: build them in the folder, then ``os.replace`` the folder
    (or each file) onto the target inside the block.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix or f".{path.name}.tmp-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sync_files(folder: str | os.PathLike) -> None:
    """fsync every file below ``folder`` (files a library wrote), before a rename publishes it."""
    for path in Path(folder).rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def swap_dir(built: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the finished folder ``built`` onto ``path``, all at once.

    A folder already at ``path`` is moved aside first and put back if the rename fails, so
    ``path`` holds the old folder or the new one, never a mix; ``built`` should sit beside
    ``path`` (a ``scratch_dir``), so that no rename crosses a file system.
    """
    built, path = Path(built), Path(path)
    with scratch_dir(path, prefix=f".{path.name}.old-") as old:
        had = path.exists()
        try:
            if had:
                os.replace(path, old / path.name)
            os.replace(built, path)
        except BaseException:
            if had and not path.exists():
                os.replace(old / path.name, path)
            raise


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> int:
    """Write one JSON object per line, atomically; returns the number of lines."""
    n = 0
    with atomic_open(path) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)`` for each non-blank line, numbered from 1.

    A line that is not JSON, or not a JSON object, raises ``ValueError`` naming the file
    and the line.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj
