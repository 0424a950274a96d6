"""The projected graph (``hnsw`` with ``hnsw_dim``): its projection, its relearning, and ``auto``'s use of it."""

from __future__ import annotations

import json

import faiss
import numpy as np
import pytest

from hieragent.memory import autotune
from hieragent.memory.index import KeyIndex
from hieragent.memory.structures import IndexSpec, projection

from index_helpers import brute_force, recall


def in_subspace(rng: np.random.Generator, n: int, basis: np.ndarray, centres: int = 30) -> np.ndarray:
    """Clustered unit keys ``[n, D]`` inside the row span of ``basis [r, D]``."""
    c = rng.standard_normal((centres, len(basis)))
    z = c[rng.integers(0, centres, n)] + 0.3 * rng.standard_normal((n, len(basis)))
    x = z @ basis
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def matrix(transform: faiss.LinearTransform) -> np.ndarray:
    return faiss.vector_to_array(transform.A).reshape(transform.d_out, transform.d_in).astype(np.float64)


def test_the_projection_keeps_the_top_directions_of_the_second_moment_and_inner_products_within_them():
    rng = np.random.default_rng(7)
    dim, d = 48, 12
    keys = rng.standard_normal((3000, dim)) * np.linspace(3.0, 0.1, dim)  # a spread spectrum, not centred
    keys = (keys + 0.5).astype(np.float32)
    a = matrix(projection(keys, d))  # [d, D]
    np.testing.assert_allclose(a @ a.T, np.eye(d), atol=1e-5)  # orthonormal rows
    x = keys.astype(np.float64)
    sv = np.linalg.svd(x, compute_uv=False)  # float64, uncentred: what the projection keeps is the top d
    np.testing.assert_allclose(np.sum((x @ a.T) ** 2), np.sum(sv[:d] ** 2), rtol=1e-5)
    # keys of rank d keep every inner product exactly; a centred PCA would shift them by the mean
    basis = np.linalg.qr(rng.standard_normal((dim, d)))[0].T  # [d, D]
    low = ((rng.standard_normal((500, d)) + 0.7) @ basis).astype(np.float32)  # off-centre, inside the span
    q = (rng.standard_normal((20, d)) @ basis).astype(np.float32)
    t = projection(low, d)
    np.testing.assert_allclose(t.apply(q) @ t.apply(low).T, q.astype(np.float64) @ low.astype(np.float64).T,
                               atol=1e-4)


def test_a_projected_graph_relearns_its_projection_when_the_bank_has_grown():
    """The first keys span one subspace, the later four times as many another: a graph still
    projecting onto the first would map the new keys near zero and lose their neighbours."""
    rng = np.random.default_rng(8)
    dim = 32
    basis = np.linalg.qr(rng.standard_normal((dim, dim)))[0].T
    first = in_subspace(rng, 200, basis[:8])
    later, q = np.split(in_subspace(rng, 850, basis[8:16]), [800])
    spec = IndexSpec(kind="hnsw", hnsw_m=16, hnsw_dim=8, ef_search=64, rerank=4, retrain_growth=2.0,
                     background_from=10**9)
    index = KeyIndex(dim, spec)
    index.add(np.arange(200), first)
    assert index.active == "hnsw" and index.trained_at == 200
    a = matrix(faiss.downcast_VectorTransform(index._faiss.chain.at(0)))
    assert np.linalg.norm(a @ basis[:8].T) ** 2 > 7.99  # the projection spans the first subspace
    index.add(np.arange(200, 1000), later)  # grown 5x: relearned on all the keys
    assert index.trained_at == 1000
    a = matrix(faiss.downcast_VectorTransform(index._faiss.chain.at(0)))
    assert np.linalg.norm(a @ basis[8:16].T) ** 2 > 7.9  # now the later, larger subspace
    keys, ids = np.concatenate([first, later]), np.arange(1000)
    found, scores = index.search(q, 10)
    assert recall(found, brute_force(keys, ids, q, 10)[0]) >= 0.95
    exact = np.einsum("bd,bkd->bk", q.astype(np.float64), keys[found].astype(np.float64))
    np.testing.assert_allclose(scores, exact, atol=1e-5)  # re-scored: exact cosines
    plain = KeyIndex(dim, IndexSpec(kind="hnsw", hnsw_m=16, retrain_growth=2.0, background_from=10**9))
    plain.add(np.arange(200), first)
    plain.add(np.arange(200, 1000), later)
    assert plain.trained_at == 0 and plain.ops["rebuilds"] == 1  # a graph of full keys learns nothing


def test_auto_measures_projected_graphs_where_the_dimension_allows_and_uses_a_cached_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HIERAGENT_CACHE", str(tmp_path))
    assert all(s[1].get("hnsw_dim") == 0 for s in autotune.structures(32, IndexSpec()) if s[0] == "hnsw")
    hnsw = [s for s in autotune.structures(128, IndexSpec()) if s[0] == "hnsw"]
    assert sorted((s["hnsw_m"], s["hnsw_dim"]) for _, s in hnsw) == [(16, 0), (16, 32), (32, 0), (32, 32)]
    rng = np.random.default_rng(10)
    dim = 128
    basis = np.linalg.qr(rng.standard_normal((dim, 24)))[0].T  # keys of low rank, as embeddings of templated text
    keys, q = np.split(in_subspace(rng, 3064, basis, centres=60), [3000])  # queries: of the same clusters
    spec = IndexSpec(kind="auto", auto_threshold=2000, background_from=10**9)
    choice = {"kind": "hnsw", "hnsw_m": 16, "hnsw_dim": 32}
    (tmp_path / "index_auto.json").write_text(json.dumps({autotune.machine_key(dim, spec): {"choice": choice}}))
    index = KeyIndex(dim, spec)
    index.add(np.arange(3000), keys)
    assert "cached structure" in index.auto_note and index.active == "hnsw"
    assert index.tuned["hnsw_dim"] == 32 and index.tuned["rerank"] >= 1 and index.rerank == index.tuned["rerank"]
    assert isinstance(index._faiss, faiss.IndexPreTransform) and index._faiss.index.d == 32
    found, scores = index.search(q, 10)
    assert recall(found, brute_force(keys, np.arange(3000), q, 10)[0]) >= autotune.RECALL - 0.03
    exact = np.einsum("bd,bkd->bk", q.astype(np.float64), keys[found].astype(np.float64))
    np.testing.assert_allclose(scores, exact, atol=1e-5)
    restored = KeyIndex.restore(dim, spec, index.ids(), index.reconstruct(index.ids()), index.state())
    assert (restored.tuned, restored.ops["rebuilds"]) == (index.tuned, 0)
    assert restored.search(q, 10)[0].tobytes() == found.tobytes()
    # stage 1 on these keys measures the projected graphs beside the rest
    measured = autotune.measure_sample(keys, spec, autotune.default_make_on(spec))
    dims = {(c["hnsw_m"], c["hnsw_dim"]) for c in measured["settings"] if c["kind"] == "hnsw"}
    assert dims == {(16, 0), (16, 32), (32, 0), (32, 32)}
    assert all("rerank" in c for c in measured["settings"] if c["kind"] == "hnsw" and c["hnsw_dim"])


def test_a_projection_as_wide_as_the_keys_is_refused_by_name():
    with pytest.raises(ValueError, match=r"memory.index.hnsw_dim=32 must be below the key dimension 32 "
                                         r"\(0: the graph holds the full keys\)"):
        KeyIndex(32, IndexSpec(kind="hnsw", hnsw_dim=32))
    with pytest.raises(ValueError, match="memory.index.hnsw_dim must be >= 0, got -1"):
        IndexSpec(hnsw_dim=-1)
