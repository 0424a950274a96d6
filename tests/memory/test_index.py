"""KeyIndex: every index kind against float64 brute force, removal by id, training, persistence."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from hieragent.memory.bank import MemoryBank
from hieragent.memory.index import BLAS_MIN_BATCH, IndexSpec, KeyIndex, auto_nlist, blas_search

D = 32


def clustered(rng: np.random.Generator, n: int, centres: int = 40, d: int = D) -> np.ndarray:
    """Unit vectors around random centres: data with neighbourhoods, like embeddings."""
    c = rng.standard_normal((centres, d))
    x = c[rng.integers(0, centres, n)] + 0.35 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def brute_force(keys: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    sims = q.astype(np.float64) @ keys.astype(np.float64).T  # [B, N]
    top = np.argsort(-sims, axis=1)[:, :k]
    return ids[top], np.take_along_axis(sims, top, axis=1)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return sum(len(set(f) & set(t)) for f, t in zip(found, truth)) / truth.size


SPECS = {
    "flat": IndexSpec(kind="flat"),
    "ivf_flat": IndexSpec(kind="ivf_flat", nlist=16, nprobe=8),
    "ivf_pq": IndexSpec(kind="ivf_pq", nlist=16, nprobe=8, pq_m=16, rerank=8),
    "hnsw": IndexSpec(kind="hnsw", hnsw_m=16, ef_search=64),
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
    assert index.active == kind and len(index) == len(ids)
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


def test_auto_is_exact_below_its_threshold_and_ivf_above():
    rng = np.random.default_rng(3)
    index = KeyIndex(D, IndexSpec(kind="auto", auto_threshold=1000, nlist=8))
    index.add(np.arange(999), clustered(rng, 999))
    assert index.active == "flat"
    index.add(np.array([999]), clustered(rng, 1))
    assert index.active == "ivf_flat"
    assert auto_nlist(1_000_000) == 4096 and auto_nlist(50_000) == 1024


def test_duplicate_ids_are_refused_and_a_bad_spec_names_its_key():
    index = KeyIndex(D, SPECS["flat"])
    index.add(np.array([4]), clustered(np.random.default_rng(4), 1))
    with pytest.raises(ValueError, match="already holds"):
        index.add(np.array([4]), clustered(np.random.default_rng(5), 1))
    with pytest.raises(ValueError, match="memory.index.kind 'lsh'.*flat, ivf_flat"):
        IndexSpec(kind="lsh")
    with pytest.raises(ValueError, match="memory.index.nprobe"):
        IndexSpec(nprobe=0)
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
