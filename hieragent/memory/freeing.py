"""Freeing what a swap replaced (``index.KeyIndex._poll``) a slice at a time, off the step.

At 1M keys the old index's lists and rows are gigabytes of pages, and handing them back to the
kernel takes hundreds of milliseconds, too long for the one update that swaps. Two ways spread
it: where builds run on loans of the caller's updates (``build_loan`` > 0, a CPU step), so does
the freeing (``OnLoans``), a slice at a time in the updates after the swap; where builds run in
a thread (``build_loan`` 0, for a step that leaves the CPU idle, as a GPU step does), a release
thread of its own frees them (``release``). Beside a CPU step on every core, that thread
measured no better than freeing in the step (``make bench-freeing``: its slices preempt the
step's threads, which meet after every op).
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator

import faiss
import numpy as np

log = logging.getLogger(__name__)

LISTS_PER_SLICE = 64  # IVF lists freed at a time (at 1M keys in 4096 lists: 24 MB of codes)
PAGES_PER_SLICE = 32 << 20  # bytes of key rows handed back at a time
RELEASE_SHARE = 0.1  # the most of one core that the freeing takes

_released: queue.SimpleQueue = queue.SimpleQueue()
_releaser: threading.Thread | None = None
_handover = threading.Lock()
# what was freed in slices (either way): ``lists`` (IVF indexes), ``pages`` (mapped rows); ``kept``: held elsewhere
freed: Counter[str] = Counter()


def release(things: list) -> None:
    """Free ``things`` (a replaced index, its rows and id map) in a background thread, not the
    caller's, and empty the list: the caller keeps no other reference to them.

    At 1M keys and D=384 the rows and an ``ivf_flat`` index's lists are about 3 GB of pages. The
    thread frees an IVF index's lists ``LISTS_PER_SLICE`` at a time inside FAISS, which releases
    the GIL (its destructors, called through SWIG, hold it), and rows in a mapping of their own
    ``PAGES_PER_SLICE`` bytes at a time, sleeping between slices so that it takes at most
    ``RELEASE_SHARE`` of one core; the rest goes whole."""
    global _releaser
    with _handover:  # the thread frees nothing before the caller's list is empty
        if _releaser is None or not _releaser.is_alive():
            _releaser = threading.Thread(target=_free_released, name="hieragent-release", daemon=True)
            _releaser.start()
        _released.put(things.copy())
        things.clear()


def _after_fork() -> None:
    """A forked child has no release thread, and may have forked while a caller held the lock."""
    global _released, _releaser, _handover
    _released, _releaser, _handover = queue.SimpleQueue(), None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def released() -> None:
    """Block until everything handed to ``release`` so far is freed."""
    done = threading.Event()
    release([done])
    done.wait()


def _free_released() -> None:
    while True:
        _free(_released.get())


def _free(things: list) -> None:
    """Free ``things`` on the release thread, pausing after each slice (``_pause``)."""
    with _handover:
        pass
    started = time.perf_counter()
    for _ in slices(things):
        _pause(started)
        started = time.perf_counter()


def slices(things: list) -> Iterator[None]:
    """Free ``things`` (they go with this generator) a slice per ``next``: an IVF index's lists
    and mapped key rows a slice at a time, what something else still holds not at all, the rest
    whole when the generator ends. The caller keeps no other reference to them."""
    for thing in things:  # ``_held_by_list`` counts the references of this loop's shape
        if isinstance(thing, threading.Event):
            thing.set()
            continue
        if sys.getrefcount(thing) > _HELD_BY_LIST:
            freed["kept"] += 1
            continue
        try:
            if isinstance(thing, faiss.Index):
                yield from _free_lists(thing)
            elif isinstance(thing, np.ndarray):
                yield from _free_pages(thing)
        except Exception:  # what is left goes whole; the caller goes on
            log.warning("memory index: freeing a replaced %s in slices failed", type(thing).__name__, exc_info=True)


class OnLoans:
    """Freeing on the caller's thread, a slice at a time, in loans of its time (``spend``):
    where builds run on loans (``build_loan`` > 0), the index frees what a swap replaced in the
    updates after it, as it built the new index in those before."""

    def __init__(self) -> None:
        self._pending: deque[Iterator[None]] = deque()

    def __len__(self) -> int:
        """Hand-overs not freed yet."""
        return len(self._pending)

    def add(self, things: list) -> None:
        """Free ``things`` in later loans, and empty the list."""
        self._pending.append(slices(things.copy()))
        things.clear()

    def spend(self, seconds: float) -> int:
        """Free slices for about ``seconds`` (at least one where any is left); the slices freed."""
        deadline, n = time.perf_counter() + seconds, 0
        while self._pending:
            try:
                next(self._pending[0])
            except StopIteration:  # the rest of that hand-over went with its generator
                self._pending.popleft()
                continue
            n += 1
            if time.perf_counter() >= deadline:
                break
        return n


def _held_by_list(things: list) -> int:
    for thing in things:
        return sys.getrefcount(thing)
    return 0


def _mapping(rows: np.ndarray) -> tuple[list[int], mmap.mmap | None]:
    """The references each link from ``rows`` down to the mapping that holds its memory has, and
    that mapping (None: another kind of memory)."""
    counts, link = [], rows.base
    while isinstance(link, np.ndarray):
        counts.append(sys.getrefcount(link))
        link = link.base
    if not isinstance(link, memoryview) or not isinstance(link.obj, mmap.mmap):
        return counts, None
    counts += [sys.getrefcount(link), sys.getrefcount(link.obj)]
    return counts, link.obj


_HELD_BY_LIST = _held_by_list([object()])
# a mapping that one view of its rows alone holds, as ``key_rows`` and a lent build make them
_ALONE = _mapping(np.frombuffer(mmap.mmap(-1, mmap.PAGESIZE), dtype=np.float32).reshape(-1, 4)[:8])[0]


def _free_lists(index: faiss.Index) -> Iterator[None]:
    """Free an IVF index's lists ``LISTS_PER_SLICE`` at a time, yielding after each slice (the
    index is unusable after; a layout other than ``ArrayInvertedLists`` goes whole with it)."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None or not ivf.own_invlists:
        return
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    if not isinstance(lists, faiss.ArrayInvertedLists):
        return
    for n in range(lists.codes.size() - LISTS_PER_SLICE, -LISTS_PER_SLICE, -LISTS_PER_SLICE):
        lists.codes.resize(max(n, 0))  # destroys the last lists' codes in FAISS (their ids, 0.5%, go with the index)
        yield
    freed["lists"] += 1


def _free_pages(rows: np.ndarray) -> Iterator[None]:
    """Hand back the pages of rows that a mapping of their own holds (``key_rows``, a lent build's
    memfd) ``PAGES_PER_SLICE`` bytes at a time, yielding after each slice, where no other view
    of them is left: every link down to the mapping has the references of one alone."""
    counts, area = _mapping(rows)
    if area is None or len(counts) != len(_ALONE) or any(c > a for c, a in zip(counts, _ALONE)):
        return
    for start in range(0, len(area), PAGES_PER_SLICE):
        size = min(PAGES_PER_SLICE, len(area) - start)
        try:
            area.madvise(mmap.MADV_REMOVE, start, size)  # a shared mapping: frees the memfd's pages too
        except OSError:
            area.madvise(mmap.MADV_DONTNEED, start, size)  # a private one (``key_rows``)
        yield
    freed["pages"] += 1


def _pause(started: float) -> None:
    """Sleep ``1 / RELEASE_SHARE - 1`` times the work since ``started``, so that freeing takes at
    most that share of one core whatever the training step does meanwhile."""
    time.sleep((time.perf_counter() - started) * (1 / RELEASE_SHARE - 1))
