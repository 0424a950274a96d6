"""The bank's key index: exact keys in rows, and a FAISS index over the rows chosen by config.

The exact float32 keys are the source of truth; the FAISS index is an accelerator built from
them, so switching from flat to IVF (or back) loses nothing. Which FAISS index a config builds,
and how it is searched, is ``structures.py``.

**Rows, tombstones, compaction.** Keys live in rows appended in insertion order; the FAISS
index labels each key by its row. Removing an id clears its row's bit in a live bitmap (O(1))
and every search passes the bitmap to FAISS as an ``IDSelectorBitmap``, so removed rows are
skipped inside the scan for every kind. Once dead rows pass ``compact_fraction`` of all rows
the index is rebuilt over the live rows only, so a removal costs O(1) amortised
(``ops`` counts the work; ``tests/memory/test_index.py`` checks it does not grow with N).

**Rebuilds off the step.** A rebuild (a change of kind, an IVF retrain, a compaction) over at
least ``background_from`` rows runs in a background thread on a snapshot of the rows, which
are never written in place. The old index keeps answering every search meanwhile, and adds
and removals go on; when the new index is ready the next call swaps it in and replays what
changed since the snapshot (O(changes)). The old index and rows are freed a slice at a time
after the swap (``freeing.py``): on the loans of the next updates, as the build ran on those
before it, or where builds run in a thread (``build_loan`` 0), in another one too. ``wait()``
blocks until a running rebuild is in.
The build itself, over a snapshot, is ``rebuild.py``.
"""

from __future__ import annotations

import logging
import threading
import time
import statistics
from collections import Counter, deque
from typing import Iterator

import faiss
import numpy as np

from hieragent.memory.freeing import OnLoans, release
from hieragent.memory.rebuild import (CHUNK, Built, Job, copy_live, give_room, index_over, key_rows, lower_priority,
                                      map_rows, new_rows)
from hieragent.memory.structures import (STRUCTURE, IndexSpec, blas_search, fastscan_m, reranked, search_params,
                                         search_rows, trains, wanted_kind)

log = logging.getLogger(__name__)

HEADROOM_AT = 0.9  # a large index rebuilds into a bigger buffer in the background at this fill
QUERIES_KEPT = 256  # recent queries kept for ``auto`` to measure recall on
CATCH_UP_LEFT = 512  # a background build hands over once at most this many new rows are unindexed
LOANS_KEPT = 16  # updates whose median time sets a loan
MIN_LOAN_S = 0.005  # the least a loan gives a build (updates of a few milliseconds still finish it)
CATCH_UP_SLICE = 256  # rows a lent build's catch-up indexes per slice (an IVF assignment each)
DROP_SLICE = 8192  # ids removed during a build that its catch-up drops per slice


class KeyIndex:
    """Exact unit keys by int64 id, searched through the FAISS index that ``spec`` asks for.

    ``active`` names the index in use: ``flat`` while an IVF kind waits for enough keys or a
    background build. ``ids()`` reports the live ids in insertion order (an update moves an
    id to the end), which is the order persistence writes. ``ops`` counts the rows each
    operation touched: ``removed`` ids and ``rows_rebuilt`` by (re)builds and compactions.
    """

    def __init__(self, dim: int, spec: IndexSpec | None = None) -> None:
        self.dim, self.spec = dim, spec or IndexSpec()
        if self.spec.kind == "ivf_pq" and dim % self.spec.pq_m:
            raise ValueError(f"memory.index.pq_m={self.spec.pq_m} must divide the key dimension {dim}")
        if self.spec.kind == "ivf_fastscan" and dim % fastscan_m(self.spec, dim):
            raise ValueError(f"memory.index.fastscan_m={self.spec.fastscan_m} must divide the key dimension {dim}")
        if self.spec.hnsw_dim >= dim:
            raise ValueError(f"memory.index.hnsw_dim={self.spec.hnsw_dim} must be below the key dimension {dim} "
                             f"(0: the graph holds the full keys)")
        self._buf = np.zeros((0, dim), dtype=np.float32)  # [capacity, D]; rows [:_n] hold keys
        self._rid = np.zeros(0, dtype=np.int64)  # [capacity], the id of each row
        self._live = np.zeros(0, dtype=bool)  # [capacity]
        self._bits = np.zeros(0, dtype=np.uint8)  # the live mask packed for FAISS's IDSelectorBitmap
        self._n = 0  # rows used, live or dead
        self._dead = 0
        self._row: dict[int, int] = {}  # live id -> row
        self._job: Job | None = None
        self._template: faiss.Index | None = None
        self.auto_kind: str | None = None  # what ``auto`` chose above its threshold
        self.tuned: dict[str, int] = {}  # and the nprobe / rerank it measured (else the spec's)
        self.auto_note = ""
        self.active = "flat"
        self.trained_at = 0
        self.hold_swaps = False  # across processes: a finished background build waits for wait()
        self.last_build: tuple[float, float] | None = None  # the last background build: (wall s, its CPU s)
        self.last_swap_s = float("nan")  # seconds the caller's thread spent in the last swap
        self.last_slices: dict[str, float] = {}  # the last lent build: its longest slice per stage (s)
        self.ops: Counter[str] = Counter()
        self._faiss: faiss.Index = faiss.IndexFlatIP(dim)
        self._queries = np.zeros((QUERIES_KEPT, dim), dtype=np.float32)
        self._asked = 0
        self._lent_at: float | None = None  # when the last ``lend`` returned
        self._between: deque[float] = deque(maxlen=LOANS_KEPT)  # the caller's time between them
        self.freeing = OnLoans()  # what swaps replaced, freed on the loans after them

    # ---- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._row)

    @property
    def rows(self) -> int:
        """Rows in the FAISS index now, removed ones included (until the next compaction)."""
        return self._n

    @property
    def nprobe(self) -> int:
        return self.tuned.get("nprobe", self.spec.nprobe)

    @property
    def rerank(self) -> int:
        """Candidates per result re-scored exactly; 0 where the index's scores are exact."""
        if not reranked(self.active, self.spec, self.dim, self.tuned):
            return 0
        return self.tuned.get("rerank", self.spec.rerank)

    @property
    def ef_search(self) -> int:
        return self.tuned.get("ef_search", self.spec.ef_search)

    @property
    def building(self) -> str | None:
        """The kind a background rebuild is making, or None."""
        return None if self._job is None else self._job.kind

    def ids(self) -> np.ndarray:
        return self._rid[: self._n][self._live[: self._n]]

    def held(self) -> list:
        """What a swap replaces and hands to ``freeing.release``: the FAISS index, the rows, the id
        map, the live mask (the trained template may go on into the next index)."""
        return [self._faiss, self._buf, self._rid, self._live, self._row, self._bits]

    def reconstruct(self, ids: np.ndarray) -> np.ndarray:
        """Exact stored keys ``[len(ids), D]``; unknown ids raise KeyError."""
        rows = [self._row[i] for i in np.asarray(ids, dtype=np.int64).ravel().tolist()]
        return self._buf[rows] if rows else np.zeros((0, self.dim), dtype=np.float32)

    def search(self, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Top ``min(n, len)`` ids and inner products per query, best first: ``[B, n']`` each.

        Rows an approximate index cannot fill (an IVF probe that reaches too few keys) are
        answered by exact search, so every row holds ``n'`` real ids.
        """
        rows, scores = self._top_rows(q, n)
        return self._rid[rows], scores

    def search_with_keys(self, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``search`` and the exact keys of what it found, ``[B, n', D]``, read by row: no id
        lookup per candidate (at 1M entries, those of a batch of 128 queries x 8 candidates
        took about 5 ms, a fifth of the retrieval's time)."""
        rows, scores = self._top_rows(q, n)
        return self._rid[rows], scores, self._buf[rows]

    def _top_rows(self, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        self._poll()
        q = np.ascontiguousarray(q, dtype=np.float32)
        self._remember(q)
        n = min(n, len(self))
        if n == 0:
            return np.zeros((len(q), 0), dtype=np.int64), np.zeros((len(q), 0), dtype=np.float32)
        params, _selector = self._params()
        scores, rows = search_rows(self._faiss, self._buf, q, n, params, self.rerank)
        short = (rows[:, :n] < 0).any(axis=1)
        if short.any():
            rows, scores = rows[:, :n].copy(), scores[:, :n].copy()
            rows[short], scores[short] = self._exact(q[short], n)
        return rows[:, :n], scores[:, :n]

    def _remember(self, q: np.ndarray) -> None:
        """Keep the last ``QUERIES_KEPT`` queries (a ring): ``auto`` tunes on what is asked."""
        q = q[-QUERIES_KEPT:]
        start = self._asked % QUERIES_KEPT
        first = min(len(q), QUERIES_KEPT - start)  # up to the end of the ring, then from its start
        self._queries[start:start + first] = q[:first]
        self._queries[: len(q) - first] = q[first:]
        self._asked += len(q)

    def recent_queries(self) -> np.ndarray:
        """The queries kept, ``[min(asked, QUERIES_KEPT), D]`` (a copy)."""
        return self._queries[: min(self._asked, QUERIES_KEPT)].copy()

    def _params(self) -> tuple[faiss.SearchParameters | None, faiss.IDSelector | None]:
        """Search settings, with the live bitmap as a selector once rows were removed; the
        caller holds the selector until the search returns (older FAISS wrappers do not)."""
        sel = faiss.IDSelectorBitmap(self._n, faiss.swig_ptr(self._bits)) if self._dead else None
        return search_params(self._faiss, self.active, self.nprobe, self.ef_search, sel), sel

    def _exact(self, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-n rows of live keys ``[B, n]`` (the fallback for rows IVF leaves short)."""
        sims = q @ self._buf[: self._n].T  # [B, N]
        sims[:, ~self._live[: self._n]] = -np.inf
        top = np.argsort(-sims, axis=1, kind="stable")[:, :n]
        return top, np.take_along_axis(sims, top, axis=1).astype(np.float32)

    # ---- writing -------------------------------------------------------------------------
    def add(self, ids: np.ndarray, keys: np.ndarray) -> None:
        self._poll()
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        keys = np.ascontiguousarray(keys, dtype=np.float32).reshape(len(ids), self.dim)
        dup = [int(i) for i in ids if int(i) in self._row]
        if dup or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"key index already holds (or was given twice) ids {dup or ids.tolist()}")
        start, end = self._n, self._n + len(ids)
        self._reserve(end)
        self._buf[start:end], self._rid[start:end], self._live[start:end] = keys, ids, True
        self._set_bits(start, end)
        self._row.update(zip(ids.tolist(), range(start, end)))
        self._n = end
        # IVF assigns them to lists, a flat search: 16 keys against 4096 lists took 1.2-1.4 ms on BLAS
        # against 1.7-1.9 ms on FAISS's per-query path (the 2-core EPYC)
        with blas_search(len(keys)):
            self._faiss.add(keys)  # labels start at ntotal == start: each key is labelled by its row
        self._maybe_rebuild()

    def remove(self, ids: np.ndarray) -> None:
        """Tombstone ids (O(1) each); compaction once dead rows pass ``compact_fraction``."""
        self._poll()
        gone: list[int] = []
        for i in np.asarray(ids, dtype=np.int64).ravel().tolist():
            row = self._row.pop(i, None)
            if row is None:
                continue
            self._live[row] = False
            self._bits[row >> 3] &= np.uint8(0xFF ^ (1 << (row & 7)))
            gone.append(i)
        self._dead += len(gone)
        self.ops["removed"] += len(gone)
        if self._job is not None:
            self._job.removed += gone
        if gone:
            self._maybe_rebuild()

    def wait(self) -> None:
        """Block until a background rebuild is swapped in (nothing to do when none runs); where
        ``hold_swaps`` holds a finished one, this is the swap, at a point every process agrees on."""
        if self._job is not None and self._job.thread is not None:
            self._job.thread.join()
        if self._job is not None and self._job.lent is not None:
            self._lent(None)
        self._poll(force=True)

    def lend(self, seconds: float | None = None) -> None:
        """The trainer calls this once per update. A rebuild on loans (``spec.build_loan`` > 0)
        gets ``seconds`` of this thread (default: ``build_loan`` times the median time between
        the last calls): its process runs meanwhile, and this thread does its own share. A
        finished rebuild swaps in (unless held)."""
        now = time.perf_counter()
        if self._lent_at is not None:
            self._between.append(now - self._lent_at)
        if seconds is None:
            seconds = max(MIN_LOAN_S, self.spec.build_loan * statistics.median(self._between or [0.0]))
        building = self._job is not None and self._job.lent is not None
        if building:
            self._lent(seconds)
        self._poll()
        if not building:  # the loan frees what the last swap replaced, a slice at a time
            self.freeing.spend(seconds)
        self._lent_at = time.perf_counter()  # the caller's own time runs from here to the next call

    def _lent(self, seconds: float | None) -> None:
        job = self._job
        if job is None or job.lent is None or job.lent.done:
            return
        try:
            job.lent.finish() if seconds is None else job.lent.advance(seconds)
        except BaseException as e:  # raised by _poll, as a thread's error is
            job.error = e

    def ready(self) -> bool:
        """No background build runs (none started, or it has finished)."""
        return self._job is None or not self._job.running

    def choice(self) -> tuple[str, dict[str, int]] | None:
        """What a finished build made: ``(kind, tuned search settings)``; None if none or failed."""
        job = self._job
        if job is None or not self.ready() or job.built is None:
            return None
        return job.built.kind, dict(job.built.tuned)

    def adopt(self, choice: tuple[str, dict[str, int]]) -> None:
        """Make the finished build match ``choice``, another process's ``choice()`` (``auto``
        measured something else here): the same kind takes its search settings; another kind
        is built anew, in the background, and waits for the next agreement."""
        job = self._job
        if job is None or job.built is None or not self.ready():
            return
        kind, tuned = choice
        if job.built.kind == kind and all(job.built.tuned.get(k) == tuned.get(k) for k in STRUCTURE):
            job.built.tuned = dict(tuned)  # the same index: only the search settings differ
            return
        self._job = None
        self.auto_kind, self.tuned = kind, dict(tuned)
        self._start(kind, train=True)

    def _reserve(self, rows: int) -> None:
        if rows <= len(self._buf):
            return
        cap = max(rows, 2 * len(self._buf), 64)  # geometric growth: adding one key is amortised O(D)
        buf = key_rows(cap, self.dim)
        buf[: self._n] = self._buf[: self._n]  # a running build keeps reading the old array
        rid, live = np.full(cap, -1, dtype=np.int64), np.zeros(cap, dtype=bool)
        rid[: self._n], live[: self._n] = self._rid[: self._n], self._live[: self._n]
        bits = np.zeros(cap // 8 + 1, dtype=np.uint8)
        bits[: len(self._bits)] = self._bits
        self._buf, self._rid, self._live, self._bits = buf, rid, live, bits

    def _set_bits(self, start: int, end: int) -> None:
        rows = np.arange(start, end)
        np.bitwise_or.at(self._bits, rows >> 3, np.left_shift(1, rows & 7).astype(np.uint8))

    # ---- rebuilding ----------------------------------------------------------------------
    def _maybe_rebuild(self) -> None:
        if self._job is not None:
            return
        want = self._wanted()
        if want != self.active or self._needs_retrain():
            self._start(want, train=True, tune=True)
        elif self._dead and self._dead >= self.spec.compact_fraction * self._n:
            self._start(self.active, train=False)
        elif self._n >= HEADROOM_AT * len(self._buf) and self._n >= self.spec.background_from:
            # the rows are about to outgrow their buffer, whose growth would copy every key in
            # the step: rebuild into a larger one in the background instead
            self._start(self.active, train=False)

    def _start(self, kind: str, train: bool, background: bool | None = None, tune: bool = False) -> None:
        """Snapshot the rows and build ``kind`` over the live ones (``"auto"``: choose it;
        ``tune``: where ``auto`` chose ``kind``, measure its search settings again)."""
        keep = np.flatnonzero(self._live[: self._n])
        template = None if train or kind != self.active else self._template
        job = Job(kind=kind, snap_n=self._n)
        args = (self._buf, self._rid, keep, kind, template, tune, self.recent_queries())
        if background is None:
            background = len(keep) >= self.spec.background_from
        if not background:
            job.built = self._build(*args)
            self._job = job
            self._poll()
            return
        if self.spec.build_loan > 0:
            from hieragent.memory import lent

            if lent.available():
                req = lent.request(self.spec, kind, self.tuned, template, self.trained_at, tune, args[-1])
                job.lent = lent.LentBuild(self._buf, self._rid, keep, self.dim, req,
                                          after=lambda *built: self._lent_finish(job, *built))
                self._job = job
                log.info("memory index: building %s over %d keys in a process lent %.0f%% of each update's time "
                         "(%s serves meanwhile)", kind, len(keep), 100 * self.spec.build_loan, self.active)
                return

        def run() -> None:
            try:
                # one OpenMP thread for this thread's FAISS calls (the setting is per thread), at a
                # lower priority (``spec.build_nice``), so the training step keeps most of the cores
                faiss.omp_set_num_threads(1)
                lower_priority(self.spec.build_nice)
                cpu = time.thread_time()
                built = self._build(*args)
                self._catch_up(built, job)
                job.cpu_s = time.thread_time() - cpu
                job.built = built
            except BaseException as e:  # handed to the main thread by _poll
                job.error = e

        job.thread = threading.Thread(target=run, name=f"hieragent-index-{kind}", daemon=True)
        self._job = job
        log.info("memory index: building %s over %d keys in the background (%s serves meanwhile)",
                 kind, len(keep), self.active)
        job.thread.start()

    def _build(self, buf: np.ndarray, rid: np.ndarray, keep: np.ndarray, kind: str,
               template: faiss.Index | None, tune: bool = False, queries: np.ndarray | None = None) -> Built:
        """The new rows and index from a snapshot: reads rows of ``buf`` that nobody writes."""
        m = len(keep)
        new_buf, new_rid = new_rows(m, self.dim)
        for _ in copy_live(buf, rid, keep, new_buf, new_rid):
            pass
        kind, index, template, trained_at, tuned, note = index_over(
            new_buf[:m], kind, self.spec, self.tuned, template, self.trained_at, tune, queries)
        row: dict[int, int] = {}
        for _ in map_rows(new_rid, m, row):
            pass
        return Built(kind, index, template, trained_at, new_buf, new_rid, m, row, tuned, note)

    def _lent_finish(self, job: Job, m: int, kind: str, index: faiss.Index, template: faiss.Index | None,
                     trained_at: int, tuned: dict[str, int], note: str, buf: np.ndarray,
                     rid: np.ndarray) -> Iterator[str]:
        """A lent build's last steps, in this thread and in slices: the id map, the catch-up."""
        row: dict[int, int] = {}
        for _ in map_rows(rid, m, row):
            yield "map"
        built = Built(kind, index, template, trained_at, buf, rid, m, row, tuned, note)
        for _ in self._catch_up_steps(built, job, CATCH_UP_SLICE, blas=True):
            yield "catch-up"
        job.cpu_s, job.built = job.lent.cpu_s, built

    def _poll(self, force: bool = False) -> None:
        """Swap in a finished rebuild, replaying the adds and removals made since its snapshot
        (a background one only when ``force`` where ``hold_swaps``)."""
        job = self._job
        if job is None or (job.running and job.error is None):
            return
        if self.hold_swaps and job.background and not force and job.error is None:
            return
        self._job = None
        swap_started = time.perf_counter()
        if job.error is not None:
            raise RuntimeError(f"memory index: building {job.kind} failed ({job.error!r}); "
                               f"the {self.active} index over every key is still in use") from job.error
        b = job.built
        assert b is not None
        # rows added since the snapshot (live or not) follow its live rows; the build has
        # indexed those up to b.caught already
        t = self._n - job.snap_n
        total = b.m + t
        self._copy_tail(b, job.snap_n, b.caught or job.snap_n, self._n, blas=True)  # no build runs now
        live = np.zeros(len(b.buf), dtype=bool)
        live[: b.m] = True
        live[b.m:total] = self._live[job.snap_n:self._n]
        dead = int(t - live[b.m:total].sum())
        self._drop_removed(b, job)  # what the build thread has not dropped yet
        live[np.asarray(b.killed, dtype=np.int64)] = False
        dead += len(b.killed)
        tail_live = np.flatnonzero(live[b.m:total]) + b.m
        b.row.update(zip(b.rid[tail_live].tolist(), tail_live.tolist()))
        if b.kind != self.active:
            log.info("memory index: %s -> %s over %d keys%s", self.active, b.kind, len(b.row),
                     f" ({b.note})" if b.note else "")
        if job.background:
            self.last_build = (time.perf_counter() - job.started, job.cpu_s)
            self.last_slices = dict(job.lent.longest) if job.lent is not None else {}
            log.info("memory index: the background build of %s swapped in after %.1f s (%.1f s of CPU in its "
                     "%s)", b.kind, *self.last_build, "process" if job.lent is not None else "thread")
        if self.spec.kind == "auto" and b.kind != "flat":
            self.auto_kind, self.tuned, self.auto_note = b.kind, b.tuned, b.note or self.auto_note
        old = self.held()
        self._buf, self._rid, self._live, self._n, self._dead, self._row = b.buf, b.rid, live, total, dead, b.row
        bits = np.packbits(live, bitorder="little")
        self._bits = np.concatenate([bits, np.zeros(len(live) // 8 + 1 - len(bits), dtype=np.uint8)])
        self._faiss, self.active, self._template, self.trained_at = b.index, b.kind, b.template, b.trained_at
        if self.spec.build_loan > 0:
            # a CPU step: freed on the loans after this one, as the build ran on those before
            # (a thread beside the step measured no better than freeing in it: ``make bench-freeing``)
            self.freeing.add(old)
        else:
            release(old)  # a build thread's setting (a GPU step, an idle CPU): off this thread
        self.ops["rows_rebuilt"] += total
        self.ops["rebuilds"] += 1
        self.last_swap_s = time.perf_counter() - swap_started

    def _copy_tail(self, b: Built, snap_n: int, start: int, end: int, blas: bool = False) -> None:
        """Copy rows ``[start, end)`` of this index (added after the snapshot at ``snap_n``) into
        the build ``b`` and index them there. Rows are append-only, so a build thread may call
        this for rows below an ``end`` it read before the buffer it reads them from. ``blas``:
        assign them to IVF lists on BLAS (not from a build thread, which would hold the
        process-wide threshold, and with it the caller's searches, for its whole add)."""
        if end <= start:
            return
        lo, hi = b.m + start - snap_n, b.m + end - snap_n
        if hi > len(b.buf):
            cap = max(hi, 2 * len(b.buf))
            buf, rid = key_rows(cap, self.dim), np.full(cap, -1, dtype=np.int64)
            buf[:lo], rid[:lo] = b.buf[:lo], b.rid[:lo]
            b.buf, b.rid = buf, rid
        b.buf[lo:hi], b.rid[lo:hi] = self._buf[start:end], self._rid[start:end]
        with blas_search(hi - lo if blas else 0):
            b.index.add(b.buf[lo:hi])
        b.caught = end

    @staticmethod
    def _drop_removed(b: Built, job: Job, limit: int | None = None) -> bool:
        """Take the snapshot's rows of the ids removed since the snapshot out of ``b`` (into
        ``b.killed``), from where the last call stopped, at most ``limit`` of them (None: all);
        True while more are left."""
        end = len(job.removed)  # the list only grows (in the caller's thread)
        stop = end if limit is None else min(end, b.dropped + limit)
        for i in job.removed[b.dropped:stop]:
            row = b.row.pop(i, None)
            if row is not None:
                b.killed.append(row)
        b.dropped = stop
        return stop < end

    def _catch_up(self, b: Built, job: Job) -> None:
        """In the build thread: index the rows added while it built and drop the removed ones,
        until few are left, so that the swap on the caller's thread replays only a handful
        (O(1), not O(build time))."""
        for _ in self._catch_up_steps(b, job, CHUNK):
            pass

    def _catch_up_steps(self, b: Built, job: Job, rows: int, blas: bool = False) -> Iterator[None]:
        """``_catch_up`` in slices of ``rows`` rows (``blas``: see ``_copy_tail``)."""
        snap_n = job.snap_n
        b.caught = snap_n
        while True:
            # a lent build's first pass drops every eviction made while it built: in slices too
            while self._drop_removed(b, job, DROP_SLICE):
                yield None
            end = self._n  # read before the buffer: every row below it is in that buffer
            if end - b.caught <= CATCH_UP_LEFT:
                return
            for s in range(b.caught, end, rows):
                self._copy_tail(b, snap_n, s, min(s + rows, end), blas)
                yield None

    def _wanted(self) -> str:
        return wanted_kind(self.spec, len(self), self.auto_kind)

    def _needs_retrain(self) -> bool:
        return (trains(self.active, self.spec, self.dim, self.tuned)
                and len(self) >= self.spec.retrain_growth * max(self.trained_at, 1))

    # ---- persistence ---------------------------------------------------------------------
    def state(self) -> dict:
        """The built FAISS index as bytes (none for flat, which rebuilds in a second) and the id
        of each of its rows (-1 where removed), so it loads without a rebuild."""
        self._poll()  # a finished build swaps in; a running or held one is not saved
        if self.active == "flat":
            return {"active": "flat", "trained_at": self.trained_at, "faiss": None, "rows": None}
        rows = np.where(self._live[: self._n], self._rid[: self._n], -1)
        return {"active": self.active, "trained_at": self.trained_at, "rows": rows, "tuned": dict(self.tuned),
                "faiss": faiss.serialize_index(self._faiss)}

    @classmethod
    def restore(cls, dim: int, spec: IndexSpec, ids: np.ndarray, keys: np.ndarray,
                state: dict | None = None) -> KeyIndex:
        """An index over ``ids``/``keys``: the saved FAISS bytes when they are of the kind the
        spec wants now and their rows hold exactly these ids, else a rebuild from the keys."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        keys = np.ascontiguousarray(keys, dtype=np.float32).reshape(len(ids), dim)
        index = cls(dim, spec)
        state = state or {}
        saved, blob, rows = state.get("active"), state.get("faiss"), state.get("rows")
        if spec.kind == "auto" and saved not in (None, "flat") and len(ids) >= spec.auto_threshold:
            index.auto_kind, index.tuned = saved, dict(state.get("tuned") or {})  # a choice measured before
        want = wanted_kind(spec, len(ids), index.auto_kind)
        if saved not in (None, want):
            log.warning("memory index: saved as %s, the config asks for %s; rebuilding over %d exact keys",
                        saved, want, len(ids))
        if saved == want and blob is not None and rows is not None:
            rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
            live = rows >= 0
            loaded = faiss.deserialize_index(np.ascontiguousarray(blob, dtype=np.uint8))
            if loaded.ntotal == len(rows) and loaded.d == dim and np.array_equal(rows[live], ids):
                give_room(loaded)
                index._reserve(len(rows) + len(rows) // 2)
                index._buf[: len(rows)][live] = keys
                index._rid[: len(rows)], index._live[: len(rows)] = rows, live
                index._n, index._dead = len(rows), int((~live).sum())
                packed = np.packbits(live, bitorder="little")
                index._bits[: len(packed)] = packed
                index._row = dict(zip(ids.tolist(), np.flatnonzero(live).tolist()))
                index._faiss, index.active = loaded, want
                index.trained_at = int(state.get("trained_at", len(ids)))
                if trains(want, spec, dim, index.tuned):  # compactions re-add into a trained, empty copy
                    index._template = faiss.clone_index(loaded)
                    index._template.reset()
                return index
        index._reserve(len(ids) + len(ids) // 2)
        index._buf[: len(ids)], index._rid[: len(ids)], index._live[: len(ids)] = keys, ids, True
        index._set_bits(0, len(ids))
        index._n = len(ids)
        index._row = dict(zip(ids.tolist(), range(len(ids))))
        index._start(want, train=True, background=False)
        return index

