"""A swap frees the replaced index, its rows and its id map a slice at a time, off the update
that swapped: at 1M keys their pages took about 430 ms to free there. Where builds run on loans
(``build_loan`` > 0) the loans after the swap free them (``freeing.OnLoans``); where builds run
in a thread, a release thread does (``freeing.release``)."""

from __future__ import annotations

import gc
import threading
import weakref

import faiss
import numpy as np
import pytest

from hieragent.memory import freeing, rebuild
from hieragent.memory.index import KeyIndex
from hieragent.memory.structures import IndexSpec

from index_helpers import D, brute_force, clustered, recall


@pytest.fixture
def no_cyclic_gc():
    gc.disable()
    yield
    gc.enable()


def freed_in(obj: object, where: list[str], name: str = "") -> None:
    weakref.finalize(obj, lambda: where.append(name + threading.current_thread().name))


def ivf_over(keys: np.ndarray, nlist: int = 8) -> faiss.IndexIVFFlat:
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(D), D, nlist, faiss.METRIC_INNER_PRODUCT)
    index.train(keys)
    index.add(keys)
    return index


def test_a_swap_frees_the_old_index_and_rows_in_the_release_thread_and_every_search_still_answers():
    rng = np.random.default_rng(1)
    keys, ids = clustered(rng, 950), rng.permutation(10_000)[:950].astype(np.int64)
    spec = IndexSpec(kind="ivf_flat", nlist=16, nprobe=16, train_per_list=39, retrain_growth=1.3, background_from=0,
                     build_loan=0.0)
    index = KeyIndex(D, spec)
    index.add(ids[:700], keys[:700])  # 16 lists x 39 keys: a background build of ivf_flat over flat
    index.wait()
    assert index.active == "ivf_flat"
    where: list[str] = []
    freed_in(index._buf, where, "rows:")
    freed_in(index._faiss, where, "index:")
    freed_in(index._rid, where, "rid:")
    lists = freeing.freed["lists"]
    index.add(ids[700:950], keys[700:950])  # past 1.3x: a retrain in the background, in the rows' headroom
    assert index.building == "ivf_flat"
    index.wait()
    freeing.released()
    # none freed on this thread, none left
    assert sorted(where) == ["index:hieragent-release", "rid:hieragent-release", "rows:hieragent-release"]
    assert freeing.freed["lists"] == lists + 1  # the IVF lists went in slices, in FAISS (the GIL released)
    q = keys[rng.choice(950, 32, replace=False)]
    truth, _ = brute_force(keys[:950], ids[:950], q, 10)
    assert recall(index.search(q, 10)[0], truth) == 1.0  # nprobe = nlist: exact


def test_beside_a_cpu_step_the_loans_after_a_swap_free_the_old_index_a_slice_each(monkeypatch, no_cyclic_gc):
    """With builds on loans (``build_loan`` > 0: a CPU step on every core), a release thread
    measured no better than freeing in the step, so each later loan frees a slice on this thread.
    Without the cyclic collector: a lent build left in a reference cycle would be kept whole."""
    monkeypatch.setattr(freeing, "LISTS_PER_SLICE", 2)  # 16 lists: 8 slices
    rng = np.random.default_rng(5)
    keys, ids = clustered(rng, 950), rng.permutation(10_000)[:950].astype(np.int64)
    spec = IndexSpec(kind="ivf_flat", nlist=16, nprobe=16, train_per_list=39, retrain_growth=1.3, background_from=0)
    assert spec.build_loan > 0
    index = KeyIndex(D, spec)
    index.add(ids[:700], keys[:700])
    index.wait()  # the first build, on loans
    index.lend(0.0)  # frees what that swap replaced (a flat index: no slices)
    assert index.active == "ivf_flat" and len(index.freeing) == 0
    where: list[str] = []
    freed_in(index._faiss, where, "index:")
    freed_in(index._buf, where, "rows:")
    lists = freeing.freed["lists"]
    index.add(ids[700:950], keys[700:950])  # past 1.3x: a retrain on loans
    assert index.building == "ivf_flat"
    index.wait()  # the swap: nothing freed in it
    assert where == [] and len(index.freeing) == 1 and index.trained_at == 950
    q = keys[rng.choice(950, 32, replace=False)]
    truth, _ = brute_force(keys, ids, q, 10)
    loans = 0
    while len(index.freeing):
        index.lend(0.0)  # a loan of no time still frees one slice
        loans += 1
        assert recall(index.search(q, 10)[0], truth) == 1.0  # nprobe = nlist: exact, between every slice
        if loans < 8:
            assert where == [] and freeing.freed["lists"] == lists
    assert loans >= 8 and freeing.freed["lists"] == lists + 1
    assert sorted(where) == ["index:MainThread", "rows:MainThread"]


def test_a_loan_frees_slices_for_its_seconds_and_at_least_one():
    rng = np.random.default_rng(6)
    loans = freeing.OnLoans()
    where: list[str] = []
    handed = [ivf_over(clustered(rng, 4000), nlist=2 * freeing.LISTS_PER_SLICE) for _ in range(2)]
    for thing in handed:
        freed_in(thing, where)
    del thing
    loans.add(handed)
    assert handed == [] and len(loans) == 1
    assert loans.spend(0.0) == 1 and where == []  # half the first index's lists
    assert loans.spend(60.0) == 3 and where == ["MainThread"] * 2 and len(loans) == 0  # the rest
    assert loans.spend(60.0) == 0


def test_an_index_held_elsewhere_keeps_its_lists_and_answers_after_its_release():
    keys = clustered(np.random.default_rng(2), 400)
    index = ivf_over(keys)
    index.nprobe = 8
    before = index.search(keys[:5], 3)
    kept, lists = freeing.freed["kept"], freeing.freed["lists"]
    handed = [index]
    freeing.release(handed)
    assert handed == []  # the caller's list is emptied: the thread holds the only handed reference
    freeing.released()
    assert freeing.freed["kept"] == kept + 1 and freeing.freed["lists"] == lists
    assert index.ntotal == 400
    after = index.search(keys[:5], 3)
    assert np.array_equal(before[1], after[1]) and np.array_equal(before[0], after[0])


def test_released_waits_for_everything_handed_before_it():
    rng = np.random.default_rng(3)
    lists = freeing.freed["lists"]
    where: list[str] = []
    handed = []
    for _ in range(3):
        handed.append([ivf_over(clustered(rng, 4000), nlist=100), rng.standard_normal((1000, D)).astype(np.float32)])
        for thing in handed[-1]:
            freed_in(thing, where)
    del thing
    for things in handed:
        freeing.release(things)
    freeing.released()
    assert where == ["hieragent-release"] * 6 and freeing.freed["lists"] == lists + 3


def test_rows_in_their_own_mapping_go_in_slices_unless_another_view_is_left():
    rows = rebuild.key_rows(4 * freeing.PAGES_PER_SLICE // (4 * D) + 7, D)  # 4 slices and a bit
    rows[:] = np.random.default_rng(4).standard_normal(rows.shape, dtype=np.float32)
    first = rebuild.new_rows(1000, D, rows)[0]  # a view of the same mapping, held here
    copy = first.copy()
    pages = freeing.freed["pages"]
    freeing.release([rows])
    del rows
    freeing.released()
    assert freeing.freed["pages"] == pages and np.array_equal(first, copy)  # the view's rows are intact
    where: list[str] = []
    freed_in(first, where)
    freeing.release([first])
    del first
    freeing.released()
    assert freeing.freed["pages"] == pages + 1 and where == ["hieragent-release"]
    small = rebuild.key_rows(8, D)  # plain numpy memory: freed whole, when its last reference goes
    freeing.release([small])
    del small
    freeing.released()
    assert freeing.freed["pages"] == pages + 1
