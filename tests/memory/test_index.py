"""KeyIndex: every index kind against float64 brute force, removal by id, training, persistence."""

from __future__ import annotations

import json
import os
import threading

import faiss
import numpy as np
import pytest

from hieragent.memory import autotune
from hieragent.memory.bank import MemoryBank
from hieragent.memory.index import KeyIndex
from hieragent.memory.rebuild import key_rows
from hieragent.memory.structures import BLAS_MIN_BATCH, STRUCTURE, IndexSpec, auto_nlist, blas_search

from index_helpers import D, brute_force, clustered, recall

SPECS = {
    "flat": IndexSpec(kind="flat"),
    "ivf_flat": IndexSpec(kind="ivf_flat", nlist=16, nprobe=8),
    "ivf_pq": IndexSpec(kind="ivf_pq", nlist=16, nprobe=8, pq_m=16, rerank=8),
    "ivf_fastscan": IndexSpec(kind="ivf_fastscan", nlist=16, nprobe=8, fastscan_m=16, rerank=20),
    "hnsw": IndexSpec(kind="hnsw", hnsw_m=16, ef_search=64),
    # the graph over the keys' 28 top principal directions, 8n candidates re-scored (these keys'
    # noise is isotropic, so every direction dropped costs recall: at 16 of 32 it was 0.61)
    "hnsw_projected": IndexSpec(kind="hnsw", hnsw_m=16, hnsw_dim=28, ef_search=64, rerank=8),
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    keys = clustered(rng, 12_000)
    ids = rng.permutation(100_000)[:12_000].astype(np.int64)  # sparse, unordered ids
    near = keys[rng.choice(len(keys), 64, replace=False)] + 0.1 * rng.standard_normal((64, D))
    q = (near / np.linalg.norm(near, axis=1, keepdims=True)).astype(np.float32)  # queries near the data
    return keys, ids, q


@pytest.mark.parametrize("kind", list(SPECS))
def test_each_kind_finds_the_exact_neighbours_with_exact_scores(kind, data):
    keys, ids, q = data
    index = KeyIndex(D, SPECS[kind])
    for s in range(0, len(ids), 3000):  # added in batches: IVF trains once enough keys exist
        index.add(ids[s:s + 3000], keys[s:s + 3000])
    assert index.active == SPECS[kind].kind and len(index) == len(ids)
    found, scores = index.search(q, 10)
    truth, truth_scores = brute_force(keys, ids, q, 10)
    assert found.shape == scores.shape == (64, 10) and (found >= 0).all()
    assert recall(found, truth) >= (1.0 if kind == "flat" else 0.9)
    # every score is the exact cosine of the id it names (IVF-PQ re-scores its candidates)
    exact = np.einsum("bd,bkd->bk", q.astype(np.float64), index.reconstruct(found.ravel()).reshape(64, 10, D))
    np.testing.assert_allclose(scores, exact, atol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all()
    if kind == "flat":
        np.testing.assert_allclose(scores, truth_scores, atol=1e-5)


@pytest.mark.parametrize("kind", list(SPECS))
def test_removed_ids_are_never_returned_and_the_rest_stay_exact(kind, data):
    keys, ids, q = data
    index = KeyIndex(D, SPECS[kind])
    index.add(ids, keys)
    first, _ = index.search(q, 10)
    gone = np.unique(first[:, :3])  # the best neighbours of every query: removal must show
    index.remove(gone)
    keep = ~np.isin(ids, gone)
    found, _ = index.search(q, 10)
    assert not np.isin(found, gone).any() and len(index) == keep.sum()
    truth, _ = brute_force(keys[keep], ids[keep], q, 10)
    assert recall(found, truth) >= (1.0 if kind == "flat" else 0.9)
    assert index.reconstruct(ids[keep][:5]).tobytes() == keys[keep][:5].tobytes()
    with pytest.raises(KeyError):
        index.reconstruct(gone[:1])


def test_ivf_waits_for_enough_keys_then_trains_and_retrains_as_the_bank_grows():
    rng = np.random.default_rng(2)
    spec = IndexSpec(kind="ivf_flat", nlist=8, train_per_list=10, retrain_growth=2.0)
    index = KeyIndex(D, spec)
    keys = clustered(rng, 400)
    index.add(np.arange(79), keys[:79])
    assert index.active == "flat"  # 79 < 8 lists * 10 keys
    index.add(np.arange(79, 80), keys[79:80])
    assert index.active == "ivf_flat" and index.trained_at == 80
    index.add(np.arange(80, 159), keys[80:159])
    assert index.trained_at == 80
    index.add(np.arange(159, 160), keys[159:160])
    assert index.trained_at == 160  # grown 2x: the quantizer retrained on all keys


def self_recall(index: KeyIndex, rng: np.random.Generator, queries: int = 200) -> float:
    """recall@10 of ``index`` for some of its own keys as queries, each against its float64
    nearest other keys (what auto's second stage measures, on queries of the test's choosing)."""
    ids = index.ids()
    keys = index.reconstruct(ids)
    pick = rng.choice(len(ids), queries, replace=False)
    truth = brute_force(keys, ids, keys[pick], 11)[0][:, 1:]  # the first is the query itself
    found = index.search(keys[pick], 11)[0]
    found = [[i for i in row if i != ids[p]][:10] for row, p in zip(found.tolist(), pick)]
    return recall(np.array(found), truth)


def grid_size(kind: str, nlist: int) -> int:
    return sum(kind == "hnsw" or s["nprobe"] <= nlist for s in autotune.GRID[kind])


def test_auto_is_exact_below_its_threshold_then_measures_caches_and_reuses_its_choice(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HIERAGENT_CACHE", str(tmp_path))
    rng = np.random.default_rng(3)
    keys = clustered(rng, 3000)
    spec = IndexSpec(kind="auto", auto_threshold=2000, nlist=16)
    index = KeyIndex(D, spec)
    asked = clustered(np.random.default_rng(4), 300)
    index.search(asked[:200], 10)  # the index keeps the latest 256 queries, even while empty
    index.search(asked[200:], 10)
    assert np.array_equal(np.sort(index.recent_queries(), axis=0), np.sort(asked[-256:], axis=0))
    index.add(np.arange(1999), keys[:1999])
    assert index.active == "flat" and not (tmp_path / "index_auto.json").exists()
    index.add(np.array([1999]), keys[1999:2000])
    assert index.active in autotune.CANDIDATES and "measured now" in index.auto_note
    cache = json.loads((tmp_path / "index_auto.json").read_text())
    (entry,) = cache.values()
    measured = entry["measured"]
    # stage 1 measured every structure at every setting on the sample; its rule chose the structure
    assert entry["choice"] == autotune.decide(measured) and entry["choice"]["kind"] == index.active
    assert all(index.tuned[k] == v for k, v in entry["choice"].items() if k != "kind")
    assert {(c["kind"], c.get("fastscan_m"), c.get("hnsw_m")) for c in measured["settings"]} == {
        ("ivf_flat", None, None), ("ivf_fastscan", D // 8, None), ("ivf_fastscan", D // 2, None),
        ("hnsw", None, 16), ("hnsw", None, 32)}
    assert len(measured["settings"]) == (grid_size("ivf_flat", 16) + 2 * grid_size("ivf_fastscan", 16)
                                         + 2 * grid_size("hnsw", 16))
    assert measured["keys"] == 2000 and measured["queries"] == "recent"  # stage 1 and 2 used what was asked
    assert "its 256 latest queries" in index.auto_note
    # stage 2 set the search settings on the whole index, and they hold on queries it never saw
    assert set(index.tuned) - set(STRUCTURE) <= {"nprobe", "rerank", "ef_search"}  # where a graph won, hnsw_dim 0
    assert self_recall(index, rng) >= autotune.RECALL - 0.03
    # the tuned settings are the ones the index searches with, and they persist
    restored = KeyIndex.restore(D, spec, index.ids(), index.reconstruct(index.ids()), index.state())
    assert (restored.active, restored.tuned, restored.ops["rebuilds"]) == (index.active, index.tuned, 0)
    # a second bank on this machine reuses the structure: no sample sweep, only stage 2
    again = KeyIndex(D, spec)
    again.add(np.arange(2000), keys[:2000])
    assert again.active == index.active and "cached structure" in again.auto_note
    assert f"{autotune.QUERIES} of them as queries" in again.auto_note  # never asked: its own keys
    # a cached structure that misses the recall bar on this bank's keys at every setting is
    # measured again and replaced (fast-scan here may only probe one list without re-scoring)
    monkeypatch.setitem(autotune.GRID, "ivf_fastscan", ({"nprobe": 1, "rerank": 1},))
    bad = {"kind": "ivf_fastscan", "fastscan_m": 4}  # 4 x 4 bits
    (tmp_path / "index_auto.json").write_text(json.dumps({autotune.machine_key(D, spec): {"choice": bad}}))
    remeasured = KeyIndex(D, spec)
    remeasured.add(np.arange(2000), keys[:2000])
    assert "measured now" in remeasured.auto_note and remeasured.tuned.get("fastscan_m") != 4
    assert "ivf_fastscan {'fastscan_m': 4} missed" in remeasured.auto_note  # the note says what was tried
    assert json.loads((tmp_path / "index_auto.json").read_text())[autotune.machine_key(D, spec)]["choice"] != bad
    assert self_recall(remeasured, rng) >= autotune.RECALL - 0.03
    # an unreadable cache is reported and measured again, never trusted
    (tmp_path / "index_auto.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        third = KeyIndex(D, spec)
        third.add(np.arange(2000), keys[:2000])
    assert "unreadable auto-index cache" in caplog.text and "measured now" in third.auto_note
    assert auto_nlist(1_000_000) == 4096 and auto_nlist(50_000) == 1024


def test_auto_tunes_on_the_whole_bank_where_a_sample_misjudges_recall(tmp_path, monkeypatch):
    """Clusters of about 40 keys, sampled at a twelfth: in the sample a query's ten nearest
    keys run out of its cluster, so no (non-exhaustive) setting reaches the recall bar there;
    auto then fell back to its most accurate, slowest setting. Now the sample only ranks the
    structures, and the search settings come from the whole bank."""
    monkeypatch.setenv("HIERAGENT_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "SAMPLE", 1000)
    monkeypatch.setattr(autotune, "GRID", {  # none of them exhaustive on the sample
        "ivf_flat": tuple({"nprobe": p} for p in (1, 2, 4)),
        "ivf_fastscan": tuple({"nprobe": p, "rerank": r} for p in (1, 2, 4) for r in (2, 5)),
        "hnsw": ()})
    monkeypatch.setattr(autotune, "HNSW_M", ())  # a graph finds everything in a sample this small
    rng = np.random.default_rng(5)
    d = 128  # high enough that keys of different clusters are about equally far apart
    centres = rng.standard_normal((300, d))
    x = centres[rng.integers(0, 300, 12_000)] / np.sqrt(d) + 0.04 * rng.standard_normal((12_000, d))
    keys = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    index = KeyIndex(d, IndexSpec(kind="auto", auto_threshold=12_000))
    index.add(np.arange(12_000), keys)
    (entry,) = json.loads((tmp_path / "index_auto.json").read_text()).values()
    assert max(c["recall"] for c in entry["measured"]["settings"]) < autotune.RECALL  # the sample misjudges
    assert index.active in autotune.CANDIDATES and "recall@10" in index.auto_note
    assert self_recall(index, rng) >= autotune.RECALL - 0.03


def test_auto_picks_the_fastest_setting_near_the_best_recall():
    flat = {"kind": "ivf_flat", "nprobe": 16, "ms": 5.0, "recall": 0.99}
    fast = {"kind": "ivf_fastscan", "fastscan_m": 8, "nprobe": 8, "rerank": 5, "ms": 2.0, "recall": 0.90}
    slower = {**fast, "rerank": 10, "ms": 3.0, "recall": 0.96}
    measured = {"keys": 1, "exact_ms": 100.0, "settings": [flat, fast]}
    assert autotune.decide(measured) == {"kind": "ivf_flat"}  # the faster one misses the recall bar
    measured["settings"].append(slower)
    assert autotune.decide(measured) == {"kind": "ivf_fastscan", "fastscan_m": 8}
    # a sample where nothing reaches the bar: the fastest within SLACK of the best
    flat["recall"], fast["recall"], slower["recall"] = 0.80, 0.70, 0.80 - autotune.SLACK + 0.005
    assert autotune.decide(measured) == {"kind": "ivf_fastscan", "fastscan_m": 8}
    slower["recall"] = 0.80 - autotune.SLACK - 0.005
    assert autotune.decide(measured) == {"kind": "ivf_flat"}


def test_duplicate_ids_are_refused_and_a_bad_spec_names_its_key():
    index = KeyIndex(D, SPECS["flat"])
    index.add(np.array([4]), clustered(np.random.default_rng(4), 1))
    with pytest.raises(ValueError, match="already holds"):
        index.add(np.array([4]), clustered(np.random.default_rng(5), 1))
    with pytest.raises(ValueError, match="memory.index.kind 'lsh'.*flat, ivf_flat"):
        IndexSpec(kind="lsh")
    with pytest.raises(ValueError, match="memory.index.nprobe"):
        IndexSpec(nprobe=0)
    with pytest.raises(ValueError, match=r"memory.index.build_nice must be in \[0, 19\]"):
        IndexSpec(build_nice=20)
    with pytest.raises(ValueError, match=r"memory.index.build_loan must be in \[0, 10\]"):
        IndexSpec(build_loan=-0.1)
    with pytest.raises(ValueError, match="pq_m=7 must divide the key dimension 32"):
        KeyIndex(D, IndexSpec(kind="ivf_pq", pq_m=7))


def test_blas_search_gives_the_same_answer_and_restores_the_global_threshold(data):
    keys, ids, q = data
    flat = faiss.IndexFlatIP(D)
    flat.add(keys)
    before = faiss.cvar.distance_compute_blas_threshold
    plain = flat.search(q, 10)
    with blas_search(len(q)):
        assert faiss.cvar.distance_compute_blas_threshold == BLAS_MIN_BATCH
        fast = flat.search(q, 10)
    assert faiss.cvar.distance_compute_blas_threshold == before
    assert (plain[1] == fast[1]).mean() > 0.99  # BLAS may reorder near-exact ties only
    np.testing.assert_allclose(plain[0], fast[0], atol=1e-5)


@pytest.mark.parametrize("saved", ["ivf_pq", "hnsw"])
def test_loading_into_another_index_kind_keeps_every_entry(saved, data, caplog):
    keys, ids, q = data
    bank = MemoryBank(capacity=20_000, merge_threshold=2.0, index=SPECS[saved])
    bank.add([f"e{i}" for i in range(3000)], kind="episodic", source="t", step=1, keys=keys[:3000])
    bank.add([f"s{i}" for i in range(3000, 12_000)], kind="skill", source="t", step=2, keys=keys[3000:])
    assert bank.index_kind == saved
    state = bank.state_dict()
    flat = MemoryBank(capacity=20_000, merge_threshold=2.0, index=SPECS["flat"])
    with caplog.at_level("WARNING"):
        flat.load_state_dict(state)
    assert f"saved as {saved}, the config asks for flat" in caplog.text
    assert flat.index_kind == "flat" and flat.ids() == bank.ids()
    assert flat.keys(flat.ids()).tobytes() == bank.keys(bank.ids()).tobytes()
    assert [flat.entry(i) for i in flat.ids()] == [bank.entry(i) for i in bank.ids()]
    # back into the saved kind: the built FAISS index is reused, so answers are identical
    same = MemoryBank(capacity=20_000, merge_threshold=2.0, index=SPECS[saved])
    same.load_state_dict(state)
    for x, y in zip(same.search(q, 10), bank.search(q, 10)):
        assert x.tobytes() == y.tobytes()


def test_saved_directory_round_trips_an_approximate_index_exactly(data, tmp_path):
    keys, ids, q = data
    bank = MemoryBank(capacity=20_000, merge_threshold=2.0, index=SPECS["ivf_flat"])
    bank.add([f"s{i}" for i in range(len(ids))], keys=keys)
    bank.save(tmp_path / "bank")
    assert (tmp_path / "bank" / "index.npy").is_file()
    loaded = MemoryBank.load(tmp_path / "bank")
    assert loaded.index_spec == bank.index_spec and loaded.index_kind == "ivf_flat"
    for x, y in zip(loaded.search(q, 10), bank.search(q, 10)):
        assert x.tobytes() == y.tobytes()


def list_contents(index: faiss.Index) -> list[tuple[bytes, bytes]]:
    """Each inverted list's ids and codes, as bytes (lists of the array layout)."""
    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
    sizes = [lists.list_size(no) for no in range(lists.nlist)]
    return [(faiss.rev_swig_ptr(lists.get_ids(no), n).tobytes(),
             faiss.rev_swig_ptr(lists.get_codes(no), n * lists.code_size).tobytes()) for no, n in enumerate(sizes)]


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_pq", "ivf_fastscan"])
def test_a_restored_ivf_index_holds_the_same_lists_and_takes_the_same_adds(kind, data):
    """``restore`` gives each deserialised list room to grow (``give_room``): every list keeps
    its ids and codes byte for byte, and keys added afterwards land where they land in the index
    that was saved."""
    keys, ids, q = data
    index = KeyIndex(D, SPECS[kind])
    for s in range(0, 10_500, 3500):
        index.add(ids[s:s + 3500], keys[s:s + 3500])
    assert index.active == kind
    restored = KeyIndex.restore(D, SPECS[kind], index.ids(), index.reconstruct(index.ids()), index.state())
    assert (restored.active, restored.ops["rebuilds"]) == (kind, 0)
    array = kind != "ivf_fastscan"  # fast-scan's block lists are left as they are
    if array:
        assert list_contents(restored._faiss) == list_contents(index._faiss)
    for each in (index, restored):
        for s in range(10_500, len(ids), 100):  # 100 at a time: every list grows, most more than once
            each.add(ids[s:s + 100], keys[s:s + 100])
    if array:
        assert list_contents(restored._faiss) == list_contents(index._faiss)
    for x, y in zip(restored.search_with_keys(q, 10), index.search_with_keys(q, 10)):
        assert x.tobytes() == y.tobytes()


def live_truth(index: KeyIndex, model: dict[int, np.ndarray], q: np.ndarray, k: int):
    ids = np.fromiter(model, dtype=np.int64)
    return brute_force(np.stack([model[i] for i in ids]), ids, q, k)


@pytest.mark.parametrize("mode", ["inline", "thread", "lent"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_every_kind_stays_exact_through_many_add_remove_update_cycles(kind, mode, data):
    """Adds, evictions and updates interleaved, with compactions (and rebuilds in a thread, or
    in a process on a loan per cycle, while the cycles go on); checked against float64 brute force."""
    keys, ids, q = data
    rng = np.random.default_rng(11)
    spec = SPECS[kind]
    spec = IndexSpec(**{**spec.__dict__, "train_per_list": 10, "background_from": 10**9 if mode == "inline" else 0,
                        "build_loan": 0.0 if mode == "thread" else 0.25})
    index = KeyIndex(D, spec)
    model: dict[int, np.ndarray] = {}
    fresh = iter(range(10**6, 2 * 10**6))
    built_beside = False
    for cycle in range(12):
        batch = rng.choice(len(ids), 500, replace=False)
        taken = np.isin(ids[batch], np.fromiter(model, dtype=np.int64))
        new = np.where(taken, [next(fresh) for _ in batch], ids[batch])
        new_keys = np.where(taken[:, None], clustered(rng, len(batch)), keys[batch])  # no duplicate keys (ties)
        index.add(new, new_keys)
        built_beside |= index.building is not None  # a build this call started (swapped at the next call)
        model.update(zip(new.tolist(), new_keys))
        gone = rng.choice(np.fromiter(model, dtype=np.int64), 150, replace=False)
        index.remove(gone)
        built_beside |= index.building is not None
        for i in gone.tolist():
            del model[i]
        moved = rng.choice(np.fromiter(model, dtype=np.int64), 20, replace=False)
        for i in moved.tolist():  # an update: the same id with a new key
            index.remove(np.array([i]))
            model[i] = clustered(rng, 1)[0]
            index.add(np.array([i]), model[i][None])
        found, scores, found_keys = index.search_with_keys(q, 10)  # answered at every point, a build running or not
        assert found.shape == (len(q), 10) and all(int(i) in model for i in found.ravel())
        # the keys read by row are the stored keys of the ids found, across compactions and swaps
        assert found_keys.tobytes() == np.stack([model[i] for i in found.ravel().tolist()]).tobytes()
        index.lend(0.02)  # the trainer's loan, once per update (a lent build runs only then)
        if mode == "lent" and cycle % 3 == 2:
            # a lent build finishes here however loaded the machine is (its child may not have
            # started within the loans), so that a later build of the spec's kind is not crowded out
            index.wait()
    index.wait()
    assert index.active == SPECS[kind].kind
    if mode != "inline":  # cycles went on while a build ran in its thread or process
        assert built_beside and index.ops["rebuilds"] >= 1
    else:  # trained, then compacted or retrained
        assert index.ops["rebuilds"] >= 2
    assert len(index) == len(model) and set(index.ids().tolist()) == set(model)
    assert index.reconstruct(np.array(list(model))).tobytes() == np.stack(list(model.values())).tobytes()
    found, scores = index.search(q, 10)
    again, again_scores, _ = index.search_with_keys(q, 10)
    assert np.array_equal(again, found) and np.array_equal(again_scores, scores)
    truth, truth_scores = live_truth(index, model, q, 10)
    assert recall(found, truth) >= (1.0 if kind == "flat" else 0.9)
    exact = np.einsum("bd,bkd->bk", q.astype(np.float64), np.stack([[model[int(i)] for i in r] for r in found]))
    np.testing.assert_allclose(scores, exact, atol=1e-5)  # every score is the exact cosine of its id
    if kind == "flat":
        np.testing.assert_allclose(scores, truth_scores, atol=1e-5)


@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "hnsw"])
def test_removal_costs_the_same_counted_work_at_every_size(kind):
    """Counted, not timed: rows rewritten per removal stay below a constant as N grows 16x
    (a flat index rebuilt on every eviction would rewrite N rows per removal)."""
    per_removal = []
    for n in (1000, 16_000):
        rng = np.random.default_rng(n)
        spec = IndexSpec(kind=kind, nlist=16, train_per_list=10, hnsw_m=8, ef_search=32, background_from=10**9)
        index = KeyIndex(D, spec)
        index.add(np.arange(n), clustered(rng, n))
        before = index.ops.copy()
        alive = list(range(n))  # oldest first, as the bank evicts
        fresh = clustered(rng, n)
        for j in range(n):  # a full bank that evicts one of its oldest entries per add, for n adds
            index.remove(np.array([alive.pop(int(rng.integers(64)))]))
            index.add(np.array([n + j]), fresh[j:j + 1])
            alive.append(n + j)
        removed = index.ops["removed"] - before["removed"]
        rebuilt = index.ops["rows_rebuilt"] - before["rows_rebuilt"]
        assert removed == n and index.ops["rebuilds"] - before["rebuilds"] >= 2  # compacted, more than once
        per_removal.append(rebuilt / removed)
        assert len(index) == n and index.rows <= n / (1 - spec.compact_fraction) + 1
    assert max(per_removal) <= 1 / spec.compact_fraction + 1  # at most ~4 rows rewritten per removal
    assert per_removal[1] <= 1.5 * per_removal[0]  # and not growing with N


def test_a_background_retrain_serves_every_search_and_loses_no_entry(data, monkeypatch):
    keys, ids, q = data
    gate, started = threading.Event(), threading.Event()
    build = KeyIndex._build
    nice = []

    def held(self, *args):  # the real build, held until the test has worked beside it
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        started.set()
        gate.wait(30)
        return build(self, *args)

    monkeypatch.setattr(KeyIndex, "_build", held)
    spec = IndexSpec(kind="ivf_flat", nlist=16, train_per_list=39, retrain_growth=2.0, background_from=0,
                     build_nice=19, build_loan=0.0)
    index = KeyIndex(D, spec)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    index.add(ids[:700], keys[:700])  # 16 lists x 39 keys: training starts
    assert index.active == "flat" and started.wait(10) and index.building == "ivf_flat"
    # while the quantizer trains: the old index answers, and adds and removals go on
    index.add(ids[700:5000], keys[700:5000])
    index.remove(ids[:100])
    index.remove(ids[4900:5000])  # added after the snapshot, then removed
    index.remove(ids[200:201])
    index.add(ids[200:201], keys[4000:4001])  # an update of a snapshot row during the build
    found, _ = index.search(q, 10)
    assert index.active == "flat" and index.building == "ivf_flat"
    live = {int(i): keys[j] for j, i in enumerate(ids[:4900]) if j >= 100}
    live[int(ids[200])] = keys[4000]
    truth, _ = live_truth(index, live, q, 10)
    assert recall(found, truth) == 1.0  # exact: the flat index, tombstones filtered
    gate.set()
    index.wait()
    assert index.active == "ivf_flat" and index.building is None and index.trained_at == 700
    # the build ran in its own thread at build_nice (Linux sets niceness per thread); ours is unchanged
    assert nice == [19] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    wall, cpu = index.last_build
    assert 0 < cpu and wall > 0
    assert set(index.ids().tolist()) == set(live) and len(index) == len(live)
    assert index.reconstruct(ids[200:201]).tobytes() == keys[4000:4001].tobytes()
    found, scores = index.search(q, 10)
    truth, _ = live_truth(index, live, q, 10)
    assert recall(found, truth) >= 0.9 and all(int(i) in live for i in found.ravel())
    # the bank grew past 2x its training size meanwhile: the next add starts a retrain
    index.add(ids[5000:5001], keys[5000:5001])
    assert index.building == "ivf_flat"
    index.wait()
    assert index.trained_at == len(live) + 1


def test_a_failed_background_build_says_so_and_keeps_the_old_index(data, monkeypatch):
    keys, ids, q = data

    def broken(self, *args):
        raise MemoryError("no room for the new lists")

    spec = IndexSpec(kind="ivf_flat", nlist=16, background_from=0, build_loan=0.0)  # a thread (lent: test_lent.py)
    index = KeyIndex(D, spec)
    monkeypatch.setattr(KeyIndex, "_build", broken)
    index.add(ids[:1000], keys[:1000])
    with pytest.raises(RuntimeError, match="building ivf_flat failed.*MemoryError.*flat index over every key"):
        index.wait()
    assert index.active == "flat" and len(index) == 1000
    truth, _ = brute_force(keys[:1000], ids[:1000], q, 10)
    assert recall(index.search(q, 10)[0], truth) == 1.0


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_fastscan", "hnsw", "hnsw_projected"])
def test_a_saved_index_with_tombstones_loads_without_a_rebuild(kind, data, tmp_path):
    keys, ids, q = data
    bank = MemoryBank(capacity=10_000, merge_threshold=2.0, index=SPECS[kind])
    bank.add([f"s{i}" for i in range(len(ids))], keys=keys)  # evicts 2000: tombstones, no compaction
    assert bank.events["evicted"] == 2000 and bank._index.rows == len(ids) and len(bank) == 10_000
    bank.save(tmp_path / "bank")
    loaded = MemoryBank.load(tmp_path / "bank")
    assert loaded._index.rows == bank._index.rows and loaded._index.ops["rebuilds"] == 0
    assert loaded.ids() == bank.ids()
    for x, y in zip(loaded.search(q, 10), bank.search(q, 10)):
        assert x.tobytes() == y.tobytes()


def test_processes_whose_auto_measured_differently_swap_in_the_same_index_at_the_same_vote(tmp_path, monkeypatch,
                                                                                         data):
    """Two banks as two ranks would hold them: the same adds, swaps held for the vote. Their
    cached measurements (real cache files) disagree; after the votes both search rank 0's kind
    with rank 0's settings. Rank 1 trained its copy on the rows of a later update, so the two
    may order near-ties differently: both must find the exact neighbours."""
    keys, ids, q = data
    spec = IndexSpec(kind="auto", auto_threshold=3000, nlist=16, fastscan_m=16, background_from=0)
    choices = ({"kind": "ivf_fastscan", "fastscan_m": 16}, {"kind": "ivf_flat"})
    banks = []
    for rank, choice in enumerate(choices):
        folder = tmp_path / f"rank{rank}"
        folder.mkdir()
        setting = {**choice, "nprobe": 8, "ms": 1.0, "recall": 0.99}
        (folder / "index_auto.json").write_text(json.dumps(
            {autotune.machine_key(D, spec): {"choice": choice, "measured": {"keys": 1, "exact_ms": 9.0,
                                                                           "settings": [setting]}}}))
        monkeypatch.setenv("HIERAGENT_CACHE", str(folder))
        bank = MemoryBank(capacity=20_000, merge_threshold=2.0, index=spec)
        bank.hold_index_swaps()
        bank.add([f"s{i}" for i in range(3000)], keys=keys[:3000])
        banks.append(bank)
        while not bank.index_vote()[0]:  # this rank's build reads its cache before the next one starts
            bank.lend_index()

    def vote(extra: slice) -> list[bool]:
        for bank in banks:  # an update on every rank: adds and evictions go on while builds are held
            bank.add([f"s{i}" for i in range(extra.start, extra.stop)], keys=keys[extra])
        votes = [bank.index_vote() for bank in banks]
        return [bank.swap_index(votes) for bank in banks]

    assert [b.index_kind for b in banks] == ["flat", "flat"]  # finished, but held for the vote
    assert [b.index_vote()[1][0] for b in banks] == ["ivf_fastscan", "ivf_flat"]
    assert vote(slice(3000, 3100)) == [False, False]  # rank 1 rebuilds as rank 0 chose
    while not all(b.index_vote()[0] for b in banks):
        for bank in banks:
            bank.lend_index()
    assert vote(slice(3100, 3200)) == [True, True]
    assert [b.index_kind for b in banks] == ["ivf_fastscan", "ivf_fastscan"]
    assert banks[0]._index.tuned == banks[1]._index.tuned and banks[0]._index.tuned["fastscan_m"] == 16
    assert banks[0].ids() == banks[1].ids() and len(banks[0]) == 3200
    truth = brute_force(keys[:3200], np.arange(3200), q, 10)[0]
    for bank in banks:
        assert recall(bank.search(q, 10)[0], truth) >= autotune.RECALL - 0.03


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="page advice is read from Linux's smaps")
def test_key_rows_are_kept_out_of_huge_pages():
    """Appends touch the key rows a few at a time. numpy advises huge pages for large arrays, and
    the first write into each 2 MB of such an array may then compact memory inside one update
    (34-72 ms on this project's VM), so the rows are advised out of them (``nh`` in VmFlags)."""
    n = 2 * (2 << 20) // (4 * D)  # two huge pages' worth
    rows = key_rows(n, D)
    assert rows.shape == (n, D) and rows.dtype == np.float32 and not rows.any()
    rows[-1] = 1.0  # writable
    start = rows.ctypes.data
    with open("/proc/self/smaps") as f:
        maps = f.read().split("\n")
    for i, line in enumerate(maps):
        lo, _, hi = line.split(" ", 1)[0].partition("-")
        if hi and all(c in "0123456789abcdef" for c in lo + hi) and int(lo, 16) <= start < int(hi, 16):
            flags = next(m for m in maps[i + 1:] if m.startswith("VmFlags:")).split()[1:]
            assert "nh" in flags and "hg" not in flags
            break
    else:
        raise AssertionError("no mapping holds the key rows")
    small = key_rows(8, D)  # under one huge page: plain numpy
    assert small.shape == (8, D) and not small.any()
