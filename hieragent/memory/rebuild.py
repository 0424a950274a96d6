"""Building a FAISS index over a snapshot of the key index's rows (``index.KeyIndex``).

A rebuild (a change of kind, an IVF retrain, a compaction) copies the snapshot's live rows
into new ones, builds the index that ``kind`` names over them (``index_over``; ``auto``
measures which, ``autotune.py``), and maps each id to its new row. The same steps run inline,
in a background thread (``index.py``) or in a process on loans (``lent.py``). The copies and
the map yield after each slice of ``CHUNK`` rows (a lent build's copies: ``SLICE_BYTES`` of keys),
where a lent build pauses between loans.
A rebuild hands back a ``Built``; its owner keeps a ``Job`` while one is in flight. Where builds
run in a thread, what a swap replaces is freed in one too (``freeing.py``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import faiss
import numpy as np

from hieragent.memory.structures import IndexSpec, trained_index, trains

# rows per call while (re)building: numpy copies and dict updates hold the GIL, so a background
# build does its Python-side work in slices of a few milliseconds and the step is never blocked long
CHUNK = 8192
# what a lent build's copies move per slice, in the training thread between two loans: rows of
# keys are larger than ids (CHUNK rows of 384-d keys are 12 MB)
SLICE_BYTES = 2 << 20
HUGE_PAGE = 2 << 20


def slice_rows(dim: int) -> int:
    """Rows of ``dim``-d float32 keys in one ``SLICE_BYTES`` slice (at least 256)."""
    return max(256, SLICE_BYTES // (4 * dim))


def lower_priority(nice: int) -> None:
    """Give the calling thread niceness ``nice`` (Linux sets it per thread id; elsewhere it
    may apply to the process, or not at all). Lowering one's own priority needs no privilege."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def key_rows(cap: int, dim: int) -> np.ndarray:
    """Zeroed key rows ``[cap, D]`` (float32), advised out of transparent huge pages.

    Keys are appended a few rows per update. numpy advises huge pages for large arrays, and
    with the kernel's THP defrag at ``madvise`` the first write into each 2 MB of such an array
    may compact memory for a huge page inside the step that crosses into it: tens of
    milliseconds on this project's VM, once every ~1365 rows at D=384, where small pages cost
    a fraction of a millisecond per append. Searches read the index's own copy of the keys,
    not these rows."""
    size = cap * dim * 4
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros((cap, dim), dtype=np.float32)
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed on first touch
    area.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(area, dtype=np.float32).reshape(cap, dim)


def new_rows(m: int, dim: int, buf: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Empty rows for a rebuild over ``m`` keys (``buf``: memory of at least that capacity to use):
    ``(keys [cap, D], ids [cap])`` with headroom, since compaction (at a quarter dead) comes before growth."""
    cap = rows_capacity(m)
    if buf is None:
        buf = key_rows(cap, dim)
    return buf[:cap], np.full(cap, -1, dtype=np.int64)


def rows_capacity(m: int) -> int:
    return max(64, m + m // 2)


def copy_live(buf: np.ndarray, rid: np.ndarray, keep: np.ndarray, new_buf: np.ndarray,
              new_rid: np.ndarray, rows: int = CHUNK) -> Iterator[None]:
    """The snapshot's live rows ``keep`` into the first rows of the new ones, ``rows`` at a
    time (yielding after each: a lent build slices its work there)."""
    for s in range(0, len(keep), rows):
        e = min(s + rows, len(keep))
        new_buf[s:e], new_rid[s:e] = buf[keep[s:e]], rid[keep[s:e]]
        yield None


def map_rows(rid: np.ndarray, m: int, row: dict[int, int]) -> Iterator[None]:
    """Fill ``row`` (id -> row) for the first ``m`` rows of ``rid``, a ``CHUNK`` at a time."""
    for s in range(0, m, CHUNK):
        e = min(s + CHUNK, m)
        row.update(zip(rid[s:e].tolist(), range(s, e)))
        yield None


def add_in_slices(index: faiss.Index, keys: np.ndarray) -> None:
    """Add ``keys`` (labels: their rows) in slices of ``8 * CHUNK``: FAISS releases the GIL
    while it adds, so the slices can be larger than the Python-side ones."""
    for s in range(0, len(keys), 8 * CHUNK):
        index.add(keys[s:s + 8 * CHUNK])


def give_room(index: faiss.Index) -> None:
    """Give each inverted list of a deserialised IVF index room to grow, as the lists of an index
    filled in slices (``add_in_slices``) have. FAISS reads each list into a vector of exactly its
    size, so the first key added to a list copies all of it: at 1M keys in 4096 lists, a loaded
    ``ivf_flat`` bank paid 460-1,030 page faults and 2-3 ms of evolution per update more than the
    same bank given room, in one process (a probe on the 2-core EPYC, outside the repo). Growing
    a list by one entry and back doubles the vector's capacity (std::vector's growth) while
    writing only the entries it holds; the spare half stays untouched memory. One copy of the
    lists, at load. Lists of other layouts (fast-scan's blocks) are left as they are."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None:
        return
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    if not isinstance(lists, faiss.ArrayInvertedLists):
        return
    for no in range(lists.nlist):
        size = lists.list_size(no)
        if size:
            lists.resize(no, size + 1)
            lists.resize(no, size)


def index_over(keys: np.ndarray, kind: str, spec: IndexSpec, tuned: dict[str, int], template: faiss.Index | None,
               trained_at: int, tune: bool = False, queries: np.ndarray | None = None
               ) -> tuple[str, faiss.Index, faiss.Index | None, int, dict[str, int], str]:
    """A FAISS index of ``kind`` over ``keys`` (labels: their rows): ``(kind, index, template,
    trained_at, tuned, note)``. ``"auto"`` chooses the kind; ``tune`` (where the spec is auto)
    measures its search settings again; a ``template`` (trained, empty) is re-added into
    without training (a compaction)."""
    m = len(keys)
    note, tuned = "", dict(tuned)

    def make(kind: str, tuned: dict[str, int]) -> faiss.Index:
        """A new index of ``kind`` over ``keys``, trained on them where it learns (IVF, a projected graph)."""
        nonlocal template, trained_at
        index = trained_index(kind, keys, spec, tuned)
        if trains(kind, spec, keys.shape[1], tuned):
            trained_at, template = m, faiss.clone_index(index)
        add_in_slices(index, keys)
        return index

    if kind == "auto" or (tune and spec.kind == "auto" and kind != "flat"):
        # auto's first build chooses the kind; its retrainings measure the search settings again
        from hieragent.memory import autotune

        kind, index, tuned, note = autotune.build(keys, spec, make, None if kind == "auto" else (kind, tuned),
                                                  queries=queries)
    elif template is not None:  # a compaction: the trained quantizer, the live keys re-added
        index = faiss.clone_index(template)
        add_in_slices(index, keys)
    else:
        index = make(kind, tuned)
    return kind, index, template, trained_at, tuned, note


@dataclass
class Built:
    """A rebuilt index and its compacted rows, made from a snapshot (by a thread or inline)."""

    kind: str
    index: faiss.Index
    template: faiss.Index | None  # trained and empty: compactions re-add without retraining
    trained_at: int
    buf: np.ndarray  # [capacity, D]; rows [:m] are the snapshot's live keys, in order
    rid: np.ndarray  # [capacity], the id of each row
    m: int
    row: dict[int, int]
    tuned: dict[str, int] = field(default_factory=dict)
    note: str = ""
    caught: int = 0  # rows of the owner below this (added after the snapshot) are indexed here
    dropped: int = 0  # the job's removals before this are applied: their rows are in ``killed``
    killed: list[int] = field(default_factory=list)


@dataclass
class Job:
    kind: str
    snap_n: int
    removed: list[int] = field(default_factory=list)  # ids removed after the snapshot
    thread: threading.Thread | None = None
    built: Built | None = None
    error: BaseException | None = None
    started: float = field(default_factory=time.perf_counter)
    cpu_s: float = float("nan")  # CPU seconds of the background build (its thread, or its process)
    lent: Any = None  # a ``lent.LentBuild``: the build runs on the caller's loans

    @property
    def background(self) -> bool:
        return self.thread is not None or self.lent is not None

    @property
    def running(self) -> bool:
        return (self.thread is not None and self.thread.is_alive()) or (self.lent is not None and not self.lent.done)
