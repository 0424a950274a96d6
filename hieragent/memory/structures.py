"""What FAISS index a spec builds over the bank's keys, and how it is searched.

The bank's keys and their rows live in ``index.py`` (``KeyIndex``); this module holds the
config (``IndexSpec``) and the FAISS side: building an index of a kind, learning what it
learns from the keys, and searching it with exact scores. Index types (``IndexSpec.kind``):

  * ``flat``: exact inner product (``IndexFlatIP``).
  * ``ivf_flat`` / ``ivf_pq`` / ``ivf_fastscan``: inverted lists over a k-means coarse
    quantizer, with full codes, 8-bit product-quantised codes, or 4-bit fast-scan PQ codes
    (``IVF…,PQ…x4fs``, scanned with SIMD lookup tables). Until ``nlist * train_per_list``
    keys exist the index stays flat; then the quantizer trains and the index switches, and
    it retrains when the bank has grown ``retrain_growth`` times past its last training.
    PQ candidates (``rerank * n`` of them) are re-scored with the exact keys, so every
    score is an exact cosine.
  * ``hnsw``: a graph index (``IndexHNSWFlat``); with ``hnsw_dim`` the graph holds the keys
    projected onto their ``hnsw_dim`` top principal directions (``IndexPreTransform``), each
    step of the walk costs that much less, and ``rerank * n`` candidates are re-scored with the
    exact keys. The projection is learned from the keys, like an IVF quantizer, and relearned
    on the same schedule.
  * ``auto``: exact below ``auto_threshold`` entries; from there the approximate kind this
    machine does best, measured once on the bank's own keys and cached (``autotune.py``).

Every search sets FAISS's BLAS threshold for the call: ``IndexFlatIP`` only uses BLAS for
batches of at least ``faiss.cvar.distance_compute_blas_threshold`` queries (128000 in the
faiss-cpu wheels), and below it a batch of 256 over 1M keys is eight times slower than the
BLAS path (``make bench-memory``). IVF's coarse quantizer is such a flat index: over 4096
lists its per-query path was most of a 128-query IVF search (16 ms against 4 ms on BLAS, on
a 2-core Xeon).
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Iterator

import faiss
import numpy as np

INDEX_KINDS = ("flat", "ivf_flat", "ivf_pq", "ivf_fastscan", "hnsw", "auto")
IVF_KINDS = ("ivf_flat", "ivf_pq", "ivf_fastscan")
RERANKED = ("ivf_pq", "ivf_fastscan")  # and a projected graph (``hnsw_dim``): their scores are approximate
STRUCTURE = ("fastscan_m", "hnsw_m", "hnsw_dim")  # fixed at build time in auto's ``tuned``; the rest: search settings
BLAS_MIN_BATCH = 16  # batches at least this large take FAISS's BLAS path in exact search
TRAIN_PER_LIST_MAX = 64  # IVF trains its quantizer on at most this many keys per list
PROJECTION_SAMPLE = 50_000  # keys a graph's projection is learned from, at most
_blas_lock = threading.Lock()


@dataclass
class IndexSpec:
    """Which FAISS index the bank searches with.

    Attributes:
        kind: ``flat`` | ``ivf_flat`` | ``ivf_pq`` | ``ivf_fastscan`` | ``hnsw`` | ``auto``.
        nlist: Inverted lists for IVF; 0 picks about ``4 * sqrt(N)`` (a power of two) at training.
        nprobe: Lists visited per query. 16 gives recall@10 0.98 on MiniLM keys (bench-memory).
        train_per_list: Keys per list needed before IVF trains (FAISS warns below 39).
        retrain_growth: Retrain the IVF quantizer when the bank has grown this many times.
        pq_m: Sub-quantizers of IVF-PQ (must divide the key dimension), 8 bits each.
        fastscan_m: Sub-quantizers of the 4-bit fast-scan PQ; 0 is an eighth of the dimension
            (48 x 4 bits at 384: recall@10 0.99 with ``rerank`` 10 at 1M keys, bench-memory).
        rerank: Kinds whose scores are approximate (PQ, a projected graph) fetch ``rerank * n``
            candidates and re-score them exactly.
        hnsw_m: Graph degree of HNSW.
        hnsw_dim: 0: HNSW holds the full keys; else it holds their projection onto this many
            top principal directions (uncentred: inner products are what it keeps), and its
            candidates are re-scored. On MiniLM keys a graph at 96 of 384 dimensions searches
            about twice as fast at about the same recall (``make bench-memory``).
        ef_search: HNSW search breadth.
        auto_threshold: Size at which ``auto`` leaves exact search for its measured choice.
        compact_fraction: Rebuild over the live rows once removed rows pass this share.
        background_from: Rebuilds over at least this many rows run in a background thread.
        build_nice: Niceness of that thread (Linux sets it per thread): 0 shares the cores
            equally with the training step, 19 yields the most. Not Linux's idle class: under
            a training loop that keeps every core busy (or env workers beside it), a build in
            that class never finishes.
        build_loan: Above 0 (on Linux), a background build runs in a child process that is
            stopped except while the trainer lends it time, once per update (``KeyIndex.lend``,
            see ``lent.py``): this share of the update's own time (the median of the last few),
            so an update during a build takes at most about ``1 + build_loan`` times as long,
            whatever the machine. 0 builds in a thread (at ``build_nice``), concurrently with
            training: better where the step leaves cores idle, worse where it keeps all busy.
    """

    kind: str = "auto"
    nlist: int = 0
    nprobe: int = 16
    train_per_list: int = 39
    retrain_growth: float = 4.0
    pq_m: int = 48
    fastscan_m: int = 0
    rerank: int = 10
    hnsw_m: int = 32
    hnsw_dim: int = 0
    ef_search: int = 128
    auto_threshold: int = 50_000
    compact_fraction: float = 0.25
    background_from: int = 20_000
    build_nice: int = 10
    build_loan: float = 0.25

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"memory.index.kind '{self.kind}' is unknown; expected one of {', '.join(INDEX_KINDS)}")
        for name in ("nprobe", "train_per_list", "pq_m", "rerank", "hnsw_m", "ef_search", "auto_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"memory.index.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("nlist", "fastscan_m", "hnsw_dim", "background_from"):
            if getattr(self, name) < 0:
                raise ValueError(f"memory.index.{name} must be >= 0, got {getattr(self, name)}")
        if self.retrain_growth <= 1:
            raise ValueError(f"memory.index.retrain_growth must be > 1, got {self.retrain_growth}")
        if not 0 < self.compact_fraction < 1:
            raise ValueError(f"memory.index.compact_fraction must be in (0, 1), got {self.compact_fraction}")
        if not 0 <= self.build_loan <= 10:
            raise ValueError(f"memory.index.build_loan must be in [0, 10] (a share of an update's time; 0: build in "
                             f"a thread), got {self.build_loan}")
        if not 0 <= self.build_nice <= 19:
            raise ValueError(f"memory.index.build_nice must be in [0, 19] (a niceness), got {self.build_nice}")


@contextlib.contextmanager
def blas_search(batch: int) -> Iterator[None]:
    """Let exact FAISS search use BLAS for this batch (the threshold is process-global)."""
    if batch < BLAS_MIN_BATCH:
        yield
        return
    with _blas_lock:
        old = faiss.cvar.distance_compute_blas_threshold
        faiss.cvar.distance_compute_blas_threshold = BLAS_MIN_BATCH
        try:
            yield
        finally:
            faiss.cvar.distance_compute_blas_threshold = old


def auto_nlist(n: int) -> int:
    """About ``4 * sqrt(n)`` lists, rounded to a power of two (4096 at 1M entries)."""
    return max(1, 2 ** round(math.log2(max(4.0 * math.sqrt(n), 1.0))))


def empty_index(kind: str, dim: int, spec: IndexSpec, nlist: int, tuned: dict[str, int] | None = None) -> faiss.Index:
    """An untrained FAISS index of ``kind`` whose labels will be row numbers (``tuned``: the
    ``fastscan_m`` or ``hnsw_m`` that ``auto`` chose, over the spec's)."""
    tuned = tuned or {}
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        return faiss.IndexHNSWFlat(dim, tuned.get("hnsw_m", spec.hnsw_m), faiss.METRIC_INNER_PRODUCT)
    quantizer = faiss.IndexFlatIP(dim)
    if kind == "ivf_flat":
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    elif kind == "ivf_pq":
        index = faiss.IndexIVFPQ(quantizer, dim, nlist, spec.pq_m, 8, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexIVFPQFastScan(quantizer, dim, nlist, tuned.get("fastscan_m") or fastscan_m(spec, dim), 4,
                                         faiss.METRIC_INNER_PRODUCT)
    return index  # faiss's Python wrapper keeps the quantizer alive with the index


def trained_index(kind: str, keys: np.ndarray, spec: IndexSpec, tuned: dict[str, int] | None = None) -> faiss.Index:
    """An empty index of ``kind`` for ``keys``: IVF kinds with ``spec.nlist`` (else about
    ``4 * sqrt(len(keys))``) lists trained on a sample of them; a projected graph behind the
    projection learned from them."""
    d = projected_dim(spec, keys.shape[1], tuned)
    if kind == "hnsw" and d:
        graph = faiss.IndexHNSWFlat(d, (tuned or {}).get("hnsw_m", spec.hnsw_m), faiss.METRIC_INNER_PRODUCT)
        return faiss.IndexPreTransform(projection(keys, d), graph)  # the wrapper keeps both alive
    index = empty_index(kind, keys.shape[1], spec, spec.nlist or auto_nlist(len(keys)), tuned)
    if kind in IVF_KINDS:
        index.train(train_sample(keys, np.arange(len(keys)), index.nlist))
    return index


def projected_dim(spec: IndexSpec, dim: int, tuned: dict[str, int] | None = None) -> int:
    """The dimension an HNSW graph holds its keys in, 0 where it holds them whole."""
    d = (tuned or {}).get("hnsw_dim", spec.hnsw_dim)
    return d if 0 < d < dim else 0


def trains(kind: str, spec: IndexSpec, dim: int, tuned: dict[str, int] | None = None) -> bool:
    """Whether ``kind`` learns from the keys (IVF's quantizer, a graph's projection), so it is
    relearned when the bank has grown ``retrain_growth`` times, and compactions re-add into it."""
    return kind in IVF_KINDS or (kind == "hnsw" and projected_dim(spec, dim, tuned) > 0)


def reranked(kind: str, spec: IndexSpec, dim: int, tuned: dict[str, int] | None = None) -> bool:
    """Whether ``kind``'s own scores are approximate, so its candidates are re-scored exactly."""
    return kind in RERANKED or (kind == "hnsw" and projected_dim(spec, dim, tuned) > 0)


def projection(keys: np.ndarray, d: int) -> faiss.LinearTransform:
    """The map of keys ``[N, D]`` onto the ``d`` top eigenvectors of their second moment (of at
    most ``PROJECTION_SAMPLE`` of them): not centred as PCA is, since a centred projection keeps
    distances but shifts each key's inner products by its own share of the mean."""
    if len(keys) > PROJECTION_SAMPLE:
        keys = keys[np.sort(np.random.default_rng(0).choice(len(keys), PROJECTION_SAMPLE, replace=False))]
    x = keys.astype(np.float64)
    _, vecs = np.linalg.eigh(x.T @ x)  # ascending eigenvalues
    top = np.ascontiguousarray(vecs[:, ::-1][:, :d].T, dtype=np.float32)  # [d, D]
    transform = faiss.LinearTransform(keys.shape[1], d, False)
    faiss.copy_array_to_vector(top.ravel(), transform.A)
    transform.is_trained = True
    return transform


def fastscan_m(spec: IndexSpec, dim: int) -> int:
    return spec.fastscan_m or max(dim // 8, 1)


def wanted_kind(spec: IndexSpec, n: int, auto_kind: str | None = None) -> str:
    """The kind ``spec`` asks for at ``n`` keys (``"auto"``: above the threshold, not chosen yet)."""
    if spec.kind == "auto":
        return "flat" if n < spec.auto_threshold else (auto_kind or "auto")
    if spec.kind in IVF_KINDS:
        # PQ codebooks train on the same sample: 256 (8-bit) or 16 (4-bit) codes per sub-quantizer
        lists = max(spec.nlist or auto_nlist(n), {"ivf_flat": 1, "ivf_pq": 256, "ivf_fastscan": 16}[spec.kind])
        return spec.kind if n >= lists * spec.train_per_list else "flat"
    return spec.kind


def train_sample(keys: np.ndarray, rows: np.ndarray, nlist: int) -> np.ndarray:
    """At most ``TRAIN_PER_LIST_MAX`` keys per list (and at least 10k, for PQ's 256 codes), a
    fixed sample: k-means on it is as good as on all keys, and at 1M keys several times faster."""
    cap = max(TRAIN_PER_LIST_MAX * nlist, 10_000)
    if len(rows) > cap:
        rows = np.sort(np.random.default_rng(0).choice(rows, cap, replace=False))
    return keys[rows]


def rescore(buf: np.ndarray, q: np.ndarray, rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner products of candidate ``rows [B, m]`` of ``buf`` with ``q``, best ``n`` first
    (-1, a row the index could not fill, stays last): ``(scores, rows)``, ``[B, n]`` each."""
    valid = rows >= 0
    safe = np.ascontiguousarray(np.where(valid, rows, 0), dtype=np.int64)
    exact = np.empty(rows.shape, dtype=np.float32)  # [B, m]; by row in C++, no [B, m, D] gather
    faiss.fvec_inner_products_by_idx(faiss.swig_ptr(exact), faiss.swig_ptr(q), faiss.swig_ptr(buf),
                                     faiss.swig_ptr(safe), buf.shape[1], len(q), rows.shape[1])
    exact[~valid] = -np.inf
    top = np.argsort(-exact, axis=1, kind="stable")[:, :n]
    return np.take_along_axis(exact, top, axis=1).astype(np.float32), np.take_along_axis(rows, top, axis=1)


def search_params(index: faiss.Index, kind: str, nprobe: int, ef_search: int,
                  sel: faiss.IDSelector | None = None) -> faiss.SearchParameters | None:
    """FAISS search parameters of ``kind`` (``sel``: the rows to consider, None for all)."""
    if kind == "flat":
        return None if sel is None else faiss.SearchParameters(sel=sel)
    if kind == "hnsw":
        graph = faiss.SearchParametersHNSW(efSearch=ef_search, sel=sel)
        if isinstance(index, faiss.IndexPreTransform):  # the keyword form keeps a reference to ``graph``
            return faiss.SearchParametersPreTransform(index_params=graph)
        return graph
    return faiss.SearchParametersIVF(nprobe=min(nprobe, index.nlist), sel=sel)


def search_rows(index: faiss.Index, buf: np.ndarray, q: np.ndarray, n: int,
                params: faiss.SearchParameters | None, rerank: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Top-``n`` ``(scores, rows)`` of ``index`` (labelled by rows of ``buf``) for ``q``; with
    ``rerank``, ``rerank * n`` candidates re-scored exactly (0: the index's scores are exact);
    ``[B, >= n]``, rows -1 where the index found too few."""
    fetch = min(n * max(rerank, 1), index.ntotal)
    with blas_search(len(q)):  # IVF's coarse quantizer is a flat index too: 4x faster on BLAS at 128 queries
        scores, rows = index.search(q, fetch, params=params)
    return rescore(buf, q, rows, n) if rerank else (scores, rows)
