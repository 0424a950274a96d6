"""The bank's key index: exact keys kept by id, and a FAISS index over them chosen by config.

The exact float32 keys are the source of truth; the FAISS index is an accelerator rebuilt
from them whenever its type changes, so switching from flat to IVF-PQ (or back) loses
nothing. Index types (``IndexSpec.kind``):

  * ``flat``: exact inner product (``IndexFlatIP``); the default under about 50k entries.
  * ``ivf_flat`` / ``ivf_pq``: inverted lists over a k-means coarse quantizer, with full or
    product-quantised codes. Until ``nlist * train_per_list`` keys exist the index stays
    flat; then the quantizer trains on the keys and the index switches, and it retrains
    when the bank has grown ``retrain_growth`` times past its last training size.
    IVF-PQ candidates are re-scored with the exact keys, so scores are exact cosines.
  * ``hnsw``: a graph index (``IndexHNSWFlat``). It cannot delete, so removed ids become
    tombstones filtered at search time, and the graph is rebuilt once they pass a tenth.
  * ``auto``: flat, then IVF-Flat once the bank reaches ``auto_threshold`` entries.

Exact search sets FAISS's BLAS threshold for the call: ``IndexFlatIP`` only uses BLAS for
batches of at least ``faiss.cvar.distance_compute_blas_threshold`` queries (128000 in the
faiss-cpu wheels), and below it a batch of 256 over 1M keys is eight times slower than the
BLAS path (``make bench-memory``).
"""

from __future__ import annotations

import logging
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import faiss
import numpy as np

log = logging.getLogger(__name__)

INDEX_KINDS = ("flat", "ivf_flat", "ivf_pq", "hnsw", "auto")
BLAS_MIN_BATCH = 16  # batches at least this large take FAISS's BLAS path in exact search
TRAIN_PER_LIST_MAX = 64  # IVF trains its quantizer on at most this many keys per list
_blas_lock = threading.Lock()


@dataclass
class IndexSpec:
    """Which FAISS index the bank searches with.

    Attributes:
        kind: ``flat`` | ``ivf_flat`` | ``ivf_pq`` | ``hnsw`` | ``auto`` (see the module doc).
        nlist: Inverted lists for IVF; 0 picks about ``4 * sqrt(N)`` (a power of two) at training.
        nprobe: Lists visited per query. 16 gives recall@10 0.98 on MiniLM keys (bench-memory).
        train_per_list: Keys per list needed before IVF trains (FAISS warns below 39).
        retrain_growth: Retrain the IVF quantizer when the bank has grown this many times.
        pq_m: Sub-quantizers of IVF-PQ (must divide the key dimension), 8 bits each.
        rerank: IVF-PQ fetches ``rerank * n`` candidates and re-scores them exactly.
        hnsw_m: Graph degree of HNSW.
        ef_search: HNSW search breadth.
        auto_threshold: Size at which ``auto`` leaves exact search for IVF-Flat.
    """

    kind: str = "auto"
    nlist: int = 0
    nprobe: int = 16
    train_per_list: int = 39
    retrain_growth: float = 4.0
    pq_m: int = 48
    rerank: int = 4
    hnsw_m: int = 32
    ef_search: int = 128
    auto_threshold: int = 50_000

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"memory.index.kind '{self.kind}' is unknown; expected one of {', '.join(INDEX_KINDS)}")
        for name in ("nprobe", "train_per_list", "pq_m", "rerank", "hnsw_m", "ef_search", "auto_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"memory.index.{name} must be >= 1, got {getattr(self, name)}")
        if self.nlist < 0:
            raise ValueError(f"memory.index.nlist must be >= 0 (0 = automatic), got {self.nlist}")
        if self.retrain_growth <= 1:
            raise ValueError(f"memory.index.retrain_growth must be > 1, got {self.retrain_growth}")


@contextmanager
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


class KeyIndex:
    """Exact unit keys by int64 id, searched through the FAISS index that ``spec`` asks for.

    ``active`` names the index actually in use: ``flat`` while an IVF kind waits for enough
    keys to train. Rows are kept in insertion order (removal keeps the order of the rest),
    which is the order ``ids()`` reports and persistence writes.
    """

    def __init__(self, dim: int, spec: IndexSpec | None = None) -> None:
        self.dim, self.spec = dim, spec or IndexSpec()
        if self.spec.kind == "ivf_pq" and dim % self.spec.pq_m:
            raise ValueError(f"memory.index.pq_m={self.spec.pq_m} must divide the key dimension {dim}")
        self._buf = np.zeros((0, dim), dtype=np.float32)  # [capacity, D]; rows [:N] are keys
        self._ids = np.zeros(0, dtype=np.int64)  # [N], the id of each key row
        self._row: dict[int, int] = {}
        self._tombstones: set[int] = set()  # hnsw only: removed ids still in the graph
        self.active = "flat"
        self.trained_at = 0
        self._faiss: faiss.Index = self._empty("flat", 0)

    @property
    def _keys(self) -> np.ndarray:
        return self._buf[: len(self._ids)]  # [N, D], a view

    @_keys.setter
    def _keys(self, keys: np.ndarray) -> None:
        self._buf = np.ascontiguousarray(keys, dtype=np.float32)

    # ---- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> np.ndarray:
        return self._ids.copy()

    def reconstruct(self, ids: np.ndarray) -> np.ndarray:
        """Exact stored keys ``[len(ids), D]``; unknown ids raise KeyError."""
        rows = [self._row[int(i)] for i in ids]
        return self._keys[rows] if rows else np.zeros((0, self.dim), dtype=np.float32)

    def search(self, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Top ``min(n, len)`` ids and inner products per query, best first: ``[B, n']`` each.

        Rows an approximate index cannot fill (an IVF probe that reaches too few keys) are
        answered by exact search, so every row holds ``n'`` real ids.
        """
        n = min(n, len(self))
        if n == 0:
            return np.zeros((len(q), 0), dtype=np.int64), np.zeros((len(q), 0), dtype=np.float32)
        if self.active == "flat":
            return self._search_flat(q, n)
        fetch = n * (self.spec.rerank if self.active == "ivf_pq" else 1) + len(self._tombstones)
        scores, ids = self._faiss.search(q, min(fetch, self._faiss.ntotal))
        if self.active != "ivf_pq" and not self._tombstones and (ids[:, :n] >= 0).all():
            return ids[:, :n].astype(np.int64), scores[:, :n]  # the common case, without a Python loop
        out_ids = np.empty((len(q), n), dtype=np.int64)
        out_scores = np.empty((len(q), n), dtype=np.float32)
        short: list[int] = []
        for b in range(len(q)):
            keep = [j for j, i in enumerate(ids[b]) if i >= 0 and int(i) not in self._tombstones]
            if len(keep) < n:
                short.append(b)
                continue
            found = ids[b, keep]
            if self.active == "ivf_pq":  # exact re-scoring of the compressed candidates
                exact = self.reconstruct(found) @ q[b]
                order = np.argsort(-exact, kind="stable")[:n]
                out_ids[b], out_scores[b] = found[order], exact[order]
            else:
                out_ids[b], out_scores[b] = found[:n], scores[b, keep[:n]]
        if short:
            out_ids[short], out_scores[short] = self._exact(q[short], n)
        return out_ids, out_scores

    def _search_flat(self, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        with blas_search(len(q)):
            scores, rows = self._faiss.search(q, n)
        return self._ids[rows], scores

    def _exact(self, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        sims = q @ self._keys.T  # [B, N]
        top = np.argsort(-sims, axis=1, kind="stable")[:, :n]
        return self._ids[top], np.take_along_axis(sims, top, axis=1).astype(np.float32)

    # ---- writing -------------------------------------------------------------------------
    def add(self, ids: np.ndarray, keys: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        keys = np.ascontiguousarray(keys, dtype=np.float32).reshape(len(ids), self.dim)
        dup = [int(i) for i in ids if int(i) in self._row]
        if dup or len(set(ids.tolist())) != len(ids):
            raise ValueError(f"key index already holds (or was given twice) ids {dup or ids.tolist()}")
        start, end = len(self._ids), len(self._ids) + len(ids)
        if end > len(self._buf):  # grow geometrically, so adding one key at a time is amortised O(D)
            buf = np.zeros((max(end, 2 * len(self._buf), 64), self.dim), dtype=np.float32)
            buf[:start] = self._buf[:start]
            self._buf = buf
        self._buf[start:end] = keys
        self._ids = np.concatenate([self._ids, ids])
        self._row.update({int(i): start + j for j, i in enumerate(ids)})
        want = self._wanted()
        if want != self.active or self._needs_retrain():
            self.rebuild(want)
        elif self.active == "flat":
            self._faiss.add(keys)  # rows of a flat index are our rows; ids map through _ids
        else:
            self._faiss.add_with_ids(keys, ids)

    def remove(self, ids: np.ndarray) -> None:
        gone = {int(i) for i in ids if int(i) in self._row}
        if not gone:
            return
        keep = np.array([int(i) not in gone for i in self._ids], dtype=bool)
        self._ids, self._keys = self._ids[keep], self._keys[keep]
        self._row = {int(i): j for j, i in enumerate(self._ids)}
        if self.active == "flat":
            self._faiss = self._empty("flat", 0)
            if len(self._ids):
                self._faiss.add(self._keys)
        elif self.active == "hnsw":
            self._tombstones |= gone
            if len(self._tombstones) > 0.1 * max(len(self._ids), 1):
                self.rebuild(self.active)
        else:
            self._faiss.remove_ids(np.fromiter(gone, dtype=np.int64))

    def rebuild(self, kind: str | None = None) -> None:
        """Build index ``kind`` (default: what the spec wants at this size) over the exact keys."""
        kind = kind or self._wanted()
        n = len(self._ids)
        index = self._empty(kind, n)
        if kind in ("ivf_flat", "ivf_pq") and n:
            # k-means on a fixed sample of TRAIN_PER_LIST_MAX keys per list: as good, and at 1M
            # keys several times faster than training on all of them
            cap = TRAIN_PER_LIST_MAX * index.nlist
            sample = np.sort(np.random.default_rng(0).choice(n, cap, replace=False)) if n > cap else slice(None)
            index.train(self._keys[sample])
            self.trained_at = n
        if n:
            if kind == "flat":
                index.add(self._keys)
            else:
                index.add_with_ids(self._keys, self._ids)
        if kind != self.active:
            log.info("memory index: %s -> %s over %d keys", self.active, kind, n)
        self._faiss, self.active, self._tombstones = index, kind, set()

    def _wanted(self) -> str:
        spec, n = self.spec, len(self._ids)
        if spec.kind == "auto":
            return "ivf_flat" if n >= spec.auto_threshold else "flat"
        if spec.kind in ("ivf_flat", "ivf_pq"):
            lists = max(self._nlist(n), 256 if spec.kind == "ivf_pq" else 1)  # PQ: 256 codes each
            return spec.kind if n >= lists * spec.train_per_list else "flat"
        return spec.kind

    def _needs_retrain(self) -> bool:
        return (self.active in ("ivf_flat", "ivf_pq")
                and len(self._ids) >= self.spec.retrain_growth * max(self.trained_at, 1))

    def _nlist(self, n: int) -> int:
        return self.spec.nlist or auto_nlist(n)

    def _empty(self, kind: str, n: int) -> faiss.Index:
        spec, d = self.spec, self.dim
        if kind == "flat":
            return faiss.IndexFlatIP(d)
        if kind == "hnsw":
            graph = faiss.IndexHNSWFlat(d, spec.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            graph.hnsw.efSearch = spec.ef_search
            return faiss.IndexIDMap2(graph)
        quantizer = faiss.IndexFlatIP(d)
        nlist = self._nlist(n)
        if kind == "ivf_flat":
            index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexIVFPQ(quantizer, d, nlist, spec.pq_m, 8, faiss.METRIC_INNER_PRODUCT)
        index.nprobe = min(spec.nprobe, nlist)
        return index  # faiss's Python wrapper keeps the quantizer alive with the index

    # ---- persistence ---------------------------------------------------------------------
    def state(self) -> dict:
        """The built FAISS index as bytes (none for flat, which rebuilds in a second)."""
        if self.active == "hnsw" and self._tombstones:
            self.rebuild("hnsw")
        blob = None if self.active == "flat" else faiss.serialize_index(self._faiss)
        return {"active": self.active, "trained_at": self.trained_at, "faiss": blob}

    @classmethod
    def restore(cls, dim: int, spec: IndexSpec, ids: np.ndarray, keys: np.ndarray,
                state: dict | None = None) -> KeyIndex:
        """An index over ``ids``/``keys``: the saved FAISS bytes when they are of the kind the
        spec wants now and hold exactly these keys, else a rebuild from the exact keys."""
        index = cls(dim, spec)
        index._ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        index._keys = np.ascontiguousarray(keys, dtype=np.float32).reshape(len(index._ids), dim)
        index._row = {int(i): j for j, i in enumerate(index._ids)}
        state = state or {}
        saved, blob = state.get("active"), state.get("faiss")
        want = index._wanted()
        if saved not in (None, want):
            log.warning("memory index: saved as %s, the config asks for %s; rebuilding over %d exact keys",
                        saved, want, len(index._ids))
        if saved == want and blob is not None:
            loaded = faiss.deserialize_index(np.ascontiguousarray(blob, dtype=np.uint8))
            if loaded.ntotal == len(index._ids) and loaded.d == dim:
                if hasattr(loaded, "nprobe"):
                    loaded.nprobe = min(spec.nprobe, loaded.nlist)
                index._faiss, index.active = loaded, want
                index.trained_at = int(state.get("trained_at", len(index._ids)))
                return index
        index.rebuild(want)
        return index
