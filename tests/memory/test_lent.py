"""Index rebuilds on loans (``lent.py``): a real child process that runs only while lent time,
a real SIGKILL of it, and an index dropped mid-build."""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

from hieragent.memory import lent
from hieragent.memory.index import KeyIndex
from hieragent.memory.structures import IndexSpec

from index_helpers import D, brute_force, clustered, recall

pytestmark = pytest.mark.skipif(not lent.available(), reason="loans need Linux's memfd and stop signals")

SPEC = IndexSpec(kind="ivf_flat", nlist=16, nprobe=16, train_per_list=39, background_from=0, build_loan=0.25)


def proc_stat(pid: int) -> tuple[str, int]:
    """``(state, CPU ticks)`` of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


def memfds(since: Counter | None = None) -> Counter:
    """This process's open memfds of lent builds, by name (less those open in ``since``: other
    tests' indexes may still live in a mapping of theirs)."""
    gc.collect()  # what is garbage already holds nothing in either count
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, closed by now
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    names = Counter(link.removesuffix(" (deleted)").removeprefix("/memfd:hieragent-index-") for link in found
                    if link.startswith("/memfd:hieragent-index-"))
    return names - (since or Counter())


def started(index: KeyIndex) -> int:
    """Lend until the build's process exists; its pid."""
    while index._job.lent._proc is None:
        index.lend(0.001)
    return index._job.lent._proc.pid


@pytest.fixture()
def keys():
    rng = np.random.default_rng(3)
    return clustered(rng, 3000), rng.permutation(10_000)[:3000].astype(np.int64), clustered(rng, 32)


def test_a_lent_build_takes_cpu_only_on_loans_and_loses_no_entry(keys):
    x, ids, q = keys
    index, before = KeyIndex(D, SPEC), memfds()
    index.add(ids[:700], x[:700])  # 16 lists x 39 keys: training starts, in a process on loans
    assert index.active == "flat" and index.building == "ivf_flat"
    pid = started(index)
    # the keys twice (the mapping keeps a descriptor of its own), the request, the result, the child's stderr
    assert memfds(before) == Counter({"keys": 2, "request": 1, "result": 1, "stderr": 1})
    with open(f"/proc/{pid}/environ", "rb") as f:  # its heap in huge pages (freed in few, short calls)
        assert b"GLIBC_TUNABLES=" + lent.HUGE_HEAP.encode() in f.read().split(b"\0")
    state, ticks = proc_stat(pid)  # stopped already: the caller waits for its stop to take effect
    time.sleep(0.5)  # no loan: the process stays stopped and spends nothing
    assert state == "T" and proc_stat(pid) == ("T", ticks)
    index.add(ids[700:2000], x[700:2000])  # meanwhile adds, removals and exact searches go on
    index.remove(ids[:50])
    index.remove(ids[1950:2000])  # added after the snapshot, then removed
    live = dict(zip(ids[50:1950].tolist(), x[50:1950]))
    truth, _ = brute_force(x[50:1950], ids[50:1950], q, 10)
    assert recall(index.search(q, 10)[0], truth) == 1.0
    loans, running = 0, 0
    while index.building:
        index.lend(0.02)
        loans += 1
        child = index._job.lent._proc if index._job is not None and index._job.lent is not None else None
        if child is not None and child.poll() is None:  # between loans: stopped the moment a loan ends
            running += proc_stat(child.pid)[0] != "T"
    assert index.active == "ivf_flat" and loans > 1 and index.trained_at == 700 and running == 0
    assert memfds(before) in (Counter(), Counter(keys=1))  # at most the mapping the new rows may live in
    assert index.last_build[1] > 0  # the process's CPU seconds
    # the longest slice of each stage the caller ran ("stop" or "exit" only where a loan ran out,
    # "catch-up" only where more rows came in meanwhile than a swap replays)
    assert set(index.last_slices) - {"stop", "exit", "catch-up"} == {"copy", "start", "result", "fill", "map"}
    assert all(s > 0 for s in index.last_slices.values())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert set(index.ids().tolist()) == set(live)
    assert index.reconstruct(ids[50:1950]).tobytes() == x[50:1950].tobytes()
    found, scores = index.search(q, 10)
    assert recall(found, truth) >= 0.95
    near = index.reconstruct(found.ravel()).reshape(*found.shape, D).astype(np.float64)
    np.testing.assert_allclose(scores, np.einsum("bd,bkd->bk", q.astype(np.float64), near), atol=1e-5)


def test_the_copy_into_shared_memory_moves_a_slice_of_bytes_per_step():
    from hieragent.memory.rebuild import SLICE_BYTES, copy_live, slice_rows

    assert slice_rows(384) * 384 * 4 <= SLICE_BYTES < (slice_rows(384) + 1) * 384 * 4
    assert slice_rows(1 << 20) == 256  # at least a few rows, however wide
    rng = np.random.default_rng(11)
    buf, rid = rng.standard_normal((1000, D)).astype(np.float32), rng.permutation(5000)[:1000].astype(np.int64)
    keep = np.sort(rng.choice(1000, 300, replace=False))
    new_buf, new_rid = np.zeros((450, D), dtype=np.float32), np.full(450, -1, dtype=np.int64)
    steps = sum(1 for _ in copy_live(buf, rid, keep, new_buf, new_rid, rows=64))
    assert steps == 5  # ceil(300 / 64)
    assert new_buf[:300].tobytes() == buf[keep].tobytes() and new_rid[:300].tolist() == rid[keep].tolist()
    assert not new_buf[300:].any() and (new_rid[300:] == -1).all()


def test_removals_made_during_a_build_are_dropped_in_slices_and_none_survives(keys, monkeypatch):
    from hieragent.memory import index as index_mod

    monkeypatch.setattr(index_mod, "DROP_SLICE", 64)
    dropped: list[int] = []
    drop = KeyIndex._drop_removed

    def counted(b, job, limit=None):
        before = b.dropped
        more = drop(b, job, limit)
        dropped.append((b.dropped - before, limit))
        return more

    monkeypatch.setattr(KeyIndex, "_drop_removed", staticmethod(counted))
    x, ids, q = keys
    index = KeyIndex(D, SPEC)
    index.add(ids[:700], x[:700])  # the build starts on loans
    started(index)
    index.add(ids[700:3000], x[700:3000])
    index.remove(ids[100:600])  # 500 of the snapshot's ids removed while it builds
    while index.building:
        index.lend(0.02)
    sliced = [n for n, limit in dropped if limit is not None]
    assert sum(sliced) == 500 and max(sliced) == 64 and len(sliced) >= 8  # 500 ids, 64 per slice
    assert all(n == 0 for n, limit in dropped if limit is None)  # the swap had none left to drop
    live = np.r_[ids[:100], ids[600:3000]]
    assert set(index.ids().tolist()) == set(live.tolist())
    truth, _ = brute_force(np.r_[x[:100], x[600:3000]], live, q, 10)
    assert recall(index.search(q, 10)[0], truth) >= 0.95


def test_a_killed_build_process_says_so_and_keeps_the_old_index(keys):
    x, ids, q = keys
    index = KeyIndex(D, SPEC)
    index.add(ids[:1000], x[:1000])
    pid = started(index)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"building ivf_flat failed.*exited with -9.*flat index over every key"):
        index.wait()
    assert index.active == "flat" and len(index) == 1000 and index.building is None
    truth, _ = brute_force(x[:1000], ids[:1000], q, 10)
    assert recall(index.search(q, 10)[0], truth) == 1.0
    index.add(ids[1000:1001], x[1000:1001])  # the next add starts a fresh build, which finishes
    index.wait()
    assert index.active == "ivf_flat" and len(index) == 1001


def test_an_index_dropped_mid_build_leaves_no_process(keys):
    x, ids, _ = keys
    index, before = KeyIndex(D, SPEC), memfds()
    index.add(ids[:1000], x[:1000])
    pid = started(index)
    del index
    gc.collect()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert memfds(before) == Counter()
    early = KeyIndex(D, IndexSpec(**{**SPEC.__dict__, "nlist": 4, "train_per_list": 39}))
    early.add(ids[:200], x[:200])  # 4 lists x 39 keys: a build starts; before its first loan, no memfd nor process
    assert early.building == "ivf_flat" and memfds(before) == Counter() and early._job.lent._proc is None
    early._job.lent.advance(0.0)  # one slice: the keys' memfd, filled; no process yet
    assert memfds(before) == Counter(keys=2) and early._job.lent._proc is None
    del early
    gc.collect()
    assert memfds(before) == Counter()


def test_results_cross_in_slices_and_arrive_whole(monkeypatch):
    """The child's result goes through a memfd a slice per system call (a stop signal waits at
    most one); sliced at an odd size, a pickle of arrays larger than a slice reads back exactly."""
    monkeypatch.setattr(lent, "WRITE_SLICE", 1001)
    rng = np.random.default_rng(5)
    out = {"index": rng.integers(0, 256, 123_457, dtype=np.uint8), "assign": rng.integers(-1, 4096, 9999),
           "note": "ivf_flat"}
    fd = os.memfd_create("hieragent-test")
    try:
        pickle.dump(out, lent.Slices(fd), protocol=pickle.HIGHEST_PROTOCOL)
        assert os.fstat(fd).st_size > 123_457 + 8 * 9999
        with lent.reader(fd) as f:
            back = pickle.load(f)
    finally:
        os.close(fd)
    assert back["note"] == "ivf_flat"
    np.testing.assert_array_equal(back["index"], out["index"])
    np.testing.assert_array_equal(back["assign"], out["assign"])


def test_the_child_adds_huge_pages_to_the_tunables_it_inherits(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert lent.child_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + lent.HUGE_HEAP
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert lent.child_env()["GLIBC_TUNABLES"] == lent.HUGE_HEAP
    monkeypatch.setattr(lent, "HUGE_HEAP", "")
    assert "GLIBC_TUNABLES" not in lent.child_env()


def shared_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


def test_release_unmaps_shared_keys_in_slices_and_keeps_them():
    """The child drops its page tables over the shared keys before it exits, a slice per call
    (unmapped at once, 1.15 GB took one 15 ms call that a stop waited for); the keys stay."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64 * 1024, 64)).astype(np.float32)  # 16 MB
    fd = os.memfd_create("hieragent-test")
    try:
        os.write(fd, x.tobytes())
        area = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        keys = np.frombuffer(area, dtype=np.float32).reshape(-1, 64)
        before = shared_kb()
        assert float(keys.astype(np.float64).sum()) == pytest.approx(float(x.astype(np.float64).sum()))
        mapped = shared_kb() - before
        assert mapped > 15 * 1024  # every page of the keys now in this process's tables
        calls = []
        madvise = area.madvise

        class Counted:  # mmap's methods are read-only: count the calls through a proxy
            def __len__(self):
                return len(area)

            def madvise(self, *args):
                calls.append(args)
                return madvise(*args)

        lent.release(Counted(), step=1 << 20)
        assert len(calls) == 16 and shared_kb() - before < mapped - 15 * 1024
        np.testing.assert_array_equal(keys, x)  # read back from the memfd
        del keys
        area.close()
    finally:
        os.close(fd)


def test_a_stop_says_whether_the_child_stopped_or_had_exited():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert lent.stop(proc) and proc_stat(proc.pid)[0] == "T" and proc.returncode is None
        proc.kill()  # a stopped process dies of SIGKILL
        assert not lent.stop(proc) and proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
