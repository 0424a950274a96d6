"""Index rebuilds that take CPU only when the bank lends it: a child process, stopped between loans.

Where the training step keeps every core busy (a CPU run on a 2-core machine), no concurrent
build leaves the step alone: the step's threads meet after every op, and whenever the
scheduler gives the build a slice of one core, the other core's thread waits at the barrier.
``make bench-memory`` measured the longest step at 4-10x the median beside a build thread at
niceness 10, and a process spinning at niceness 19 still stretched a step to 2.1x (``--spinner``). So with
``memory.index.build_loan`` > 0 (the default) a background rebuild runs in a child process
that is stopped (``SIGSTOP``) except while the bank lends it time: ``KeyIndex.lend()``,
called once per training update, continues it for ``build_loan`` times the update's own time
while the caller waits, then stops it.
The caller's own share of the rebuild (copying the snapshot's live rows into shared memory,
filling the new IVF lists, the id map, the rows added meanwhile) runs in the same loans, in
slices. An update during a build is then longer by about one loan, on any machine.

The child reads the snapshot's keys from a ``memfd`` the caller filled and builds what the
thread would (``index_over``: training, ``auto``'s measurements, the adds). It hands back the
trained, empty index and each row's inverted list for ``ivf_flat`` (the caller fills the lists
itself, a copy per slice, rather than deserialize a gigabyte at once), and the whole serialized
index for the kinds whose codes are small (PQ, fast-scan) or that FAISS cannot fill from given
lists (HNSW). While stopped between loans the child's wall clock runs on, so ``auto``'s timings
there use CPU time.

The request, the result and the child's stderr pass through ``memfd``s too, never a disk: one
``write`` system call cannot be stopped, and a result written to a file under ``/tmp`` in one
call could spend a few hundred milliseconds in the kernel (allocating page cache) while the
training step ran beside it. Both sides write in slices of ``WRITE_SLICE`` bytes, so a stop
waits at most one.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import faiss
import numpy as np

from hieragent.memory.rebuild import copy_live, index_over, new_rows, rows_capacity, slice_rows
from hieragent.memory.structures import IndexSpec

CHILD = "child"  # what the caller's steps yield while the child works
WRITE_SLICE = 1 << 22  # bytes per write system call (about a millisecond into memory)


def available() -> bool:
    """Lent builds need Linux's memfd and stop signals; elsewhere the thread builds."""
    return hasattr(os, "memfd_create") and hasattr(signal, "SIGSTOP")


class LentBuild:
    """The caller's side of one rebuild: ``advance(seconds)`` runs its steps (and the child)
    for that long, ``finish()`` to the end without stopping the child. Once the child is done,
    ``after(m, kind, index, template, trained_at, tuned, note, buf, rid)`` gives the caller's last
    steps (an iterator, each item one slice); ``done`` when they are.

    ``longest`` keeps, per stage of the caller's share, its longest slice in seconds (a stall
    above one loan names its stage there): ``copy`` (the snapshot into shared memory),
    ``start`` (the request and the child's start), ``stop`` (the child's stop after its loan,
    beyond the loan), ``exit`` (as ``stop``, where the loan ended inside the child's exit),
    ``result`` (reading what the child built), ``fill`` (the IVF lists) and what ``after``
    yields (the bank's: ``map``, ``catch-up``)."""

    def __init__(self, buf: np.ndarray, rid: np.ndarray, keep: np.ndarray, dim: int, request: dict[str, Any],
                 after: Callable[..., Iterator[str]]) -> None:
        self.dim, self.request, self.after = dim, request, after
        self.done, self.cpu_s = False, float("nan")
        self.longest: dict[str, float] = {}
        self._held = _Held()  # the child and the memfds, released by close() or when this build is dropped
        weakref.finalize(self, self._held.release)
        self._steps = self._run(buf, rid, keep)

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._held.proc

    def advance(self, seconds: float) -> None:
        """Work on the rebuild for about ``seconds`` (the child runs only inside this call)."""
        deadline = time.perf_counter() + seconds
        while not self.done:  # at least one slice, however short the loan
            if self._step() == CHILD:
                self._lend(deadline - time.perf_counter())
            if time.perf_counter() >= deadline:
                return

    def finish(self) -> None:
        while not self.done:
            if self._step() == CHILD:
                self._lend(None)

    def close(self) -> None:
        """Stop the child (if any) and close the memfds."""
        self._held.release()

    def _step(self) -> str | None:
        t0 = time.perf_counter()
        try:
            stage = next(self._steps)
        except StopIteration:
            self._end()
            return None
        except BaseException:
            self._end()
            self.close()
            raise
        if stage != CHILD:  # the child's own time is in its loans (``_lend``)
            self._note(stage, time.perf_counter() - t0)
        return stage

    def _note(self, stage: str, seconds: float) -> None:
        self.longest[stage] = max(seconds, self.longest.get(stage, 0.0))

    def _end(self) -> None:
        """Done: ``after`` goes, since its closure holds the caller's job, which holds this build.
        Kept, that cycle left the built index to the cyclic collector, so that the swap after the
        next build could not free it (``freeing``), and a collection at some later step did."""
        self.done, self.after = True, None

    def _lend(self, seconds: float | None) -> None:
        """Let the child run for ``seconds`` (None: until it exits), then stop it."""
        proc = self._proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)
        try:
            proc.wait(timeout=None if seconds is None else max(seconds, 0.0))
        except subprocess.TimeoutExpired:
            t0 = time.perf_counter()
            stopped = stop(proc)
            self._note("stop" if stopped else "exit", time.perf_counter() - t0)

    def _run(self, buf: np.ndarray, rid: np.ndarray, keep: np.ndarray) -> Iterator[str]:
        m, dim, held = len(keep), self.dim, self._held
        size = rows_capacity(m) * dim * 4
        fd = held.memfd("keys")
        os.ftruncate(fd, size)
        shared = np.frombuffer(mmap.mmap(fd, size), dtype=np.float32).reshape(-1, dim)
        new_buf, new_rid = new_rows(m, dim, shared)
        rows = slice_rows(dim)
        for _ in copy_live(buf, rid, keep, new_buf, new_rid, rows):  # into memory the child maps
            yield "copy"
        request, result, err = held.memfd("request"), held.memfd("result"), held.memfd("stderr")
        pickle.dump({**self.request, "m": m, "dim": dim}, Slices(request), protocol=pickle.HIGHEST_PROTOCOL)
        fds = (fd, request, result)
        held.proc = subprocess.Popen([sys.executable, "-m", "hieragent.memory.lent", *map(str, fds)], pass_fds=fds,
                                     stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=child_env())
        stop(held.proc)  # it runs on loans only (its imports included)
        yield "start"
        while held.proc.poll() is None:
            yield CHILD
        if held.proc.returncode != 0:
            tail = os.pread(err, 2000, max(os.fstat(err).st_size - 2000, 0)).decode("utf-8", errors="replace")
            raise RuntimeError(f"the index build process exited with {held.proc.returncode}:\n{tail}")
        with reader(result) as f:
            out = pickle.load(f)
        self.close()
        self.cpu_s = out["cpu_s"]
        index = faiss.deserialize_index(out["index"])
        template = faiss.deserialize_index(out["template"]) if out["template"] is not None else None
        yield "result"
        assign = out["assign"]
        if assign is not None:  # ivf_flat: fill the trained, empty index's lists here, a slice at a time
            for s in range(0, m, rows):
                e = min(s + rows, m)
                x, ids, lists = new_buf[s:e], np.arange(s, e, dtype=np.int64), np.ascontiguousarray(assign[s:e])
                index.add_core(e - s, faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(lists))
                yield "fill"
        yield from self.after(m, out["kind"], index, template, out["trained_at"], out["tuned"], out["note"], new_buf,
                              new_rid)


# The child's heap in transparent huge pages (glibc 2.35+; ignored elsewhere): a 1M-key build
# frees gigabytes, and the kernel's teardown of them in 4 KB pages ran as one uninterruptible
# call that a stop after a loan waited out (a heap trim of 35 ms at 500k keys; 2.5 ms for
# 1.2 GB in huge pages at 1M, both traced with strace).
HUGE_HEAP = "glibc.malloc.hugetlb=1"
RELEASE_SLICE = 1 << 26  # bytes of the shared keys unmapped per system call in the child


def child_env() -> dict[str, str]:
    """The child's environment: the caller's, with ``HUGE_HEAP`` added to any glibc tunables."""
    env = dict(os.environ)
    if HUGE_HEAP:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), HUGE_HEAP)))
    return env


def release(area: mmap.mmap, step: int = RELEASE_SLICE) -> None:
    """Drop this process's page tables over a shared mapping, ``step`` bytes per system call;
    the data stays in the memfd (a later read faults it back in). Unmapped at once, the keys of
    a 500k-key build (1.15 GB) took one 15 ms call, and a stop waited for it."""
    for s in range(0, len(area), step):
        area.madvise(mmap.MADV_DONTNEED, s, min(step, len(area) - s))


def stop(proc: subprocess.Popen) -> bool:
    """Stop the child and wait until it has stopped (True) or exited (False). ``SIGSTOP`` takes
    effect only when each of its threads next passes through the kernel: without the wait, a busy child ran on into
    the caller's next step (in the stall at 200k keys it was still running when 572 of 723
    steps began, and took CPU during 150 of them). A child that exited meanwhile keeps its
    exit code for ``Popen``. A child already in its exit ignores the signal, and the wait
    lasts until the kernel has torn down its memory."""
    proc.send_signal(signal.SIGSTOP)
    try:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED)
    except ChildProcessError:  # already reaped by Popen
        return False
    if pid and not os.WIFSTOPPED(status):
        proc.returncode = os.waitstatus_to_exitcode(status)
        return False
    return True


class _Held:
    """What a lent build holds outside this process's heap: its child process and its memfds
    (their mappings outlive them)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.fds: list[int] = []

    def memfd(self, name: str) -> int:
        fd = os.memfd_create(f"hieragent-index-{name}")
        self.fds.append(fd)
        return fd

    def release(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        while self.fds:
            with contextlib.suppress(OSError):
                os.close(self.fds.pop())


class Slices:
    """A binary file over a descriptor that writes at most ``WRITE_SLICE`` bytes per system
    call (``pickle.dump``'s target): a stop signal takes effect between two slices."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self.fd, view[done:done + WRITE_SLICE])
        return done


def reader(fd: int) -> Any:
    """The whole of a memfd another process wrote (the offset is shared: read from the start)."""
    os.lseek(fd, 0, os.SEEK_SET)
    return open(fd, "rb", closefd=False)


def list_of_rows(index: faiss.Index, m: int) -> np.ndarray:
    """The inverted list of each of ``m`` rows of an IVF index labelled by rows."""
    assign = np.full(m, -1, dtype=np.int64)
    lists = index.invlists
    for li in range(index.nlist):
        size = lists.list_size(li)
        if size:
            assign[faiss.rev_swig_ptr(lists.get_ids(li), size)] = li
    return assign


def child(keys_fd: int, request_fd: int, result_fd: int) -> None:
    """The child: build what the request asks over the shared keys; pickle the result."""
    from hieragent.memory import autotune

    with contextlib.suppress(OSError, AttributeError):  # die with the caller (Linux)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    autotune.CLOCK = time.process_time  # stopped between loans: wall time would count the stops
    with reader(request_fd) as f:
        req = pickle.load(f)
    m, dim = req["m"], req["dim"]
    area = mmap.mmap(keys_fd, 0, prot=mmap.PROT_READ)
    keys = np.frombuffer(area, dtype=np.float32).reshape(-1, dim)[:m]
    template = faiss.deserialize_index(req["template"]) if req["template"] is not None else None
    cpu = time.process_time()
    kind, index, template, trained_at, tuned, note = index_over(
        keys, req["kind"], req["spec"], req["tuned"], template, req["trained_at"], req["tune"], req["queries"])
    assign = None
    if kind == "ivf_flat":
        assign = list_of_rows(index, m)
        index = faiss.clone_index(template)  # the caller fills the lists
    release(area)
    out = {"kind": kind, "index": faiss.serialize_index(index), "assign": assign, "trained_at": trained_at,
           "template": None if template is None else faiss.serialize_index(template), "tuned": tuned,
           "note": note, "cpu_s": time.process_time() - cpu}
    pickle.dump(out, Slices(result_fd), protocol=pickle.HIGHEST_PROTOCOL)  # read once this process has exited
    del out, index, template, keys, assign
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Give the heap's free memory back to the kernel before exiting, in calls a stop can fall
    between (glibc's ``malloc_trim``: one ``madvise`` per 64 MB arena). Left to the exit, the
    teardown of a 1M-key build's address space (the OpenMP threads' arenas, about 575 MB in 4 KB
    pages) ran as one uninterruptible step of 32-57 ms that a stop after a loan waited out;
    trimmed first, the exit took 5 ms."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)


def request(spec: IndexSpec, kind: str, tuned: dict[str, int], template: faiss.Index | None, trained_at: int,
            tune: bool, queries: np.ndarray | None) -> dict[str, Any]:
    return {"spec": spec, "kind": kind, "tuned": dict(tuned), "trained_at": trained_at, "tune": tune,
            "queries": queries, "template": None if template is None else faiss.serialize_index(template)}


if __name__ == "__main__":
    try:
        child(*map(int, sys.argv[1:4]))
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
